"""Kernel launches of one compressed EDGC step, counted on the CPU as a GPU would make them.

    python -m edgc_bench.gpu --count-only --out DIR        # writes DIR/count.json

The rule (docs/concepts/engine.md, "How dispatches are counted"): the counter counts what a GPU would
launch for each ATen operator that reaches the Python dispatch key while the step runs (after
autograd and composite-implicit decomposition, so ``torch.matmul`` counts as the ``mm`` or ``bmm`` it
becomes):
- nothing for what launches no kernel: views (``OpOverload.is_view``: ``view``, ``t``, ``transpose``,
  ``split``, ``detach``, …) and in-place view ops (``torch.Tag.inplace_view``: ``t_``, ``as_strided_``,
  …); ``METADATA_ONLY``: allocation without initialisation (``empty``, ``empty_strided``,
  ``empty_like``, ``new_empty``, ``new_empty_strided``, ``resize_``), ``_unsafe_view`` (a view whose
  schema does not say so), ``set_`` and the ``sym_*`` size queries; the ``prim`` namespace
  (``prim.device``, ``prim.layout``): metadata queries, which a fake tensor answers through the
  dispatcher where a real one answers in C++;
- one copy per input for a ``cat`` (or ``stack``) where CUDA copies input by input: inputs of
  another dtype than the output (a gather that casts as it goes), more than 4 dimensions, or
  offsets past 32 bits; else one batched copy per 128 inputs (64 if any input is strided)
  (`edgc_probes.op_traffic.cat_kernels`, after ATen's ``cat_out_cuda``);
- one per tensor for a ``_foreach_*`` op on lists of mixed dtypes, which PyTorch runs tensor by
  tensor (`edgc_probes.op_traffic.kernels_per_dispatch`);
- one launch per call of a graph region (`edgc.device.graphs.GraphRegion`) that asks for graphs and
  that the capture checker passes over steady steps (`edgc_probes.capture_check.passing_regions`;
  ``replayed``), its operators kept apart (``in_graphs``); a region it does not pass counts its operators;
- one for everything else.
A launch is not a kernel: a ``_foreach_*`` op launches one kernel per chunk of its tensor list, a
``linalg_*`` op (QR, Cholesky, eigh) several cuSOLVER or MAGMA kernels and a workspace allocation, a
GEMM sometimes two (split-K), a graph's replay all the kernels it holds. The profiler on a GPU counts
the kernels (`edgc_bench.gpu`); this count is what the CPU can hold the code to.

How: on fake tensors, through the DDP hook of a state settled on them (`edgc_probes.hook_steps`: no
DDP, no process group, no memory).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgc.device import graphs

from .capture_check import passing_regions
from .hook_steps import _zeros, as_on_an_accelerator, sampled_config, settled_hook
from .host_reads import counted_host_reads
from .op_traffic import kernels_per_dispatch, op_traffic
from .stand_ins import counting_communicator

__all__ = ["DispatchCounter", "StepCount", "as_on_an_accelerator", "count_hook_step", "sampled_config"]
GRAPH_LAUNCH = "graph_replay"  # the counted name of a graph region's call
RULE = (
    "launches a GPU would make per ATen dispatch: none for views, in-place view ops, allocation-only ops "
    "(empty*, new_empty*, resize_), _unsafe_view, set_, sym_* and prim ops; a cat one copy per input where "
    "CUDA copies input by input; a mixed-dtype _foreach_* one per tensor; a graph region the capture "
    "checker passes one per call (edgc_probes.dispatch_count)"
)

aten = torch.ops.aten

METADATA_ONLY = frozenset(
    {
        aten.empty,
        aten.empty_strided,
        aten.empty_like,
        aten.new_empty,
        aten.new_empty_strided,
        aten.resize_,
        aten._unsafe_view,
        aten.set_,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
    }
)


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether a dispatch of ``func`` launches device work (the rule of the module docstring)."""
    if func.namespace == "prim" or func.is_view or torch.Tag.inplace_view in func.tags:
        return False
    return func.overloadpacket not in METADATA_ONLY


