"""Miner services for tests: :func:`local_miner` builds a :class:`MinerService` serving on 127.0.0.1
from flat keyword arguments (what the test networks pass through)."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Optional

from iota_subnet.miner.options import DataOptions, MinerOptions, ServeOptions
from iota_subnet.miner.parts import MinerParts
from iota_subnet.miner.service import MinerService
from iota_subnet.utils.supervise import Supervisor

#: serving on the loopback address, published as such
LOCAL = ServeOptions(host="127.0.0.1", external_ip="127.0.0.1")
_SERVE = {f.name for f in fields(ServeOptions)}
#: flat names of the DataOptions fields (as the miner's flags name them)
_DATA = {"data": "source", "cache_dir": "cache_dir", "allow_data_fallback": "allow_fallback", "dataset": "dataset"}


def local_miner(cfg: Any, wallet: Any, chain: Any, *, parts: Optional[MinerParts] = None,
                supervisor: Optional[Supervisor] = None, **kw: Any) -> MinerService:
    """A miner serving on 127.0.0.1. ``kw``: :class:`MinerOptions` fields, and flat the fields of its
    :class:`ServeOptions` (``host``, ``port``, ``external_ip``, ``dashboard_port``) and
    :class:`DataOptions` (``data``, ``cache_dir``, ``allow_data_fallback``, ``dataset``)."""
    serve = {k: kw.pop(k) for k in list(kw) if k in _SERVE}
    data = {_DATA[k]: kw.pop(k) for k in list(kw) if k in _DATA}
    opts = MinerOptions(serve=ServeOptions(**{"host": LOCAL.host, "external_ip": LOCAL.external_ip, **serve}),
                        data=DataOptions(**data), **kw)
    return MinerService(cfg, wallet, chain, opts, parts=parts, supervisor=supervisor)
