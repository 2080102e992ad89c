"""The operator's web dashboard: a read-only page per validator (and optionally per miner).

* :mod:`.sources`: the snapshot a page shows, built from a neuron's small explicit interface
  (``status()``, ``metrics.jsonl``, chain reads, miners' ``/health``);
* :mod:`.history`: bounded time series for the plots;
* :mod:`.server`: the aiohttp app (GET only) serving the page, its vendored assets and the snapshot.

Start one with ``--dashboard-port`` on ``iota-subnet validator`` / ``miner``; ``localnet`` turns it
on for its validators and prints the address.
"""
from .server import DashboardServer
from .sources import MinerSource, ValidatorSource, ValidatorSourceOptions, health_poller

__all__ = ["DashboardServer", "MinerSource", "ValidatorSource", "ValidatorSourceOptions", "health_poller"]
