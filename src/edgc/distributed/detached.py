"""What an unpickled gradient-sync state holds in place of its `Communicator`.

A pickle (``torch.save(state)``, ``copy.deepcopy``) cannot carry what ties a state to its training
run: the process group, a live connection, and which tensors are which parameters, known by
``id(p)``, which means nothing in another process (where a new tensor may even reuse an old id, and
would silently get another parameter's error feedback). So the unpickled state keeps all its data,
and its ``state_dict()`` still works, but it refuses its first step with one line that names the
supported way: ``state_dict()``, then ``load_state_dict()`` into a state built with ``model=``.
Refusing at the step rather than in ``torch.load`` keeps the rest of a checkpoint (model,
optimizer) loadable, and this state's data recoverable.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..device.totals import StepTotals


class DetachedCommunicator:
    """Rank and world size of the pickled state (its ``state_dict()`` records them); anything else
    a step would use (collectives, the group) raises the refusal."""

    def __init__(self, state_name: str, rank: int, world_size: int):
        self.state_name, self.rank, self.world_size = state_name, rank, world_size

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "state_name":  # pickle and copy probe dunders; not yet set
            raise AttributeError(name)
        raise RuntimeError(
            f"this {self.state_name} was restored from a pickle, which cannot carry its process group or which "
            f"tensors are its parameters (their error feedback would be lost): save state.state_dict() instead "
            f"and restore it with load_state_dict() into a new {self.state_name}(..., model=ddp_model); "
            "this one's state_dict() still holds everything"
        )


def detached_fields(fields: dict, state_name: str, comm, last: Any) -> dict:
    """What a gradient-sync state called ``state_name`` pickles: its ``fields`` (its ``__dict__``, its last
    step settled locally), with a `DetachedCommunicator` in place of its ``comm``, no step in progress, and
    ``last``, its last step (a `StepRecord` or None), without the events and streams that tie it to this
    run: its metrics and pending snapshot travel."""
    return {
        **fields,
        "comm": DetachedCommunicator(state_name, comm.rank, comm.world_size),
        "_current": None,
        "_last": None
        if last is None
        else dataclasses.replace(last, totals=StepTotals(), collectives=None, busy=[], job_values={}),
    }
