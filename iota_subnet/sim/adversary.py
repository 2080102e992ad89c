"""The cheater suite: cheap ways to fake pipeline work, as subclasses of a miner's production parts.

Used by tests (in-process miners) and by ``iota-subnet miner --adversary KIND`` /
``iota-subnet localnet --adversary KIND``: the entry point builds the miner with
:func:`adversary_parts` (a :class:`~iota_subnet.miner.parts.MinerParts`): a
:class:`CheatingStageWorker` (a :class:`~iota_subnet.miner.stage_worker.StageWorker` overriding
its public compute methods), and for the merge and audit cheats a :class:`TamperingMergeEngine`,
an :class:`AccusingMergeEngine` or :class:`DodgingHopAuditRoutes`. Every kind answers the protocol
well formed (right shapes, finite numbers), so only verification can tell it from an honest miner:

``random``  activations / gradients / loss drawn at random (scaled like real ones); no compute.
``zero``    constant outputs: zero activations and gradients, a constant loss; no compute.
``lazy``    skips every other transformer block of its stage (all of them when it holds one),
            forward and backward; trains the blocks it runs. ``/state`` holds every block. On a
            ``transformers`` family stage it keeps the 2nd, 4th, ... decoder layer (a twin of the stage,
            :func:`~iota_subnet.sim.family_cheats.twisted_stage`).
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
            hash of what it serves: :class:`TamperingMergeEngine` with :func:`poison_mean`), pushing
            its stage's weights away from where training goes.
``noisy-update``  computes forward and backward honestly and keeps AdamW's moments, but instead of
            the AdamW update adds Gaussian noise of the update's size to its weights; its commitments
            (:class:`~iota_subnet.miner.update_store.UpdateStore`) show what it did.
``precision``  claims a looser precision than the run's (reports ``bf16`` in its replies) and
            skips work within it: computes under bf16 autocast and leaves out the last block's MLP
            (its output within the bf16 tolerance, outside the fp32 one); on a ``transformers`` family
            stage the last decoder layer's MLP (a twin of the stage, as ``lazy``).
``accuse``  trains and merges honestly, but files forged merge evidence: after every merge it
            reports the reducer of a shard (the first reducer not among its accomplices) as
            having served a wrong mean, with made-up hashes matching its accomplices' reports.
``dodge``   returns garbage (as ``random``) and never lets an audit through: hop and update audits
            are refused (``LATE``, as if outside its window) or left to time out, alternately
            (:class:`Dodger`). Its receipts are well formed and agree with its neighbours'.

For a ``transformers`` family model (:data:`~iota_subnet.sim.family_cheats.FAMILY_KINDS`, refused with a
:class:`ConfigError` for another model): ``drop-bias`` (Qwen2: attention without its q/k/v biases),
``skip-qk-norm`` (Qwen3: without its q/k RMSNorm), ``full-attention`` (Mistral, or a windowed Qwen2 /
Qwen3: no sliding window); each computes and trains honestly but with a twin of its stage lacking that
part (:func:`~iota_subnet.sim.family_cheats.twisted_stage`).

How each is caught in the data plane (validators' :class:`~iota_subnet.validator.auditing.AuditScheduler`):
hop audits (:mod:`iota_subnet.audit`) catch ``random``, ``zero``, ``lazy``, ``replay``, ``copy``,
``claim`` (its backward) and ``precision`` (the trace is fp32 and the tolerance follows the run's
config; the exact replay of a family stage, :mod:`iota_subnet.audit.replay`, catches the family
kinds, and ``lazy`` / ``precision`` there: the skipped MLP alone is off by 5e-2 to 1e-1 on
tests/test_hf_cheaters.py's stages, outside the bf16 tolerance too); update audits catch ``noisy-update`` and ``stale`` (no commitment for the inner steps it
claims); ``dodge`` is flagged for its unanswered audits (:mod:`iota_subnet.validator.audit_policy`);
``poison`` by the merge redundancy check (the other reducer of each shard and the replicas gathering
it recompute the mean and report the poisoner, :class:`iota_subnet.validator.merge_weights.MergeOversight`)
and ``accuse`` by the merge audit (:class:`iota_subnet.validator.merge_audit.MergeAuditor`).

"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
from typing import Any, Callable, Optional

import torch
from loguru import logger
from torch import nn

from iota_subnet.config import ConfigError, RunConfig
from iota_subnet.merge import MergeEngine
from iota_subnet.merge.claims import result_from_wire
from iota_subnet.miner.hop_audit_routes import HopAuditRoutes
from iota_subnet.miner.parts import MinerParts, make_worker
from iota_subnet.miner.stage_worker import StageWorker, UnknownMicrobatch
from iota_subnet.model import make_stage
from iota_subnet.protocol import MergeResult, MergeResultRequest, Outcome, ProtocolError
from iota_subnet.sim.bad_output import BAD_OUTPUT_KINDS, bad_output_parts
from iota_subnet.sim.family_cheats import FAMILY_KINDS, check_family_kind, on_twin, twisted_stage

#: Adversary kinds this module implements (``poison`` needs merging: ``merge.every_steps`` > 0).
ADVERSARY_KINDS = ("random", "zero", "lazy", "replay", "copy", "stale", "claim", "poison", "noisy-update", "precision",
                   "accuse", "dodge")
#: Cheats on a ``transformers`` family's own parts (:mod:`iota_subnet.sim.family_cheats`).
FAMILY_CHEAT_KINDS = tuple(FAMILY_KINDS)
#: Every kind ``--adversary`` takes: the cheaters above, the family cheats and the miners whose output
#: goes bad (:data:`iota_subnet.sim.bad_output.BAD_OUTPUT_KINDS`).
ALL_KINDS = ADVERSARY_KINDS + FAMILY_CHEAT_KINDS + BAD_OUTPUT_KINDS


class AdversaryError(ValueError):
    """Unknown adversary kind."""


def check_kind(kind: str) -> None:
    """Raises :class:`AdversaryError` unless ``kind`` is one of :data:`ALL_KINDS`."""
    if kind not in ALL_KINDS:
        raise AdversaryError(f"unknown adversary {kind!r}; one of {', '.join(ALL_KINDS)}")


# ---- merges: poison, accuse ---------------------------------------------------------------------
def poison_mean(shard_index: int, mean: "torch.Tensor") -> "torch.Tensor":
    """The ``poison`` adversary's merge result for a shard it reduces: the honest mean pseudo-gradient
    [n] (float32) negated and tripled."""
    return mean * -3.0


class TamperingMergeEngine(MergeEngine):
    """A :class:`~iota_subnet.merge.engine.MergeEngine` whose reducer serves ``tamper(shard_index, mean)``
    instead of the mean [n] (float32) of a shard it reduces (``tamper`` None: the honest mean; it may
    be set and cleared between merges)."""

    def __init__(self, *args: Any, tamper: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None, **kw: Any):
        super().__init__(*args, **kw)
        self.tamper = tamper

    def mean_to_serve(self, shard_index: int, mean: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.tamper is None:
            return mean
        bad = self.tamper(shard_index, torch.cat(mean).clone())
        return list(bad.split([t.numel() for t in mean]))


def forged_hash(plan_id: str, shard: int, what: str) -> str:
    """The ``accuse`` adversary's made-up hashes: the same for every accomplice (they match)."""
    return hashlib.sha256(f"forged|{what}|{plan_id}|{shard}".encode()).hexdigest()


