"""What an `EDGCState` checkpoint holds, and the checks a loaded one passes before anything changes.

``state_dict()`` is a plain dict keyed by parameter name (never by DDP bucket index): ``format``
(`STATE_FORMAT`), ``step``, ``totals``, ``world_size``, ``rank``, ``config`` (`EDGCConfig.to_dict`),
``controller``, ``sampler``, ``compressor`` (Q, error feedback, shapes, the group's orthonormalisation:
`edgc.engine.orthonormal_choice`), ``profiler`` (the shadow
engine's) and ``profile_seconds``, ``relative_errors``. `check_loadable` validates all of it first,
so that a bad checkpoint raises ValueError and leaves the state as it was.
"""

from __future__ import annotations

import math

import torch

from ..config import EDGCConfig
from ..engine.factors import ORTHONORMALIZATIONS
from .entropy import EntropySampler
from .profiling import profile_seconds
from .rank_control import WindowController

STATE_FORMAT = "edgc-state/1"
COMPRESSOR_KEYS = {"q", "error", "shapes", "orthonormalization"}
REQUIRED = (
    "step",
    "totals",
    "world_size",
    "config",
    "controller",
    "sampler",
    "compressor",
    "profiler",
    "profile_seconds",
)


def check_loadable(state: dict, config: EDGCConfig, follower: bool, parameter_shapes: dict) -> None:
    """Raise ValueError unless ``state`` loads into a state of ``config`` (a pipeline ``follower`` or
    not) whose model has ``parameter_shapes`` (empty: no model given, shapes unchecked)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"not an EDGC state (expected format {STATE_FORMAT!r})")
    missing = [key for key in REQUIRED if key not in state]
    if missing:
        raise ValueError(f"corrupt EDGC state: missing {missing}")
    try:
        WindowController(config, follower=follower).load_state_dict(state["controller"])
        EntropySampler(config).load_state_dict(state["sampler"])
        profile_seconds(state["profile_seconds"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"corrupt EDGC state: {exc!r}") from exc
    compressor = state["compressor"]
    if not isinstance(compressor, dict) or not {"q", "error"} <= set(compressor) <= COMPRESSOR_KEYS:
        raise ValueError(
            "corrupt EDGC state: compressor must hold 'q' and 'error' (and optionally 'shapes', 'orthonormalization')"
        )
    method = compressor.get("orthonormalization")
    if method is not None and method not in ORTHONORMALIZATIONS:
        raise ValueError(f"corrupt EDGC state: orthonormalization must be one of {ORTHONORMALIZATIONS}, got {method!r}")
    if parameter_shapes:
        _check_shapes(compressor, parameter_shapes)


def _check_shapes(compressor: dict, parameter_shapes: dict) -> None:
    for kind in ("q", "error"):
        for name, tensor in compressor[kind].items():
            shape = parameter_shapes.get(name)
            if shape is None:
                raise ValueError(f"EDGC state has {kind} for parameter {name!r}, which the model does not have")
            rows, cols = shape[0], math.prod(shape[1:])
            # Q sits on the columns; a state saved with Q on the shorter side is accepted too:
            # a warm start that no longer fits is drawn anew (edgc.engine.engine_memory.EngineMemory.resized_q).
            expected = [(rows, cols)] if kind == "error" else [(cols,), (min(rows, cols),)]
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape[: len(expected[0])]) not in expected:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"EDGC state {kind} of {name!r} has shape {got}, the parameter needs {expected[0]}")
