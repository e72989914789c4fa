"""The gradients a reducer is handed, of every kind, and how each is averaged raw.

A reducer compresses dense gradients it can view as matrices in place (`edgc.engine.lowrank`). The rest
are averaged as DDP itself would average them, never left local:

* **Sparse gradients** (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): DDP gives
  each its own bucket, whose buffer is the sparse gradient itself and whose ``gradients()`` list is
  empty; `synchronize` finds it as ``p.grad``. It is divided by the group's size and summed by the
  backend's sparse all-reduce (`Communicator.sparse_mean_async`), a job of its own, never fused
  with dense buckets and never compressed: the exact group mean, in sparse COO form, as DDP's
  default hook gives it (gloo has a sparse all-reduce; NCCL refuses sparse tensors, for DDP too).
  Other sparse layouts (CSR, …) are refused in one line.
* **Dense gradients in another layout** (a channels-last convolution's, a transposed one):
  `synchronize` averages a contiguous copy and writes the average back into the gradient, which
  keeps its layout. DDP hands its hook contiguous bucket views, and `reduce_tensors` (an
  integration's own buckets) takes contiguous dense tensors only and refuses others in one line.

Every dtype a process group all-reduces is averaged raw in its own dtype; the compressor's dtypes
are `edgc.engine.lowrank`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ..adapters import torch_adapter
from ..device.finite import all_finite
from ..distributed.comm import FINISHES, Communicator, Job
from ..distributed.mesh import local_tensor
from ..safeguards.guards import check_gradients
from .stats import ReduceStats


def is_sparse(tensor: torch.Tensor) -> bool:
    return tensor.layout != torch.strided


def check_sparse_layout(state_name: str, name: str, grad: torch.Tensor) -> None:
    """Only sparse COO gradients have an all-reduce: refuse another sparse layout in one line."""
    if grad.layout != torch.sparse_coo:
        raise ValueError(
            f"{state_name}: the gradient of {name} is sparse in layout {grad.layout}; a process group "
            "all-reduces sparse COO tensors only (nn.Embedding(sparse=True) gives those): convert it "
            "with .to_sparse_coo() or .to_dense() before the sync"
        )


def check_dense(state_name: str, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """`reduce_tensors` averages dense contiguous tensors in place: refuse another one in one line,
    before anything of the step has begun."""
    for name, tensor in zip(names, tensors):
        if is_sparse(tensor) or not tensor.is_contiguous():
            kind = f"sparse ({tensor.layout})" if is_sparse(tensor) else "not contiguous"
            raise ValueError(
                f"{state_name}.reduce_tensors: {name} is {kind}; it averages dense contiguous tensors "
                "in place (synchronize() takes gradients of any layout; else pass a contiguous copy "
                "and copy the average back)"
            )


class HandedGradients:
    """The gradients of one `synchronize` call over ``params`` (named ``names``), sorted by how they are
    averaged: ``dense`` (names and contiguous tensors: the gradients, or copies of those in another
    layout) and ``sparse`` ((name, gradient) pairs); ``grads``: every gradient as handed. A parameter
    that requires a gradient and has none gets a zero one (as in DDP: every rank sends the same
    tensors); none at all is refused (`check_gradients`). ``handed``: each ``p.grad`` as it is (a
    DTensor's too). `write_back` copies the copies' averages into their gradients."""

    def __init__(self, state_name: str, names: Sequence[str], params: Sequence[torch.Tensor]):
        named = [(name, p) for name, p in zip(names, params) if p.requires_grad]
        check_gradients(state_name, [p for _, p in named])
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.handed = [p.grad for _, p in named]
        self.grads = [local_tensor(grad) for grad in self.handed]
        self.dense_names: list[str] = []
        self.dense: list[torch.Tensor] = []
        self.sparse: list[tuple[str, torch.Tensor]] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gradient, its contiguous copy)
        for (name, _), grad in zip(named, self.grads):
            if is_sparse(grad):
                check_sparse_layout(state_name, name, grad)
                self.sparse.append((name, grad))
                continue
            if not grad.is_contiguous():
                copy = grad.contiguous()
                self._copies.append((grad, copy))
                grad = copy
            self.dense_names.append(name)
            self.dense.append(grad)

    @classmethod
    def of(cls, state_name: str, parameters: Iterable, names_for: Callable) -> HandedGradients:
        """Of ``model.parameters()`` (named by ``names_for``) or ``model.named_parameters()``."""
        entries = list(parameters)
        if entries and isinstance(entries[0], tuple):
            return cls(state_name, [name for name, _ in entries], [p for _, p in entries])
        return cls(state_name, names_for(entries), entries)

    def write_back(self) -> None:
        for grad, copy in self._copies:
            grad.copy_(copy)


def average_raw(comm: Communicator, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> Job:
    """Plain averaged all-reduce, as a job: of DDP's bucket buffer directly, or of one packed copy.
    Where the communicator asks (`Communicator.flags_nonfinite`), its stats say whether the
    average is finite."""
    packed = flat if flat is not None else torch.cat([g.reshape(-1) for g in grads])
    sent = comm.mean_async(packed)
    elements = sum(g.numel() for g in grads)
    size = elements * grads[0].element_size()
    yield FINISHES
    sent.wait()
    if flat is None:
        offset = 0
        for g in grads:
            g.view(-1).copy_(packed[offset : offset + g.numel()])
            offset += g.numel()
    stats = ReduceStats(elements, elements, size, size, ranks={n: 0 for n in names})
    if comm.flags_nonfinite:  # identical on every replica: it is of the average
        stats.nonfinite = ~torch.stack([all_finite(t) for t in ([flat] if flat is not None else grads)]).all()
    return stats


def average_sparse(comm: Communicator, names: list[str], grads: list[torch.Tensor], flat: torch.Tensor | None) -> Job:
    """One sparse gradient (``grads == [flat]``) averaged in place, as a job: its message is its
    indices and values, counted as both what it would send raw and what it sent."""
    (grad,) = grads
    sent = comm.sparse_mean_async(grad)
    yield FINISHES
    sent.wait()
    values, indices = torch_adapter.sparse_parts(grad)
    elements = values.numel() + indices.numel()
    size = values.numel() * values.element_size() + indices.numel() * indices.element_size()
    stats = ReduceStats(elements, elements, size, size, ranks={n: 0 for n in names})
    if comm.flags_nonfinite:
        stats.nonfinite = ~all_finite(values)
    return stats
