"""The SDK seam: :class:`DevnetSubstrate` implements the bittensor v11 SDK's ``Substrate``
protocol (``bittensor/_substrate.py``) on a devnet file, so ``bt.Client("local",
substrate=DevnetSubstrate(path))`` is a normal SDK client: the SDK's own reads (metagraph,
neurons, weights, hyperparameters, ...) and writes (``execute(SetWeights)``,
``execute(ServeAxon)``, ``submit_call(...)``, shielded or not) run unmodified.

Calls are signed and verified with the caller's keypair (sr25519), so only the holder of a key
can act for it; a chain-side refusal comes back as a failed ``ExtrinsicResult`` carrying the
chain's error name.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from loguru import logger

from .calls import apply
from .epoch import tick
from .reads import STORAGE, STORAGE_MAPS, account_info, runtime
from .schema import DevnetCall, Refused
from .shield import mev_public_key, seal_inner_extrinsic
from .state import DevnetState
from .tlock import Decryptor


class DevnetSubstrate:
    """``bittensor._substrate.Substrate`` backed by a devnet SQLite file.

    ``bt.Client("local", substrate=DevnetSubstrate(path))`` gives a normal SDK client. Every
    method runs its SQLite work on a worker thread, so the event loop never blocks on the
    file lock.
    """

    def __init__(self, path: str | os.PathLike, *, busy_timeout_s: float = 30.0, decryptor: Optional[Decryptor] = None):
        self.path = Path(path)
        self._busy_timeout_s = busy_timeout_s
        self._decryptor = decryptor
        self._state: Optional[DevnetState] = None
        self.token_symbols: dict[int, str] = {}
        self._unknown_logged: set = set()

    # lifecycle ---------------------------------------------------------------------------------

    @property
    def state(self) -> DevnetState:
        if self._state is None:
            self._state = DevnetState(self.path, busy_timeout_s=self._busy_timeout_s, decryptor=self._decryptor)
        return self._state

    async def connect(self) -> None:
        await asyncio.to_thread(lambda: self.state)

    async def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._state = None

    def balance(self, rao: int, netuid: int = 0):
        from bittensor.balance import Balance

        symbol = self.token_symbols.get(netuid) if netuid else None
        return Balance(int(rao), netuid, symbol)

    async def _run(self, fn, *args):
        def call():
            st = self.state
            tick(st)
            return fn(st, *args)

        try:
            return await asyncio.to_thread(call)
        except Refused as refused:
            from bittensor.result import ChainError

            raise ChainError(refused.message, refused.name) from None

    # chain / blocks ------------------------------------------------------------------------------

    async def block_number(self) -> int:
        return await self._run(lambda st: st.block())

    async def finalized_block_number(self) -> int:
        return await self.block_number()

    async def block_hash(self, block: Optional[int] = None) -> str:
        if block is not None and self._state is not None and self._state._genesis is not None:
            return self._state.block_hash(int(block))   # pure arithmetic: no file access, no thread hop
        return await self._run(lambda st: st.block_hash(st.block() if block is None else int(block)))

    async def block_time(self) -> float:
        return await self._run(lambda st: st.block_time)

    async def spec_version(self) -> int:
        return 1

    async def get_block(self, block_number: Optional[int] = None, block_hash: Optional[str] = None) -> Optional[dict]:
        def get(st: DevnetState):
            b = DevnetState.block_of_hash(block_hash) if block_hash else block_number
            b = st.block() if b is None else int(b)
            if b > st.block():
                return None
            ts = {"call": {"call_module": "Timestamp", "call_function": "set",
                           "call_args": [{"name": "now", "value": st.block_timestamp_ms(b)}]}}
            header = {"number": b, "hash": st.block_hash(b), "parentHash": st.block_hash(max(0, b - 1))}
            return {"header": header, "extrinsics": [ts]}

        return await self._run(get)

    async def blocks(self, *, finalized: bool = False) -> AsyncIterator[dict]:
        st = await asyncio.to_thread(lambda: self.state)
        last = await self.block_number()
        while True:
            now = time.time()
            next_at = st.genesis + (last + 1) * st.block_time
            if next_at > now:
                await asyncio.sleep(next_at - now + 0.001)
            current = await self.block_number()
            for b in range(last + 1, current + 1):
                yield {"header": {"number": b, "hash": st.block_hash(b), "parentHash": st.block_hash(b - 1)}}
            last = max(last, current)

    async def events(self, block_hash: Optional[str] = None) -> list[dict]:
        return []

    # storage -------------------------------------------------------------------------------------

    def _log_unknown(self, what: tuple) -> None:
        if what not in self._unknown_logged:
            self._unknown_logged.add(what)
            logger.debug("devnet: no storage/runtime item {}; answering empty", what)

    async def query(self, module: str, storage_function: str, params: Optional[list] = None,
                    block_hash: Optional[str] = None) -> Any:
        fn = STORAGE.get((module, storage_function))
        if fn is None:
            self._log_unknown((module, storage_function))
            return None

        def get(st: DevnetState):
            b = DevnetState.block_of_hash(block_hash)
            return fn(st, list(params or []), st.block() if b is None else b)

        return await self._run(get)

    async def map_has_entries(self, module: str, storage_function: str, params: list,
                              block_hash: Optional[str] = None) -> bool:
        return bool(await self.query_map(module, storage_function, params, block_hash))

    async def query_map(self, module: str, storage_function: str, params: Optional[list] = None,
                        block_hash: Optional[str] = None) -> list[tuple[Any, Any]]:
        fn = STORAGE_MAPS.get((module, storage_function))
        if fn is None:
            self._log_unknown((module, storage_function, "map"))
            return []
        return await self._run(lambda st: fn(st, list(params or [])))

    async def query_batch(self, module: str, storage_function: str, param_sets: list[list],
                          block_hash: Optional[str] = None) -> list[Any]:
        return [await self.query(module, storage_function, ps, block_hash) for ps in param_sets]

    async def runtime_call(self, api: str, method: str, params: list, block_hash: Optional[str] = None) -> Any:
        return await self._run(lambda st: runtime(st, api, method, list(params or [])))

    async def constant(self, module: str, name: str) -> Any:
        if (module, name) == ("Aura", "SlotDuration"):
            return await self._run(lambda st: int(st.block_time * 1000))
        if (module, name) == ("Balances", "ExistentialDeposit"):
            return 500
        self._log_unknown(("constant", module, name))
        return None

    async def decode_scale(self, type_string: str, data: Any) -> Any:
        from bittensor.result import ChainError

        raise ChainError("the devnet has no SCALE codec (decode_scale is not supported)")

    # calls ----------------------------------------------------------------------------------------

    async def compose(self, call) -> DevnetCall:
        if isinstance(call, DevnetCall):
            return call
        module, function, params = call
        return DevnetCall(module, function, dict(params))

    async def estimate_fee(self, call, keypair):
        from bittensor.balance import Balance

        return Balance.from_rao(0)

    async def estimate_weight(self, call, keypair) -> dict:
        return {"ref_time": 0, "proof_size": 0}

    async def account_next_index(self, address: str) -> int:
        return await self._run(lambda st: account_info(st, address)["nonce"])

    async def mev_next_key(self) -> Optional[bytes]:
        return await self._run(mev_public_key)

    async def sign_extrinsic(self, call, keypair, *, nonce: int, period: int) -> tuple[bytes, str]:
        call = await self.compose(call)
        return seal_inner_extrinsic(call, keypair, nonce, period)

    async def find_extrinsic(self, extrinsic_hash: str, block_hash: str):
        """The receipt of a shielded inner extrinsic applied in the block of ``block_hash``, or None."""
        from bittensor.balance import Balance
        from bittensor.result import ChainError, ExtrinsicResult

        block = DevnetState.block_of_hash(block_hash)
        row = await self._run(lambda st: st._q1("SELECT * FROM shielded_extrinsics WHERE hash=?", (extrinsic_hash,)))
        if row is None or block is None or int(row["block"]) != block:
            return None
        events = [{"extrinsic_idx": 0, "event": ev} for ev in json.loads(row["events"])]
        data = {}
        for ev in json.loads(row["events"]):
            if ev.get("event_id") == "NeuronRegistered":
                data = {"uid": ev["attributes"]["uid"], "burn_rao": ev["attributes"]["burn"]}
        if not row["success"]:
            error = ChainError(row["message"] or row["error"], row["error"])
            return ExtrinsicResult(success=False, message=row["message"] or "", error=error,
                                   block_hash=block_hash, extrinsic_id=f"{block}-shielded", fee=Balance.from_rao(0))
        return ExtrinsicResult(success=True, message="Success", block_hash=block_hash,
                               extrinsic_id=f"{block}-shielded", fee=Balance.from_rao(0), events=events, data=data)

    async def submit(self, call, keypair, *, nonce: Optional[int] = None, period: Optional[int] = None,
                     wait_for_inclusion: bool = True, wait_for_finalization: bool = True):
        from bittensor.balance import Balance
        from bittensor.result import ChainError, ExtrinsicResult

        call = await self.compose(call)
        signer = getattr(keypair, "ss58_address", None)
        try:
            from bittensor.sp_core import verify

            signature = bytes(keypair.sign(call.data))
            crypto = int(getattr(keypair, "crypto_type", 1))
            if not verify(call.data, signature, signer, crypto):
                raise ValueError("signature does not verify")
        except Exception as error:  # noqa: BLE001
            return ExtrinsicResult(success=False, message=f"cannot sign the extrinsic: {error}",
                                   error=ChainError(f"cannot sign the extrinsic: {error}", "BadSignature"))

        def apply_call(st: DevnetState):
            return apply(st, signer, call.module, call.function, call.params)

        try:
            block, idx, events = await self._run(apply_call)
        except ChainError as error:
            return ExtrinsicResult(success=False, message=error.message, error=error)
        st = self.state
        records = [{"extrinsic_idx": idx, "event": ev} for ev in events]
        records.append({"extrinsic_idx": idx, "event": {"module_id": "System", "event_id": "ExtrinsicSuccess", "attributes": {}}})
        data = {}
        for ev in events:
            if ev["event_id"] == "NeuronRegistered":
                data = {"uid": ev["attributes"]["uid"], "burn_rao": ev["attributes"]["burn"]}
        return ExtrinsicResult(success=True, message="Success", block_hash=st.block_hash(block),
                               extrinsic_id=f"{block}-{idx:04d}", fee=Balance.from_rao(0), events=records, data=data)

    async def submit_signed(self, extrinsic, keypair, *, wait_for_inclusion: bool = True,
                            wait_for_finalization: bool = True):
        return await self._unsupported("submit_signed")

    async def prepare(self, call, **kwargs):
        return await self._unsupported("prepare (out-of-process signing)")

    async def submit_signature(self, unsigned, signature, **kwargs):
        return await self._unsupported("submit_signature")

    def multisig_account(self, signatories: list[str], threshold: int):
        from bittensor.result import ChainError

        raise ChainError("multisig is not supported on the devnet")

    async def submit_multisig(self, call, keypair, multisig_account, **kwargs):
        return await self._unsupported("multisig")

    async def _unsupported(self, what: str):
        from bittensor.result import ChainError

        raise ChainError(f"{what} is not supported on the devnet")
