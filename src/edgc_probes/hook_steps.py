"""A DDP hook's steps on fake tensors, without DDP or a process group: the harness that the dispatch
counter (`edgc_probes.dispatch_count`) counts a step of and the capture checker (`edgc_probes.capture_check`)
checks steps of.

The tensors are fake (`torch._subclasses.fake_tensor.FakeTensorMode`: shapes, dtypes and strides with
no storage), so GPT-2 XL's 1.5 billion gradients cost nothing. A fake tensor has no values, so the
step's one host read (`edgc.device.timing.to_host`) is counted and answered with zeros. Collectives go
to `edgc_probes.stand_ins.counting_communicator`, which records each one and completes it at once, so
the engine runs exactly as it does in a process group (world size 1 by default, as on the one-GPU
bench), and no bytes move. The buckets are DDP's (`edgc_probes.stand_ins.ddp_buckets`), each passed to
the hook's state as DDP would pass it (`edgc_probes.stand_ins.GradBucketStandIn`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .host_reads import HostReads, counted_host_reads
from .live_memory import LiveStorages
from .stand_ins import GradBucketStandIn, NamedParameters, counting_communicator, ddp_buckets, ready_order


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

    from edgc.runner.jobs import DEFAULT_ACCELERATOR_FUSION_MB

    fusion_mb = DEFAULT_ACCELERATOR_FUSION_MB if config.fusion_mb is None else config.fusion_mb
    return replace(config, fusion_mb=fusion_mb, engine=replace(config.engine, force_accelerator_kernels=True))


@dataclass
class SettledHook:
    """A state whose steps run through the hook: ``step()`` passes every bucket to it once."""

    state: object  # the EDGCState
    buckets: list[GradBucketStandIn]
    layout: list[list[int]]  # the parameters of each bucket
    names: list[str]
    shapes: list[tuple[int, ...]]
    communicator: object  # its `counting_communicator`
    host: HostReads
    live: LiveStorages
    after_step: Callable | None

    def step(self) -> None:
        for bucket in self.buckets:
            self.state.reduce_bucket(bucket)

    def settled_step(self) -> dict:
        """A step, settled as the counted one is (its metrics read: its host read and a sampled step's
        estimate, which would otherwise run at the next step's start), then what follows each
        (``after_step``: a torchft commit); its metrics."""
        self.step()
        metrics = self.state.last_step_metrics
        if self.after_step is not None:
            self.after_step(self.state)
        return metrics


@contextlib.contextmanager
def settled_hook(
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
) -> Iterator[SettledHook]:
    """A state over ``named_shapes``' fake gradients in DDP's buckets (``bucket_cap_mb``; None: DDP's
    default), after the warm-up and ``settle_steps`` compressed steps (the first one creates Q and the
    error feedback), in the body (all it made is alive: `LiveStorages`). ``order``: the gradients'
    ready order (default `ready_order`, GPT-2's). ``accelerator``: the GPU's path
    (`as_on_an_accelerator`); False: the CPU's. ``count_step``: settle until that optimizer step (not
    before the settled ones); ``prepare(state)`` runs once the state is built, ``after_step(state)``
    after each settled step."""
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
            run = SettledHook(state, buckets, layout, names, shapes, communicator, host, live, after_step)
            compressed = 0
            while compressed < settle_steps or (count_step is not None and state.step < count_step):
                compressed += run.settled_step()["phase"] == "compress"
                if state.step > 100:
                    raise RuntimeError("the warm-up did not end within 100 steps: pass a static config")
            yield run
