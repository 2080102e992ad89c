"""Chain layer: the only package that touches bittensor's chain API.

* :class:`Chain` (``interface.py``): the small async interface neurons use.
* :func:`open_chain` (``sdk.py``): a :class:`Chain` on ``bt.Client`` for finney / test / local /
  devnet.
* ``devnet.py``: :class:`DevnetSubstrate`, a one-SQLite-file chain for local networks, plus
  admin helpers (``create_devnet``, ``fund``, ``add_stake``).
* ``yuma.py``: Yuma consensus as pure numpy.
* :func:`metagraph_json` / :func:`metagraph_rows`: the metagraph as JSON-ready rows (CLI).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from .devnet import DevnetSubstrate, add_stake, create_devnet, fund, halt_devnet, resume_devnet
from .interface import (Chain, ChainError, ChainTimeout, CommitmentRecord, NotRegisteredError, RateLimitedError,
                        Registration, RegistrationCostError, WeightsReceipt)
from .sdk import SdkChain, open_chain

__all__ = [
    "Chain", "ChainError", "ChainTimeout", "CommitmentRecord", "NotRegisteredError", "RateLimitedError",
    "Registration", "RegistrationCostError", "WeightsReceipt", "SdkChain", "open_chain",
    "DevnetSubstrate", "create_devnet", "fund", "add_stake", "halt_devnet", "resume_devnet", "metagraph_json", "metagraph_rows",
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


async def metagraph_json(chain: Union[Chain, str, Path], netuid: int) -> list[dict]:
    """Rows ``{uid, hotkey, coldkey, stake, validator_permit, incentive, dividends, emission (TAO/alpha),
    axon, last_update, active, commitment}``; ``chain`` is an open :class:`Chain` or a devnet file."""
    if isinstance(chain, Chain):
        return _rows(await chain.metagraph(netuid))
    return await metagraph_rows(Path(chain), netuid)


async def metagraph_rows(chain_db: Path, netuid: int) -> list[dict]:
    """The devnet's metagraph as JSON-ready rows (for ``iota-subnet chain metagraph --json``)."""
    chain = await open_chain("devnet", chain_db)
    try:
        return _rows(await chain.metagraph(netuid))
    finally:
        await chain.close()
