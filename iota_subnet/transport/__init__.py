"""HTTP transport: btauth/1-signed POSTs of protocol messages between neurons."""
from .client import NeuronClient, TransportError
from .nonce_store import SqliteNonceStore
from .server import AUTH_OUTCOMES, NeuronServer, RequestContext, Route

__all__ = ["AUTH_OUTCOMES", "NeuronClient", "NeuronServer", "RequestContext", "Route", "SqliteNonceStore",
           "TransportError"]
