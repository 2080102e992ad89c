"""Yuma consensus: one subnet epoch as pure numpy (no chain access).

Used by the devnet (:mod:`iota_subnet.devnet.epoch`) at every tempo boundary. It follows the
classic ("Yuma 2", dense) epoch of subtensor's ``pallets/subtensor/src/epoch/run_epoch.rs``
(``epoch_dense``; formerly ``epoch.rs``) and the Bittensor docs page "Yuma Consensus"
(https://docs.learnbittensor.org/learn/yuma-consensus). With ``n`` uids:

Inputs
    ``S``  stake per uid (any unit), ``W`` weights ``n x n`` (row i = validator i's weights),
    ``permit`` validator permits, ``active`` activity flags, ``last_update`` / ``registered_at``
    blocks, previous bonds ``B_old`` (``n x n``, column-normalised), ``kappa`` (0.5),
    ``bonds_alpha`` = 1 - bonds_moving_average (0.1 for the chain default 900_000 / 1e6).

Steps (names as in run_epoch.rs)
    1. Active stake: ``S_a = normalize(S * active * permit)`` (inactive or unpermitted
       validators carry no weight in consensus).
    2. Weights: keep rows of permitted validators only, drop self weights (diagonal),
       drop outdated weights ``W_ij`` with ``last_update_i <= registered_at_j`` (set before
       miner j's current hotkey registered), then ``row_normalize``.
    3. Consensus per miner column: the stake-weighted median with majority ``kappa``:
       ``C_j = max { c : sum_i S_a,i * [W_ij >= c] >= kappa }``
       (subtensor ``weighted_median_col``).
    4. Clip: ``W~_ij = min(W_ij, C_j)`` (weight above consensus is not rewarded).
    5. Validator trust ``vT_i = sum_j W~_ij``.
    6. Ranks ``R_j = sum_i S_a,i W~_ij``; trust ``T_j = R_j / sum_i S_a,i W_ij``;
       incentive ``I = normalize(R)`` (sums to 1 when any miner is weighted).
    7. Bonds: ``dB_ij = col_normalize(S_a,i * W~_ij)``;
       EMA ``B = bonds_alpha * dB + (1 - bonds_alpha) * B_old``, then ``col_normalize(B)``.
    8. Dividends ``D_i = normalize(sum_j B_ij * I_j)``.
    9. Emission of the tempo ``E``: miners get ``miner_share * E * I_j``, validators get
       ``(1 - miner_share) * E * D_i`` (the chain's 18 % owner cut is folded in; the split is
       configurable, default 50/50).

Not modelled: liquid alpha / Yuma 3 per-bond EMA, commit-reveal, childkeys, the owner cut,
root/TAO stake weighting.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EpochResult", "weighted_median_col", "yuma_epoch", "topk_nonzero"]


@dataclass
class EpochResult:
    consensus: np.ndarray  # per uid, 0..1
    rank: np.ndarray
    trust: np.ndarray
    incentive: np.ndarray  # sums to 1 (or all zero)
    dividends: np.ndarray  # sums to 1 (or all zero)
    validator_trust: np.ndarray
    bonds: np.ndarray  # n x n, column-normalised
    emission: np.ndarray  # per uid, same unit as the ``emission`` argument
    clipped_weights: np.ndarray  # n x n


def _normalize(x: np.ndarray) -> np.ndarray:
    s = float(x.sum())
    return x / s if s > 0 else np.zeros_like(x)


def _row_normalize(m: np.ndarray) -> np.ndarray:
    s = m.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, m / np.where(s > 0, s, 1), 0.0)


def _col_normalize(m: np.ndarray) -> np.ndarray:
    s = m.sum(axis=0, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, m / np.where(s > 0, s, 1), 0.0)


def weighted_median_col(stake: np.ndarray, weights: np.ndarray, kappa: float = 0.5) -> np.ndarray:
    """Per column j, the largest value ``c`` such that the stake of validators with
    ``W_ij >= c`` is at least ``kappa`` of the total (``stake`` is normalised here)."""
    stake = _normalize(np.asarray(stake, dtype=np.float64))
    weights = np.asarray(weights, dtype=np.float64)
    n_cols = weights.shape[1] if weights.ndim == 2 else 0
    out = np.zeros(n_cols)
    if stake.sum() <= 0:
        return out
    eps = 1e-12
    for j in range(n_cols):
        col = weights[:, j]
        # Candidates: the distinct weights present; descending, accumulate stake.
        order = np.argsort(-col, kind="stable")
        acc = 0.0
        for i in order:
            acc += stake[i]
            if acc + eps >= kappa:
                out[j] = col[i]
                break
    return out


def topk_nonzero(values: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the ``k`` largest strictly positive values (ties: lower index first)."""
    values = np.asarray(values, dtype=np.float64)
    mask = np.zeros(values.shape[0], dtype=bool)
    order = np.argsort(-values, kind="stable")
    for i in order[: max(0, k)]:
        if values[i] > 0:
            mask[i] = True
    return mask


def yuma_epoch(
    stake: np.ndarray,
    weights: np.ndarray,
    *,
    bonds_prev: np.ndarray | None = None,
    validator_permit: np.ndarray | None = None,
    active: np.ndarray | None = None,
    last_update: np.ndarray | None = None,
    registered_at: np.ndarray | None = None,
    kappa: float = 0.5,
    bonds_alpha: float = 0.1,
    emission: float = 1.0,
    miner_share: float = 0.5,
) -> EpochResult:
    """Run one Yuma epoch; see the module docstring for the formulas."""
    S = np.asarray(stake, dtype=np.float64)
    n = S.shape[0]
    W = np.asarray(weights, dtype=np.float64).reshape(n, n).copy()
    permit = np.ones(n, bool) if validator_permit is None else np.asarray(validator_permit, bool)
    act = np.ones(n, bool) if active is None else np.asarray(active, bool)

    # 1. active, permitted stake
    S_a = _normalize(S * act * permit)

    # 2. weight masks
    W[~permit, :] = 0.0
    np.fill_diagonal(W, 0.0)
    if last_update is not None and registered_at is not None:
        lu = np.asarray(last_update, dtype=np.int64)
        reg = np.asarray(registered_at, dtype=np.int64)
        outdated = lu[:, None] <= reg[None, :]
        W[outdated] = 0.0
    W = _row_normalize(W)

    # 3-4. consensus and clipping
    C = weighted_median_col(S_a, W, kappa)
    W_clip = np.minimum(W, C[None, :])

    # 5-6. validator trust, rank, trust, incentive
    vtrust = W_clip.sum(axis=1)
    R_pre = S_a @ W
    R = S_a @ W_clip
    with np.errstate(divide="ignore", invalid="ignore"):
        T = np.where(R_pre > 0, R / np.where(R_pre > 0, R_pre, 1), 0.0)
    I = _normalize(R)

    # 7. bonds EMA
    dB = _col_normalize(S_a[:, None] * W_clip)
    B_old = np.zeros((n, n)) if bonds_prev is None else np.asarray(bonds_prev, dtype=np.float64).reshape(n, n)
    B = _col_normalize(bonds_alpha * dB + (1.0 - bonds_alpha) * B_old)

    # 8. dividends
    D = _normalize(B @ I)

    # 9. emission split
    E = miner_share * emission * I + (1.0 - miner_share) * emission * D
    return EpochResult(
        consensus=C,
        rank=_normalize(R),
        trust=T,
        incentive=I,
        dividends=D,
        validator_trust=vtrust,
        bonds=B,
        emission=E,
        clipped_weights=W_clip,
    )
