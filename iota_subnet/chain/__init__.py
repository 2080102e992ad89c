"""Chain layer: the only package through which neurons touch bittensor's chain API.

* :class:`Chain` (``interface.py``): the small async interface neurons use.
* :func:`open_chain` (``sdk.py``): a :class:`Chain` on ``bt.Client`` for finney / test / local /
  a ws:// URL, or on a ``Substrate`` the caller hands in (``substrate=``: how the SQLite devnet
  of :mod:`iota_subnet.devnet` is injected; this package never imports it).
* :func:`metagraph_json`: the metagraph as JSON-ready rows (CLI, dashboard).
"""
from __future__ import annotations

from typing import Any

from .interface import (Chain, ChainError, ChainTimeout, CommitmentRecord, NotRegisteredError, RateLimitedError,
                        Registration, RegistrationCostError, WeightsReceipt)
from .sdk import SdkChain, SubstrateFactory, open_chain

__all__ = [
    "Chain", "ChainError", "ChainTimeout", "CommitmentRecord", "NotRegisteredError", "RateLimitedError",
    "Registration", "RegistrationCostError", "WeightsReceipt", "SdkChain", "SubstrateFactory", "open_chain",
    "metagraph_json",
]


def _rows(graph: Any) -> list[dict]:
    return [
        {
            "uid": n.uid,
            "hotkey": n.hotkey,
            "coldkey": n.coldkey,
            "stake": n.total_stake.rao / 1e9,
            "validator_permit": bool(n.validator_permit),
            "incentive": float(n.incentive),
            "dividends": float(n.dividends),
            "emission": n.emission.rao / 1e9,
            "axon": n.axon,
            "last_update": int(n.last_update),
            "active": bool(n.active),
            "commitment": n.commitment.value if n.commitment is not None else None,
        }
        for n in graph.neurons
    ]


async def metagraph_json(chain: Chain, netuid: int) -> list[dict]:
    """Rows ``{uid, hotkey, coldkey, stake, validator_permit, incentive, dividends, emission (TAO/alpha),
    axon, last_update, active, commitment}`` of an open :class:`Chain`'s metagraph of ``netuid``."""
    return _rows(await chain.metagraph(netuid))
