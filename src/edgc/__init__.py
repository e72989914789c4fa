"""edgc — Entropy-driven Dynamic Gradient Compression for PyTorch distributed training.

    from edgc import EDGCConfig, EDGCState, edgc_hook
    state = EDGCState(process_group=None, config=EDGCConfig(total_steps=10_000), model=ddp_model)
    ddp_model.register_comm_hook(state, edgc_hook)

The public API is what this package exports (``__all__``) and `edgc.integrations`; the modules
beneath are internal: their names may move between versions (`CHANGELOG.md` says where).

Modules and sub-packages, from the ground up (each sub-package's docstring names its modules):
    adapters/       What the library must read inside PyTorch and FSDP2, each private name in one place.
    device/         Streams, device-timeline timing (the only host reads), finiteness flags.
    distributed/    The one DeviceMesh, the communication layer, experts' groups, settings agreed.
    policies/       Pure rank policies: plans and decisions, CQM, the paper's mappings, splits, signals.
    runner/         The step runner (`GradientReducer`, the DDP hook): a step's cycle, jobs, values, seeds, events,
                    the one error feedback (`ErrorFeedback`).
    registry.py     Registries by name (signals, rank mappings, sync methods): one entry per name.
    checks.py       Field checks of the config dataclasses: each failure one line naming the field.
    config.py       `EDGCConfig`: every knob of EDGC in one validated dataclass.
    engine/         The PowerSGD engine: factors, layouts, its state between steps, rank changes, jobs.
    control/        Rank control: GDS, the byte budget, sync-time profiles, DAC's window and decision round, its
                    checkpoint's checks.
    safeguards/     Misuse refused, replicas compared.
    sync/           The sync methods the runner runs: baselines, outer syncs, sparse, two-stage, codecs.
    state.py        `EDGCState`: the EDGC compressor for one data-parallel group (a DDP hook state).
    parallel/       Composition with PyTorch's parallelisms: FSDP2/HSDP, pipeline stages and their traffic.
    integrations/   Glue for training stacks (Lightning, torchft, DiLoCo).
"""

from .config import EDGCConfig, LowRankConfig, field_docs
from .control.entropy import EntropySampler, gaussian_entropy, histogram_entropy
from .control.rank_control import WindowController
from .distributed.agreement import SettingsDiffer
from .distributed.comm import barrier_before_exit
from .engine.factors import orthogonalize_
from .engine.lowrank import LowRankCompressor
from .policies.rank_model import ErrorModel, error_curve_mc, error_curve_mp
from .policies.rank_rules import delta_target, limit_rank, register_rank_mapping
from .policies.signals import register_signal
from .runner.reducer import AllReduceState, GradientReducer, edgc_hook
from .safeguards.fingerprint import ReplicasDiverged
from .state import EDGCState
from .sync.baselines import CastState, QSGDState, RandomKState, TopKState
from .sync.sync_methods import register_sync_method

__all__ = [
    "EDGCConfig",
    "LowRankConfig",
    "EDGCState",
    "edgc_hook",
    "AllReduceState",
    "GradientReducer",
    "LowRankCompressor",
    "EntropySampler",
    "WindowController",
    "ErrorModel",
    "histogram_entropy",
    "gaussian_entropy",
    "error_curve_mc",
    "error_curve_mp",
    "delta_target",
    "limit_rank",
    "orthogonalize_",
    "field_docs",
    "CastState",
    "TopKState",
    "RandomKState",
    "QSGDState",
    "barrier_before_exit",
    "ReplicasDiverged",
    "SettingsDiffer",
    "register_signal",
    "register_rank_mapping",
    "register_sync_method",
]
__version__ = "0.1.0"
