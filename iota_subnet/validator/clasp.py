"""CLASP: Contribution Loss Assessment via Sampling of Pathways (arXiv 2507.17766), adapted.

Why probes
    Training micro-batches follow fixed lanes (replica ``r`` of every stage), so in the training
    log a miner's pathway membership is confounded with its lane: a lane's loss cannot be split
    between its stages. CLASP needs pathways drawn at random, so the validator sends *probe rounds*:
    one held-out micro-batch (``val_batch``) driven forward-only (``keep_for_backward=False``:
    nothing is cached or trained) through ``paths`` pathways, each stage's replica drawn uniformly
    at random and independently. Every probe records its pathway and loss (every training
    micro-batch's pathway and loss are logged too, in ``microbatches``).

Attribution
    Inside a round every pathway saw the same tokens, so the data's difficulty cancels in the
    residual ``r = loss - mean loss of the round``. For stage ``s`` and miner ``m`` of that stage:
    ``excess(m) = mean r over probes through m - mean r over probes through the other replicas of
    s``. With independent uniform choices at the other stages, their effects average out of this
    difference (it is the per-stage regression coefficient of the residual on membership
    ``1[m in pathway]``); centring within a round of ``P`` pathways shrinks a true effect ``d`` to
    about ``d (1 - 1/P)`` (measured 0.51 for d = 0.6, P = 6). Its standard error is Welch's ``sqrt(var_in / n_in + var_out / n_out)``,
    ``z = excess / se``.

Flag (both must hold, and ``n_in >= min_n``)
    * ``z >= z_threshold`` (default 4: with ~10 miners tested per tempo a false alarm from noise
      alone has probability ~3e-4 per tempo under a normal approximation);
    * ``excess >= rel_threshold x mean probe loss`` (default 0.05: pathways through it lose at
      least 5 % more; unmerged honest replicas differ by their data and drift, measured ``< 1 %``
      on the tiny model).

    Miners already flagged by audits are excluded first (``exclude``): their pathways are
    dropped, so an obvious cheater does not inflate its stage peers' contrast.

Limits: probes are forward-only, so a miner that behaves honestly whenever
``keep_for_backward=False`` escapes CLASP (audits sample training hops only, so it does not
escape those); a downstream replica trained on a cheater's outputs may lose more on honest
inputs, which is why CLASP lowers the quality factor (``clasp_penalty``) rather than zeroing it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping, Optional

Key = tuple[int, str]


@dataclass
class Attribution:
    uid: int
    hotkey: str
    stage: int
    n_in: int
    n_out: int
    excess: float          # nats: mean residual through it minus through its stage peers
    rel_excess: float      # excess / mean probe loss
    z: float
    flagged: bool

    def to_dict(self) -> dict:
        return asdict(self)


def _mean_var(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    v = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, v


def attribute(probes: Iterable[Mapping], *, exclude: Iterable[Key] = (), z_threshold: float = 4.0,
              rel_threshold: float = 0.05, min_n: int = 8) -> dict[Key, Attribution]:
    """Per-miner loss attribution from probe records.

    ``probes``: dicts ``{"round": int, "loss": float, "pathway": [{"stage", "uid", "hotkey"}, ...]}``
    (non-finite losses are dropped). Returns ``(uid, hotkey) -> Attribution`` for every miner seen.
    """
    excl = {(int(u), str(h)) for u, h in exclude}
    rounds: dict[int, list[tuple[float, list[tuple[int, Key]]]]] = {}
    for p in probes:
        loss = p.get("loss")
        if loss is None or not math.isfinite(float(loss)):
            continue
        path = [(int(h["stage"]), (int(h["uid"]), str(h["hotkey"]))) for h in p.get("pathway", [])]
        if any(k in excl for _, k in path):
            continue
        rounds.setdefault(int(p.get("round", 0)), []).append((float(loss), path))
    residuals: list[tuple[float, list[tuple[int, Key]]]] = []
    all_losses: list[float] = []
    for rows in rounds.values():
        if len(rows) < 2:
            continue
        mean = sum(l for l, _ in rows) / len(rows)
        for l, path in rows:
            residuals.append((l - mean, path))
            all_losses.append(l)
    if not residuals:
        return {}
    base = max(sum(all_losses) / len(all_losses), 1e-9)
    members: dict[int, set[Key]] = {}
    for _, path in residuals:
        for s, k in path:
            members.setdefault(s, set()).add(k)
    out: dict[Key, Attribution] = {}
    for s, keys in members.items():
        for k in keys:
            r_in = [r for r, path in residuals if (s, k) in path]
            r_out = [r for r, path in residuals if any(ss == s and kk != k for ss, kk in path)]
            if not r_in or not r_out:
                continue
            m_in, v_in = _mean_var(r_in)
            m_out, v_out = _mean_var(r_out)
            excess = m_in - m_out
            se = math.sqrt(v_in / len(r_in) + v_out / len(r_out))
            z = excess / se if se > 0 else (math.inf if excess > 0 else 0.0)
            flagged = len(r_in) >= min_n and len(r_out) >= min_n and z >= z_threshold and excess >= rel_threshold * base
            out[k] = Attribution(k[0], k[1], s, len(r_in), len(r_out), excess, excess / base,
                                 z if math.isfinite(z) else 1e9, bool(flagged))
    return out


def quality_factors(attr: Mapping[Key, Attribution], penalty: float = 0.5) -> dict[Key, tuple[float, list[str]]]:
    """``key -> (factor, reasons)``: ``penalty`` for a CLASP-flagged miner, 1 otherwise."""
    out: dict[Key, tuple[float, list[str]]] = {}
    for k, a in attr.items():
        if a.flagged:
            out[k] = (float(penalty), [f"CLASP: its pathways lose {a.excess:+.3f} nats ({100 * a.rel_excess:+.1f} %) "
                                       f"vs stage {a.stage} peers, z = {a.z:.1f} over {a.n_in} probes"])
        else:
            out[k] = (1.0, [])
    return out


def choose_pathway(replicas_by_stage: Mapping[int, list], rng) -> Optional[list]:
    """One replica per stage, uniformly and independently (None when a stage has none)."""
    path = []
    for s in sorted(replicas_by_stage):
        rs = replicas_by_stage[s]
        if not rs:
            return None
        path.append(rs[rng.randrange(len(rs))])
    return path
