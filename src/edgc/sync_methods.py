"""The registry of sync methods: the compressors `edgc train`, `edgc bench` and `edgc simulate` know by name.

Each entry is a `GradientReducer` subclass registered under its ``method`` attribute (or under a
name of its own for a variant of one class, as the two casts), with what the tools need to know
of it:

* how the harness builds it from a run's settings: which of them its constructor takes
  (``ratio``, the fraction of the elements it sends, ``--compress-ratio``; ``seed``) and which
  arguments the name fixes;
* which collective one call issues (the simulator prices an all-gather, where every rank receives
  every other rank's message, differently from an all-reduce);
* how many bytes of device memory its compression moves per gradient value, where the simulator's
  step model prices it (None: not modelled, the measured time is used).

A new compressor is one file (its class) and one `register_sync_method` call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import nn

from .baselines import CastState, QSGDState, RandomKState, TopKState
from .outer_alloc import AllocatedQuantState
from .outer_sync import QuantizedState
from .reducer import GradientReducer

ALL_REDUCE, ALL_GATHER = "all-reduce", "all-gather"
RUN_SETTINGS = ("ratio", "seed")  # what a run can hand a method's constructor


@dataclass(frozen=True)
class SyncMethod:
    """One registered sync method (see the module docstring)."""

    name: str  #: the name the tools know it by (``--compressor``, a bench method)
    reducer: type[GradientReducer]  #: the class; constructed as reducer(process_group, model=…, **arguments)
    collective: str = ALL_REDUCE  #: what one call issues: ALL_REDUCE or ALL_GATHER
    settings: tuple[str, ...] = ()  #: the run settings its constructor takes, of RUN_SETTINGS
    options: Mapping[str, Any] = field(default_factory=dict)  #: constructor arguments the name fixes
    compress_bytes_per_value: float | None = None  #: memory moved by compress + decompress per value; None = unmodelled

    def build(self, process_group=None, *, model: nn.Module | None = None, ratio: float = 0.01,
              seed: int = 714) -> GradientReducer:
        """The reducer for a run whose settings are ``ratio`` and ``seed`` (each passed only if it takes it)."""
        given = {"ratio": ratio, "seed": seed}
        return self.reducer(process_group, model=model, **self.options, **{name: given[name] for name in self.settings})


SYNC_METHODS: dict[str, SyncMethod] = {}


def register_sync_method(reducer: type[GradientReducer], *, name: str | None = None, collective: str = ALL_REDUCE,
                         settings: tuple[str, ...] = (), options: Mapping[str, Any] | None = None,
                         compress_bytes_per_value: float | None = None) -> SyncMethod:
    """Make ``reducer`` known to the tools under ``name`` (default: its ``method`` attribute)."""
    name = name or getattr(reducer, "method", "")
    if not (isinstance(reducer, type) and issubclass(reducer, GradientReducer)):
        raise ValueError(f"a sync method is a GradientReducer subclass, got {reducer!r}")
    if not name or name in SYNC_METHODS:
        raise ValueError(f"sync method name {name!r} is empty or already registered")
    if collective not in (ALL_REDUCE, ALL_GATHER) or not set(settings) <= set(RUN_SETTINGS):
        raise ValueError(f"sync method {name!r}: collective must be {ALL_REDUCE} or {ALL_GATHER} and settings "
                         f"a subset of {RUN_SETTINGS}, got {collective!r} and {settings!r}")
    entry = SyncMethod(name, reducer, collective, tuple(settings), dict(options or {}), compress_bytes_per_value)
    SYNC_METHODS[name] = entry
    return entry


def sync_method_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(SYNC_METHODS)


def sync_method(name: str) -> SyncMethod | None:
    """The entry registered as ``name``, or None (the tools' own modes, as ``edgc`` or ``none``)."""
    return SYNC_METHODS.get(name)


# A cast reads fp32 and writes 16 bits, and after the all-reduce reads them and writes fp32 back.
CAST_BYTES_PER_VALUE = 4 + 2 + 2 + 4
register_sync_method(CastState, name="fp16", options={"dtype": "float16"}, compress_bytes_per_value=CAST_BYTES_PER_VALUE)
register_sync_method(CastState, name="bf16", options={"dtype": "bfloat16"}, compress_bytes_per_value=CAST_BYTES_PER_VALUE)
register_sync_method(TopKState, collective=ALL_GATHER, settings=("ratio",))
register_sync_method(RandomKState, settings=("ratio", "seed"))
register_sync_method(QSGDState, collective=ALL_GATHER, settings=("seed",))
# DiLoCo's outer sync (`edgc.outer_sync`): the pseudo-gradients quantised with error feedback.
for _bits in (8, 4, 3, 2):
    register_sync_method(QuantizedState, name=f"quant{_bits}", collective=ALL_GATHER, options={"bits": _bits})
# … with the bits chosen per tensor where they remove the most error, 3 bits per value on average
register_sync_method(AllocatedQuantState, name="alloc3", collective=ALL_GATHER, options={"bits": 3.0})
# top-k at 5 % of the values (fp32 value + int32 index each: 0.10× the bytes), error feedback
register_sync_method(TopKState, name="topk5", collective=ALL_GATHER, options={"ratio": 0.05})
