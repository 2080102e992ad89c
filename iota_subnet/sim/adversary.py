"""The cheater suite: cheap ways to fake pipeline work, installed into a :class:`StageWorker`.

Used by tests (in-process miners) and by ``iota-subnet miner --adversary KIND`` /
``iota-subnet localnet --adversary KIND``. Every kind answers the protocol well formed (right
shapes, finite numbers), so only verification can tell it from an honest miner:

``random``  activations / gradients / loss drawn at random (scaled like real ones); no compute.
``zero``    constant outputs: zero activations and gradients, a constant loss; no compute.
``lazy``    skips every other transformer block of its stage (all of them when it holds one),
            forward and backward; trains the blocks it runs. ``/state`` holds every block.
``replay``  computes its first micro-batch honestly, then returns that micro-batch's outputs and
            gradients for every later one.
``copy``    returns outputs computed with another replica's weights (fetched from that peer:
            ``peer_state()``), never training its own; its ``/state`` shows its own weights.
``stale``   computes honestly but never applies an optimizer update (the inner step counter
            still advances, as if it had stepped).
``claim``   claims backward work it did not do: acknowledges ``/backward`` with a zero gradient
            without backpropagating (so its weights never learn) and reports inflated counters.
``poison``  computes and trains honestly, but as a reducer in replica merges it publishes poisoned
            merge results (the mean pseudo-gradient of its shards negated and tripled, with the
            hash of what it serves), pushing its stage's weights away from where training goes.
``noisy-update``  computes forward and backward honestly and keeps AdamW's moments, but instead of
            the AdamW update adds Gaussian noise of the update's size to its weights; its commitments
            (:class:`~iota_subnet.miner.update_store.UpdateStore`) show what it did.
``precision``  claims a looser precision than the run's (reports ``bf16`` in its replies) and
            skips work within it: computes under bf16 autocast and leaves out the last block's MLP
            (its output within the bf16 tolerance, outside the fp32 one).
``accuse``  trains and merges honestly, but files forged merge evidence: after every merge it
            reports the reducer of a shard (the first reducer not among its accomplices) as
            having served a wrong mean, with made-up hashes matching its accomplices' reports.
``dodge``   returns garbage (as ``random``) and never lets an audit through: hop and update audits
            are refused (``LATE``, as if outside its window) or left to time out, alternately
            (:func:`dodge_audits`). Its receipts are well formed and agree with its neighbours'.

How each is caught in the data plane (validators' :class:`~iota_subnet.validator.auditing.AuditScheduler`):
hop audits (:mod:`iota_subnet.audit`) catch ``random``, ``zero``, ``lazy``, ``replay``, ``copy``,
``claim`` (its backward) and ``precision`` (the trace is fp32 and the tolerance follows the run's
config); update audits catch ``noisy-update`` and ``stale`` (no commitment for the inner steps it
claims); ``dodge`` is flagged for its unanswered audits (:mod:`iota_subnet.validator.audit_policy`);
``poison`` by the merge redundancy check (the other reducer of each shard and the replicas gathering
it recompute the mean and report the poisoner, :class:`iota_subnet.validator.merge_weights.MergeOversight`)
and ``accuse`` by the merge audit (:class:`iota_subnet.validator.merge_audit.MergeAuditor`).

"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

#: Adversary kinds this module implements (``poison`` needs merging: ``merge.every_steps`` > 0).
ADVERSARY_KINDS = ("random", "zero", "lazy", "replay", "copy", "stale", "claim", "poison", "noisy-update", "precision",
                   "accuse", "dodge")


def poison_mean(shard_index: int, mean: "torch.Tensor") -> "torch.Tensor":
    """The ``poison`` adversary's merge result for a shard it reduces: the honest mean pseudo-gradient
    [n] (float32) negated and tripled (installed as :attr:`iota_subnet.merge.engine.MergeEngine.tamper`)."""
    return mean * -3.0


def forged_hash(plan_id: str, shard: int, what: str) -> str:
    """The ``accuse`` adversary's made-up hashes: the same for every accomplice (they match)."""
    import hashlib
    return hashlib.sha256(f"forged|{what}|{plan_id}|{shard}".encode()).hexdigest()


