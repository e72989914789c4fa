"""Mixture-of-experts: each expert's gradient averaged over its expert-data-parallel group, as a matrix of its own.

With expert parallelism (EP) a layer's E experts are split over the ranks of an EP group, and every
rank routes its tokens to them with an all-to-all. A dense parameter is then averaged over the whole
data-parallel group (all replicas hold it), an expert's over its *expert-data-parallel* (EDP) group
only: the ranks that hold the same experts (EP 2 × DP 2 on 4 ranks: dense over 4, each expert over 2).
The experts of a layer are stored as torchtitan stores them, one 3-D ``[E_local, ·, ·]`` parameter per
projection, which compressed as one matrix would mix unrelated experts in one low-rank factor.

So the experts module is marked, and a state given ``model=`` (or the FSDP hook) knows its experts:

    mark_experts(layer.experts, edp_group, first=ep_rank * E_local, tokens=layer.tokens_per_expert)
    dense = EDGCState(dp_group, config, model=model)       # every parameter but the experts
    experts = EDGCState(edp_group, config, model=model)    # the experts, each its own matrix
    loss.backward()
    dense.synchronize(dense_parameters(model))             # or DDP with ignore_experts(ddp_model)
    experts.synchronize(expert_parameters(model))

A state that syncs a marked parameter:

* **splits it by expert**: ``grad[i]`` is the matrix of global expert ``first + i``, named
  ``name[first + i]`` (its error feedback, Q and rank are its own), a view of the gradient, so its
  average lands in place;
* **refuses it on another group** than the one it was marked with, in one line, before anything is
  sent (a dense state handed experts would average different experts together);
* **agrees on it**: which experts it holds joins the settings its group compares at the first step
  (`edgc.distributed.agreement`), so a group whose ranks hold different experts is refused there;
* **counts its tokens**: ``tokens`` (a ``[E_local]`` tensor the model adds the tokens routed to
  each local expert to, on the device) is summed over the group and reset at every window's end,
  for a rank split by tokens (`edgc.policies.rank_split`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import torch_adapter
from ..device.timing import to_device, to_host
from .mesh import as_process_group, local_tensor

__all__ = [
    "ExpertMark",
    "mark_experts",
    "expert_marks",
    "expert_parameters",
    "dense_parameters",
    "ignore_experts",
    "Experts",
]

MARK = "_edgc_experts"  # the attribute a marked module carries


@dataclass(frozen=True)
class ExpertMark:
    """What `mark_experts` attached to an experts module."""

    first: int  # global index of the module's first local expert
    ranks: tuple[int, ...]  # global ranks of the expert-data-parallel group that averages them
    tokens: torch.Tensor | None = None  # [E_local]: tokens routed to each local expert, added by the model


def mark_experts(module: nn.Module, group, *, first: int, tokens: torch.Tensor | None = None) -> None:
    """Mark ``module``'s parameters as stacked experts: dim 0 is the expert, ``first`` the global index of
    its first local one, ``group`` (a process group or a 1-D DeviceMesh) the expert-data-parallel group
    that averages them; ``tokens`` (optional, ``[E_local]``) the model's count of tokens routed to each."""
    params = list(module.parameters())
    if not params:
        raise ValueError("mark_experts: the module has no parameters")
    count = local_tensor(params[0]).shape[0] if local_tensor(params[0]).dim() else 0
    if count < 1 or any(local_tensor(p).dim() < 2 or local_tensor(p).shape[0] != count for p in params):
        raise ValueError(
            "mark_experts: every parameter of an experts module stacks its experts on dim 0 "
            f"([E_local, …], at least 2-D), got shapes {[tuple(local_tensor(p).shape) for p in params]}"
        )
    if not isinstance(first, int) or first < 0:
        raise ValueError(f"mark_experts: first must be an integer ≥ 0, got {first!r}")
    if tokens is not None and tokens.shape != (count,):
        raise ValueError(f"mark_experts: tokens must have shape ({count},) (one count per local expert)")
    process_group = as_process_group(group)
    initialized = dist.is_available() and dist.is_initialized()
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD)) if initialized else (0,)
    setattr(module, MARK, ExpertMark(first, ranks, tokens))


def _inner(model: nn.Module) -> nn.Module:
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def expert_marks(model: nn.Module | None) -> dict[str, ExpertMark]:
    """Parameter name (as ``model.named_parameters()`` names it, without DDP's ``module.``) → its mark."""
    inner = None if model is None else _inner(model)
    if not isinstance(inner, nn.Module):  # a stand-in that only names parameters marks no expert
        return {}
    marks = {}
    for prefix, module in inner.named_modules():
        mark = getattr(module, MARK, None)
        if mark is not None:
            for name, _ in module.named_parameters():
                marks[f"{prefix}.{name}" if prefix else name] = mark
    return marks


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every marked expert parameter: what the experts' state synchronizes."""
    marks = expert_marks(model)
    return [(name, p) for name, p in _inner(model).named_parameters() if name in marks]


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every other parameter: what the dense state synchronizes."""
    marks = expert_marks(model)
    return [(name, p) for name, p in _inner(model).named_parameters() if name not in marks]


def ignore_experts(module: nn.Module) -> None:
    """Leave the marked experts (and their token counters) out of a DDP built on ``module`` afterwards
    (call before wrapping): DDP averages over the whole data-parallel group, and broadcasts buffers
    from its rank 0; the experts need their own group's state, and each rank counts its own tokens."""
    marks = expert_marks(module)
    counters = {id(mark.tokens) for mark in marks.values() if mark.tokens is not None}
    names = list(marks) + [name for name, buffer in module.named_buffers() if id(buffer) in counters]
    torch_adapter.ddp_ignores(module, names)


