""":class:`Chain` on the bittensor v11 SDK (``bt.Client``): finney, test, local, a ws:// URL, or
any chain handed in as the SDK's ``Substrate`` (``bt.Client("local", substrate=...)``: the
SQLite devnet of :mod:`iota_subnet.devnet` comes in this way, through :func:`open_chain`'s
``substrate`` factory).

Writes go through the SDK: ``SetWeights`` and ``ServeAxon`` intents (``SetWeights`` picks the
plain or the drand-timelocked commit-reveal path from the chain's ``CommitRevealWeightsEnabled``),
and ``submit_call`` of raw calls where no intent fits: registration submits
``register_limit`` (the chain refuses it when the burn is above the price the user accepted),
MEV-shielded like the SDK's ``BurnedRegister`` intent whenever the chain runs the shield;
commitments (``Commitments.set_commitment``) and staking (``SubtensorModule.add_stake``).

Deadlines: every call is bounded (``timeout_s`` for reads, ``write_timeout_s`` for writes, which
wait for inclusion); a call without an answer raises :class:`ChainTimeout` and the next call first
reconnects. Rate-limit refusals raise :class:`RateLimitedError`.
"""
from __future__ import annotations

import asyncio
import ipaddress
import re
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import bittensor as bt
from bittensor import calls
from bittensor.result import ChainError as SdkChainError
from bittensor.result import ConnectionNotReady, ErrorCode
from bittensor.signing import public_view
from loguru import logger

from .interface import (Chain, ChainError, ChainTimeout, CommitmentRecord, NotRegisteredError, RateLimitedError,
                        Registration, RegistrationCostError, WeightsReceipt)

NETWORKS = ("finney", "test", "local", "devnet")
MAX_COMMITMENT_BYTES = 16 * 128  # 16 Raw fields of at most 128 bytes
RAO_PER_TAO = 1_000_000_000
#: Seconds a read may take before :class:`ChainTimeout`.
DEFAULT_TIMEOUT_S = 30.0
#: Seconds a write may take (it waits for inclusion and finalization: several 12 s blocks on finney).
DEFAULT_WRITE_TIMEOUT_S = 180.0
#: Chain error names that mean "rate limited: the same write succeeds later".
RATE_LIMIT_ERRORS = ("ServingRateLimitExceeded", "SettingWeightsTooFast", "CommittingWeightsTooFast",
                     "SpaceLimitExceeded", "TxRateLimitExceeded", "NetworkTxRateLimitExceeded")
_RETRY_BLOCKS = re.compile(r"retry in ~?(\d+) blocks", re.I)

T = TypeVar("T")

#: A zero-argument factory of a fresh, unconnected bittensor ``Substrate`` (called again on every
#: reconnect), e.g. ``lambda: DevnetSubstrate(path)``.
SubstrateFactory = Callable[[], Any]


def _hotkey(wallet: Any) -> str:
    return public_view(wallet, "hotkey").ss58_address


def _coldkey(wallet: Any) -> str:
    return public_view(wallet, "coldkey").ss58_address


def _commitment_info(data: str) -> dict:
    raw = data.encode("utf-8")
    if len(raw) > MAX_COMMITMENT_BYTES:
        raise ValueError(f"commitment is {len(raw)} bytes; at most {MAX_COMMITMENT_BYTES} fit on chain")
    chunks = [raw[i : i + 128] for i in range(0, len(raw), 128)] or [b""]
    # Same shape as bittensor v9's publish_metadata: a BoundedVec of Data::RawN variants.
    return {"fields": [[{f"Raw{len(c)}": "0x" + c.hex()} for c in chunks]]}


def _result_block(result: Any) -> Optional[int]:
    height, _, _ = str(getattr(result, "extrinsic_id", "") or "").partition("-")
    return int(height) if height.isdigit() else None