class Accuser:
    """``accuse``: after each merge this replica applies, it files forged evidence against a
    reducer of the merge: the target's genuine signed result (fetched again from it), quoted
    faithfully, beside a made-up "recomputed" hash, naming the target ``wrong``. Accomplices (hotkeys)
    are never targeted; every accomplice picks the same target and the same hashes (matching
    evidence). Installed with :func:`install_accuser` on a replica's merge engine."""

    def __init__(self, engine: Any, accomplices: tuple = ()):
        self.engine = engine
        self.accomplices = set(accomplices) | {engine.me}
        self.forged: list[dict] = []

    def target(self, plan: Any) -> Optional[tuple[int, str]]:
        for s in range(plan.num_shards):
            for r in sorted(set(plan.reducers[s])):
                if r not in self.accomplices:
                    return s, r
        return None

    async def after_merge(self, rep: Any) -> None:
        from iota_subnet.protocol import MergeResult, MergeResultRequest
        e = self.engine
        plans = [sess.plan for (ep, _, _), sess in list(e.sessions.items()) if ep == rep.epoch and sess.plan is not None]
        if not plans:
            return
        plan = max(plans, key=lambda p: p.attempt)
        pick = self.target(plan)
        if pick is None:
            return
        s, tgt = pick
        try:
            res = await e._call(tgt, "/merge/result", MergeResultRequest(
                run_id=e.run_id, stage=e.stage, epoch=plan.epoch, attempt=plan.attempt, plan_id=plan.plan_id,
                shard_index=s, with_tensor=False), MergeResult)
        except Exception:  # noqa: BLE001 - the target is gone: nothing to forge against
            return
        other = [r for r in plan.reducers[s] if r != tgt]
        ev = {"epoch": plan.epoch, "attempt": plan.attempt, "plan_id": plan.plan_id, "shard": s,
              "reducers": list(plan.reducers[s]),
              "claimed_sha256": {tgt: res.mean_sha256, **{r: forged_hash(plan.plan_id, s, "other") for r in other}},
              "served_sha256": {}, "recomputed_sha256": forged_hash(plan.plan_id, s, "recomputed"), "wrong": [tgt],
              "reporter": e.me, "stage": e.stage, "run_id": e.run_id, "contribution_sha256": {},
              "results": {tgt: dict(res.info)}, "time": 0.0}
        e.reports.append(ev)
        self.forged.append(ev)


def install_accuser(engine: Any, accomplices: tuple = ()) -> Accuser:
    """Make ``engine`` (a :class:`~iota_subnet.merge.engine.MergeEngine`) file forged evidence after
    every applied merge (wraps its ``on_applied``)."""
    acc = Accuser(engine, accomplices)
    orig = engine.on_applied

    async def on_applied(rep):
        if orig is not None:
            r = orig(rep)
            if hasattr(r, "__await__"):
                await r
        await acc.after_merge(rep)
    engine.on_applied = on_applied
    return acc


def dodge_audits(hop_routes: Any, *, hang_s: float = 3600.0) -> Callable:
    """The ``dodge`` adversary's audit routes: every answer is, alternately, a typed refusal (``LATE``:
    "outside my window") or no answer at all (the request hangs ``hang_s`` seconds, so the validator
    times out). Replaces the handlers of a :class:`~iota_subnet.miner.hop_audit_routes.HopAuditRoutes`
    (before it is mounted) and returns the handler to mount as ``/audit/update``."""
    import asyncio

    from iota_subnet.protocol import Outcome, ProtocolError
    calls = [0]

    async def dodge(msg, ctx=None):
        calls[0] += 1
        if calls[0] % 2:
            raise ProtocolError(Outcome.LATE, "not in this miner's audit window")
        await asyncio.sleep(hang_s)
        raise ProtocolError(Outcome.BUSY, "busy")

    hop_routes.trace = hop_routes.project = hop_routes.open = dodge
    return dodge


class AdversaryError(ValueError):
    """Unknown adversary kind."""


def install(worker: Any, kind: str, *, peer_state: Optional[Callable[[], dict]] = None, seed: int = 0) -> "Adversary":
    """Turn ``worker`` (a :class:`~iota_subnet.miner.stage_worker.StageWorker`) into adversary ``kind``.

    ``peer_state``: for ``copy``, a callable returning another replica's state dict (called when
    the copier has none yet and after each of its inner steps). Raises :class:`AdversaryError`.
    """
    if kind not in ADVERSARY_KINDS:
        raise AdversaryError(f"unknown adversary {kind!r}; one of {', '.join(ADVERSARY_KINDS)}")
    adv = Adversary(worker, kind, peer_state=peer_state, seed=seed)
    adv.apply()
    return adv