class DispatchCounter(TorchDispatchMode):
    """Counts the kernel launches made while it is active (the module docstring's rule), per operator
    name, and the bytes each dispatch reads and writes (`edgc_probes.op_traffic.op_traffic`).
    ``replayed``: the names of the graph regions whose calls count one launch each (`GRAPH_LAUNCH`),
    those the capture checker passes; their operators go to ``in_graphs``."""

    def __init__(self, replayed: Iterable[str] = ()):
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.bytes_by_op: collections.Counter[str] = collections.Counter()
        self.in_graphs: collections.Counter[str] = collections.Counter()
        self.replayed = frozenset(replayed)
        self._local = threading.local()  # .region: the replayed region being called on this thread
        self._observing = contextlib.ExitStack()

    def __enter__(self):
        super().__enter__()
        self._observing.enter_context(graphs.observing(self))
        return self

    def __exit__(self, *exc):
        self._observing.close()
        return super().__exit__(*exc)

    def region_begin(self, region, buffers, mode) -> None:
        if region.graphs and region.name in self.replayed and getattr(self._local, "region", None) is None:
            self._local.region = region
            self.by_op[GRAPH_LAUNCH] += 1

    def region_end(self, region, buffers, mode) -> None:
        if getattr(self._local, "region", None) is region:
            self._local.region = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_kernel(func):
            name = func.overloadpacket.__name__
            replayed = getattr(self._local, "region", None) is not None
            (self.in_graphs if replayed else self.by_op)[name] += kernels_per_dispatch(func, args, out)
            self.bytes_by_op[name] += sum(op_traffic(func, args, kwargs, out))
        return out

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())


# ---------------------------------------------------------------------------- counting
@dataclass
class StepCount:
    """One counted step (or engine call)."""

    dispatches: int
    by_op: dict[str, int]
    collectives: int
    host_reads: int
    buckets: int = 1
    matrices: int = 0  # gradients of ≥ 2 dimensions
    compressed: int = 0  # of those, sent as low-rank factors
    phase: str | None = None
    rank: int | None = None
    extra: dict = field(default_factory=dict)
    bytes_by_op: dict[str, int] = field(default_factory=dict)  # read + written, per operator (`op_traffic`)
    compressed_elements: int = 0  # elements of the compressed matrices
    peak_state_bytes: int | None = None  # most bytes alive at once beyond the gradients (`LiveStorages`)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def per_compressed_element(self, value: int) -> float:
        return value / max(self.compressed_elements, 1)

    @property
    def linalg(self) -> int:
        """Dispatches of ``linalg_*`` operators (QR, Cholesky, triangular solves, eigh)."""
        return sum(count for name, count in self.by_op.items() if name.startswith(("linalg_", "_linalg_")))

    def summary(self, top: int = 15) -> dict:
        ranked = sorted(self.by_op.items(), key=lambda item: (-item[1], item[0]))
        traffic = {}
        if self.compressed_elements:
            traffic["bytes_per_compressed_element"] = round(self.per_compressed_element(self.bytes), 3)
            traffic["bytes_per_compressed_element_by_op"] = {
                name: round(self.per_compressed_element(value), 3)
                for name, value in sorted(self.bytes_by_op.items(), key=lambda item: -item[1])
                if self.per_compressed_element(value) >= 0.005
            }
        if self.peak_state_bytes is not None:
            traffic["memory_per_compressed_element"] = round(self.per_compressed_element(self.peak_state_bytes), 3)
        return {
            "dispatches": self.dispatches,
            "linalg": self.linalg,
            "matrices": self.matrices,
            "compressed": self.compressed,
            "buckets": self.buckets,
            "collectives": self.collectives,
            "host_reads": self.host_reads,
            "phase": self.phase,
            "rank": self.rank,
            "top_ops": dict(ranked[:top]),
            **traffic,
            **self.extra,
        }


def count_hook_step(
    named_shapes: list[tuple[str, tuple[int, ...]]],
    *,
    graphs: bool = False,
    **settings,
) -> StepCount:
    """Dispatches of one compressed step through the DDP hook (`edgc_probes.hook_steps.settled_hook`:
    every bucket of DDP's layout passed to `EDGCState.reduce_bucket` in DDP's order, after the warm-up
    and the settled steps; ``settings`` are its). Also the bytes its ops move and the most memory alive
    at once during it beyond the gradients (the engine's state included). ``graphs``: the graph regions
    that the capture checker passes over four steady steps (`edgc_probes.capture_check.passing_regions`,
    run first: the counted step comes after them) count one launch per call (the module docstring's rule).
    ``extra["after_last_bucket"]``: the dispatches from entering the last bucket's `reduce_bucket` to the
    step's end (its settle included): what the host issues once backward is over."""
    with settled_hook(named_shapes, **settings) as run:
        replayed = frozenset()
        if graphs:
            replayed = passing_regions(run.settled_step)
            gc.collect()  # the checker's trace (its cycles) held its steps' scratch: not the engine's memory
        run.host.reads, run.communicator.issued = 0, []
        run.live.reset_peak()
        with DispatchCounter(replayed) as counter:
            for bucket in run.buckets[:-1]:
                run.state.reduce_bucket(bucket)
            before_last = counter.total
            run.state.reduce_bucket(run.buckets[-1])
            # settled in the count: its one host read (answered by _zeros), and a sampled step's
            # entropy estimate (on a device these run at the next step's start: the step's all the same)
            metrics = run.state.last_step_metrics
        if run.after_step is not None:
            run.after_step(run.state)
    numel = dict(zip(run.names, (math.prod(shape) for shape in run.shapes)))
    compressed = [name for name, r in metrics.get("ranks", {}).items() if r]
    return StepCount(
        counter.total,
        dict(counter.by_op),
        len(run.communicator.issued),
        run.host.reads,
        buckets=len(run.layout),
        matrices=sum(len(shape) >= 2 for shape in run.shapes),
        compressed=len(compressed),
        phase=metrics["phase"],
        rank=metrics["rank"],
        bytes_by_op=dict(counter.bytes_by_op),
        compressed_elements=sum(numel[name] for name in compressed),
        peak_state_bytes=run.live.peak_bytes,
        extra={
            "after_last_bucket": counter.total - before_last,
            **({"in_graphs": dict(counter.in_graphs)} if graphs else {}),
        },
    )