class SdkChain(Chain):
    """``make_client()`` builds a fresh, unconnected ``bt.Client`` (used again to reconnect)."""

    def __init__(self, make_client: Callable[[], bt.Client], network: str, *, client: Optional[bt.Client] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S):
        self._make_client = make_client
        self.client = client if client is not None else make_client()
        self.network = network
        self.timeout_s = float(timeout_s)
        self.write_timeout_s = max(float(write_timeout_s), self.timeout_s)
        self._broken = False
        self._reconnecting = asyncio.Lock()

    # -- deadlines and reconnection ------------------------------------------------------------

    async def _io(self, what: str, call: Callable[[bt.Client], Awaitable[T]], *, write: bool = False) -> T:
        """``call(client)`` within the deadline; reconnects first after a time-out or a lost connection."""
        if self._broken:
            async with self._reconnecting:
                if self._broken:
                    await self.reconnect()
        limit = self.write_timeout_s if write else self.timeout_s
        client = self.client
        try:
            return await asyncio.wait_for(call(client), limit)
        except asyncio.TimeoutError:
            self._broken = True
            raise ChainTimeout(f"{what}: no answer from {self.network} within {limit:g} s (the endpoint is silent or "
                               "unreachable); the next chain call reconnects first", "Timeout") from None
        except (ConnectionNotReady, ConnectionError) as error:
            self._broken = True
            raise ChainError(f"{what}: the connection to {self.network} is down ({error}); the next chain call "
                             "reconnects first", "ConnectionLost") from error
        except Exception as error:
            if client is self.client:
                raise
            # another task's reconnect closed this call's connection under it (on the devnet: "Cannot
            # operate on a closed database"): a lost connection like any other, not a fault of the caller
            raise ChainError(f"{what}: the connection to {self.network} was replaced while this call ran "
                             f"({type(error).__name__}: {error}); retry", "ConnectionLost") from error

    async def connect(self) -> None:
        try:
            await asyncio.wait_for(self.client.connect(), self.timeout_s)
        except asyncio.TimeoutError:
            self._broken = True
            raise ChainTimeout(f"cannot connect to {self.network}: no answer within {self.timeout_s:g} s (check the "
                               "endpoint, or pass another --network)", "Timeout") from None
        except ChainError:
            raise
        except Exception as error:  # noqa: BLE001 - the SDK raises many kinds on a failed connect
            raise ChainError(f"cannot connect to {self.network}: {error}") from error
        self._broken = False

    async def reconnect(self) -> None:
        old, self.client = self.client, self._make_client()
        try:
            await asyncio.wait_for(old.close(), 5.0)
        except Exception:  # noqa: BLE001 - the old connection is being dropped anyway
            pass
        logger.info("reconnecting to {}", self.network)
        await self.connect()

    # -- errors --------------------------------------------------------------------------------

    def _fail(self, what: str, error: Any, hotkey: Optional[str] = None, netuid: Optional[int] = None) -> ChainError:
        name = getattr(error, "name", None)
        message = getattr(error, "message", None) or str(error)
        code = getattr(error, "code", None)
        if name in ("HotKeyNotRegisteredInSubNet", "HotKeyNotRegisteredInNetwork", "AccountNotAllowedCommit") or \
                str(code or "").endswith("NOT_REGISTERED"):
            return NotRegisteredError(
                f"{what} failed: hotkey {hotkey} is not registered on netuid {netuid} ({self.network}); "
                f"run `iota-subnet register --netuid {netuid} ...` first", name or "HotKeyNotRegisteredInSubNet")
        if name in RATE_LIMIT_ERRORS or code == ErrorCode.RATE_LIMITED:
            m = _RETRY_BLOCKS.search(message)
            return RateLimitedError(f"{what} rate limited on {self.network}: {message}", name or "RateLimited",
                                    int(m.group(1)) if m else None)
        if name == "RegistrationPriceLimitExceeded":
            return RegistrationCostError(f"{what} refused by the chain: the burn rose above the price you accepted "
                                         f"({message}); nothing was paid", name)
        hint = {
            "IncorrectWeightVersionKey": " (the subnet requires a newer weights version key: update the validator)",
            "NeuronNoValidatorPermit": " (this hotkey has no validator permit: stake more, wait for the next epoch)",
            "NotEnoughBalanceToStake": " (fund the coldkey)",
        }.get(name or "", "")
        return ChainError(f"{what} failed on {self.network}: {message}{hint}", name)

    async def _submit(self, what: str, call: Any, wallet: Any, *, signer: str = "coldkey", netuid=None,
                      shielded: bool = False):
        async def go(client):
            try:
                # a shielded call is followed to its inner receipt; inclusion is enough there (the caller
                # reads the resulting state back), and the SDK's finality polling is tight on fast blocks
                return await client.submit_call(call, wallet, signer=signer, shielded=shielded,
                                                wait_for_finalization=not shielded)
            except SdkChainError as error:
                raise self._fail(what, error, _hotkey(wallet), netuid) from error
        result = await self._io(what, go, write=True)
        if not result.success:
            raise self._fail(what, result.error or result.message, _hotkey(wallet), netuid)
        return result

    async def _execute(self, what: str, intent: Any, wallet: Any, netuid: int):
        async def go(client):
            try:
                return await client.execute(intent, wallet)
            except SdkChainError as error:
                raise self._fail(what, error, _hotkey(wallet), netuid) from error
        result = await self._io(what, go, write=True)
        if not result.success:
            raise self._fail(what, result.error or result.message, _hotkey(wallet), netuid)
        return result

    # -- reads ---------------------------------------------------------------------------------

    async def block(self) -> int:
        return await self._io("block", lambda c: c.block())

    async def block_time(self) -> float:
        return float(await self._io("block time", lambda c: c.block_time()))

    async def timestamp(self) -> float:
        return (await self.client.timestamp()).timestamp()

    async def block_seconds(self) -> float:
        return float(await self.client.block_time())

    async def tempo(self, netuid: int) -> int:
        value = await self._io("tempo", lambda c: c.query(("SubtensorModule", "Tempo"), [netuid]))
        if value is None:
            raise ChainError(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
        return int(value)

    async def hyperparameters(self, netuid: int) -> dict[str, Any]:
        params = await self._io("hyperparameters", lambda c: c.read("subnet_hyperparameters", netuid=netuid))
        if params is None:
            raise ChainError(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
        return dict(params)

    async def metagraph(self, netuid: int):
        graph = await self._io("metagraph", lambda c: c.subnets.metagraph(netuid))
        if graph is None:
            raise ChainError(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
        return graph

    async def uid(self, hotkey: str, netuid: int) -> Optional[int]:
        return await self._io("uid", lambda c: c.neurons.uid(hotkey, netuid))

    async def registration_cost(self, netuid: int) -> float:
        return float((await self._io("registration cost", lambda c: c.subnets.burn(netuid))).tao)

    async def commitments(self, netuid: int) -> dict[str, str]:
        return {hk: r.text for hk, r in (await self.commitment_records(netuid)).items()}

    async def commitment_records(self, netuid: int) -> dict[str, CommitmentRecord]:
        found = await self._io("commitments", lambda c: c.subnets.commitments(netuid))
        return {hk: CommitmentRecord(c.value, int(c.block)) for hk, c in found.items()
                if c.uid is not None and c.value is not None}

    async def axon(self, hotkey: str, netuid: int) -> Optional[str]:
        rec = await self._io("axon", lambda c: c.query(("SubtensorModule", "Axons"), [netuid, hotkey]))
        if not rec or not int(rec.get("ip", 0) or 0):
            return None
        ip = ipaddress.ip_address(int(rec["ip"])) if int(rec.get("ip_type", 4)) == 4 else \
            ipaddress.IPv6Address(int(rec["ip"]))
        return f"{ip}:{int(rec['port'])}"

    async def last_update(self, hotkey: str, netuid: int) -> Optional[int]:
        uid = await self.uid(hotkey, netuid)
        if uid is None:
            return None
        row = await self._io("last update", lambda c: c.query(("SubtensorModule", "LastUpdate"), [netuid]))
        return int(row[uid]) if isinstance(row, (list, tuple)) and uid < len(row) else None

    async def weights(self, netuid: int) -> list[tuple[int, list[tuple[int, float]]]]:
        rows = await self._io("weights", lambda c: c.weights.weights(netuid))
        return [(int(uid), sorted((int(j), float(w)) for j, w in row.items())) for uid, row in sorted(rows.items())]

    async def pending_commits(self, hotkey: str, netuid: int) -> set[int]:
        found = await self._io("weight commits", lambda c: c.weights.timelocked_weight_commits(netuid))
        return {int(e["commit_block"]) for entries in found.values() for e in entries if e["hotkey"] == hotkey}

    async def _shield_key(self) -> Optional[Any]:
        """The MEV shield's current key when the chain runs the shield, else None."""
        try:
            return await self._io("MEV shield key", lambda c: c.query(("MevShield", "NextKey"), []))
        except ChainTimeout:
            raise
        except Exception:  # noqa: BLE001 - a chain without the MevShield pallet
            return None

    # -- writes --------------------------------------------------------------------------------

    async def register(self, wallet: Any, netuid: int, max_cost_tao: Optional[float] = None) -> Registration:
        hotkey = _hotkey(wallet)
        uid = await self.uid(hotkey, netuid)
        if uid is not None:
            logger.info("hotkey {} already registered on netuid {} as uid {}", hotkey, netuid, uid)
            return Registration(uid=uid, cost_tao=0.0, already=True)
        cost = await self.registration_cost(netuid)
        limit = cost if max_cost_tao is None else float(max_cost_tao)
        if cost > limit:
            raise RegistrationCostError(f"registration on netuid {netuid} costs {cost:.9f} TAO now, above the "
                                        f"{limit:.9f} TAO accepted; nothing was paid (raise --max-burn to pay more)",
                                        "RegistrationPriceLimitExceeded")
        shielded = await self._shield_key() is not None
        logger.info("registering hotkey {} on netuid {} ({}): burns {:.9f} TAO (at most {:.9f}) from coldkey {}{}",
                    hotkey, netuid, self.network, cost, limit, _coldkey(wallet), ", MEV-shielded" if shielded else "")
        call = calls.SubtensorModule.register_limit(netuid=netuid, hotkey=hotkey,
                                                    limit_price=int(round(limit * RAO_PER_TAO)))
        result = await self._submit("registration", call, wallet, netuid=netuid, shielded=shielded)
        uid = await self.uid(hotkey, netuid)
        if uid is None:
            raise ChainError(f"registration of {hotkey} on netuid {netuid} was accepted but no uid is visible yet")
        paid = result.data.get("burn_rao")
        paid_tao = int(paid) / RAO_PER_TAO if paid is not None else cost
        logger.info("hotkey {} registered on netuid {} as uid {} ({:.9f} TAO burned)", hotkey, netuid, uid, paid_tao)
        return Registration(uid=uid, cost_tao=paid_tao, already=False)

    async def serve(self, wallet: Any, netuid: int, ip: str, port: int) -> None:
        await self._execute("serve axon", bt.ServeAxon(netuid=netuid, ip=ip, port=int(port)), wallet, netuid)

    async def publish(self, wallet: Any, netuid: int, data: str) -> None:
        await self._submit("commitment", calls.Commitments.set_commitment(netuid=netuid, info=_commitment_info(data)),
                           wallet, signer="hotkey", netuid=netuid)

    async def set_weights(self, wallet: Any, netuid: int, uids: Sequence[int], weights: Sequence[float],
                          version_key: int = 0) -> WeightsReceipt:
        intent = bt.SetWeights(netuid=netuid, uids=[int(u) for u in uids], weights=[float(w) for w in weights],
                               version_key=int(version_key))
        result = await self._execute("set weights", intent, wallet, netuid)
        block = _result_block(result)
        if block is None:
            block = await self.block()
        rnd = result.data.get("reveal_round")
        return WeightsReceipt(block=block, commit_reveal=rnd is not None, reveal_round=None if rnd is None else int(rnd))

    async def add_stake(self, wallet: Any, netuid: int, tao: float) -> None:
        rao = int(round(float(tao) * 1e9))
        await self._submit("add stake", calls.SubtensorModule.add_stake(hotkey=_hotkey(wallet), netuid=netuid,
                                                                        amount_staked=rao), wallet, netuid=netuid)

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.client.close(), 5.0)
        except Exception:  # noqa: BLE001 - closing a dead connection must not raise
            pass


async def open_chain(network: str, *, substrate: Optional[SubstrateFactory] = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S, write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> Chain:
    """Open and connect a :class:`Chain`.

    ``network``: ``finney``, ``test``, ``local`` (``$BT_CHAIN_ENDPOINT`` or ws://127.0.0.1:9944) or
    a ``ws://`` / ``wss://`` URL. With ``substrate`` (a :data:`SubstrateFactory`) the client runs
    on the substrate it builds (``bt.Client("local", substrate=substrate())``) and ``network`` only
    names the chain in messages: this is how the devnet is opened (``iota_subnet.devnet.open_devnet``).
    ``timeout_s`` bounds the connection and every read, ``write_timeout_s`` every write.

    Raises :class:`ChainError` for an unknown network, or ``devnet`` without its substrate;
    :class:`ChainTimeout` when the endpoint does not answer; ``TypeError`` when ``substrate`` is
    not callable.
    """
    if substrate is not None:
        if not callable(substrate):
            raise TypeError(f"substrate must be a zero-argument factory of a bittensor Substrate, not "
                            f"{type(substrate).__name__}")

        def make() -> bt.Client:
            return bt.Client("local", substrate=substrate())
    elif network == "devnet":
        raise ChainError("network 'devnet' is a SQLite file opened by iota_subnet.devnet (open_devnet); "
                         "pass --chain-db PATH")
    elif network in ("finney", "test", "local") or network.startswith(("ws://", "wss://")):
        def make() -> bt.Client:
            return bt.Client(network)
    else:
        raise ChainError(f"unknown network {network!r}; use one of {', '.join(NETWORKS)} or a ws:// URL")
    chain = SdkChain(make, network, timeout_s=timeout_s, write_timeout_s=write_timeout_s)
    try:
        await chain.connect()
    except BaseException:
        await chain.close()
        raise
    return chain
