"""HTTP transport: btauth/1-signed POSTs of protocol messages between neurons."""
from .client import NeuronClient, TransportError
from .nonce_store import SqliteNonceStore
from .server import AUTH_OUTCOMES, NeuronServer, PortInUseError, RequestContext, Route, start_site
from .shaping import LinkSpec, UplinkShaper, configure_process_link, parse_link, process_shaper

__all__ = ["AUTH_OUTCOMES", "LinkSpec", "NeuronClient", "NeuronServer", "PortInUseError", "start_site", "RequestContext", "Route", "SqliteNonceStore",
           "TransportError", "UplinkShaper", "configure_process_link", "parse_link", "process_shaper"]
