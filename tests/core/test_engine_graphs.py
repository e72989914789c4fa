"""The engine's stretches as graph regions (`edgc.engine.stretches`, `EDGCConfig.engine.cuda_graphs`): what a graph
would replay is what the stretch computes eagerly, step after step, because every stretch reads and writes
the same buffers at every call. The CPU cannot capture: a stand-in capture keeps the stretch's work and
each replay runs it again on the buffers of the call it was captured in, as a CUDA graph's kernels run on
the memory they were captured with (tests/gpu runs real graphs)."""

import logging

import pytest
import torch

import edgc.device.graphs as graphs
from edgc import LowRankCompressor, LowRankConfig
from edgc.device.graphs import REPLAY, observing
from edgc.distributed.comm import Communicator

SHAPES = [(64, 48), (64, 48), (48, 64), (40, 40), (48,), (64, 20)]


class StandInGraph:
    """A captured graph: its work, run again at each replay but the one right after the capture (which
    ran it)."""

    def __init__(self):
        self.work, self.fresh = None, True

    def replay(self):
        if self.fresh:
            self.fresh = False
        else:
            self.work()


captured = []


class StandInCapture:
    def __init__(self, graph, pool=None, capture_error_mode="global"):
        self.graph = graph

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.graph.work = captured.pop()


@pytest.fixture
def on_cuda(monkeypatch):
    """CPU buffers taken for CUDA ones, and CUDA's graph calls stood in for."""
    monkeypatch.setattr(graphs, "_on_cuda", lambda buffers: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", StandInCapture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    capture = graphs.GraphRegion._capture

    def keeping(self, fn, buffers):
        captured.append(fn)
        capture(self, fn, buffers)

    monkeypatch.setattr(graphs.GraphRegion, "_capture", keeping)


class Modes:
    """Each region call's mode, with the step it was in."""

    def __init__(self):
        self.modes, self.step = [], 0

    def region_begin(self, region, buffers, mode):
        self.modes.append((self.step, mode))

    def region_end(self, region, buffers, mode):
        pass


def bucket(dtype):
    """One flat buffer with a view per tensor, as DDP's bucket: the same storage at every step."""
    flat = torch.zeros(sum(torch.Size(shape).numel() for shape in SHAPES), dtype=dtype)
    views = [part.view(shape) for part, shape in zip(flat.split([torch.Size(s).numel() for s in SHAPES]), SHAPES)]
    return flat, views


@pytest.mark.parametrize("dtype,tracked", [(torch.bfloat16, True), (torch.float32, False)])
def test_replayed_stretches_give_the_eager_engines_averages_and_a_rank_change_captures_again(
    on_cuda, caplog, dtype, tracked
):
    names = [f"t{k}" for k in range(len(SHAPES))]
    engines = [
        LowRankCompressor(LowRankConfig(force_accelerator_kernels=True, cuda_graphs=graphed))
        for graphed in (False, True)
    ]
    buckets = [bucket(dtype) for _ in engines]
    generator = torch.Generator().manual_seed(3)
    modes = Modes()
    with observing(modes), caplog.at_level(logging.INFO, logger="edgc"):
        for step in range(20):
            modes.step, rank = step, 8 if step < 10 else 4
            values = torch.randn(buckets[0][0].numel(), generator=generator).to(dtype)
            for engine, (flat, views) in zip(engines, buckets):
                flat.copy_(values)
                if tracked:
                    engine.state.begin_step()
                engine.reduce(names, views, rank, Communicator(), measure_error=step % 6 == 0)
                if tracked:
                    engine.state.end_step(nonfinite=False)
            assert torch.equal(buckets[0][0], buckets[1][0]), step  # the averages, bit for bit
            for name in engines[0].error:
                assert torch.equal(engines[0].error[name], engines[1].error[name]), (step, name)
                assert torch.equal(engines[0].q[name], engines[1].q[name]), (step, name)
    # Q is used in turn, so each stretch has a region per Q buffer (and per step kind): each warms up
    # twice, captures at its third call and replays from its fourth, at either rank
    replayed = [step for step, mode in modes.modes if mode == REPLAY]
    assert any(step < 10 for step in replayed) and any(step >= 10 for step in replayed), replayed
    captures = [record.getMessage() for record in caplog.records if "captured" in record.getMessage()]
    assert any("a rank change (8 → 4)" in message for message in captures), captures
