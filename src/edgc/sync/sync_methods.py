"""The registry of sync methods: the compressors `edgc train`, `edgc bench` and `edgc simulate` know by name.

Each entry is a `GradientReducer` subclass registered under its ``method`` attribute (or under a
name of its own for a variant of one class, as the two casts), with what is known of the method
itself: the constructor arguments the name fixes, and which kind of collective one call issues,
which is what its wire costs as the group grows (the simulator prices each kind):

* ``ALL_REDUCE``: the payload in one all-reduce, 2 (N − 1)/N × its bytes per rank on a ring;
* ``ALL_GATHER``: every rank receives every other rank's message, (N − 1) × its bytes per rank (twice
  that through torchft's manager, an all-reduce of one slot per replica group): grows with N;
* ``TWO_STAGE``: `edgc.sync.two_stage`'s compressed all-reduce, an all-to-all of encoded chunks, a
  reduction by each chunk's owner, an all-gather of the re-encoded chunks: 2 (N − 1)/N × the
  encoded bytes per rank, flat in N. A new codec is a `edgc.sync.two_stage.TwoStageReducer` subclass
  (its docstring has the codec's contract) registered with this kind.

What a tool adds to it stays beside the tool: the run settings the harness hands a constructor
that takes them (`SyncMethod.build`), the memory traffic the simulator's step model prices
(``edgc_sim.step_model``).

A new compressor is one file (its class) and one `register_sync_method` call.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..registry import Registry
from ..runner.reducer import GradientReducer
from .baselines import CastState, QSGDState, RandomKState, TopKState
from .outer_alloc import AllocatedQuantState
from .outer_sparse import AllocatedSparseState, SparseQuantState
from .outer_sync import QuantizedState
from .two_stage import TwoStageQuantState

ALL_REDUCE, ALL_GATHER, TWO_STAGE = "all-reduce", "all-gather", "two-stage"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, TWO_STAGE)


@dataclass(frozen=True)
class SyncMethod:
    """One registered sync method (see the module docstring)."""

    name: str  #: the name the tools know it by (``--compressor``, a bench method)
    reducer: type[GradientReducer]  #: the class; constructed as reducer(process_group, model=…, **arguments)
    collective: str = ALL_REDUCE  #: what one call issues: ALL_REDUCE, ALL_GATHER or TWO_STAGE
    options: Mapping[str, Any] = field(default_factory=dict)  #: constructor arguments the name fixes

    def takes(self, setting: str) -> bool:
        """Whether its constructor takes the run setting ``setting`` (e.g. ``ratio``) and the name leaves it open."""
        return setting in inspect.signature(self.reducer).parameters and setting not in self.options

    def build(self, process_group=None, *, model: nn.Module | None = None, **settings: Any) -> GradientReducer:
        """The reducer for a run: ``settings`` (a run's ``ratio``, ``seed``, …) are passed where it `takes` them."""
        given = {name: value for name, value in settings.items() if self.takes(name)}
        return self.reducer(process_group, model=model, **self.options, **given)


SYNC_METHODS: Registry[SyncMethod] = Registry("sync method")


def register_sync_method(
    reducer: type[GradientReducer],
    *,
    name: str | None = None,
    collective: str = ALL_REDUCE,
    options: Mapping[str, Any] | None = None,
) -> SyncMethod:
    """Make a sync method known to the tools by name.

    Args:
        reducer: the method, a `GradientReducer` subclass.
        name: its name (default: its ``method`` attribute).
        collective: what one call issues: ``ALL_REDUCE``, ``ALL_GATHER`` or ``TWO_STAGE``.
        options: constructor arguments the name fixes.

    Returns:
        The registered `SyncMethod`.

    Raises:
        ValueError: not a `GradientReducer` subclass, an unknown collective, or a name empty or taken.
    """
    name = name or getattr(reducer, "method", "")
    if not (isinstance(reducer, type) and issubclass(reducer, GradientReducer)):
        raise ValueError(f"a sync method is a GradientReducer subclass, got {reducer!r}")
    if collective not in COLLECTIVES:
        raise ValueError(
            f"sync method {name!r}: collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}"
        )
    return SYNC_METHODS.add(name, SyncMethod(name, reducer, collective, dict(options or {})))


def sync_method_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return SYNC_METHODS.names()


def sync_method(name: str) -> SyncMethod | None:
    """The entry registered as ``name``, or None (the tools' own modes, as ``edgc`` or ``none``)."""
    return SYNC_METHODS.get(name)


# DiLoCo's outer sync named with what goes with it: "-noef" (no error feedback), "-decay<f>" (the error
# feedback multiplied by f before every sync), "-mom<f>" and "-lr<f>" (the outer SGD's momentum and rate)
OUTER_MODIFIERS = {"noef": "decay", "decay": "decay", "mom": "outer_momentum", "lr": "outer_lr"}


def outer_modifiers(modifiers: list[str], name: str) -> dict[str, float]:
    """{decay, outer_momentum, outer_lr: value} of the ``modifiers`` of ``name`` (see OUTER_MODIFIERS);
    ValueError for an unknown or repeated one."""
    fields: dict[str, float] = {}
    for modifier in modifiers:
        found = re.fullmatch(r"(noef)|(decay|mom|lr)(\d+(?:\.\d+)?)", modifier)
        if found is None:
            raise ValueError(f"unknown method {name!r}: modifier {modifier!r}")
        field = OUTER_MODIFIERS[found.group(1) or found.group(2)]
        if field in fields:
            raise ValueError(f"{name!r}: {field} given twice")
        fields[field] = 0.0 if found.group(1) else float(found.group(3))
    return fields


def outer_sync_spec(spec: str) -> dict:
    """``"sparse64-decay0.95-mom0-lr1"`` → ``{"sync": "sparse64", "decay": 0.95, "outer_momentum": 0.0,
    "outer_lr": 1.0}``: a registered method's name (the longest that starts ``spec``: a name may hold a
    dash) and its modifiers; ValueError for an unknown one."""
    parts = spec.split("-")
    for cut in range(len(parts), 0, -1):
        name = "-".join(parts[:cut])
        if sync_method(name) is not None:
            return {"sync": name, **outer_modifiers(parts[cut:], spec)}
    raise ValueError(f"unknown method {spec!r} (registered: {', '.join(sync_method_names())})")


register_sync_method(CastState, name="fp16", options={"dtype": "float16"})
register_sync_method(CastState, name="bf16", options={"dtype": "bfloat16"})
register_sync_method(TopKState, collective=ALL_GATHER)
register_sync_method(RandomKState)
register_sync_method(QSGDState, collective=ALL_GATHER)
# DiLoCo's outer sync (`edgc.sync.outer_sync`): the pseudo-gradients quantised with error feedback.
for _bits in (8, 4, 3, 2):
    register_sync_method(QuantizedState, name=f"quant{_bits}", collective=ALL_GATHER, options={"bits": _bits})
# … with the bits chosen per tensor where they remove the most error, 3 bits per value on average
register_sync_method(AllocatedQuantState, name="alloc3", collective=ALL_GATHER, options={"bits": 3.0})
# top-k at 5 % of the values (fp32 value + int32 index each: 0.10× the bytes), error feedback
register_sync_method(TopKState, name="topk5", collective=ALL_GATHER, options={"ratio": 0.05})
# chunked top-k with coded indices and 2-bit values (`edgc.sync.outer_sparse`), error feedback: 64 and 128
# values of each 4096 (0.0068× and 0.013× the bytes); and the density chosen per tensor by measured
# error per byte within the bytes of 64 of 4096
register_sync_method(SparseQuantState, name="sparse64", collective=ALL_GATHER, options={"density": 64 / 4096})
register_sync_method(SparseQuantState, name="sparse128", collective=ALL_GATHER, options={"density": 128 / 4096})
register_sync_method(AllocatedSparseState, name="sparse64a", collective=ALL_GATHER, options={"density": 64 / 4096})
# sparse128 as SparseLoCo's code averages: each sent value over the replicas that sent it (not over all),
# in flat chunks and in its 64 × 64 tiles
register_sync_method(
    SparseQuantState,
    name="sparse128-senders",
    collective=ALL_GATHER,
    options={"density": 128 / 4096, "aggregate": "senders"},
)
register_sync_method(
    SparseQuantState,
    name="sparse128-tiles",
    collective=ALL_GATHER,
    options={"density": 128 / 4096, "aggregate": "senders", "tile": 64},
)
# quant<b>'s codes through the two-stage all-reduce (`edgc.sync.two_stage`): the wire flat in the groups
for _bits in (8, 4, 3, 2):
    register_sync_method(TwoStageQuantState, name=f"quant{_bits}-2s", collective=TWO_STAGE, options={"bits": _bits})
