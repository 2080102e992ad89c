"""Yuma consensus unit tests (pure numpy, no chain)."""
from __future__ import annotations

import numpy as np
import pytest

from iota_subnet.devnet.yuma import topk_nonzero, weighted_median_col, yuma_epoch


def test_weighted_median_majority():
    stake = np.array([0.6, 0.3, 0.1])
    w = np.array([[0.2], [0.9], [1.0]])
    # The 0.6 validator alone reaches kappa=0.5 at 0.2; 0.9 is backed by only 0.4 stake.
    assert weighted_median_col(stake, w, 0.5)[0] == pytest.approx(0.2)
    assert weighted_median_col(np.array([0.3, 0.3, 0.4]), w, 0.5)[0] == pytest.approx(0.9)


def test_outlier_validator_is_clipped_to_consensus():
    # uids 0..2 validators, 3..4 miners. Validators 0 and 1 (90% stake) split evenly;
    # validator 2 (10%) puts everything on miner 4.
    n = 5
    stake = np.array([45.0, 45.0, 10.0, 0.0, 0.0])
    W = np.zeros((n, n))
    W[0, 3] = W[0, 4] = 0.5
    W[1, 3] = W[1, 4] = 0.5
    W[2, 4] = 1.0
    permit = np.array([True, True, True, False, False])
    res = yuma_epoch(stake, W, validator_permit=permit)
    assert res.consensus[4] == pytest.approx(0.5)
    assert res.clipped_weights[2, 4] == pytest.approx(0.5)  # the outlier's 1.0 is clipped
    assert res.incentive.sum() == pytest.approx(1.0)
    assert res.incentive[3] == pytest.approx(res.incentive[4], rel=0.2)
    # The honest validators keep full validator trust, the outlier loses half of it.
    assert res.validator_trust[0] == pytest.approx(1.0)
    assert res.validator_trust[2] == pytest.approx(0.5)
    assert res.dividends.sum() == pytest.approx(1.0)
    assert res.dividends[0] > res.dividends[2]
    # Emission: half to miners (incentive), half to validators (dividends).
    assert res.emission.sum() == pytest.approx(1.0)
    assert res.emission[3:].sum() == pytest.approx(0.5)


def test_incentive_sums_to_one_and_masks():
    rng = np.random.default_rng(0)
    n = 8
    stake = rng.random(n) * 100
    W = rng.random((n, n))
    res = yuma_epoch(stake, W)
    assert res.incentive.sum() == pytest.approx(1.0)
    assert np.all(np.diag(res.clipped_weights) == 0)  # self weights removed
    # Weights set before the target registered are ignored.
    last_update = np.zeros(n, dtype=int)
    registered = np.full(n, 5)
    res2 = yuma_epoch(stake, W, last_update=last_update, registered_at=registered)
    assert res2.incentive.sum() == 0.0


def test_bonds_ema():
    stake = np.array([1.0, 0.0])
    W = np.array([[0.0, 1.0], [0.0, 0.0]])
    permit = np.array([True, False])
    r1 = yuma_epoch(stake, W, validator_permit=permit, bonds_alpha=0.1)
    assert r1.bonds[0, 1] == pytest.approx(1.0)  # column-normalised
    assert r1.dividends[0] == pytest.approx(1.0)


def test_topk_nonzero():
    assert topk_nonzero(np.array([0.0, 5.0, 3.0, 1.0]), 2).tolist() == [False, True, True, False]
    assert topk_nonzero(np.array([0.0, 0.0]), 5).tolist() == [False, False]
