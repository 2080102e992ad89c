"""Hops to the next and previous stages: the send queue, alternates, failures and aborts.

A part of :class:`~iota_subnet.miner.dataplane.plane.DataPlane`. Outbound hops go through a
priority queue (backward and abort before forward, then by step and index) drained by a few
concurrent senders. A forward tries the next stage's candidates in the ticket's order (the route's
miner, then its alternates); when none accepts it the micro-batch fails: an ``abort`` hop travels
back along the path and a ``failed`` receipt names the unreachable miners. A refusal of the hop's
content (:data:`~iota_subnet.protocol.refusal.PROVABLE`: non-finite, wrong shape or dtype, content
not matching the root the hop commits in ``info["root"]``) is this stage's fault, not the
receiver's: no other candidate is tried (each would refuse the same bytes) and nobody is named
unreachable.
"""
from __future__ import annotations

import asyncio
import heapq
from typing import Awaitable, Callable, Optional

import torch
from loguru import logger

from iota_subnet.audit.commit import wire_root
from iota_subnet.protocol import Hop, ProtocolError, Ticket
from iota_subnet.protocol.refusal import PROVABLE

from .tracking import Pending

#: Wire tensors above this many bytes are committed (hashed) on a worker thread.
OFFLOAD_BYTES = 256 << 10


async def commit_wire(data: torch.Tensor, scales: Optional[torch.Tensor] = None) -> str:
    """The receipt's name for a wire tensor: :func:`iota_subnet.audit.commit.wire_root` of its token rows
    (int8 / fp8: with their scales), hex. Off the event loop and the compute thread when large."""
    t = data if scales is None else (data, scales)
    if data.numel() * data.element_size() > OFFLOAD_BYTES:
        return (await asyncio.to_thread(wire_root, t)).hex()
    return wire_root(t).hex()


class HopSending:
    """The outbound side of :class:`~iota_subnet.miner.dataplane.plane.DataPlane` (see the module docstring)."""

    def _queue_send(self, prio: tuple, coro_fn: Callable[[], Awaitable[None]]) -> None:
        heapq.heappush(self._out, (prio, next(self._seq), coro_fn))
        self._out_ready.set()

    async def _send_loop(self) -> None:
        while not self._stopping:
            if not self._out:
                self._out_ready.clear()
                await self._out_ready.wait()
                continue
            _, _, fn = heapq.heappop(self._out)
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a send reports its own failures; never stop the sender
                logger.exception(f"stage {self.stage}: a send failed unexpectedly")

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hop(self, t: Ticket, stage: int, direction: str, path: list[str], wire, loss: Optional[float] = None,
             reason: str = "", root: str = "") -> Hop:
        """``root``: :func:`commit_wire` of ``wire``, committed in ``info["root"]`` (signed with the hop)."""
        data, scales = (wire if wire is not None else (None, None))
        info = {"loss": loss} if loss is not None else {}
        if root:
            info["root"] = root
        return Hop(run_id=t.run_id, stage=stage, microbatch_id=t.microbatch_id, inner_step=self.worker.inner_step,
                   ticket=t.to_json(), direction=direction, path=list(path), reason=reason, data=data,
                   scales=scales, info=info)

    async def _send_forward(self, t: Ticket, path: list[str], wire, pend: Pending) -> None:
        nxt, errors, failed = self.stage + 1, [], []
        sha = await commit_wire(*wire)
        for cand in t.candidates(nxt):
            if cand == self.me:
                continue
            try:
                await self.send(cand, self._hop(t, nxt, "forward", path, wire, root=sha))
            except (ProtocolError, Exception) as e:  # noqa: BLE001 - transport or refusal: try the next one
                if isinstance(e, asyncio.CancelledError):
                    raise
                if isinstance(e, ProtocolError) and e.outcome in PROVABLE:
                    self.counts["refused_content"] += 1
                    self._fail(t, path, f"{cand[:10]} refused this stage's forward: {e.outcome.value}: "
                                        f"{e.message[:160]}", abort=True, unreachable=failed)
                    return
                errors.append(f"{cand[:10]}: {type(e).__name__}: {str(e)[:120]}")
                failed.append(cand)
                self.counts["send_failures"] += 1
                continue
            pend.sent_to, pend.fwd_out = cand, sha
            pend.unreachable = failed
            self.counts["hops_out_forward"] += 1
            return
        self._fail(t, path, "no miner of stage {} took the forward: {}".format(nxt, "; ".join(errors) or "none named"),
                   abort=True, unreachable=failed)

    async def _send_backward(self, t: Ticket, path: list[str], wire, loss: Optional[float], receipt: dict) -> None:
        """Send the input gradient to the stage before; then the receipt of this stage's work (with the
        digest of what was sent), or a ``failed`` one naming the unreachable miner."""
        prev = path[-1]
        try:
            sha = await commit_wire(*wire)
            await self.send(prev, self._hop(t, self.stage - 1, "backward", path, wire, loss=loss, root=sha))
            self.counts["hops_out_backward"] += 1
            self._receipt(t, bout=sha, **receipt)
        except asyncio.CancelledError:
            raise
        except ProtocolError as e:
            self.counts["send_failures"] += 1
            content = e.outcome in PROVABLE          # this stage's output was refused: not the receiver's fault
            self._receipt(t, status="failed", error=f"backward to {prev[:10]} refused: {e.outcome.value}: "
                                                    f"{str(e.message)[:160]}", unreachable=[] if content else [prev])
        except Exception as e:  # noqa: BLE001
            self.counts["send_failures"] += 1
            self._receipt(t, status="failed", error=f"backward to {prev[:10]} failed: {type(e).__name__}: {str(e)[:160]}",
                          unreachable=[prev])

    def _fail(self, t: Ticket, path: list[str], error: str, *, abort: bool, unreachable: Optional[list[str]] = None
              ) -> None:
        """This stage cannot go on with ``t``: forget it here, tell the stages before (abort) and the validator."""
        self.pending.pop(t.microbatch_id, None)
        self.worker.drop(self._key(t))
        self.steps.release(t)
        logger.warning(f"stage {self.stage}: micro-batch {t.microbatch_id} failed: {error}")
        self._receipt(t, status="failed", error=error, unreachable=unreachable or [])
        back = path[:-1] if path and path[-1] == self.me else path
        if abort and self.stage > 0 and back:
            self._spawn(self._send_abort(t, back, error))
        self._wake.set()

    async def _send_abort(self, t: Ticket, path: list[str], reason: str) -> None:
        try:
            await self.send(path[-1], self._hop(t, self.stage - 1, "abort", path, None, reason=reason[:200]))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - best effort: the stage before expires it at the deadline
            logger.debug(f"abort of {t.microbatch_id} to {path[-1][:10]} failed: {e}")

    def _on_abort(self, t: Ticket, reason: str) -> None:
        p = self.pending.pop(t.microbatch_id, None)
        self.worker.drop(self._key(t))
        self.steps.release(t)
        self.counts["aborted"] += 1
        if p is not None and self.stage > 0:
            self._spawn(self._send_abort(t, p.path[:-1], reason))
        self._wake.set()
