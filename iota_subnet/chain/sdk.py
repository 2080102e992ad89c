""":class:`Chain` on the bittensor v11 SDK (``bt.Client``): finney, test, local, a ws:// URL,
or the SQLite devnet (``bt.Client("local", substrate=DevnetSubstrate(db))``).

Writes go through the SDK's intents where they work unshielded (``SetWeights``, ``ServeAxon``)
and through ``submit_call`` of the raw call otherwise: ``execute(BurnedRegister)`` requires the
MEV-shield path (``mev_shield_required``), so registration submits
``calls.SubtensorModule.burned_register`` directly; commitments and staking have no intent that
fits (``Commitments.set_commitment``, ``SubtensorModule.add_stake``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import bittensor as bt
from bittensor import calls
from bittensor.result import ChainError as SdkChainError
from bittensor.signing import public_view
from loguru import logger

from .devnet import DevnetSubstrate
from .interface import Chain, ChainError, NotRegisteredError, Registration

NETWORKS = ("finney", "test", "local", "devnet")
MAX_COMMITMENT_BYTES = 16 * 128  # 16 Raw fields of at most 128 bytes


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


class SdkChain(Chain):
    def __init__(self, client: bt.Client, network: str):
        self.client = client
        self.network = network

    # -- errors --------------------------------------------------------------------------------

    def _fail(self, what: str, error: Any, hotkey: Optional[str] = None, netuid: Optional[int] = None) -> ChainError:
        name = getattr(error, "name", None)
        message = getattr(error, "message", None) or str(error)
        code = str(getattr(error, "code", "") or "")
        if name in ("HotKeyNotRegisteredInSubNet", "HotKeyNotRegisteredInNetwork", "AccountNotAllowedCommit") or code.endswith("NOT_REGISTERED"):
            return NotRegisteredError(
                f"{what} failed: hotkey {hotkey} is not registered on netuid {netuid} ({self.network}); "
                f"run `iota-subnet register --netuid {netuid} ...` first", name or "HotKeyNotRegisteredInSubNet")
        hint = {
            "IncorrectWeightVersionKey": " (the subnet requires a newer weights version key: update the validator)",
            "SettingWeightsTooFast": " (weights rate limit: wait and retry)",
            "NeuronNoValidatorPermit": " (this hotkey has no validator permit: stake more, wait for the next epoch)",
            "NotEnoughBalanceToStake": " (fund the coldkey)",
        }.get(name or "", "")
        return ChainError(f"{what} failed on {self.network}: {message}{hint}", name)

    async def _submit(self, what: str, call: Any, wallet: Any, *, signer: str = "coldkey", netuid=None):
        try:
            result = await self.client.submit_call(call, wallet, signer=signer)
        except SdkChainError as error:
            raise self._fail(what, error, _hotkey(wallet), netuid) from error
        if not result.success:
            raise self._fail(what, result.error or result.message, _hotkey(wallet), netuid)
        return result

    async def _execute(self, what: str, intent: Any, wallet: Any, netuid: int):
        try:
            result = await self.client.execute(intent, wallet)
        except SdkChainError as error:
            raise self._fail(what, error, _hotkey(wallet), netuid) from error
        if not result.success:
            raise self._fail(what, result.error or result.message, _hotkey(wallet), netuid)
        return result

    # -- reads ---------------------------------------------------------------------------------

    async def block(self) -> int:
        return await self.client.block()

    async def timestamp(self) -> float:
        return (await self.client.timestamp()).timestamp()

    async def block_seconds(self) -> float:
        return float(await self.client.block_time())

    async def tempo(self, netuid: int) -> int:
        value = await self.client.query(("SubtensorModule", "Tempo"), [netuid])
        if value is None:
            raise ChainError(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
        return int(value)

    async def hyperparameters(self, netuid: int) -> dict[str, Any]:
        params = await self.client.read("subnet_hyperparameters", netuid=netuid)
        if params is None:
            raise ChainError(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
        return dict(params)

    async def metagraph(self, netuid: int):
        graph = await self.client.subnets.metagraph(netuid)
        if graph is None:
            raise ChainError(f"subnet {netuid} does not exist on {self.network}", "SubnetNotExists")
        return graph

    async def uid(self, hotkey: str, netuid: int) -> Optional[int]:
        return await self.client.neurons.uid(hotkey, netuid)

    async def registration_cost(self, netuid: int) -> float:
        return float((await self.client.subnets.burn(netuid)).tao)

    async def commitments(self, netuid: int) -> dict[str, str]:
        found = await self.client.subnets.commitments(netuid)
        return {hk: c.value for hk, c in found.items() if c.uid is not None and c.value is not None}

    async def weights(self, netuid: int) -> list[tuple[int, list[tuple[int, float]]]]:
        rows = await self.client.weights.weights(netuid)
        return [(int(uid), sorted((int(j), float(w)) for j, w in row.items())) for uid, row in sorted(rows.items())]

    # -- writes --------------------------------------------------------------------------------

    async def register(self, wallet: Any, netuid: int) -> Registration:
        hotkey = _hotkey(wallet)
        uid = await self.uid(hotkey, netuid)
        if uid is not None:
            logger.info("hotkey {} already registered on netuid {} as uid {}", hotkey, netuid, uid)
            return Registration(uid=uid, cost_tao=0.0, already=True)
        cost = await self.registration_cost(netuid)
        logger.info("registering hotkey {} on netuid {} ({}): burns {:.9f} TAO from coldkey {}",
                    hotkey, netuid, self.network, cost, _coldkey(wallet))
        await self._submit("registration", calls.SubtensorModule.burned_register(netuid=netuid, hotkey=hotkey),
                           wallet, netuid=netuid)
        uid = await self.uid(hotkey, netuid)
        if uid is None:
            raise ChainError(f"registration of {hotkey} on netuid {netuid} was accepted but no uid is visible yet")
        logger.info("hotkey {} registered on netuid {} as uid {}", hotkey, netuid, uid)
        return Registration(uid=uid, cost_tao=cost, already=False)

    async def serve(self, wallet: Any, netuid: int, ip: str, port: int) -> None:
        await self._execute("serve axon", bt.ServeAxon(netuid=netuid, ip=ip, port=int(port)), wallet, netuid)

    async def publish(self, wallet: Any, netuid: int, data: str) -> None:
        await self._submit("commitment", calls.Commitments.set_commitment(netuid=netuid, info=_commitment_info(data)),
                           wallet, signer="hotkey", netuid=netuid)

    async def set_weights(self, wallet: Any, netuid: int, uids: Sequence[int], weights: Sequence[float],
                          version_key: int = 0) -> None:
        intent = bt.SetWeights(netuid=netuid, uids=[int(u) for u in uids], weights=[float(w) for w in weights],
                               version_key=int(version_key))
        await self._execute("set weights", intent, wallet, netuid)

    async def add_stake(self, wallet: Any, netuid: int, tao: float) -> None:
        rao = int(round(float(tao) * 1e9))
        await self._submit("add stake", calls.SubtensorModule.add_stake(hotkey=_hotkey(wallet), netuid=netuid,
                                                                        amount_staked=rao), wallet, netuid=netuid)

    async def close(self) -> None:
        await self.client.close()


async def open_chain(network: str, chain_db: Optional[Path | str] = None) -> Chain:
    """Open and connect a :class:`Chain`.

    ``network``: ``finney``, ``test``, ``local`` (``$BT_CHAIN_ENDPOINT`` or ws://127.0.0.1:9944),
    a ``ws://`` / ``wss://`` URL, or ``devnet`` (the SQLite devnet at ``chain_db``).
    """
    if network == "devnet":
        if chain_db is None:
            raise ChainError("network 'devnet' needs the chain database: pass --chain-db PATH")
        path = Path(chain_db)
        if not path.exists():
            raise ChainError(f"devnet chain database {path} does not exist; create it first "
                             "(iota_subnet.chain.devnet.create_devnet / the localnet script)")
        client = bt.Client("local", substrate=DevnetSubstrate(path))
    elif network in ("finney", "test", "local") or network.startswith(("ws://", "wss://")):
        client = bt.Client(network)
    else:
        raise ChainError(f"unknown network {network!r}; use one of {', '.join(NETWORKS)} or a ws:// URL")
    try:
        await client.connect()
    except Exception as error:  # noqa: BLE001
        raise ChainError(f"cannot connect to {network}: {error}") from error
    return SdkChain(client, network)
