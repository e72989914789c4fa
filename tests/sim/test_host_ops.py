"""The host model per op class (edgc_sim.host_ops): a trace read into costs per class, a census priced
with them, and the committed model within its bound of the H200's measured hook rows."""

import json
from pathlib import Path

import pytest

from edgc_sim.host_ops import (
    HostOpCosts,
    OpCensus,
    costs_from_trace,
    hook_ops,
    host_time,
    op_class,
    read_trace,
)
from edgc_sim.host_report import CHECK_WITHIN, check_rows, check_table, costs_table

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "gpu" / "h200-2026-11-27"
PARENT = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"


def op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def hook_call(start):
    """One hook call: the accumulation, then bmm (5 µs after it), a view, a _foreach_add_ run tensor by
    tensor over 3 tensors, a no-op `to`, an add; the call ends 5 µs after the add."""
    return [
        op(PARENT, start, 100),
        op("torch::autograd::AccumulateGrad", start, 10),
        op("aten::bmm", start + 15, 20),
        op("aten::view", start + 40, 2),
        op("aten::_foreach_add_", start + 50, 30),
        *[op("aten::add_", start + 51 + 9 * k, 8) for k in range(3)],
        op("aten::to", start + 85, 1),
        op("aten::add", start + 90, 5),
        op("aten::empty", start + 91, 1),  # inside add: not an op of the hook's own
    ]


def test_a_trace_gives_each_op_its_span_and_the_gap_before_it():
    trace = {"traceEvents": hook_call(0) + hook_call(1000) + [op("aten::mm", 500, 50)]}  # mm: outside any hook
    ops, calls = hook_ops(trace)
    assert [name for name, _, _ in ops[:4]] == ["aten::bmm", "aten::view", "aten::_foreach_add_", "aten::add"]
    assert [(micros, units) for _, micros, units in ops[:4]] == [(20, 1), (2 + 5, 1), (30 + 8, 3), (5 + 10, 1)]
    assert calls == [5 + 5, 5 + 5]  # before the first op, after the last
    costs = costs_from_trace(trace, launch_s=10e-6)
    assert costs.op_s == pytest.approx({"gemm": 20e-6, "view": 7e-6, "foreach": 38e-6 / 3, "elementwise": 15e-6})
    assert costs.call_s == pytest.approx(10e-6) and costs.calls == 2 and costs.samples["foreach"] == 6
    with pytest.raises(ValueError, match="no hook call"):
        costs_from_trace({"traceEvents": [op("aten::mm", 0, 5)]})


def test_a_census_is_priced_per_class_and_per_hook_call():
    costs = HostOpCosts(
        {"gemm": 30e-6, "view": 5e-6, "elementwise": 40e-6, "collective": 200e-6}, 100e-6, launch_s=10e-6
    )
    census = OpCensus({"bmm": 4, "mm": 6, "add": 2, "cuda_graph_replay": 1}, {"view": 20, "slice": 10}, 3, 5)
    assert census.by_class() == {"gemm": 10, "elementwise": 2, "graph": 1, "view": 30, "collective": 3}
    time = host_time(census, costs)
    expected = 10 * 30e-6 + 3 * 40e-6 + 30 * 5e-6 + 3 * 200e-6 + 5 * 100e-6  # a replay at one element-wise op
    assert time.seconds == pytest.approx(expected) and time.by_class["call"] == pytest.approx(5 * 100e-6)
    half = costs.scaled_to(5e-6)
    assert host_time(census, half).seconds == pytest.approx(expected / 2)
    with pytest.raises(ValueError, match="linalg"):
        host_time(OpCensus({"linalg_cholesky_ex": 1}, {}, 0, 0), costs)
    assert OpCensus.from_dict(census.to_dict()) == census


@pytest.mark.parametrize(
    "name,kind",
    [
        ("linalg_solve_triangular", "linalg"),
        ("aten::linalg_cholesky_ex", "linalg"),
        ("baddbmm", "gemm"),
        ("c10d::allreduce_", "collective"),
        ("_foreach_add_", "foreach"),
        ("_to_copy", "copy"),
        ("sum", "reduction"),
        ("aten::slice", "view"),
        ("nan_to_num", "elementwise"),
    ],
)
def test_op_classes(name, kind):
    assert op_class(name) == kind


def test_the_committed_model_is_within_its_bound_of_each_measured_hook_row_and_in_the_docs(load_producer):
    """The H200 trace, its per-op cost and the measured engine's census give each measured row within
    CHECK_WITHIN; docs/gpu.md shows these tables (scripts/to_docs.py host-model)."""
    script = load_producer("host-model")
    launch_s = json.loads((RUN / "device.json").read_text())["measured"]["launch_s"]
    costs = costs_from_trace(
        read_trace(RUN / "trace_nccl.json.gz"), launch_s, "docs/gpu/h200-2026-11-27/trace_nccl.json.gz"
    )
    census = json.loads(script.CENSUS.read_text())
    measured, again = script.measured_rows(script.PROFILED), script.measured_rows(script.RUN)
    rows = check_rows(costs, script.censuses(census["steps"]), measured, again)
    assert [r["bucket"] for r in rows] == ["25 (default)", "100", "200"]
    assert all(abs(r["error"]) <= CHECK_WITHIN for r in rows), [r["error"] for r in rows]
    page = (ROOT / "docs" / "gpu.md").read_text()
    assert costs_table(costs) in page and check_table(rows) in page
