"""Kernel-launching ATen dispatches of one compressed EDGC step, counted on the CPU.

    python -m edgc_bench.gpu --count-only --out DIR        # writes DIR/count.json

What is counted: every ATen operator that reaches the Python dispatch key while the step runs
(after autograd and composite-implicit decomposition, so ``torch.matmul`` counts as the ``mm`` or
``bmm`` it becomes), except those that launch no kernel on a GPU:
- views (``OpOverload.is_view``: ``view``, ``t``, ``transpose``, ``split``, ``detach``, …) and
  in-place view ops (``torch.Tag.inplace_view``: ``t_``, ``as_strided_``, …);
- ``METADATA_ONLY``: allocation without initialisation (``empty``, ``empty_strided``,
  ``empty_like``, ``new_empty``, ``new_empty_strided``, ``resize_``), ``_unsafe_view`` (a view
  whose schema does not say so), ``set_`` and the ``sym_*`` size queries;
- the ``prim`` namespace (``prim.device``, ``prim.layout``): metadata queries, which a fake tensor
  answers through the dispatcher where a real one answers in C++.
Everything else counts once per dispatch, except a ``_foreach_*`` op on lists of mixed dtypes,
which PyTorch runs tensor by tensor (`edgc_bench.op_traffic.kernels_per_dispatch`): once per tensor. A dispatch is not a
kernel: a ``_foreach_*`` op launches one kernel per chunk of its tensor list, a ``linalg_*`` op (QR, Cholesky, eigh)
several cuSOLVER or
MAGMA kernels and a workspace allocation, a GEMM sometimes two (split-K). The profiler on a GPU
counts the kernels (`edgc_bench.gpu`); this count is what the CPU can hold the code to.

How: the tensors are fake (`torch._subclasses.fake_tensor.FakeTensorMode`: shapes, dtypes and
strides with no storage), so GPT-2 XL's 1.5 billion gradients cost nothing. A fake tensor has no
values, so any host read of one raises, except the step's one read (`edgc.device.timing.to_host`), which
is counted and answered with zeros. Collectives go to `CountingCommunicator`, which records each
one and completes it at once, so the engine runs exactly as it does in a process group (world size
1 by default, as on the one-GPU bench), and no bytes move. The buckets are DDP's, reproduced by
`ddp_buckets`, and each is passed to the hook's state as DDP would pass it (`GradBucketStandIn`);
these stand-ins are in stand_ins.py.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .gpu_support import counted_host_reads
from .live_memory import LiveStorages
from .op_traffic import kernels_per_dispatch, op_traffic
from .stand_ins import GradBucketStandIn, NamedParameters, counting_communicator, ddp_buckets, ready_order

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
    """Counts the kernel-launching dispatches made while it is active, per operator name, and the
    bytes each of them reads and writes (`edgc_bench.op_traffic.op_traffic`)."""

    def __init__(self):
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()
        self.bytes_by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_kernel(func):
            name = func.overloadpacket.__name__
            self.by_op[name] += kernels_per_dispatch(func, args)
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


def _zeros(tensor: torch.Tensor) -> list:
    """The step's host read answered without reading: a fake tensor has no values."""
    return [0.0] * tensor.numel()


def _static_config(rank: int):
    from edgc import EDGCConfig

    return EDGCConfig.static(rank, total_steps=100_000, warmup_fraction=0.0)


def sampled_config(rank: int):
    """Adaptive rank control held at ``rank`` (one window over the run), the gradients sampled and the
    error measured on every step: what a sampled step adds to a static one."""
    from edgc import EDGCConfig

    return EDGCConfig(
        r_max=rank,
        r_min=rank,
        total_steps=100_000,
        warmup_fraction=0.0,
        warmup_error_test=False,
        window=100_000,
        iteration_sample_ratio=1.0,
    )