def expert_name(name: str, index: int) -> str:
    """The matrix of global expert ``index`` in the stacked parameter ``name``."""
    return f"{name}[{index}]"


class Experts:
    """The stacked expert parameters one state may sync (see the module docstring), held by its
    `edgc.safeguards.guards.UsageGuard`: ``marks`` and ``shapes`` (this rank's stacked shape) by parameter name, and
    ``first``, the global index of the expert of each one's first row (the mark's, or an FSDP shard's
    own: `hold`). ``synced``: those this state was handed; ``counted``: the tokens of each since the
    window began, taken from the model's counters at every step (this rank's, kept with its checkpoint)."""

    def __init__(self, marks: dict[str, ExpertMark], shapes: dict[str, tuple[int, ...]]):
        self.marks = dict(marks)
        self.shapes = {name: tuple(shapes[name]) for name in marks if name in shapes}
        self.first = {name: mark.first for name, mark in marks.items()}
        self.synced: set[str] = set()
        self.counted: dict[str, torch.Tensor] = {}
        self._checked: set[str] = set()

    def __getstate__(self) -> dict:
        """Without the model's token counters (device tensors of this run)."""
        marks = {name: ExpertMark(mark.first, mark.ranks) for name, mark in self.marks.items()}
        return {**self.__dict__, "marks": marks, "_checked": set()}

    def hold(self, name: str, mark: ExpertMark, first: int, shape: tuple[int, ...]) -> None:
        """Sync ``name`` (this rank's rows of shape ``shape``) as experts whose first row is global expert
        ``first``: an FSDP shard of a marked parameter."""
        self.marks[name], self.first[name], self.shapes[name] = mark, first, tuple(shape)

    def expand(self, names: list[str], grads: list[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
        """Each stacked expert gradient replaced by its experts' matrices (views), named `expert_name`."""
        if not self.marks or not any(name in self.marks for name in names):
            return names, grads
        out_names, out_grads = [], []
        for name, grad in zip(names, grads):
            if name not in self.marks:
                out_names.append(name)
                out_grads.append(grad)
                continue
            self.synced.add(name)
            first = self.first[name]
            out_names += [expert_name(name, first + i) for i in range(grad.shape[0])]
            out_grads += list(grad.unbind(0))
        return out_names, out_grads

    def check_group(self, state_name: str, names: Iterable[str], ranks) -> None:
        """Refuse, in one line, an expert parameter handed to a state on another group than its own
        (``ranks()``: the state's global ranks, asked only when a name is new)."""
        for name in names:
            if name in self._checked or name not in self.marks:
                continue
            mark, group = self.marks[name], list(ranks())
            if list(mark.ranks) != group:
                raise RuntimeError(
                    f"{state_name}: {name} holds experts averaged over their expert-data-parallel group, "
                    f"global ranks {list(mark.ranks)}, but this state averages over {group}: sync the "
                    "experts with a state of their own on that group (and leave them out of this one: "
                    "edgc.distributed.experts.dense_parameters, ignore_experts)"
                )
            self._checked.add(name)

    def agreed(self, ranks: list[int]) -> dict[str, list]:
        """What every rank of a group of global ``ranks`` must hold alike: each stacked parameter marked
        for that group, and its first expert (ranks holding other experts are not each other's replicas)."""
        held = sorted((name, self.first[name]) for name, mark in self.marks.items() if list(mark.ranks) == ranks)
        return {"experts held": held} if held else {}

    def matrix_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``shapes`` (parameter name → shape) with each expert's matrix beside its stacked parameter."""
        out = dict(shapes)
        for matrices in self.groups().values():
            out.update(matrices)
        return out

    def groups(self) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
        """Stacked parameter → (matrix name, its shape) of each of its experts: the matrices a rank split
        shares one rank budget among."""
        return {
            name: [(expert_name(name, self.first[name] + i), shape[1:]) for i in range(shape[0])]
            for name, shape in self.shapes.items()
        }

    def count_tokens(self) -> None:
        """Add the model's counters of the experts this state syncs to ``counted`` and reset them (device
        adds, no host read, no collective): at every step, after the forward that counted them."""
        counters = {}
        for name in sorted(self.synced):
            tokens = self.marks[name].tokens
            if tokens is None:
                continue
            start = self.first[name] - self.marks[name].first
            rows = tokens.detach()[start : start + self.shapes[name][0]].to(torch.float64)
            kept = self.counted.get(name)
            if kept is None or kept.device != rows.device:  # the first step, or the first after a load
                kept = self.counted[name] = torch.zeros_like(rows) if kept is None else to_device(kept, rows.device)
            kept += rows
            counters[id(tokens)] = tokens
        for tokens in counters.values():
            tokens.zero_()

    def take_tokens(self, comm) -> dict[str, float]:
        """Matrix name → the tokens routed to its expert since the last call, summed over ``comm``'s group
        (integer counts in float64: exact, the same on every rank), ``counted`` reset. Collective over
        the group (one all-reduce, not the step's traffic); nothing without counters."""
        names = sorted(self.counted)
        if not names:
            return {}
        summed = torch.cat([self.counted[name] for name in names])
        if comm.issues and comm.world_size > 1:
            issued_before = comm.mark()
            comm.all_reduce(summed)
            comm.forget_since(*issued_before)
        values, out = to_host(summed), {}
        for name in names:
            count = self.counted[name].numel()
            out.update({expert_name(name, self.first[name] + i): values[i] for i in range(count)})
            values = values[count:]
            self.counted[name].zero_()
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tokens counted since the window began, by parameter name."""
        return {name: counted.detach().cpu().clone() for name, counted in self.counted.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], device: torch.device | None) -> None:
        self.counted = {
            name: to_device(counted.to(torch.float64), device or "cpu")
            for name, counted in state.items()
            if name in self.marks
        }
