"""The one place that reads PyTorch's private members on its objects (FSDP2's are `edgc.adapters.fsdp_adapter`'s).

Each is read here, by name, and nowhere else:

* ``Tensor._version``: the in-place version counter, which tells that a gradient was not touched
  since ``synchronize()`` averaged it (`edgc.safeguards.guards`).
* ``Tensor._base``: the tensor a view was taken from, which tells that the kept error feedback still
  views one arena (`edgc.engine.engine_memory`), and that a call's tensors are one run of one buffer
  (`edgc.sync.flat_buffers`).
* ``Tensor._values()`` and ``._indices()``: a sparse gradient's parts as they are, coalesced or not
  (the public ``values()`` refuses an uncoalesced tensor) (`edgc.runner.gradients`).
* ``Variable._execution_engine.queue_callback``: a call at the end of the backward pass, where
  FSDP2's hooks of one step are all in (`edgc.parallel.fsdp`), as FSDP2 itself closes its step.
* ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``: parameters a DDP built
  afterwards leaves alone (`edgc.distributed.experts`: experts have a group of their own).
* ``OpOverload._schema``, ``ScriptObject._type()`` and ``StreamSynchronizations._state_wait_for_other``
  (``torch.cuda._sanitizer``): what the CPU stream checker (`edgc_probes.stream_check`) reads of an
  operator's arguments, of a boxed work or process group, and how it orders one stream after another.
* ``UntypedStorage._cdata``: a storage's identity, fake tensors' too, which the capture checker
  (`edgc_probes.capture_check`) compares between steps.
* ``ProcessGroupGloo._Options`` and an options object's ``_timeout``: the one way to give a
  DeviceMesh's gloo and NCCL groups the default group's timeout (`edgc.distributed.mesh`).

Should PyTorch rename one of them, this module is what changes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s in-place version counter."""
    return tensor._version


def view_base(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of, or None (not a view, or no tensor)."""
    return getattr(tensor, "_base", None)


def sparse_parts(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the sparse COO ``grad``, coalesced or not."""
    return grad._values(), grad._indices()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Call ``callback`` once the running backward pass has finished."""
    Variable._execution_engine.queue_callback(callback)


def ddp_ignores(module: nn.Module, names: list[str]) -> None:
    """A DDP built on ``module`` afterwards leaves the parameters and buffers ``names`` alone."""
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def backend_options(backend: str, timeout: timedelta):
    """``backend``'s process-group options carrying ``timeout`` (gloo or nccl), or None for another backend."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


def op_schema(func):
    """The schema of the operator ``func`` (an ``OpOverload``): its arguments and returns, with their aliasing."""
    return func._schema


def script_type(value: torch.ScriptObject) -> str:
    """The TorchScript class name of a boxed object (a ``Work``, a ``ProcessGroup``)."""
    return str(value._type())


def storage_identity(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (the same for every view of it, fake tensors included), unique
    among the storages alive."""
    return tensor.untyped_storage()._cdata


def sanitizer_wait(syncs, waiting: dict, state: dict) -> None:
    """In the CUDA sanitizer's ``StreamSynchronizations`` ``syncs``: the sync state ``waiting`` is ordered
    after ``state``."""
    syncs._state_wait_for_other(waiting, state)
