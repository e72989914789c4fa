"""Glue for training stacks: register an edgc hook wherever a DDP model is built for you.

Modules:
    lightning.py    `EDGCDDPStrategy`: Lightning's DDPStrategy that registers the EDGC hook.
    diloco.py       DiLoCo / Streaming DiLoCo whose outer sync is EDGC's (plain process group).
    diloco_fragment.py A DiLoCo fragment: θ_global and Δ as one flat buffer each, the outer optimizer.
    torchft.py      EDGC across torchft replica groups: uncommitted steps, heal, quorum averages; DiLoCo.
    torchft_managed.py A sync state under torchft's manager: collectives, the verdict per step, heals.
    torchft_quorum.py  `QuorumSettings`: lighthouse and Manager settings that keep every live group in the quorum.
    torchft_adapter.py The one place that reads torchft's private members (its process group, timeout, DiLoCo's step).
    torchtitan.py   `EDGCTrainer`: torchtitan's trainer with EDGC on its replica all-reduce, one config name away.
    torchtitan_torchft.py EDGC across the replica groups of torchtitan's torchft experiment.
    torchtitan_adapter.py The one place that knows how torchtitan (0.3.0) shards its models for FSDP.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import EDGCConfig
from ..runner.reducer import GradientReducer, edgc_hook
from ..state import EDGCState


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel module of ``model`` (itself, or under torch.compile's wrapper).

    Args:
        model: a module, DDP-wrapped or not, compiled or not.

    Returns:
        The `DistributedDataParallel` module, or None when ``model`` is not one.
    """
    for candidate in (model, getattr(model, "_orig_mod", None)):
        if isinstance(candidate, DistributedDataParallel):
            return candidate
    return None


def check_group(state: object) -> None:
    """Check, before training, the process group an edgc state averages over (`edgc.safeguards.guards`).

    A `GradientReducer` built for the default group before ``init_process_group`` (easy with
    launchers that initialise it for you) binds that group now; one given a DDP model refuses
    another group than DDP's.

    Args:
        state: the hook's state; anything but a `GradientReducer` is left alone.

    Raises:
        RuntimeError: the world size the state holds still differs from its process group's.
    """
    if isinstance(state, GradientReducer):
        state.check_group()
    if isinstance(state, GradientReducer) and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(state.comm.group)
        if state.comm.world_size != world:
            raise RuntimeError(
                f"{type(state).__name__} was created for a world of {state.comm.world_size} process(es) "
                f"but the process group has {world}: create it after init_process_group "
                "(or pass an EDGCConfig and let the integration build the state)"
            )


def register_edgc(
    model: nn.Module,
    config: EDGCConfig | None = None,
    *,
    state: GradientReducer | None = None,
    hook: Callable = edgc_hook,
    process_group: dist.ProcessGroup | None = None,
) -> GradientReducer | None:
    """Register the EDGC hook on a DDP-wrapped ``model`` and return its state.

    Call it before the first forward. Without a process group of more than one rank there is
    nothing to compress: it warns and returns None, so one script runs under ``python`` and
    ``torchrun`` alike.

    Args:
        model: the DDP-wrapped model (or torch.compile's wrapper of one).
        config: the settings of an `EDGCState` built with the model's parameter names (default
            `EDGCConfig()`); give this or ``state``.
        state: a ready state instead, any `GradientReducer` (e.g. `AllReduceState`).
        hook: the comm hook to register with the state (default `edgc_hook`).
        process_group: the group to average over (default: the default group).

    Returns:
        The registered state, or None when there is no group of more than one rank.

    Raises:
        ValueError: both ``config`` and ``state`` are given.
        TypeError: a group of more than one rank, but ``model`` is not DDP-wrapped.
    """
    if config is not None and state is not None:
        raise ValueError("give either config or state, not both")
    ddp = find_ddp(model)
    if ddp is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
            warnings.warn("edgc: no distributed process group of more than one rank; no hook registered", stacklevel=2)
            return None
        raise TypeError(
            f"register_edgc needs a DistributedDataParallel model, got {type(model).__name__} "
            "(with Accelerate: the model returned by accelerator.prepare)"
        )
    if state is None:
        state = EDGCState(process_group, config if config is not None else EDGCConfig(), model=ddp)
    check_group(state)
    ddp.register_comm_hook(state, hook)
    return state


__all__ = ["register_edgc", "find_ddp", "check_group"]
