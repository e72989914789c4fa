"""Graph regions (`edgc.device.graphs`): eager on the CPU and told to observers; on CUDA, warm-up, one
capture, replays, and a capture again when told or when the buffers change, each said on the ``edgc``
logger. CUDA's graph calls are stood in for here (the CPU cannot capture); tests/gpu/test_cuda_graphs.py
runs the real ones on a GPU."""

import logging
import threading

import pytest
import torch

import edgc.device.graphs as graphs
from edgc.device.graphs import CAPTURE, EAGER, REPLAY, GraphRegion, observing


class Seen:
    """An observer: (event, region name, mode, buffers' storages) per call."""

    def __init__(self):
        self.events = []

    def region_begin(self, region, buffers, mode):
        self.events.append(("begin", region.name, mode, [b.untyped_storage().data_ptr() for b in buffers]))

    def region_end(self, region, buffers, mode):
        self.events.append(("end", region.name, mode, [b.untyped_storage().data_ptr() for b in buffers]))


def test_on_the_cpu_every_call_runs_eagerly_and_observers_see_it_from_every_thread():
    out = torch.zeros(3)
    region = GraphRegion("add", graphs=True, warmup_calls=1)
    seen = Seen()
    with observing(seen):
        for _ in range(3):
            region(lambda: out.add_(1), out)
        thread = threading.Thread(target=region, args=(lambda: out.add_(1), out))
        thread.start()
        thread.join()
    region(lambda: out.add_(1), out)  # no observer any more
    assert out.tolist() == [5.0, 5.0, 5.0]
    assert region.calls == 5 and region.captures == 0 and not region.captured
    pointer = out.untyped_storage().data_ptr()
    assert seen.events == [(event, "add", EAGER, [pointer]) for _ in range(4) for event in ("begin", "end")]


def test_observers_hear_the_end_of_a_call_that_raises():
    seen = Seen()

    def fails():
        raise ValueError("inside")

    with observing(seen), pytest.raises(ValueError, match="inside"):
        GraphRegion("fails")(fails)
    assert [event for event, *_ in seen.events] == ["begin", "end"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": ""}, "non-empty string"),
        ({"name": "r", "warmup_calls": 0}, "warmup_calls"),
        ({"name": "r", "capture_error_mode": "loose"}, "capture_error_mode"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GraphRegion(**kwargs)


class StandInGraph:
    """Stands for `torch.cuda.CUDAGraph`: what `torch.cuda.graph` ran in its body is what replay runs."""

    made: list = []

    def __init__(self):
        self.work = None
        StandInGraph.made.append(self)

    def replay(self):
        self.work()


class StandInCapture:
    """Stands for `torch.cuda.graph`: records the body's device work (here: a closure) instead of running it."""

    fail = False

    def __init__(self, graph, pool=None, capture_error_mode="global"):
        self.graph = graph
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        recording.append([])

    def __exit__(self, *exc):
        work = recording.pop()
        if StandInCapture.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.graph.work = lambda: [step() for step in work]


recording: list = []


@pytest.fixture
def on_cuda(monkeypatch):
    """CPU buffers taken for CUDA ones, and CUDA's graph calls stood in for."""
    StandInGraph.made = []
    StandInCapture.fail = False
    monkeypatch.setattr(graphs, "_on_cuda", lambda buffers: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", StandInCapture)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def add_one(out):
    """Device work the stand-in capture records instead of running while a capture is under way."""

    def work():
        out.add_(1)

    return lambda: recording[-1].append(work) if recording else work()


def test_warm_up_then_one_capture_then_replays(on_cuda, caplog):
    out = torch.zeros(2)
    region = GraphRegion("send_p", graphs=True, warmup_calls=2)
    seen = Seen()
    with observing(seen), caplog.at_level(logging.INFO, logger="edgc"):
        for _ in range(5):
            region(add_one(out), out)
    assert out.tolist() == [5.0, 5.0]  # every call did its work once, the capture's too
    assert [mode for event, _, mode, _ in seen.events if event == "begin"] == [EAGER, EAGER, CAPTURE, REPLAY, REPLAY]
    assert region.captures == 1 and len(StandInGraph.made) == 1
    assert [record.getMessage() for record in caplog.records] == [
        "graph region send_p: captured (capture 1, first capture)"
    ]
    assert caplog.records[0].edgc["kind"] == "graph_captured"
    other = GraphRegion("send_p", graphs=True, warmup_calls=1, rank=1)  # another rank of the group: silent
    with caplog.at_level(logging.INFO, logger="edgc"):
        for _ in range(3):
            other(add_one(out), out)
    assert other.captures == 1 and len([r for r in caplog.records if r.name == "edgc"]) == 1


def test_recapture_when_told_and_when_the_buffers_change(on_cuda, caplog):
    first, second = torch.zeros(2), torch.zeros(3)
    region = GraphRegion("send_q", graphs=True, warmup_calls=1)
    with caplog.at_level(logging.INFO, logger="edgc"):
        for _ in range(3):
            region(add_one(first), first)  # eager, capture, replay
        region.recapture("rank 4 → 2")
        assert not region.captured
        for _ in range(3):
            region(add_one(first), first)  # eager, capture, replay
        for _ in range(3):
            region(add_one(second), second)  # new buffers: eager, capture, replay
    assert first.tolist() == [6.0, 6.0] and second.tolist() == [3.0, 3.0, 3.0]
    assert region.captures == 3
    assert [record.getMessage() for record in caplog.records] == [
        "graph region send_q: captured (capture 1, first capture)",
        "graph region send_q: captured (capture 2, rank 4 → 2)",
        "graph region send_q: captured (capture 3, its buffers are not those captured "
        "(another storage, shape, stride or dtype))",
    ]


def test_a_failed_capture_runs_eagerly_from_then_on_and_says_so(on_cuda, caplog):
    out = torch.zeros(1)
    region = GraphRegion("finish", graphs=True, warmup_calls=1)
    StandInCapture.fail = True
    with caplog.at_level(logging.INFO, logger="edgc"):
        for _ in range(4):
            region(add_one(out), out)
    assert out.tolist() == [4.0]
    assert not region.graphs and region.captures == 0
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.edgc["kind"] == "graph_failed"
    assert "graph region finish: capture failed, runs eagerly from now on" in record.getMessage()
