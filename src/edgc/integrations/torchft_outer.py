"""A registered sync method (`edgc.sync_methods`) as the outer sync of torchft's DiLoCo
(`edgc.integrations.torchft.DiLoCo` with ``sync_method=``).

`managed_sync_state` builds the method's state with torchft's side added (`ManagedOuterSync`):

* every collective through the manager (`ManagedCommunicator`; an all-gather is an all-reduce of
  one slot per participant), so a failure is the manager's to report and nothing hangs;
* the step waits for the manager's verdict: committed, the residual is kept; not committed, the
  error feedback is as before the step and DiLoCo carries the step's pseudo-gradient into the next
  one (nothing is lost);
* heal: the shared part (the outer step count) is registered with the manager; a healed replica
  keeps its own error feedback, which is none after a restart (measured against a peer's copy by
  `edgc experiment diloco`, ``+heal=peer``).
"""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..reducer import GradientReducer
from ..sync_methods import sync_method
from .torchft import ManagedCommunicator, _commit_with


class ManagedOuterSync:
    """Mixin before a sync method's class: its state on a torchft replica group (see the module docstring)."""

    def attach(self, manager, state_key: str) -> None:
        self.comm = ManagedCommunicator(manager)  # type: ignore[assignment]
        self.defer_commit = True
        self.steps_discarded = 0  # outer steps whose sync ran but which the manager did not commit
        self.heals = 0  # times the shared state came from a peer
        manager.register_state_dict_fn(state_key, self._heal, self.shared_state_dict)
        _commit_with(manager, self)  # type: ignore[arg-type]

    def finish_step(self, committed: bool) -> None:
        """The manager's verdict on the pending step."""
        if not self.pending:  # type: ignore[attr-defined]
            return
        if committed:
            self.commit_step()  # type: ignore[attr-defined]
        else:
            self.steps_discarded += 1
            self.rollback_step()  # type: ignore[attr-defined]

    def shared_state_dict(self) -> dict:
        """What every replica holds alike: the outer step count."""
        return {"step": self.step}  # type: ignore[attr-defined]

    def _heal(self, state: dict) -> None:
        self.step = int(state["step"])
        self.heals += 1


def managed_sync_state(name: str, manager, model: nn.Module, state_key: str) -> GradientReducer:
    """The registered sync method ``name``'s state for one torchft replica group."""
    entry = sync_method(name)
    if entry is None:
        raise ValueError(f"sync method {name!r} is not registered")
    managed = type(f"Managed{entry.reducer.__name__}", (ManagedOuterSync, entry.reducer), {})
    state = replace(entry, reducer=managed).build(None, model=model)
    state.attach(manager, state_key)  # type: ignore[attr-defined]
    return state
