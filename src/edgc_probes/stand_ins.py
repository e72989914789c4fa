"""What DDP and a process group hand EDGC's hook, without either (dispatch_count.py counts a step on
them): DDP's buckets in the order its backward fills them, a communicator that records each
collective and completes it at once, a ``GradBucket`` and a model that only name their tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------- DDP's buckets
def ready_order(names: list[str]) -> list[int]:
    """Indices of the parameters in the order their gradients become ready in GPT-2's backward,
    which is the order DDP's rebuilt buckets hold them in (it records that order in the first
    iteration). Reverse registration order, except that a LayerNorm's weight is ready before its
    bias (its backward node accumulates them in that order, where a Conv1D's ``addmm`` gives the
    bias first). Checked against DDP around ``GPT2LMHeadModel`` and, in the suite, around
    `edgc_probes.gpt2_layout.GPT2Layout` (tests/bench/test_dispatch_count.py)."""
    order = list(reversed(range(len(names))))
    for k in range(len(order) - 1):
        bias, weight = names[order[k]], names[order[k + 1]]
        if bias.endswith(".bias") and weight == bias[: -len("bias")] + "weight" and _is_layer_norm(bias):
            order[k], order[k + 1] = order[k + 1], order[k]
    return order


def _is_layer_norm(name: str) -> bool:
    return name.split(".")[-2].startswith("ln_")


def ddp_buckets(
    shapes: list[tuple[int, ...]], order: list[int], dtype: torch.dtype, bucket_cap_mb: float | None
) -> list[list[int]]:
    """Parameter indices of each of DDP's buckets after its rebuild, in the order the hook sees them.

    Reproduces ``Reducer::rebuild_buckets``: the gradients in ready ``order`` go through
    ``dist._compute_bucket_assignment_by_size`` with the limits [first bucket, bucket cap]. The
    first bucket is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) only with DDP's default
    ``bucket_cap_mb=None`` (25 MiB); an explicit ``bucket_cap_mb`` caps every bucket, the first too.
    """
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    tensors = [torch.empty(shapes[i], dtype=dtype, device="meta") for i in order]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [first, cap], [], order)
    return [list(bucket) for bucket in buckets]


# ---------------------------------------------------------------------------- a step without a group
class _CompletedWork:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def counting_communicator(world_size: int = 1):
    """A `Communicator` that issues every collective as in a process group of ``world_size`` but
    only records it ((kind, elements, dtype) in ``.issued``) and completes it at once."""
    from edgc.distributed.comm import Communicator

    class CountingCommunicator(Communicator):
        def __init__(self):
            super().__init__(None)
            self.world_size, self.issued = world_size, []

        @property
        def issues(self) -> bool:
            return True

        @property
        def waits_on_device(self) -> bool:  # as NCCL's: the accelerator's path the counts stand for
            return True

        def _all_reduce_work(self, tensor, op):
            self.issued.append(("all_reduce", tensor.numel(), str(tensor.dtype)))
            return _CompletedWork()

        def _broadcast_work(self, tensor):
            self.issued.append(("broadcast", tensor.numel(), str(tensor.dtype)))
            return _CompletedWork()

        def _all_gather_work(self, out, tensor):
            self.issued.append(("all_gather", tensor.numel(), str(tensor.dtype)))
            return _CompletedWork()

        def _all_to_all_work(self, out, tensor):
            self.issued.append(("all_to_all", tensor.numel(), str(tensor.dtype)))
            return _CompletedWork()

        def _all_gather_into_work(self, out, tensor):
            self.issued.append(("all_gather_into", tensor.numel(), str(tensor.dtype)))
            return _CompletedWork()

    return CountingCommunicator()


class GradBucketStandIn:
    """What the hook reads of DDP's ``GradBucket``: a flat buffer and views of it, one per parameter."""

    def __init__(self, index: int, parameters: list[torch.Tensor], dtype: torch.dtype, last: bool):
        self._index, self._parameters, self._last = index, parameters, last
        self._buffer = torch.zeros(sum(p.numel() for p in parameters), dtype=dtype, device=parameters[0].device)
        sizes = [p.numel() for p in parameters]
        self._gradients = [flat.view(p.shape) for flat, p in zip(self._buffer.split(sizes), parameters)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._last

    def index(self) -> int:
        return self._index


class NamedParameters:
    """Stands for the model: `EDGCState` only asks it for ``named_parameters()``."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self._named = named

    def named_parameters(self):
        return iter(self._named)