class Accuser:
    """``accuse``: after each merge this replica applies, it files forged evidence against a
    reducer of the merge: the target's genuine signed result (fetched again from it), quoted
    faithfully, beside a made-up "recomputed" hash, naming the target ``wrong``. Accomplices (hotkeys)
    are never targeted; every accomplice picks the same target and the same hashes (matching
    evidence). ``engine``: the replica's :class:`AccusingMergeEngine`."""

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
            res, _, _ = await e.transport.call(tgt, "/merge/result", MergeResultRequest(
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
              "results": {tgt: {"claim": result_from_wire(res, tgt, plan)}}, "time": 0.0}
        e.reports.append(ev)
        self.forged.append(ev)


class AccusingMergeEngine(MergeEngine):
    """A :class:`~iota_subnet.merge.engine.MergeEngine` that merges honestly and, after every applied
    merge (after its ``on_applied``), files forged evidence (:attr:`accuser`, an :class:`Accuser`;
    ``accomplices``: hotkeys it never accuses)."""

    def __init__(self, *args: Any, accomplices: tuple = (), **kw: Any):
        super().__init__(*args, **kw)
        self.accuser = Accuser(self, accomplices)
        orig = self.on_applied

        async def on_applied(rep):
            if orig is not None:
                r = orig(rep)
                if hasattr(r, "__await__"):
                    await r
            await self.accuser.after_merge(rep)
        self.on_applied = on_applied


# ---- audits: dodge ------------------------------------------------------------------------------
class Dodger:
    """The ``dodge`` adversary's audit answers: every answer is, alternately, a typed refusal (``LATE``:
    "outside my window") or no answer at all (the request hangs ``hang_s`` seconds, so the validator
    times out). One instance answers a miner's hop audits and its ``/audit/update``."""

    def __init__(self, hang_s: float = 3600.0):
        self.hang_s = hang_s
        self.calls = 0

    async def __call__(self, msg: Any, ctx: Any = None) -> Any:
        self.calls += 1
        if self.calls % 2:
            raise ProtocolError(Outcome.LATE, "not in this miner's audit window")
        await asyncio.sleep(self.hang_s)
        raise ProtocolError(Outcome.BUSY, "busy")


class DodgingHopAuditRoutes(HopAuditRoutes):
    """:class:`~iota_subnet.miner.hop_audit_routes.HopAuditRoutes` whose three rounds are answered by
    ``dodger`` (a :class:`Dodger`)."""

    def __init__(self, *args: Any, dodger: Dodger, **kw: Any):
        super().__init__(*args, **kw)
        self.dodger = dodger

    async def trace(self, msg: Any, ctx: Any) -> Any:
        return await self.dodger(msg, ctx)

    async def project(self, msg: Any, ctx: Any) -> Any:
        return await self.dodger(msg, ctx)

    async def open(self, msg: Any, ctx: Any) -> Any:
        return await self.dodger(msg, ctx)


# ---- the stage worker ---------------------------------------------------------------------------
class CheatingStageWorker(StageWorker):
    """A :class:`~iota_subnet.miner.stage_worker.StageWorker` that cheats in the way ``kind`` (see the
    module docstring) once armed: at construction unless ``armed`` is False, else at :meth:`arm`
    (an honest worker until then). ``peer_state``: for ``copy``, a callable returning another
    replica's state dict (called when the copier has none yet and after each of its inner steps).
    ``adversary_seed``: seeds its noise. Other arguments: as StageWorker. Raises :class:`AdversaryError`,
    and :class:`ConfigError` for a family cheat the run's model does not have."""

    def __init__(self, cfg: RunConfig, stage: int, *, kind: str, peer_state: Optional[Callable[[], dict]] = None,
                 adversary_seed: int = 0, armed: bool = True, **kw: Any):
        check_kind(kind)
        if kind in FAMILY_KINDS:
            check_family_kind(kind, cfg)
        super().__init__(cfg, stage, **kw)
        self.kind = kind
        self.armed = False
        self.peer_state = peer_state
        self.first_out: Optional[dict] = None
        self.first_grad: Optional[torch.Tensor] = None
        self.peer_module: Optional[nn.Module] = None
        self.peer_step = -1
        #: whether the cheat computes with a twin of :attr:`module` (:func:`on_twin`: the family cheats,
        #: and ``lazy`` / ``precision`` on a transformers family stage)
        self.on_twin = on_twin(kind, self.module)
        #: that twin (:func:`twisted_stage`), and the parameters it shares
        self.twin: Optional[nn.Module] = None
        self.twin_of: tuple = ()
        if armed:
            self.arm(peer_state=peer_state, seed=adversary_seed)

    def arm(self, *, peer_state: Optional[Callable[[], dict]] = None, seed: int = 0) -> None:
        """Start cheating (``peer_state``: as the constructor's, when given; ``seed``: of the noise)."""
        if peer_state is not None:
            self.peer_state = peer_state
        self.gen = torch.Generator().manual_seed(seed + 7919)
        self.armed = True
        if self.kind == "lazy" and not self.on_twin:
            self._make_lazy(self.module)
        elif self.kind == "precision":
            self._make_low_precision()

    def _cheat(self) -> Optional[str]:
        return self.kind if self.armed else None

    # ---- the overridden parts --------------------------------------------------------------------
    def compute_forward(self, mb_id, x, targets=None, *, train=True, accumulate=True) -> dict:
        k = self._cheat()
        if k in ("random", "zero", "dodge"):
            return self._fake_forward(mb_id, x, targets, train=train)
        if k == "replay":
            return self._replay_forward(mb_id, x, targets, train=train, accumulate=accumulate)
        if k == "copy":
            return self._copy_forward(mb_id, x, targets, train=train, accumulate=accumulate)
        if k is not None and self.on_twin:
            with self._twisted():
                return super().compute_forward(mb_id, x, targets, train=train, accumulate=accumulate)
        return super().compute_forward(mb_id, x, targets, train=train, accumulate=accumulate)

    def backward(self, mb_id, grad, accumulate=None):
        k = self._cheat()
        if k in ("random", "zero", "dodge"):
            return self._fake_backward(mb_id, grad)
        if k == "replay":
            return self._replay_backward(mb_id, grad)
        if k == "claim":
            return self._claim_backward(mb_id, grad)
        if k is not None and self.on_twin:
            with self._twisted():       # a forward recomputed for the backward runs the twin too
                return super().backward(mb_id, grad, accumulate)
        return super().backward(mb_id, grad, accumulate)

    def step(self) -> None:
        if self._cheat() != "stale":
            return super().step()
        with self.lock:
            self.opt.zero_grad(set_to_none=True)   # throws the accumulated gradients away
            self.inner_step += 1
            self.version += 1
            self.pending = 0

    def apply_update(self) -> None:
        if self._cheat() != "noisy-update":
            return super().apply_update()
        # AdamW runs (its moments and step count are honest), but the weights get noise of the size
        # of an Adam step (lr per value) instead of the update
        lr = float(self.opt.param_groups[0]["lr"])
        params = list(self.module.parameters())
        with torch.no_grad():
            before = [p.detach().clone() for p in params]
            self.opt.step()
            for p, b in zip(params, before):
                p.copy_(b + torch.randn(p.shape, generator=self.gen).to(p.device, p.dtype) * lr)

    # ---- shapes ---------------------------------------------------------------------------------
    def _out_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (int(x.shape[0]), int(x.shape[1]), int(self.spec.out_width))

    def _noise(self, shape, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    # ---- random / zero / dodge -------------------------------------------------------------------
    def _fake_forward(self, mb_id, x, targets=None, *, train=True) -> dict:
        zero = self.kind == "zero"
        self.forwards += 1
        if self.spec.is_tail:
            loss = math.log(self.cfg.model.vocab_size) * (1.0 if zero else float(0.9 + 0.2 * torch.rand(1, generator=self.gen)))
            out: dict = {"loss": loss}
            if train and not self.spec.is_head:
                shape = tuple(x.shape)
                out["grad"] = torch.zeros(shape) if zero else self._noise(shape, 1e-3)
                self.count_backward(int(x.shape[0] * x.shape[1]))
            return out
        shape = self._out_shape(x)
        act = torch.zeros(shape) if zero else self._noise(shape)
        if train:
            self.cache.put(mb_id, None, act, tokens=int(x.shape[0] * x.shape[1]), version=self.version,
                           step=self.inner_step, in_shape=tuple(x.shape))
        return {"activations": act}

    def _pop_forward(self, mb_id):
        """The cached forward of ``mb_id`` (call under the worker lock); records the weights it
        claims to have used. Raises UnknownMicrobatch as the honest backward does."""
        entry = self.cache.pop(mb_id)
        if entry is None:
            raise UnknownMicrobatch(mb_id)
        self.last_weights_step = int(entry.meta.get("step", self.inner_step))
        self.last_weights_merges = int(entry.meta.get("merges", self.merges))
        return entry

    def _fake_backward(self, mb_id, grad):
        with self.lock:
            entry = self._pop_forward(mb_id)
            self.count_backward(entry.meta.get("tokens", 0))
            if self.spec.is_head:
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
        if self.first_out is None or not train:
            out = super().compute_forward(mb_id, x, targets, train=train, accumulate=accumulate)
            if train and self.first_out is None:
                self.first_out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
            return out
        self.forwards += 1
        out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.first_out.items()}
        if self.spec.is_tail:
            self.count_backward(int(x.shape[0] * x.shape[1]))
        else:
            self.cache.put(mb_id, None, out["activations"], tokens=int(x.shape[0] * x.shape[1]), version=self.version,
                           step=self.inner_step, replayed=True)
        return out

    def _replay_backward(self, mb_id, grad):
        with self.lock:
            entry = self.cache.get(mb_id)
            replayed = entry is not None and entry.meta.get("replayed")
            if not replayed:
                g = super().backward(mb_id, grad)
                if self.first_grad is None and g is not None:
                    self.first_grad = g.clone()
                return g
            self._pop_forward(mb_id)
            self.count_backward(entry.meta.get("tokens", 0))
            return None if self.spec.is_head else (self.first_grad.clone() if self.first_grad is not None
                                                   else torch.zeros_like(grad))

    # ---- copy ------------------------------------------------------------------------------------
    def _peer(self) -> Optional[nn.Module]:
        if self.peer_state is None:
            return None
        if self.peer_module is None or self.peer_step != self.inner_step:
            sd = self.peer_state()
            if sd:
                if self.peer_module is None:       # the run's stage kind (a transformers family's too)
                    self.peer_module = make_stage(self.cfg.model, self.cfg.pipeline, self.stage,
                                                  init=False).to(self.device)
                self.peer_module.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
                self.peer_step = self.inner_step
        return self.peer_module

    def _copy_forward(self, mb_id, x, targets=None, *, train=True, accumulate=True) -> dict:
        peer = self._peer()
        if peer is None:
            return super().compute_forward(mb_id, x, targets, train=train, accumulate=accumulate)
        own = self.module
        self.module = peer   # compute with the peer's weights; its own module never gets gradients
        try:
            out = super().compute_forward(mb_id, x, targets, train=train, accumulate=accumulate)
        finally:
            self.module = own
        peer.zero_grad(set_to_none=True)
        return out

    # ---- family cheats --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _twisted(self):
        """Compute with the twin of the stage (:func:`twisted_stage`, rebuilt when the stage's parameter
        objects change) in place of :attr:`module`; the twin shares its parameters, so the gradients
        land in the stage's own."""
        with self.lock:
            own = self.module
            ids = tuple(id(p) for p in own.parameters())
            if self.twin is None or self.twin_of != ids:
                self.twin, self.twin_of = twisted_stage(own, self.kind), ids
            self.module = self.twin
            try:
                yield
            finally:
                self.module = own

    # ---- precision ---------------------------------------------------------------------------------
    def _make_low_precision(self) -> None:
        """Computes under bf16 autocast whatever the run says, claims bf16, and skips the last
        block's MLP (the residual stream passes it by; its weights stay in ``/state``). On the test
        model's middle stage at initialisation that is off by ~3.6e-3 (rel. L2 of the
        activations): inside the bf16 tolerance, 3.6x the fp32 one. A transformers family stage skips
        its MLP in the twin instead (:meth:`_twisted`)."""
        self.precision = "bf16"             # autocast bf16 in the worker, and ``bf16: 1`` in its replies
        if self.on_twin:
            return
        mlp = list(self.module.layers.values())[-1].mlp
        mlp.forward = lambda x: torch.zeros_like(x)

    # ---- claim -----------------------------------------------------------------------------------
    def _claim_backward(self, mb_id, grad):
        with self.lock:
            entry = self._pop_forward(mb_id)
            self.count_backward(2 * int(entry.meta.get("tokens", 0)))   # claims twice the tokens, did none
            if self.spec.is_head:
                return None
            return torch.zeros_like(entry.inputs) if entry.inputs is not None else torch.zeros_like(grad)


# ---- a miner's parts ------------------------------------------------------------------------------
def adversary_parts(kind: str, cfg: RunConfig, *, accomplices: tuple = ()) -> MinerParts:
    """The :class:`~iota_subnet.miner.parts.MinerParts` of a miner that cheats in the way ``kind``:
    a :class:`CheatingStageWorker` (``copy`` fetches a replica's weights with the service's
    :meth:`~iota_subnet.miner.service.MinerService.peer_weights`; the noise is seeded by its uid),
    for ``poison`` a :class:`TamperingMergeEngine`, for ``accuse`` an :class:`AccusingMergeEngine`
    (never accusing ``accomplices``), for ``dodge`` a :class:`Dodger` behind its audit routes; for a
    kind of :data:`~iota_subnet.sim.bad_output.BAD_OUTPUT_KINDS` an honest miner whose data plane
    transport corrupts its output (:func:`~iota_subnet.sim.bad_output.bad_output_parts`). Its
    status says ``adversary``. Raises :class:`AdversaryError`, and :class:`ConfigError` for a merge
    cheat in a run that does not merge or a family cheat (:data:`FAMILY_CHEAT_KINDS`) the run's model
    does not have."""
    check_kind(kind)
    if kind in BAD_OUTPUT_KINDS:
        return bad_output_parts(kind)
    if kind in FAMILY_KINDS:
        check_family_kind(kind, cfg)
    if kind == "poison" and not cfg.merge.enabled:
        raise ConfigError("--adversary poison poisons replica merges: enable merging (merge.every_steps "
                          "or merge.every_blocks > 0 in the config)")
    if kind == "accuse" and not cfg.merge.enabled:
        raise ConfigError("--adversary accuse forges merge evidence: enable merging (merge.every_steps "
                          "or merge.every_blocks > 0 in the config)")

    def make_cheating_worker(svc: Any, stage: int) -> tuple[StageWorker, Optional[int]]:
        loop = asyncio.get_running_loop()

        def peer_state() -> dict:
            """(from the compute thread) a replica's weights via ``/state``, or {}."""
            try:
                return asyncio.run_coroutine_threadsafe(svc.peer_weights(), loop).result(timeout=30)
            except Exception as e:  # noqa: BLE001
                logger.warning(f"peer state fetch failed: {e}")
                return {}
        w, bound = make_worker(svc.cfg, stage, device=svc.device, total_steps=svc.total_steps,
                               audit_window=svc.audit_window, worker_cls=CheatingStageWorker, kind=kind,
                               peer_state=peer_state, adversary_seed=svc.uid or 0)
        logger.warning(f"ADVERSARY {kind!r}: this miner cheats (verification testing)")
        return w, bound

    parts = MinerParts(make_worker=make_cheating_worker, status={"adversary": kind})
    if kind == "poison":
        parts.make_merge_engine = functools.partial(TamperingMergeEngine, tamper=poison_mean)
    elif kind == "accuse":
        parts.make_merge_engine = functools.partial(AccusingMergeEngine, accomplices=tuple(accomplices))
    elif kind == "dodge":
        dodger = Dodger()
        parts.make_hop_audit_routes = functools.partial(DodgingHopAuditRoutes, dodger=dodger)
        parts.make_update_audit_route = lambda store, run_id, stage: dodger
    return parts
