"""The tokens routed to each expert a state syncs: read from the model's counters, never written.

A model counts the tokens its router sends to each expert in a tensor of its own (the *counter*), and
may reset it when it likes: torchtitan's ``tokens_per_expert_E`` drives its auxiliary-loss-free load
balancing, which reads and zeroes it in an optimizer pre-hook. edgc owns its counts: it reads the
counter and keeps what it read, and never changes it.

* **What a step counted** is the counter's value at the sync minus its value at the first training
  forward of the step (the model in training mode, gradients on: taken by a forward pre-hook on the
  model, `watch`), so gradient accumulation's forwards all count, a reset between steps is seen as one,
  and an evaluation between steps (which may come before the model's reset) moves nothing. Where no
  forward ran through the model the state watches, the value at the last sync stands in. (With
  activation checkpointing a recomputed forward counts again, as it does for torchtitan's balancing:
  the split's proportions are unchanged.)
* **Which counter** (``mark_experts(..., tokens=)``, or a found experts module's nearest counter,
  `edgc.distributed.experts`): a counter *per local expert* (``[E_local]``, the tokens this rank's experts
  processed, every expert-parallel peer's included) is summed over the state's group, the expert's
  replicas: every token the expert saw. A counter *per global expert* (``[E]``, this rank's routing
  decisions for every expert, torchtitan's) is read at the rows of the experts the state syncs and
  summed over the same group: the tokens of that group's own batches, a sample of the global batch
  (``1/ep`` of it). A rank split reads proportions, which either gives.
* **Per window**: the counts of each step are added on the device (no host read) and summed over the
  group once per window (`take`), as per-step means: what `edgc.policies.rank_split` shares the rank by.
"""

from __future__ import annotations

import torch
from torch import nn

from ..device.timing import to_device, to_host

__all__ = ["ExpertTokens"]


class ExpertTokens:
    """The window's tokens of each stacked experts parameter a state syncs (see the module docstring).
    ``counted``: name → float64 ``[rows]``, this rank's, kept with its checkpoint; ``steps``: steps counted."""

    def __init__(self):
        self.counted: dict[str, torch.Tensor] = {}
        self.steps = 0
        self._base: dict[int, torch.Tensor] = {}  # id(counter) → its value at the step's first forward
        self._counters: dict[int, torch.Tensor] = {}
        self._open = False  # a forward ran since the last count
        self._hook = None

    def __getstate__(self) -> dict:
        """Without the model's counters and the hook (this run's)."""
        return {"counted": self.counted, "steps": self.steps}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        self.counted, self.steps = state["counted"], state["steps"]

    def watch(self, model: nn.Module | None, counters: list[torch.Tensor]) -> None:
        """Read ``counters`` at the first forward of each step through ``model`` (a forward pre-hook)."""
        self._counters = {id(c): c for c in counters}
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if model is not None and counters:
            self._hook = model.register_forward_pre_hook(lambda module, _: self._step_begins(module))

    def _step_begins(self, model: nn.Module) -> None:
        # A training forward only: an evaluation between steps may come before the model's own reset
        if self._open or not self._counters or not (model.training and torch.is_grad_enabled()):
            return
        self._open = True
        self._snapshot()

    def _snapshot(self) -> None:
        counters = list(self._counters.values())
        if any(self._base.get(key) is None or self._base[key].device != c.device for key, c in self._counters.items()):
            self._base = {key: c.detach().clone() for key, c in self._counters.items()}
        elif counters:
            torch._foreach_copy_([self._base[key] for key in self._counters], [c.detach() for c in counters])

    def count(self, rows: dict[str, tuple[torch.Tensor, int, int]]) -> None:
        """Add this step's tokens (``rows``: parameter name → (its counter, first row, rows)) to ``counted``:
        device adds, no host read, no collective, the counters untouched. At every step's sync."""
        if not rows:
            return
        for counter, _, _ in rows.values():  # a state that watches no model reads them at its syncs alone
            self._counters.setdefault(id(counter), counter)
        if any(id(counter) not in self._base for counter, _, _ in rows.values()):
            # the first step without a forward through the watched model: everything counted so far
            self._base = {key: torch.zeros_like(c.detach()) for key, c in self._counters.items()}
        names = sorted(rows)
        for name in names:
            counter = rows[name][0]
            kept = self.counted.get(name)
            if kept is None or kept.device != counter.device:
                self.counted[name] = (
                    torch.zeros(rows[name][2], dtype=torch.float64, device=counter.device)
                    if kept is None
                    else to_device(kept, counter.device)
                )
        now = [rows[n][0].detach()[rows[n][1] : rows[n][1] + rows[n][2]] for n in names]
        before = [self._base[id(rows[n][0])][rows[n][1] : rows[n][1] + rows[n][2]] for n in names]
        deltas = torch._foreach_sub(now, before)
        torch._foreach_clamp_min_(deltas, 0)  # a counter the model reset in the middle of a step counts from zero
        torch._foreach_add_([self.counted[n] for n in names], deltas)
        self.steps += 1
        self._snapshot()  # where no forward runs through the watched model, the next step counts from here
        self._open = False

    def take(self, comm, first: dict[str, int], name_of) -> dict[str, float]:
        """Matrix name (``name_of(parameter, global index)``) → the mean tokens per step routed to its expert
        since the last call, summed over ``comm``'s group (exact integer sums in float64, the same on every
        rank); ``counted`` reset. Collective over the group (one all-reduce, not the step's traffic)."""
        names = sorted(self.counted)
        if not names:
            return {}
        summed = torch.cat([self.counted[name] for name in names] + [self.counted[names[0]].new_full((1,), self.steps)])
        if comm.issues and comm.world_size > 1:
            issued_before = comm.mark()
            comm.all_reduce(summed)
            comm.forget_since(*issued_before)
        values, out = to_host(summed), {}
        steps = max(1.0, values[-1] / max(1, comm.world_size if comm.issues else 1))
        for name in names:
            count = self.counted[name].numel()
            out.update({name_of(name, first[name] + i): values[i] / steps for i in range(count)})
            values = values[count:]
            self.counted[name].zero_()
        self.steps = 0
        return out

    def state_dict(self) -> dict:
        """This rank's tokens counted since the window began, by parameter name, and the steps counted."""
        return {"counted": {name: c.detach().cpu().clone() for name, c in self.counted.items()}, "steps": self.steps}

    def load_state_dict(self, state: dict, held: set[str], device: torch.device | None) -> None:
        counted = state.get("counted", state) if isinstance(state, dict) else {}
        self.counted = {
            name: to_device(c.to(torch.float64), device or "cpu")
            for name, c in counted.items()
            if name in held and isinstance(c, torch.Tensor)
        }
        self.steps = int(state.get("steps", 0)) if isinstance(state.get("steps", 0), int) else 0
