"""What one state does with the stacked experts it syncs (`edgc.distributed.experts` says which parameters those are).

A state handed an expert parameter:

* **splits it by expert**: ``grad[i]`` is the matrix of global expert ``first + i``, named
  ``name[first + i]`` (its error feedback, Q and rank are its own), a view of the gradient, so its
  average lands in place;
* **scales it** by ``1/ep`` first (`edgc.distributed.scaling`, the one place gradients are scaled);
* **refuses it on another group** than its own, in one line, before anything is sent: a marked one on
  another group than the one it was marked with, a found one on a group that holds two of its EP ranks,
  one split over ranks no one named on any (a dense state handed experts would average different
  experts together);
* **agrees on it**: which experts it holds, and their scale, join the settings its group compares at the
  first step (`edgc.distributed.agreement`), so a group whose ranks hold different experts is refused there;
* **counts its tokens** for a rank split by tokens (`edgc.distributed.expert_tokens`, `edgc.policies.rank_split`);
* **resumes at another ep** where it can: a checkpoint that holds every expert this rank now holds (saved
  at a smaller ep) continues, the experts' Q by global index; one that lacks some is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from .expert_tokens import ExpertTokens
from .experts import ExpertMark, expert_name
from .mesh import local_tensor

__all__ = ["Experts"]


class Experts:
    """The stacked expert parameters one state may sync (see the module docstring), held by its
    `edgc.safeguards.guards.UsageGuard`: ``marks`` and ``shapes`` (this rank's stacked shape) by parameter name, and
    ``first``, the global index of the expert of each one's first row (the mark's, or an FSDP shard's
    own: `hold`). ``synced``: those this state was handed; ``tokens``: what it counted of them."""

    def __init__(self, marks: dict[str, ExpertMark], shapes: dict[str, tuple[int, ...]]):
        self.marks = dict(marks)
        self.shapes = {name: tuple(shapes[name]) for name in marks if name in shapes}
        self.first = {name: mark.first for name, mark in marks.items()}
        self.synced: set[str] = set()
        self.tokens = ExpertTokens()
        self._checked: set[str] = set()

    def __getstate__(self) -> dict:
        """Without the model's token counters (device tensors of this run)."""
        marks = {name: replace(mark, tokens=None) for name, mark in self.marks.items()}
        return {**self.__dict__, "marks": marks, "_checked": set()}

    @property
    def ep(self) -> dict[str, int]:
        """Parameter name → the ep its experts are split over (`edgc.distributed.scaling`)."""
        return {name: mark.ep for name, mark in self.marks.items()}

    def is_matrix(self, name: str) -> bool:
        """Whether ``name`` is one expert's matrix of a stacked parameter this state knows (`expert_name`)."""
        return name.endswith("]") and name.rsplit("[", 1)[0] in self.marks

    def hold(self, name: str, mark: ExpertMark, first: int, shape: tuple[int, ...]) -> None:
        """Sync ``name`` (this rank's rows of shape ``shape``) as experts whose first row is global expert
        ``first``: an FSDP shard of an experts parameter."""
        self.marks[name], self.first[name], self.shapes[name] = mark, first, tuple(shape)

    def watch(self, model) -> None:
        """Read the token counters of the experts at the first forward of each step through ``model``."""
        counters = {id(m.tokens): local_tensor(m.tokens) for m in self.marks.values() if m.tokens is not None}
        self.tokens.watch(model, list(counters.values()))

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
        """Refuse, in one line, an expert parameter handed to a state that cannot average it (the module
        docstring; ``ranks()``: the state's global ranks, asked only when a name is new)."""
        for name in names:
            if name in self._checked or name not in self.marks:
                continue
            mark, group = self.marks[name], list(ranks())
            if mark.unknown is not None:
                raise RuntimeError(
                    f"{state_name}: {name} {mark.unknown}: say its expert-data-parallel group with "
                    "edgc.distributed.experts.mark_experts(module, group, first=…, ep=…)"
                )
            if mark.ranks is not None and list(mark.ranks) != group:
                raise RuntimeError(
                    f"{state_name}: {name} holds experts averaged over their expert-data-parallel group, "
                    f"global ranks {list(mark.ranks)}, but this state averages over {group}: sync the "
                    "experts with a state of their own on that group (and leave them out of this one: "
                    "edgc.distributed.experts.dense_parameters, ignore_experts)"
                )
            if mark.ranks is None and mark.ep_ranks is not None and len(set(group) & set(mark.ep_ranks)) > 1:
                raise RuntimeError(
                    f"{state_name}: {name} holds experts split over the expert-parallel ranks {list(mark.ep_ranks)} "
                    f"(a DTensor sharded on dim 0 over an expert mesh dimension), but this state averages over "
                    f"{group}, which holds other experts of it: sync it with a state on its expert-data-parallel "
                    "group (and leave it out of this one: edgc.distributed.experts.dense_parameters, ignore_experts)"
                )
            self._checked.add(name)

    def held(self, ranks: list[int]) -> dict[str, int]:
        """Stacked parameter → its experts' ep, of those this state averages over the group of global
        ``ranks``: marked for it, or found and handed to it."""
        return {
            name: mark.ep
            for name, mark in self.marks.items()
            if (mark.ranks is not None and list(mark.ranks) == ranks) or (mark.ranks is None and name in self._checked)
        }

    def agreed(self, ranks: list[int]) -> dict[str, list]:
        """What every rank of a group of global ``ranks`` must hold alike: each stacked parameter it averages,
        and its first expert (ranks holding other experts are not each other's replicas)."""
        held = sorted((name, self.first[name]) for name in self.held(ranks))
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
        """Add this step's tokens of the experts this state syncs (`edgc.distributed.expert_tokens.ExpertTokens.count`):
        at every step, after the forward that counted them."""
        rows = {}
        for name in self.synced:
            mark = self.marks[name]
            if mark.tokens is None or name not in self.shapes:
                continue
            counter = local_tensor(mark.tokens)
            per_local = counter.shape[0] == mark.count  # else one count per global expert
            start = self.first[name] - (mark.first if per_local else 0)
            rows[name] = (counter, start, self.shapes[name][0])
        self.tokens.count(rows)

    def take_tokens(self, comm) -> dict[str, float]:
        """Matrix name → the mean tokens per step routed to its expert in the window, summed over ``comm``'s
        group (`edgc.distributed.expert_tokens.ExpertTokens.take`). Collective over the group."""
        return self.tokens.take(comm, self.first, expert_name)

    def restricted(self, compressor: dict) -> dict:
        """A checkpoint's compressor state (Q and error feedback by matrix name) for the experts this rank
        holds: a checkpoint saved at a smaller ep holds more, and continues with those of this rank; one
        that lacks some of them (saved at a larger ep) is refused in one line."""
        kinds = [kind for kind in ("q", "error", "shapes") if isinstance(compressor.get(kind, {}), dict)]
        kept = {kind: dict(compressor.get(kind, {})) for kind in kinds}
        for name, matrices in self.groups().items():
            mine = {matrix for matrix, _ in matrices}
            saved = {key for key in kept.get("q", {}) if key.startswith(f"{name}[") and key.endswith("]")}
            if not saved or saved == mine:
                continue
            if not mine <= saved:
                raise ValueError(
                    f"EDGC state: the checkpoint holds experts {_indices(saved)} of {name} and this rank "
                    f"{_indices(mine)}: it was saved at a larger expert parallelism, whose other experts are in "
                    "other ranks' checkpoints; resume at its ep (or a smaller one)"
                )
            for kind in kept:
                kept[kind] = {key: value for key, value in kept[kind].items() if key not in saved - mine}
        return {**compressor, **kept}

    def state_dict(self) -> dict:
        return self.tokens.state_dict()

    def load_state_dict(self, state: dict, device: torch.device | None) -> None:
        self.tokens.load_state_dict(state, set(self.marks), device)


def _indices(matrices: set[str]) -> str:
    values = sorted(int(name.rsplit("[", 1)[1][:-1]) for name in matrices)
    return f"[{values[0]}–{values[-1]}]" if values == list(range(values[0], values[-1] + 1)) else str(values)
