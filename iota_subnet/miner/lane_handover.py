"""Where a replica handed a lane it did not train gets the lane's weights (the data plane's rule is
in :mod:`iota_subnet.miner.dataplane.handover`).

A lane's weights at a stage are those of the replica that trained the lane there last: the stage's
latest merged state plus what that replica trained since (the replicas of a stage merge every
``merge.every_steps`` inner steps; without merging, all it trained). In order of preference:

1. ``holder``: the state (``/state``) of the stage peer that trained the lane last, found by asking
   every stage peer's ``/health`` (``stats["lane"]``: the lane it last trained in as the lane's own
   miner, ``stats["inner_step"]``: its step; the one with the highest step). A departed member that
   is still reachable (unavailable to validators for a while, or moved to another slot) gives its
   state this way. Its optimizer state does not travel: the taker's own moments go on. A peer the
   ticket's validator barred as a cheater (``Ticket.not_from``) is never asked: its weights are
   not trusted, whatever lane it says it trained.
2. ``merged``: the stage's latest merged state (the anchor; pulled by state sync first when a peer
   holds a later merged epoch than this replica). What the lane trained since that merge on a
   member that is gone is lost.
3. ``own``: no merging and no holder answers: this replica's own weights (logged; nothing else
   holds the lane's).

This replica's inner step becomes the lane's (the ticket's step); accumulated gradients are
dropped; results computed from then on name the new weights (:meth:`StageWorker.weights_replaced`).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import torch
from loguru import logger

from iota_subnet.miner.catch_up import stage_merged_epoch
from iota_subnet.miner.chain_view import ChainView
from iota_subnet.miner.compute_thread import ComputeThread
from iota_subnet.miner.merging import MinerMerging
from iota_subnet.protocol import Health, ProtocolError, StateRequest, StateResponse, Ticket
from iota_subnet.transport import NeuronClient, TransportError

#: Seconds to wait for a stage peer's ``/health`` while looking for a lane's holder.
ASK_TIMEOUT_S = 5.0
#: Seconds to wait for the holder's ``/state`` (the stage's whole weights).
STATE_TIMEOUT_S = 60.0


async def lane_holder(view: ChainView, lane: int, client: NeuronClient,
                      not_from: frozenset = frozenset()) -> Optional[tuple[str, int]]:
    """(hotkey, inner step) of the stage peer (seen through ``view``, the miner's chain view) that
    trained ``lane`` last, among those that answer ``/health`` and are not in ``not_from`` (miners the
    ticket's validator barred); None when none did."""
    async def ask(hk: str):
        ep = view.endpoint_of(hk)
        if ep is None:
            return None
        try:
            h = await client.call(ep, hk, "/health", Health(run_id=view.run_id, stage=view.stage), Health,
                                  timeout_s=ASK_TIMEOUT_S, retries=0)
        except (TransportError, ProtocolError, asyncio.TimeoutError) as e:
            logger.info(f"stage {view.stage}: {hk[:10]} does not answer /health ({e}); not asked for lane {lane}")
            return None
        try:
            if int(h.stats.get("lane", -1)) != lane:
                return None
            return hk, int(h.stats.get("inner_step", h.inner_step or 0))
        except (AttributeError, TypeError, ValueError, OverflowError):      # a malformed answer: not a holder
            logger.info(f"stage {view.stage}: {hk[:10]} answered /health with malformed stats; not asked for lane {lane}")
            return None
    barred = [hk for hk in view.stage_peers() if hk in not_from]
    if barred:
        logger.info(f"stage {view.stage}: not taking lane {lane}'s weights from {len(barred)} peer(s) the validator "
                    f"barred ({', '.join(h[:10] for h in barred)})")
    found = [r for r in await asyncio.gather(*(ask(hk) for hk in view.stage_peers() if hk not in not_from))
             if r is not None]
    return max(found, key=lambda r: r[1]) if found else None


def state_mismatch(own: dict, got: Any) -> str:
    """Why a peer's stage state ``got`` (name -> tensor) cannot replace ``own`` (this stage's
    ``state_dict``): missing or extra names, another shape or dtype, a non-finite value; "" when it fits.
    Checked before anything is loaded (``load_state_dict`` copies what fits before it raises)."""
    if not isinstance(got, dict) or set(got) != set(own):
        return "other tensor names"
    for name, x in own.items():
        y = got[name]
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
            return f"{name}: not a {x.dtype} tensor of shape {tuple(x.shape)}"
        if y.is_floating_point() and not bool(torch.isfinite(y).all()):
            return f"{name}: non-finite values"
    return ""


async def take_lane(t: Ticket, *, worker: Any, wallet: Any, view: ChainView, compute: ComputeThread,
                    merging: Optional[MinerMerging]) -> str:
    """Give ``worker`` (the stage's compute, run on ``compute``) the weights of ``t``'s lane (see the
    module docstring) and the lane's step. ``wallet`` signs the requests to the stage peers found
    through ``view``; ``merging``: the miner's merge part when the run merges (None: not merging).
    Returns how (``holder <hotkey> at step k`` | ``merged epoch e`` | ``own``), for the log."""
    w, stage = worker, view.stage
    merge = merging.engine if merging is not None else None
    tensors: Optional[dict] = None
    how = "own"
    async with NeuronClient(wallet, alternates=view.relays_of) as client:
        found = await lane_holder(view, t.lane, client, frozenset(t.not_from))
        if found is not None:
            hk, step = found
            try:
                resp = await client.call(view.endpoint_of(hk), hk, "/state",
                                         StateRequest(run_id=view.run_id, stage=stage), StateResponse,
                                         timeout_s=STATE_TIMEOUT_S, retries=1)
                bad = state_mismatch(w.module.state_dict(), resp.tensors)
                if bad:
                    logger.warning(f"stage {stage}: lane {t.lane}'s holder {hk[:10]} sent a state that does not "
                                   f"fit this stage ({bad}); not taken")
                else:
                    tensors, how = resp.tensors, f"holder {hk[:10]} at step {resp.state_meta.get('step', step)}"
            except (TransportError, ProtocolError, asyncio.TimeoutError, TypeError) as e:
                logger.warning(f"stage {stage}: lane {t.lane}'s holder {hk[:10]} did not send its state: {e}")
    if merge is not None:
        # the anchor too: the next merge's pseudo-gradient is taken against it
        epochs, _ = await stage_merged_epoch(merge, view.stage_peers(), ASK_TIMEOUT_S)
        if epochs and max(epochs) > merge.merged_epoch:
            if not await merging.pull_merged_state(min_epoch=max(epochs)):
                logger.warning(f"stage {stage}: merged epoch {max(epochs)} not pulled for lane {t.lane}; "
                               f"this replica's merged epoch {merge.merged_epoch} stands")
        if tensors is None:
            how = f"merged epoch {merge.merged_epoch} (the lane's training since it on a departed member is lost)"
    if how == "own":
        logger.warning(f"stage {stage}: no replica holds lane {t.lane}'s weights and the run does not merge; "
                       f"training it with this replica's own weights")

    def apply():
        with w.lock:
            if tensors is not None:
                w.module.load_state_dict(tensors, strict=True)
                w.weights_replaced()
            elif merge is not None:
                merge.params.write(merge.anchor)      # calls weights_replaced
            w.opt.zero_grad(set_to_none=True)
            w.pending = 0
            if t.step != w.inner_step:
                w.last_skip = (w.inner_step, int(t.step))
            w.inner_step = int(t.step)
            w.lane = int(t.lane)
    await compute.run(apply)
    return how
