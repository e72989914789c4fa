"""Which ATen operators make the host wait for the device on CUDA (`edgc_probes.stream_check`).

A value read (``_local_scalar_dense``: ``item``, ``bool``, ``float``); an operator whose output size
depends on values (``nonzero``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without
``output_size``, ...); the linear-algebra calls that check their own errors on the host
(``cholesky``, ``inv``, ``solve`` and the rest without ``_ex``, whose composite calls
``_linalg_check_errors``; ``eigh``, ``eigvalsh`` and ``svd``, which have no ``_ex``); and copies
between host and device: a blocking one either way, and any copy into pageable host memory
(CUDA returns from it only once the copy is done), where a non-blocking copy into pinned memory
is a stream operation (`StreamChecker.host_touches` checks the host's reads of it). The Python-level
ones (``.cpu()``, ``tolist``, ``numpy``, ``Stream.synchronize``, ...) are in
`edgc_probes.stream_check_patches`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from edgc.adapters import torch_adapter

aten = torch.ops.aten

# Operators whose output size depends on values, and those that read values to check errors or
# to answer the host.
DATA_DEPENDENT_SIZE = frozenset(
    {aten.nonzero, aten.masked_select, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.bincount}
)
HOST_CHECKED = frozenset(
    {
        aten._local_scalar_dense,
        aten.equal,
        aten.is_nonzero,
        aten._linalg_check_errors,
        aten._linalg_eigh,
        aten._linalg_svd,
        aten.linalg_eig,
    }
)
VALUE_SIZED = DATA_DEPENDENT_SIZE | HOST_CHECKED
BOOL_INDEXED = frozenset({aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_})


@dataclass
class HostSync:
    """One host synchronisation outside `host_reads_allowed`: what, and the library frame that did it."""

    kind: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where}"


def _argument(func, args, kwargs, name: str, default=None):
    for position, argument in enumerate(torch_adapter.op_schema(func).arguments):
        if argument.name == name:
            return args[position] if position < len(args) else kwargs.get(name, default)
    return default


def value_read(func, args, kwargs) -> tuple[str, bool, torch.Tensor | None] | None:
    """Whether an operator reads its input's values on the host, whatever the tensors' provenance: (what,
    whether its output's size depends on them, the tensor read), or None."""
    packet = func.overloadpacket
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if packet in VALUE_SIZED:
        return packet.__name__, packet in DATA_DEPENDENT_SIZE, first
    if packet in BOOL_INDEXED and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in pytree.tree_leaves(args[1])
    ):
        return f"{packet.__name__} with a boolean mask", True, first
    if packet is aten.repeat_interleave and first is not None:
        repeats = _argument(func, args, kwargs, "repeats", first)
        if isinstance(repeats, torch.Tensor) and _argument(func, args, kwargs, "output_size") is None:
            return "repeat_interleave without output_size", True, repeats
    return None


def host_syncs_of(checker, func, args, kwargs) -> list[tuple[str, torch.Tensor | None]]:
    """The host synchronisation a device operator makes, if it makes one: (what, the tensor read) for
    ``checker.host_sync`` once the operator is queued (the host waits for it too)."""
    read = value_read(func, args, kwargs)
    if read is not None:
        return [(read[0], read[2])]
    if func.overloadpacket is aten.copy_:
        return _copy(checker, args[0], args[1], bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
    return []


def _copy(checker, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> list:
    into, out_of = checker.kind_of(destination), checker.kind_of(source)
    if (into == "device") == (out_of == "device"):
        return []
    if into == "device":
        return [] if non_blocking else [("blocking copy_ host → device", destination)]
    if into == "host":
        return [("copy_ device → pageable host memory", source)]
    return [] if non_blocking else [("blocking copy_ device → pinned host memory", source)]
