"""The chain interface the neurons use: one small async ABC, :class:`Chain`.

Only :mod:`iota_subnet.chain` touches bittensor's chain API; miners, validators and the CLI
talk to a :class:`Chain` obtained from :func:`iota_subnet.chain.open_chain`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from bittensor.metagraph import Metagraph


class ChainError(RuntimeError):
    """A chain read or write failed; ``name`` is the chain's error name when known."""

    def __init__(self, message: str, name: Optional[str] = None):
        super().__init__(message)
        self.name = name


class NotRegisteredError(ChainError):
    """The hotkey has no uid on the subnet."""


@dataclass(frozen=True)
class Registration:
    uid: int
    cost_tao: float  # what the registration burned (0 when the hotkey was already registered)
    already: bool  # the hotkey was registered before this call


class Chain(abc.ABC):
    """What a neuron needs from the chain. All methods are coroutines except ``network``."""

    network: str

    # reads
    @abc.abstractmethod
    async def block(self) -> int:
        """Current block height."""

    async def timestamp(self) -> float:
        """UNIX time (seconds) of the head block, from its ``Timestamp`` (``iota-subnet doctor``'s clock check)."""
        raise NotImplementedError(f"{type(self).__name__} does not read block timestamps")

    async def block_seconds(self) -> float:
        """Seconds per block (12 on mainnet)."""
        return 12.0

    @abc.abstractmethod
    async def tempo(self, netuid: int) -> int:
        """Blocks per epoch of the subnet."""

    @abc.abstractmethod
    async def hyperparameters(self, netuid: int) -> dict[str, Any]:
        """The subnet's hyperparameters by chain name (``tempo``, ``weights_version``, ...)."""

    @abc.abstractmethod
    async def metagraph(self, netuid: int) -> "Metagraph":
        """The SDK's ``bittensor.metagraph.Metagraph`` of the subnet."""

    @abc.abstractmethod
    async def uid(self, hotkey: str, netuid: int) -> Optional[int]:
        """The hotkey's uid on the subnet, or None."""

    async def is_registered(self, hotkey: str, netuid: int) -> bool:
        return await self.uid(hotkey, netuid) is not None

    async def require_uid(self, hotkey: str, netuid: int) -> int:
        """The hotkey's uid; raises :class:`NotRegisteredError` with the fix when it has none."""
        uid = await self.uid(hotkey, netuid)
        if uid is None:
            raise NotRegisteredError(
                f"hotkey {hotkey} is not registered on netuid {netuid} ({self.network}); "
                f"run `iota-subnet register --netuid {netuid} ...` first",
                "HotKeyNotRegisteredInSubNet",
            )
        return uid

    @abc.abstractmethod
    async def registration_cost(self, netuid: int) -> float:
        """TAO burned by a registration right now."""

    @abc.abstractmethod
    async def commitments(self, netuid: int) -> dict[str, str]:
        """hotkey -> published text, for hotkeys registered on the subnet."""

    @abc.abstractmethod
    async def weights(self, netuid: int) -> list[tuple[int, list[tuple[int, float]]]]:
        """Every validator's weight row as ``(uid, [(uid, fraction), ...])`` (rows sum to 1)."""

    # writes (``wallet`` is a ``bittensor.Wallet``)
    @abc.abstractmethod
    async def register(self, wallet: Any, netuid: int) -> Registration:
        """Burned registration of the wallet's hotkey, paid by its coldkey. Idempotent."""

    @abc.abstractmethod
    async def serve(self, wallet: Any, netuid: int, ip: str, port: int) -> None:
        """Publish the hotkey's endpoint (``ServeAxon``)."""

    @abc.abstractmethod
    async def publish(self, wallet: Any, netuid: int, data: str) -> None:
        """Publish a short text commitment for the hotkey (at most 2048 utf-8 bytes)."""

    @abc.abstractmethod
    async def set_weights(
        self, wallet: Any, netuid: int, uids: Sequence[int], weights: Sequence[float], version_key: int = 0
    ) -> None:
        """Set the hotkey's weights (``SetWeights``); raises :class:`ChainError` when refused."""

    @abc.abstractmethod
    async def add_stake(self, wallet: Any, netuid: int, tao: float) -> None:
        """Stake ``tao`` from the wallet's coldkey to its hotkey on the subnet."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection."""

    async def __aenter__(self) -> "Chain":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
