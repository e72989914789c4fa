"""Mixture-of-experts: which parameters are experts, and over which group each expert's gradient is averaged.

With expert parallelism (EP) a layer's E experts are split over the ``ep`` ranks of an EP group, and every
rank routes its tokens to them with an all-to-all. A dense parameter is then averaged over the whole
data-parallel group (all replicas hold it), an expert's over its *expert-data-parallel* (EDP) group
only: the ranks that hold the same experts (EP 2 × DP 2 on 4 ranks: dense over 4, each expert over 2).
The experts of a layer are stored as torchtitan stores them, one 3-D ``[E_local, ·, ·]`` parameter per
projection, which compressed as one matrix would mix unrelated experts in one low-rank factor: a state
splits it and compresses each expert as a matrix of its own (`edgc.distributed.expert_sync`).

**Which parameters are experts** (`expert_marks`), the first that applies:

* a module `mark_experts` marked: its group, first expert and ``ep`` as told (the override);
* a DTensor parameter sharded on dim 0 over a mesh dimension named in ``EXPERT_MESH_DIMS`` (``"ep"``,
  torchtitan's name and this library's mesh's): ``ep`` is that dimension's size, its first expert its
  coordinate there times the experts per rank;
* the parameters of a module whose class is named in ``EXPERT_MODULES`` (``GroupedExperts``:
  torchtitan's and this harness's, matched by name, so the library imports neither), each a ``[E, ·, ·]``
  stack. One that holds all of its module's experts (``num_experts``, where it says) is its experts at
  ep = 1. One that holds fewer as plain tensors is split over ranks no one named: a state handed it
  refuses it in one line before its first step (mark it).

Never from a shape alone: a fused ``[3, h, d]`` QKV weight is one dense parameter. A found expert is
averaged over the group of the state it reaches, which must hold one replica of it per rank: a state
whose group holds two ranks of its EP dimension (a dense state handed it) refuses it in one line,
naming it, before anything is sent; which experts each rank holds is compared with the other settings
at the first step (`edgc.distributed.agreement`). Its token counter is the nearest 1-D buffer named in
``TOKEN_COUNTERS`` on its module or the two above (torchtitan's ``tokens_per_expert_E``).

Marked, with a state per group:

    mark_experts(layer.experts, edp_group, first=ep_rank * E_local, ep=ep, tokens=layer.tokens_per_expert)
    ignore_experts(model)                                  # before DDP(model), if DDP syncs the dense part
    dense = EDGCState(dp_group, config, model=model)       # every parameter but the experts
    experts = EDGCState(edp_group, config, model=model)    # the experts, each its own matrix
    loss.backward()
    dense.synchronize(dense_parameters(model))
    experts.synchronize(expert_parameters(model))

An expert's gradient is scaled by 1/ep before its average (the tokens of its ep peers are in it): the
result is the same at any ep. The contract, and FSDP's division off (torchtitan's), is
`edgc.distributed.scaling`'s, the one place gradients are scaled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import torch_adapter
from .mesh import as_process_group, is_dtensor, local_tensor

__all__ = [
    "ExpertMark",
    "mark_experts",
    "expert_marks",
    "expert_parameters",
    "dense_parameters",
    "ignore_experts",
    "EXPERT_MESH_DIMS",
    "EXPERT_MODULES",
    "TOKEN_COUNTERS",
]

MARK = "_edgc_experts"  # the attribute a marked module carries
EXPERT_MESH_DIMS = ("ep",)  # a DTensor Shard(0) over a mesh dimension of one of these names: experts split over it
EXPERT_MODULES = ("GroupedExperts",)  # class names of modules that stack their experts on dim 0
TOKEN_COUNTERS = ("tokens_per_expert_E", "tokens_per_expert", "tokens")  # a found experts module's counter
COUNTER_DEPTH = 2  # modules above a found experts module searched for its counter


@dataclass(frozen=True)
class ExpertMark:
    """What makes a parameter's dim 0 a stack of experts: `mark_experts`'s, or found (`expert_marks`)."""

    first: int  # global index of the first expert this EP rank holds
    ranks: tuple[int, ...] | None  # global ranks of the expert-data-parallel group; None: found, the state's
    tokens: torch.Tensor | None = None  # the model's counter, per local ([count]) or global ([count·ep]) expert
    ep: int = 1  # expert-parallel ranks the layer's experts are split over (its gradient sums their tokens)
    count: int = 0  # experts this EP rank holds (dim 0 as marked)
    ep_ranks: tuple[int, ...] | None = None  # found on an EP mesh dimension: its global ranks
    unknown: str | None = None  # found but split over ranks no one named: why a state refuses it


def mark_experts(module: nn.Module, group, *, first: int, ep: int, tokens: torch.Tensor | None = None) -> None:
    """Mark ``module``'s parameters as stacked experts (call before wrapping the model): dim 0 is the expert,
    ``first`` the global index of this rank's first one, ``ep`` the expert-parallel ranks the layer's experts
    are split over (1: every expert on every rank), ``group`` (a process group or a 1-D DeviceMesh) the
    expert-data-parallel group that averages them; ``tokens`` (optional) the model's counter of tokens
    routed to each local expert (``[E_local]``) or each global one (``[E]``), read and never written."""
    params = list(module.parameters())
    if not params:
        raise ValueError("mark_experts: the module has no parameters")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"mark_experts: ep must be an integer ≥ 1 (the expert-parallel ranks), got {ep!r}")
    rows = [_rows(p, ep) if p.dim() >= 2 else 0 for p in params]
    if rows[0] < 1 or any(r != rows[0] for r in rows):
        raise ValueError(
            "mark_experts: every parameter of an experts module stacks its experts on dim 0 "
            f"([E_local, …], at least 2-D), got shapes {[tuple(local_tensor(p).shape) for p in params]}"
        )
    if not isinstance(first, int) or first < 0:
        raise ValueError(f"mark_experts: first must be an integer ≥ 0, got {first!r}")
    if tokens is not None and tuple(tokens.shape) not in ((rows[0],), (rows[0] * ep,)):
        raise ValueError(
            f"mark_experts: tokens must have shape ({rows[0]},) (one count per local expert) or "
            f"({rows[0] * ep},) (per global expert), got {tuple(tokens.shape)}"
        )
    process_group = as_process_group(group)
    initialized = dist.is_available() and dist.is_initialized()
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD)) if initialized else (0,)
    setattr(module, MARK, ExpertMark(first, ranks, tokens, ep, rows[0]))


def _rows(p: torch.Tensor, ep: int) -> int:
    """Experts of ``p`` on one EP rank: dim 0 of the tensor the model sees (a DTensor's global shape), per
    EP rank where a DTensor is sharded over an EP dimension."""
    return p.shape[0] // ep if _expert_placement(p) is not None else p.shape[0]


def _expert_placement(p: torch.Tensor) -> tuple[int, int, tuple[int, ...]] | None:
    """(ep, this rank's coordinate, that dimension's global ranks) of a DTensor sharded on dim 0 over a mesh
    dimension named in ``EXPERT_MESH_DIMS``; None for anything else."""
    if not is_dtensor(p):
        return None
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or ()
    for dim, placement in enumerate(p.placements):
        if dim < len(names) and names[dim] in EXPERT_MESH_DIMS and placement.is_shard(0):
            ranks = tuple(dist.get_process_group_ranks(mesh.get_group(dim)))
            return mesh.size(dim), mesh.get_local_rank(dim), ranks
    return None


def _inner(model: nn.Module) -> nn.Module:
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _counter(inner: nn.Module, prefix: str, rows: int, ep: int) -> torch.Tensor | None:
    """A found experts module's token counter: the nearest 1-D buffer named in ``TOKEN_COUNTERS`` of one
    count per local or global expert, on the module or the ``COUNTER_DEPTH`` modules above it."""
    parts = prefix.split(".") if prefix else []
    for depth in range(len(parts), max(-1, len(parts) - COUNTER_DEPTH - 1), -1):
        owner = inner.get_submodule(".".join(parts[:depth]))
        buffers = dict(owner.named_buffers(recurse=False))
        for name in TOKEN_COUNTERS:
            buffer = buffers.get(name)
            if isinstance(buffer, torch.Tensor) and buffer.dim() == 1 and buffer.shape[0] in (rows, rows * ep):
                return buffer
    return None


def _found_module(inner: nn.Module, prefix: str, module: nn.Module) -> ExpertMark | None:
    """The mark of an experts module found by its class (see the module docstring), or None: its own
    parameters do not stack experts on dim 0 alike."""
    params = [p for _, p in module.named_parameters(recurse=False)]
    if not params or any(p.dim() < 3 for p in params):
        return None
    placement = _expert_placement(params[0])
    ep, coordinate, ep_ranks = placement if placement is not None else (1, 0, None)
    rows = params[0].shape[0] // ep
    if rows < 1 or any(_rows(p, ep) != rows or (_expert_placement(p) is None) != (placement is None) for p in params):
        return None
    tokens = _counter(inner, prefix, rows, ep)
    total = getattr(module, "num_experts", None)
    if placement is None and isinstance(total, int) and rows < total:
        reason = (
            f"holds {rows} of its module's {total} experts ({type(module).__name__}, plain tensors), split over "
            "expert-parallel ranks that no state was told"
        )
        return ExpertMark(0, None, tokens, 1, rows, None, reason)
    return ExpertMark(coordinate * rows, None, tokens, ep, rows, ep_ranks)


def expert_marks(model: nn.Module | None) -> dict[str, ExpertMark]:
    """Parameter name (as ``model.named_parameters()`` names it, without DDP's ``module.``) → its mark, for
    every parameter that is experts (the module docstring's order: marked, then found)."""
    inner = None if model is None else _inner(model)
    if not isinstance(inner, nn.Module):  # a stand-in that only names parameters marks no expert
        return {}
    marks: dict[str, ExpertMark] = {}
    for prefix, module in inner.named_modules():
        mark = getattr(module, MARK, None)
        if mark is not None:
            marks.update({_joined(prefix, name): mark for name, _ in module.named_parameters()})
    for prefix, module in inner.named_modules():
        if type(module).__name__ in EXPERT_MODULES:
            found = _found_module(inner, prefix, module)
            for name, _ in module.named_parameters(recurse=False) if found is not None else ():
                marks.setdefault(_joined(prefix, name), found)
    for name, p in inner.named_parameters():
        placement = _expert_placement(p) if name not in marks and p.dim() >= 3 else None
        if placement is not None:
            ep, coordinate, ep_ranks = placement
            marks[name] = ExpertMark(coordinate * (p.shape[0] // ep), None, None, ep, p.shape[0] // ep, ep_ranks)
    return marks


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every expert parameter (marked or found): what the experts' state synchronizes."""
    marks = expert_marks(model)
    return [(name, p) for name, p in _inner(model).named_parameters() if name in marks]


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every other parameter (shared experts included): what the dense state synchronizes."""
    marks = expert_marks(model)
    return [(name, p) for name, p in _inner(model).named_parameters() if name not in marks]


def ignore_experts(module: nn.Module) -> None:
    """Leave the experts (and their token counters) out of a DDP built on ``module`` afterwards: call it on
    the module before wrapping it (a DDP already built has chosen its parameters). DDP averages over the
    whole data-parallel group, and broadcasts buffers from its rank 0; the experts need their own group's
    state, and each rank counts its own tokens."""
    if isinstance(getattr(module, "_orig_mod", module), nn.parallel.DistributedDataParallel):
        raise ValueError(
            "ignore_experts: call it on the module before wrapping it in DistributedDataParallel (the DDP "
            "given has chosen the parameters it averages)"
        )
    marks = expert_marks(module)
    counters = {id(mark.tokens) for mark in marks.values() if mark.tokens is not None}
    names = list(marks) + [name for name, buffer in module.named_buffers() if id(buffer) in counters]
    torch_adapter.ddp_ignores(module, names)


def expert_name(name: str, index: int) -> str:
    """The matrix of global expert ``index`` in the stacked parameter ``name``."""
    return f"{name}[{index}]"
