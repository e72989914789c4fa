"""Graph regions on a GPU (`edgc.device.graphs`): a real capture replays the captured work on the
buffers it was captured on, a new layout captures again, and work that cannot be captured (a host
read) falls back to eager with one WARNING line. Skipped without CUDA: tests/core/test_graphs.py
checks the same state machine on the CPU with CUDA's graph calls stood in for."""

import logging

import pytest
import torch

from edgc.device.graphs import CAPTURE, EAGER, REPLAY, GraphRegion, observing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


class Modes:
    def __init__(self):
        self.modes = []

    def region_begin(self, region, buffers, mode):
        self.modes.append(mode)

    def region_end(self, region, buffers, mode):
        pass


def test_a_captured_region_replays_its_work_and_captures_again_on_a_new_layout(caplog):
    side = torch.cuda.Stream()
    m, q = torch.randn(4, 64, 32, device="cuda"), torch.randn(4, 32, 8, device="cuda")
    p = torch.empty(4, 64, 8, device="cuda")
    region, seen = GraphRegion("form_p", graphs=True, warmup_calls=2), Modes()
    with torch.cuda.stream(side), observing(seen), caplog.at_level(logging.INFO, logger="edgc"):
        for _ in range(5):
            m.mul_(1.5)
            region(lambda: torch.bmm(m, q, out=p), m, q, p)
            torch.testing.assert_close(p, torch.bmm(m, q))
        wider = torch.empty(4, 64, 16, device="cuda")
        q16 = torch.randn(4, 32, 16, device="cuda")
        for _ in range(4):
            region(lambda: torch.bmm(m, q16, out=wider), m, q16, wider)
            torch.testing.assert_close(wider, torch.bmm(m, q16))
    torch.cuda.synchronize()
    assert seen.modes == [EAGER, EAGER, CAPTURE, REPLAY, REPLAY, EAGER, EAGER, CAPTURE, REPLAY]
    assert region.captures == 2
    assert [r.edgc["kind"] for r in caplog.records if hasattr(r, "edgc")] == ["graph_captured"] * 2


def test_work_that_reads_the_host_falls_back_to_eager(caplog):
    x = torch.ones(8, device="cuda")
    region = GraphRegion("reads", graphs=True, warmup_calls=1)
    with caplog.at_level(logging.INFO, logger="edgc"):
        for _ in range(3):
            region(lambda: x.add_(x.sum().item()), x)
    torch.cuda.synchronize()
    assert not region.graphs and region.captures == 0
    assert [r.levelno for r in caplog.records if hasattr(r, "edgc")] == [logging.WARNING]
