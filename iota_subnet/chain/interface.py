"""The chain interface the neurons use: one small async ABC, :class:`Chain`.

Only :mod:`iota_subnet.chain` touches bittensor's chain API; miners, validators and the CLI
talk to a :class:`Chain` obtained from :func:`iota_subnet.chain.open_chain`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from iota_subnet.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from bittensor.metagraph import Metagraph


class ChainError(UserError, RuntimeError):
    """A chain read or write failed; ``name`` is the chain's error name when known."""

    def __init__(self, message: str, name: Optional[str] = None):
        super().__init__(message)
        self.name = name


class NotRegisteredError(ChainError):
    """The hotkey has no uid on the subnet."""


class RateLimitedError(ChainError):
    """The chain refused a write because of a rate limit (serving, weights, commitment space).

    ``retry_after_blocks``: blocks to wait before the same write can succeed, when known."""

    def __init__(self, message: str, name: Optional[str] = None, retry_after_blocks: Optional[int] = None):
        super().__init__(message, name)
        self.retry_after_blocks = retry_after_blocks


class ChainTimeout(ChainError):
    """A chain call got no answer within its deadline (the endpoint accepted and went silent, or the
    network is down). The :class:`Chain` reconnects before its next call."""


class RegistrationCostError(ChainError):
    """Registration was not submitted (or the chain refused it) because its cost is above what the
    user accepted; nothing was paid."""


@dataclass(frozen=True)
class Registration:
    uid: int
    cost_tao: float  # what the registration burned (0 when the hotkey was already registered)
    already: bool  # the hotkey was registered before this call


@dataclass(frozen=True)
class WeightsReceipt:
    """A weights extrinsic the chain reported as successful: ``block`` it was included in;
    ``commit_reveal`` when the weights were committed (timelocked, revealed by the chain at drand
    round ``reveal_round``) rather than set in the clear."""

    block: int
    commit_reveal: bool = False
    reveal_round: Optional[int] = None


@dataclass(frozen=True)
class CommitmentRecord:
    """A hotkey's published commitment: its text and the block it was published at."""

    text: str
    block: int


class Chain(abc.ABC):
    """What a neuron needs from the chain. All methods are coroutines except ``network``.

    Every call has a deadline: a call that gets no answer in time raises :class:`ChainTimeout`
    instead of waiting for ever."""

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
    async def commitment_records(self, netuid: int) -> dict[str, CommitmentRecord]:
        """hotkey -> (text, block published), for hotkeys registered on the subnet."""

    @abc.abstractmethod
    async def axon(self, hotkey: str, netuid: int) -> Optional[str]:
        """The endpoint ``"ip:port"`` the hotkey has served on the subnet, or None."""

    @abc.abstractmethod
    async def last_update(self, hotkey: str, netuid: int) -> Optional[int]:
        """Block of the hotkey's last weights set or commit on the subnet (None: not registered)."""

    @abc.abstractmethod
    async def block_time(self) -> float:
        """Seconds per block."""

    @abc.abstractmethod
    async def weights(self, netuid: int) -> list[tuple[int, list[tuple[int, float]]]]:
        """Every validator's weight row as ``(uid, [(uid, fraction), ...])`` (rows sum to 1)."""

    # writes (``wallet`` is a ``bittensor.Wallet``)
    @abc.abstractmethod
    async def register(self, wallet: Any, netuid: int, max_cost_tao: Optional[float] = None) -> Registration:
        """Burned registration of the wallet's hotkey, paid by its coldkey. Idempotent.

        The chain refuses it when the burn at inclusion is above ``max_cost_tao`` (default: the
        cost read just before submitting), so no more than that is ever paid; raises
        :class:`RegistrationCostError` then (nothing paid)."""

    @abc.abstractmethod
    async def serve(self, wallet: Any, netuid: int, ip: str, port: int) -> None:
        """Publish the hotkey's endpoint (``ServeAxon``); :class:`RateLimitedError` inside the
        serving rate limit."""

    @abc.abstractmethod
    async def publish(self, wallet: Any, netuid: int, data: str) -> None:
        """Publish a short text commitment for the hotkey (at most 2048 utf-8 bytes);
        :class:`RateLimitedError` when the hotkey's commitment space for this epoch is used up."""

    @abc.abstractmethod
    async def set_weights(
        self, wallet: Any, netuid: int, uids: Sequence[int], weights: Sequence[float], version_key: int = 0
    ) -> WeightsReceipt:
        """Set the hotkey's weights (``SetWeights``: in the clear, or committed when the subnet
        runs commit-reveal); raises :class:`ChainError` when refused (:class:`RateLimitedError`
        inside the weights rate limit). Success means the chain said so; use
        :meth:`weights_landed` to confirm."""

    async def pending_commits(self, hotkey: str, netuid: int) -> set[int]:
        """Blocks of the hotkey's weight commits the chain has not revealed (or dropped) yet
        (``TimelockedWeightCommits``; empty without commit-reveal). A commit leaves it once its reveal
        was tried: the weights row then shows it, or the chain refused it."""
        return set()

    async def weights_landed(self, hotkey: str, netuid: int, receipt: WeightsReceipt) -> bool:
        """Whether the chain's state shows the weights of ``receipt`` (the hotkey's ``last_update``
        reached the receipt's block: set, or committed for a later reveal)."""
        last = await self.last_update(hotkey, netuid)
        return last is not None and last >= receipt.block

    async def reconnect(self) -> None:
        """Drop the connection and open a new one (after a :class:`ChainTimeout`)."""

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


def served_endpoint(axon: Any) -> Optional[str]:
    """``"ip:port"`` of a served axon, else None (unserved: ip 0.0.0.0 or port 0)."""
    if axon is None:
        return None
    if not isinstance(axon, str):  # an AxonInfo-like object
        ip, port = getattr(axon, "ip", None), getattr(axon, "port", None)
        axon = f"{ip}:{port}"
    host, _, port = str(axon).rpartition(":")
    if not host or host in ("0.0.0.0", "0", "::", "[::]", "None") or not port.isdigit() or int(port) == 0:
        return None
    return f"{host}:{port}"
