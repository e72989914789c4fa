"""What the host spends issuing a hook's ops on a GPU, per op class, read from a profiler trace.

On a GPU our hook is bound by the host that issues it (docs/gpu.md: the H200's kernels were busy
38 % of the hook's wall time at GPT-2 XL): what a step costs is what Python, the dispatcher and the
launches cost per op, and that differs by an order of magnitude between a view (a few µs) and a
batched Cholesky (≈ 100 µs). So the host's time is priced per op class (`OP_CLASSES`), each class's
cost read from a `torch.profiler` trace of the hook on the GPU (`costs_from_trace`), and multiplied
by the ops of each class one step issues (`OpCensus`: the dispatch counter's per-op output, views
included, counted on the CPU for any model size; `edgc_probes.dispatch_count`).

Reading a trace. DDP calls the hook from the autograd hook of a bucket's last gradient, so in the
trace each hook call is what an ``AccumulateGrad`` evaluation holds besides the accumulation itself.
Its top-level ATen ops, in time order, are the hook's ops; an op's host cost is its own span plus
the gap before it (the Python that prepared it). The gap before a call's first op and the time after
its last belong to the call (`HostOpCosts.call_s`: entering and leaving the hook, once per bucket).
A ``_foreach_*`` op that PyTorch ran tensor by tensor (mixed dtypes: its children are the per-tensor
op) is that many units, as the dispatch counter counts it; an ``aten::to`` that dispatched nothing
(same dtype and device) is not an op, its time goes into the next op's gap.

A class's cost is the mean over the trace's ops of that class. The trace is profiled, the measured
hook rows it is checked against are not (the profiler's own cost per op is in the classes' costs);
it is one model size (the trace's), used at others through the census's counts.

A CUDA graph's replay is one launch from the host: a counted replay (an op whose name says
``graph``) costs what an element-wise op costs, the ops inside the graph nothing.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

OP_CLASSES = {
    "linalg": "cuSOLVER/cuBLAS factorisations and solves (linalg_cholesky_ex, linalg_solve_triangular, …)",
    "gemm": "matrix products (mm, bmm, baddbmm, addmm)",
    "collective": "a collective issued to the process group (c10d's all_reduce, …)",
    "reduction": "reductions to a few values (sum, mean, norms)",
    "elementwise": "one element-wise kernel (add, where, div, fills, …): one launch",
    "foreach": "one tensor of a _foreach_* op PyTorch runs tensor by tensor (mixed dtypes)",
    "copy": "copies and casts (copy_, _to_copy, cat, stack, clone)",
    "view": "views and metadata (view, slice, transpose, split, empty, …): no kernel",
    "graph": "a CUDA graph's replay: one launch",
}
GEMM_OPS = frozenset({"mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul"})
COPY_OPS = frozenset({"copy_", "_to_copy", "to", "cat", "stack", "clone", "contiguous", "_foreach_copy_"})
REDUCTION_OPS = frozenset({"sum", "mean", "norm", "linalg_vector_norm", "amax", "amin", "prod", "dot"})
VIEW_OPS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "slice",
        "select",
        "narrow",
        "transpose",
        "t",
        "permute",
        "numpy_T",
        "expand",
        "expand_as",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "diagonal",
        "split",
        "split_with_sizes",
        "chunk",
        "unbind",
        "as_strided",
        "alias",
        "detach",
        "_unsafe_view",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "set_",
        "resolve_conj",
        "resolve_neg",
        "lift_fresh",
    }
)
# the class a replayed CUDA graph is priced at: one launch
GRAPH_REPLAY_AS = "elementwise"
# the trace's events: DDP's autograd hook of a bucket's last gradient holds each hook call
HOOK_PARENT = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
HOOK_OWN = "torch::autograd::AccumulateGrad"
NOT_OPS = frozenset({"record_param_comms"})  # the collective's own record, outside it when the profiler splits it


def op_class(name: str) -> str:
    """The class of an op named as the dispatch counter names it (``bmm``) or as a trace does (``aten::bmm``)."""
    namespace, _, op = name.rpartition("::")
    if namespace == "c10d" or op in {"all_reduce", "allreduce_", "all_gather", "all_to_all", "broadcast_"}:
        return "collective"
    if "graph" in op:
        return "graph"
    if op.startswith(("linalg_", "_linalg_")):
        return "linalg"
    if op in GEMM_OPS:
        return "gemm"
    if op in COPY_OPS:
        return "copy"
    if op.startswith("_foreach_"):
        return "foreach"
    if op in REDUCTION_OPS:
        return "reduction"
    if op in VIEW_OPS:
        return "view"
    return "elementwise"


@dataclass(frozen=True)
class HostOpCosts:
    """Host seconds per op of each class and per hook call, on the host they were measured on."""

    op_s: dict  #: class (`OP_CLASSES`) -> seconds per op (> 0)
    call_s: float  #: seconds per hook call (one per DDP bucket), besides its ops (≥ 0)
    samples: dict = field(default_factory=dict)  #: class -> ops of the trace it was measured on
    launch_s: float = 0.0  #: that host's cost of a tiny eager op, seconds (0: not known; see `scaled_to`)
    source: str = ""  #: where the numbers come from
    calls: int = 0  #: hook calls of the trace they were measured on

    def __post_init__(self):
        unknown = set(self.op_s) - set(OP_CLASSES)
        if unknown:
            raise ValueError(f"op classes {sorted(unknown)} not in {sorted(OP_CLASSES)}")
        if any(not value > 0 for value in self.op_s.values()) or self.call_s < 0 or self.launch_s < 0:
            raise ValueError("op costs must be > 0 and the call's and the launch's ≥ 0")

    def per_op(self, op_class_name: str) -> float:
        """Seconds per op of a class; a graph's replay at one launch's cost (`GRAPH_REPLAY_AS`)."""
        if op_class_name == "graph":
            op_class_name = GRAPH_REPLAY_AS
        if op_class_name not in self.op_s:
            raise ValueError(f"no cost measured for op class {op_class_name!r} (the trace had none)")
        return self.op_s[op_class_name]

    def scaled_to(self, launch_s: float, source: str = "") -> HostOpCosts:
        """The same costs on a host whose tiny eager op costs ``launch_s``: every cost × launch_s / self.launch_s."""
        if not self.launch_s:
            raise ValueError("these costs carry no launch cost to scale from")
        factor = launch_s / self.launch_s
        return replace(
            self,
            op_s={name: value * factor for name, value in self.op_s.items()},
            call_s=self.call_s * factor,
            launch_s=launch_s,
            source=source or f"{self.source}, × {factor:.3f} (per-op cost {1e6 * launch_s:.1f} µs)",
        )


@dataclass(frozen=True)
class OpCensus:
    """The ops one hook step issues (`edgc_probes.dispatch_count`'s per-op output, views counted beside it)."""

    by_op: dict  #: kernel-launching dispatches per op name, as the counter counts them
    views_by_op: dict  #: dispatches that launch nothing (views, allocation, metadata) per op name
    collectives: int  #: collectives issued
    hook_calls: int  #: hook calls (DDP buckets)

    @classmethod
    def from_dict(cls, data: dict) -> OpCensus:
        return cls(dict(data["by_op"]), dict(data["views_by_op"]), int(data["collectives"]), int(data["hook_calls"]))

    def to_dict(self) -> dict:
        return {
            "by_op": self.by_op,
            "views_by_op": self.views_by_op,
            "collectives": self.collectives,
            "hook_calls": self.hook_calls,
        }

    def by_class(self) -> Counter:
        """Ops per class; every op that launches nothing is a view."""
        classes: Counter = Counter()
        for name, count in self.by_op.items():
            kind = op_class(name)
            classes["elementwise" if kind == "view" else kind] += count
        classes["view"] += sum(self.views_by_op.values())
        classes["collective"] += self.collectives
        return classes


@dataclass(frozen=True)
class HostTime:
    """One step's host time and its parts."""

    seconds: float  #: all of it
    by_class: dict  #: class -> seconds (and "call": the hook calls' own)


def host_time(census: OpCensus, costs: HostOpCosts) -> HostTime:
    """The host's time for one step: every op at its class's cost, every hook call at the call's."""
    parts = {name: count * costs.per_op(name) for name, count in census.by_class().items() if count}
    parts["call"] = census.hook_calls * costs.call_s
    return HostTime(sum(parts.values()), parts)


# ---------------------------------------------------------------------------- the trace
def read_trace(path: str | Path) -> dict:
    """A Chrome trace from torch.profiler (``.json`` or ``.json.gz``)."""
    path = Path(path)
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as handle:
        return json.load(handle)


def _children(events: list[dict]) -> dict[int, list[dict]]:
    """Each event's direct children (by index), from the nesting of spans on one thread."""
    ordered = sorted(range(len(events)), key=lambda k: (events[k]["ts"], -events[k]["dur"]))
    children: dict[int, list[dict]] = {k: [] for k in ordered}
    stack: list[int] = []
    for k in ordered:
        event = events[k]
        while stack and event["ts"] >= events[stack[-1]]["ts"] + events[stack[-1]]["dur"]:
            stack.pop()
        if stack:
            children[stack[-1]].append(event)
        stack.append(k)
    return children


def _units(event: dict, kids: list[dict]) -> int:
    """Dispatches the counter counts for one op: a _foreach_* op run tensor by tensor counts per tensor."""
    op = event["name"].rpartition("::")[2]
    if op.startswith("_foreach_"):
        per_tensor = sum(1 for kid in kids if kid["name"].rpartition("::")[2] == op.removeprefix("_foreach_"))
        return max(per_tensor, 1)
    return 1


def hook_ops(trace: dict) -> tuple[list[tuple[str, float, int]], list[float]]:
    """The hook's ops in a trace as (op name, host µs incl. the gap before it, units), and each hook
    call's own µs (before its first op and after its last)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    children, ops, calls = {}, [], []
    for thread in {e["tid"] for e in events}:
        mine = [e for e in events if e["tid"] == thread]
        children.update({id(mine[k]): kids for k, kids in _children(mine).items()})
    for parent in (e for e in events if e["name"] == HOOK_PARENT):
        kids = children[id(parent)]
        own = [kid for kid in kids if kid["name"] == HOOK_OWN]
        body = [kid for kid in kids if kid["name"] != HOOK_OWN]
        if not body:
            continue
        reached = own[-1]["ts"] + own[-1]["dur"] if own else parent["ts"]
        first = None
        for event in body:
            grandchildren = children[id(event)]
            if event["name"] in NOT_OPS or (event["name"] == "aten::to" and not grandchildren):
                continue  # not an op of its own: its time is the next op's gap
            gap = event["ts"] - reached
            if first is None:
                first, gap = gap, 0.0
            ops.append((event["name"], event["dur"] + gap, _units(event, grandchildren)))
            reached = event["ts"] + event["dur"]
        if first is not None:
            calls.append(first + parent["ts"] + parent["dur"] - reached)
    return ops, calls


def costs_from_trace(trace: dict, launch_s: float = 0.0, source: str = "") -> HostOpCosts:
    """`HostOpCosts` from the hook's ops in a profiler trace (see the module docstring)."""
    ops, calls = hook_ops(trace)
    if not calls:
        raise ValueError(f"no hook call in the trace (no {HOOK_PARENT!r} event holding ops)")
    per_class: dict[str, list[float]] = {}
    for name, micros, units in ops:
        per_class.setdefault(op_class(name), []).extend([micros / units] * units)
    return HostOpCosts(
        {name: statistics.fmean(values) / 1e6 for name, values in per_class.items()},
        statistics.fmean(calls) / 1e6,
        {name: len(values) for name, values in per_class.items()},
        launch_s,
        source,
        len(calls),
    )
