import pytest

from edgc_experiments.pareto import frontier, frontier_bytes, frontier_loss, static_ranks, _verdict


def test_frontier_keeps_non_dominated_points_and_interpolates_between_them():
    points = [(1.0, 5.0), (2.0, 4.0), (3.0, 4.5), (4.0, 3.0)]  # (3, 4.5) is dominated by (2, 4)
    front = frontier(points)
    assert front == [(1.0, 5.0), (2.0, 4.0), (4.0, 3.0)]
    assert frontier_loss(front, 3.0) == pytest.approx(3.5)
    assert frontier_loss(front, 0.5) is None and frontier_loss(front, 9.0) == 3.0
    assert frontier_bytes(front, 3.5) == pytest.approx(3.0)
    assert frontier_bytes(front, 2.0) is None  # lower than any static point reached


def test_static_ranks_and_an_unmoved_edgc_run_is_called_static():
    assert static_ranks(16) == [4, 8, 16, 32]
    unmoved = {"rank_changes": 0, "mean_rank": 16.0, "decisions": 18, "gap_loss": 0.0, "bytes_vs_frontier": 1.0}
    assert "static PowerSGD at r=16" in _verdict(unmoved)
    below = {**unmoved, "rank_changes": 3, "mean_rank": 12.0, "gap_loss": -0.01}
    assert _verdict(below).startswith("on/below")
