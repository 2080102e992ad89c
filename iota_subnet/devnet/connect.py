"""Opening the devnet as a :class:`~iota_subnet.chain.Chain`: the devnet's substrate is injected
into the same bittensor v11 SDK client every network uses (:func:`iota_subnet.chain.open_chain`
with ``substrate=``), so neurons run the same code on the devnet as on finney.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from iota_subnet.chain import Chain, ChainError, metagraph_json, open_chain
from iota_subnet.chain.sdk import DEFAULT_TIMEOUT_S, DEFAULT_WRITE_TIMEOUT_S

from .substrate import DevnetSubstrate
from .tlock import Decryptor


async def open_devnet(chain_db: Optional[str | os.PathLike], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                      write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S, decryptor: Optional[Decryptor] = None) -> Chain:
    """A connected :class:`~iota_subnet.chain.Chain` (network ``devnet``) on the devnet file
    ``chain_db``; every reconnect opens the file afresh. ``decryptor`` replaces the drand
    commit-reveal decryptor (tests). Raises :class:`~iota_subnet.chain.ChainError` when
    ``chain_db`` is None or does not exist."""
    if chain_db is None:
        raise ChainError("network 'devnet' needs the chain database: pass --chain-db PATH")
    path = Path(chain_db)
    if not path.exists():
        raise ChainError(f"devnet chain database {path} does not exist; create it first "
                         "(iota_subnet.devnet.create_devnet / the localnet script)")
    return await open_chain("devnet", substrate=lambda: DevnetSubstrate(path, decryptor=decryptor),
                            timeout_s=timeout_s, write_timeout_s=write_timeout_s)


async def metagraph_rows(chain_db: str | os.PathLike, netuid: int) -> list[dict]:
    """The devnet's metagraph as JSON-ready rows (:func:`~iota_subnet.chain.metagraph_json`), for
    ``iota-subnet chain metagraph --json`` and the localnet's progress."""
    chain = await open_devnet(chain_db)
    try:
        return await metagraph_json(chain, netuid)
    finally:
        await chain.close()
