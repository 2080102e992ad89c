"""The chain a command line names (``--network``, ``--chain-db``): the devnet file or an SDK endpoint."""
from __future__ import annotations

from typing import Optional

from iota_subnet.chain import open_chain
from iota_subnet.devnet import open_devnet
from iota_subnet.neuron_common import DEFAULT_CHAIN_TIMEOUT_S


async def open_network_chain(network: str, chain_db: Optional[str] = None, *,
                             timeout_s: float = DEFAULT_CHAIN_TIMEOUT_S):
    """The :class:`~iota_subnet.chain.Chain` that ``--network`` / ``--chain-db`` name: ``devnet`` opens
    the devnet file (:func:`iota_subnet.devnet.open_devnet`), any other network the SDK's endpoint
    (:func:`iota_subnet.chain.open_chain`; ``chain_db`` is ignored there). ``timeout_s`` bounds the
    connection and every read. Raises :class:`~iota_subnet.chain.ChainError` (a missing devnet file
    included) or :class:`~iota_subnet.chain.ChainTimeout`."""
    if network == "devnet":
        return await open_devnet(chain_db, timeout_s=timeout_s)
    return await open_chain(network, timeout_s=timeout_s)