def count_engine_call(
    shape: tuple[int, int],
    matrices: int,
    *,
    rank: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    settle_calls: int = 1,
    fake: bool = True,
    other_shape: tuple[int, int] | None = None,
) -> StepCount:
    """Dispatches of one `LowRankCompressor.reduce` call on ``matrices`` gradients of one shape
    (one bucket holding them; plus one of ``other_shape``), after ``settle_calls`` calls, on the
    GPU's path; on real CPU tensors with ``fake=False``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgc import LowRankCompressor, LowRankConfig

    with counted_host_reads(_zeros) as host, FakeTensorMode() if fake else contextlib.nullcontext():
        compressor = LowRankCompressor(LowRankConfig(force_accelerator_kernels=True))  # the GPU's path
        communicator = counting_communicator()
        names = [f"matrix{k}" for k in range(matrices)]
        grads = [torch.zeros(shape, dtype=dtype) for _ in names]
        if other_shape is not None:
            names.append("other")
            grads.append(torch.zeros(other_shape, dtype=dtype))
        for _ in range(settle_calls):
            compressor.reduce(names, grads, rank, communicator, measure_error=False)
        communicator.issued = []
        with DispatchCounter() as counter:
            stats = compressor.reduce(names, grads, rank, communicator, measure_error=False)
    return StepCount(
        counter.total,
        dict(counter.by_op),
        len(communicator.issued),
        host.reads,
        matrices=matrices,
        compressed=sum(1 for r in stats.ranks.values() if r),
        rank=rank,
    )


# ---------------------------------------------------------------------------- GPT-2
def count_gpt2_step(
    size: str, bucket_cap_mb: float | None = None, *, rank: int = 32, dtype: torch.dtype = torch.bfloat16
) -> StepCount:
    """`count_hook_step` on GPT-2 ``size``'s parameters (Hugging Face's layout; ``None``: DDP's
    default buckets). E.g. ``count_gpt2_step("xl").dispatches``: a compressed step at rank 32, bf16."""
    from .gpt2_layout import gpt2_parameters

    return count_hook_step(gpt2_parameters(size), bucket_cap_mb=bucket_cap_mb, rank=rank, dtype=dtype)


def count_report(
    sizes: Iterable[str] = ("medium", "large", "xl"),
    bucket_caps: Iterable[float | None] = (None, 100, 200),
    *,
    rank: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    group_sizes: Iterable[int] = (1, 2, 8),
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """What ``python -m edgc_bench.gpu --count-only`` writes to count.json: the hook's step per
    model and bucket size, and one engine call on 1, 2, 8 matrices of the widest model's MLP shape."""
    from .gpt2_layout import GPT2_SIZES

    sizes = list(sizes)
    rows = []
    for size in sizes:
        for cap in bucket_caps:
            count = count_gpt2_step(size, cap, rank=rank, dtype=dtype)
            rows.append(
                {
                    "model": size,
                    "bucket_cap_mb": 25 if cap is None else cap,
                    "ddp_default": cap is None,
                    **count.summary(),
                }
            )
            progress(f"count {size} bucket {rows[-1]['bucket_cap_mb']} MB: {count.dispatches} dispatches")
    widest = max(sizes, key=lambda size: GPT2_SIZES[size][1])
    shape = (GPT2_SIZES[widest][1], 4 * GPT2_SIZES[widest][1])
    engine = [
        {"model": widest, "shape": list(shape), **count_engine_call(shape, k, rank=rank, dtype=dtype).summary()}
        for k in group_sizes
    ]
    return {
        "rank": rank,
        "dtype": str(dtype).removeprefix("torch."),
        "world_size": 1,
        "torch": torch.__version__,
        "rule": RULE,
        "hook": rows,
        "engine_same_shape": engine,
    }