def as_on_an_accelerator(config):
    """``config`` (an `EDGCConfig`) for a state on fake CPU tensors that takes the path it takes on a GPU
    with fast float64: buckets fused into jobs of the accelerator default (unless it sets ``fusion_mb``)
    and factors orthonormalised by the batched float64 CholeskyQR2 rather than LAPACK's Householder QR
    (`edgc.config.LowRankConfig.force_accelerator_kernels`)."""
    from dataclasses import replace

    from edgc.state import DEFAULT_ACCELERATOR_FUSION_MB

    fusion_mb = DEFAULT_ACCELERATOR_FUSION_MB if config.fusion_mb is None else config.fusion_mb
    return replace(config, fusion_mb=fusion_mb, engine=replace(config.engine, force_accelerator_kernels=True))


def count_hook_step(
    named_shapes: list[tuple[str, tuple[int, ...]]],
    *,
    bucket_cap_mb: float | None = None,
    rank: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    world_size: int = 1,
    config=None,
    order: list[int] | None = None,
    settle_steps: int = 1,
    accelerator: bool = True,
    count_step: int | None = None,
    prepare: Callable | None = None,
    after_step: Callable | None = None,
) -> StepCount:
    """Dispatches of one compressed step through the DDP hook: every bucket of DDP's layout passed
    to `EDGCState.reduce_bucket` in DDP's order, after the warm-up and ``settle_steps`` compressed
    steps (the first one creates Q and the error feedback). ``order``: the gradients' ready order
    (default `ready_order`, GPT-2's). Also the bytes its ops move and the most memory alive at once
    during it beyond the gradients (the engine's state included). ``accelerator``: the GPU's path
    (`as_on_an_accelerator`); False: the CPU's. ``count_step``: count that optimizer step (not before
    the settled ones); ``prepare(state)`` runs once the state is built, ``after_step(state)`` after each
    step (the counted one's after the count: a torchft commit)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgc import EDGCState

    names, shapes = [name for name, _ in named_shapes], [tuple(shape) for _, shape in named_shapes]
    layout = ddp_buckets(shapes, ready_order(names) if order is None else order, dtype, bucket_cap_mb)
    with counted_host_reads(_zeros) as host, FakeTensorMode():
        parameters = [torch.empty(shape, dtype=dtype) for shape in shapes]
        buckets = [
            GradBucketStandIn(k, [parameters[i] for i in indices], dtype, last=k == len(layout) - 1)
            for k, indices in enumerate(layout)
        ]
        with LiveStorages() as live:  # everything allocated from here on: the state and its steps
            config = config or _static_config(rank)
            config = as_on_an_accelerator(config) if accelerator else config
            state = EDGCState(None, config, model=NamedParameters(list(zip(names, parameters))))
            state.attach(communicator := counting_communicator(world_size))
            if prepare is not None:
                prepare(state)

            def step() -> None:
                for bucket in buckets:
                    state.reduce_bucket(bucket)

            compressed = 0
            while compressed < settle_steps or (count_step is not None and state.step < count_step):
                step()
                compressed += state.last_step_metrics["phase"] == "compress"
                if after_step is not None:
                    after_step(state)
                if state.step > 100:
                    raise RuntimeError("the warm-up did not end within 100 steps: pass a static config")
            host.reads, communicator.issued = 0, []
            live.reset_peak()
            with DispatchCounter() as counter:
                step()
                # settled in the count: its one host read (answered by _zeros), and a sampled step's
                # entropy estimate (on a device these run at the next step's start: the step's all the same)
                metrics = state.last_step_metrics
            if after_step is not None:
                after_step(state)
    numel = dict(zip(names, (math.prod(shape) for shape in shapes)))
    compressed = [name for name, r in metrics.get("ranks", {}).items() if r]
    return StepCount(
        counter.total,
        dict(counter.by_op),
        len(communicator.issued),
        host.reads,
        buckets=len(layout),
        matrices=sum(len(shape) >= 2 for shape in shapes),
        compressed=len(compressed),
        phase=metrics["phase"],
        rank=metrics["rank"],
        bytes_by_op=dict(counter.bytes_by_op),
        compressed_elements=sum(numel[name] for name in compressed),
        peak_state_bytes=live.peak_bytes,
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
        "rule": "ATen dispatches that launch device work: views, in-place view ops, allocation-only ops "
        "(empty*, new_empty*, resize_), _unsafe_view, set_, sym_* and prim ops excluded "
        "(edgc_bench.dispatch_count)",
        "hook": rows,
        "engine_same_shape": engine,
    }