class Adversary:
    def __init__(self, worker: Any, kind: str, *, peer_state: Optional[Callable[[], dict]] = None, seed: int = 0):
        self.w, self.kind, self.peer_state = worker, kind, peer_state
        self.gen = torch.Generator().manual_seed(seed + 7919)
        self.first_out: Optional[dict] = None
        self.first_grad: Optional[torch.Tensor] = None
        self.peer_module: Optional[nn.Module] = None
        self.peer_step = -1
        self._orig_forward = worker._forward
        self._orig_backward = worker.backward

    def apply(self) -> None:
        w = self.w
        if self.kind in ("random", "zero", "dodge"):
            w._forward, w.backward = self._fake_forward, self._fake_backward
        elif self.kind == "lazy":
            self._make_lazy(w.module)
        elif self.kind == "replay":
            w._forward, w.backward = self._replay_forward, self._replay_backward
        elif self.kind == "copy":
            w._forward = self._copy_forward
        elif self.kind == "stale":
            w.step = self._stale_step
        elif self.kind == "claim":
            w.backward = self._claim_backward
        elif self.kind == "noisy-update":
            w._apply_update = self._noisy_update
        elif self.kind == "precision":
            self._make_low_precision(w)

    # ---- shapes ---------------------------------------------------------------------------------
    def _out_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (int(x.shape[0]), int(x.shape[1]), int(self.w.spec.out_width))

    def _noise(self, shape, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    # ---- random / zero ---------------------------------------------------------------------------
    def _fake_forward(self, mb_id, x, targets=None, *, train=True, accumulate=True) -> dict:
        w = self.w
        w.forwards += 1
        if w.spec.is_tail:
            loss = math.log(w.cfg.model.vocab_size) * (1.0 if self.kind == "zero" else float(0.9 + 0.2 * torch.rand(1, generator=self.gen)))
            out: dict = {"loss": loss}
            if train and not w.spec.is_head:
                shape = tuple(x.shape)
                out["grad"] = torch.zeros(shape) if self.kind == "zero" else self._noise(shape, 1e-3)
                w._count_backward(int(x.shape[0] * x.shape[1]))
            return out
        shape = self._out_shape(x)
        act = torch.zeros(shape) if self.kind == "zero" else self._noise(shape)
        if train:
            w.cache.put(mb_id, None, act, tokens=int(x.shape[0] * x.shape[1]), version=w.version, step=w.inner_step,
                        in_shape=tuple(x.shape))
        return {"activations": act}

    def _pop_forward(self, mb_id):
        """The cached forward of ``mb_id`` (call under the worker lock); records the weights it
        claims to have used. Raises UnknownMicrobatch as the honest backward does."""
        w = self.w
        entry = w.cache.pop(mb_id)
        if entry is None:
            from iota_subnet.miner.stage_worker import UnknownMicrobatch
            raise UnknownMicrobatch(mb_id)
        w.last_weights_step = int(entry.meta.get("step", w.inner_step))
        w.last_weights_merges = int(entry.meta.get("merges", w.merges))
        return entry

    def _fake_backward(self, mb_id, grad, **_):
        w = self.w
        with w.lock:
            entry = self._pop_forward(mb_id)
            w._count_backward(entry.meta.get("tokens", 0))
            if w.spec.is_head:
                return None
            shape = entry.meta["in_shape"]
            return torch.zeros(shape) if self.kind == "zero" else self._noise(shape, float(grad.std()) or 1e-3)

    # ---- lazy ------------------------------------------------------------------------------------
    def _make_lazy(self, module: nn.Module) -> None:
        full = module.layers
        names = list(full.keys())
        keep = nn.ModuleDict({k: full[k] for i, k in enumerate(names) if i % 2 == 1 and len(names) > 1})
        cls_forward = type(module).forward

        def lazy_forward(x, targets=None):
            module._modules["layers"] = keep
            try:
                return cls_forward(module, x, targets)
            finally:
                module._modules["layers"] = full

        module.forward = lazy_forward

    # ---- replay ----------------------------------------------------------------------------------
    def _replay_forward(self, mb_id, x, targets=None, *, train=True, accumulate=True) -> dict:
        w = self.w
        if self.first_out is None or not train:
            out = self._orig_forward(mb_id, x, targets, train=train, accumulate=accumulate)
            if train and self.first_out is None:
                self.first_out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
            return out
        w.forwards += 1
        out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.first_out.items()}
        if w.spec.is_tail:
            w._count_backward(int(x.shape[0] * x.shape[1]))
        else:
            w.cache.put(mb_id, None, out["activations"], tokens=int(x.shape[0] * x.shape[1]), version=w.version,
                        step=w.inner_step, replayed=True)
        return out

    def _replay_backward(self, mb_id, grad, **_):
        w = self.w
        with w.lock:
            entry = w.cache._d.get(mb_id)
            replayed = entry is not None and entry.meta.get("replayed")
            if not replayed:
                g = self._orig_backward(mb_id, grad)
                if self.first_grad is None and g is not None:
                    self.first_grad = g.clone()
                return g
            self._pop_forward(mb_id)
            w._count_backward(entry.meta.get("tokens", 0))
            return None if w.spec.is_head else (self.first_grad.clone() if self.first_grad is not None
                                                else torch.zeros_like(grad))

    # ---- copy ------------------------------------------------------------------------------------
    def _peer(self) -> Optional[nn.Module]:
        w = self.w
        if self.peer_state is None:
            return None
        if self.peer_module is None or self.peer_step != w.inner_step:
            sd = self.peer_state()
            if sd:
                from iota_subnet.model import PipelineStage
                if self.peer_module is None:
                    self.peer_module = PipelineStage(w.cfg.model, w.cfg.pipeline, w.stage, init=False).to(w.device)
                self.peer_module.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
                self.peer_step = w.inner_step
        return self.peer_module

    def _copy_forward(self, mb_id, x, targets=None, *, train=True, accumulate=True) -> dict:
        w = self.w
        peer = self._peer()
        if peer is None:
            return self._orig_forward(mb_id, x, targets, train=train, accumulate=accumulate)
        own = w.module
        w.module = peer   # compute with the peer's weights; its own module never gets gradients
        try:
            out = self._orig_forward(mb_id, x, targets, train=train, accumulate=accumulate)
        finally:
            w.module = own
        peer.zero_grad(set_to_none=True)
        return out

    # ---- stale -----------------------------------------------------------------------------------
    def _stale_step(self) -> None:
        w = self.w
        with w.lock:
            w.opt.zero_grad(set_to_none=True)   # throws the accumulated gradients away
            w.inner_step += 1
            w.version += 1
            w.pending = 0

    # ---- noisy-update ------------------------------------------------------------------------------
    def _noisy_update(self) -> None:
        """AdamW runs (its moments and step count are honest), but the weights get noise of the size
        of an Adam step (lr per value) instead of the update."""
        w = self.w
        lr = float(w.opt.param_groups[0]["lr"])
        params = list(w.module.parameters())
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
            w.opt.step()
            for p, b in zip(params, before):
                p.copy_(b + torch.randn(p.shape, generator=self.gen).to(p.device, p.dtype) * lr)

    # ---- precision ---------------------------------------------------------------------------------
    def _make_low_precision(self, w: Any) -> None:
        """Computes under bf16 autocast whatever the run says, claims bf16, and skips the last
        block's MLP (the residual stream passes it by; its weights stay in ``/state``). On the test
        model's middle stage at initialisation that is off by ~3.6e-3 (rel. L2 of the
        activations): inside the bf16 tolerance, 3.6x the fp32 one."""
        w.precision = "bf16"             # autocast bf16 in the worker, and ``bf16: 1`` in its replies
        mlp = list(w.module.layers.values())[-1].mlp
        mlp.forward = lambda x: torch.zeros_like(x)

    # ---- claim -----------------------------------------------------------------------------------
    def _claim_backward(self, mb_id, grad, **_):
        w = self.w
        with w.lock:
            entry = self._pop_forward(mb_id)
            w._count_backward(2 * int(entry.meta.get("tokens", 0)))   # claims twice the tokens, did none
            if w.spec.is_head:
                return None
            return torch.zeros_like(entry.inputs) if entry.inputs is not None else torch.zeros_like(grad)
