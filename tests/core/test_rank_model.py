import math

import numpy as np
import pytest

from edgc import ErrorModel, error_curve_mc, error_curve_mp
from edgc.policies.rank_model import cqm_target_rank


def test_monte_carlo_matches_marchenko_pastur_for_256x512():
    mc = error_curve_mc(256, 512, samples=4, seed=0)
    mp = error_curve_mp(256, 512)
    for rank in (1, 4, 8, 16, 32, 64, 128):
        assert mc[rank] == pytest.approx(mp[rank], rel=0.03), rank


def test_curve_endpoints_and_monotonicity():
    for curve in (error_curve_mc(40, 90, samples=3), error_curve_mp(40, 90)):
        assert curve[0] == pytest.approx(40 * 90, rel=0.05)  # E‖A‖² = m·n
        assert curve[-1] == pytest.approx(0, abs=1e-6 * 40 * 90)
        assert np.all(np.diff(curve) <= 1e-9)


def test_square_matrix_edge_case_is_finite():
    curve = error_curve_mp(64, 64)
    assert np.all(np.isfinite(curve)) and curve[0] == pytest.approx(64 * 64)


def test_cqm_falling_entropy_lowers_rank_rising_raises_it():
    model = ErrorModel(samples=2, seed=0)
    shapes = [(64, 128), (64, 128), (128, 256)]
    steady = cqm_target_rank(model, shapes, 16, 1.0, 1.0, 2.0, 4, 32)
    lower = cqm_target_rank(model, shapes, 16, 1.0, 0.9, 2.0, 4, 32)
    higher = cqm_target_rank(model, shapes, 16, 1.0, 1.1, 2.0, 4, 32)
    assert lower < steady == 16 < higher
    # the defining identity: the new rank's error is within the allowed budget
    budget = math.exp(2.0 * 0.1) * model.total(16, shapes)
    assert model.total(lower, shapes) <= budget < model.total(lower - 1, shapes)
