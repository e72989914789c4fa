"""edgc — Entropy-driven Dynamic Gradient Compression for PyTorch distributed training.

    from edgc import EDGCConfig, EDGCState, edgc_hook
    state = EDGCState(process_group=None, config=EDGCConfig(total_steps=10_000), model=ddp_model)
    ddp_model.register_comm_hook(state, edgc_hook)

Modules:
    config.py       `EDGCConfig`: every knob of EDGC in one validated dataclass
    checks.py       field checks of the config dataclasses: each failure one line naming the field
    state.py        `EDGCState`: the EDGC compressor for one data-parallel group (a DDP hook state)
    shadow.py       profiling's shadow syncs, timed beside the real one, and their times
    decisions.py    the decision round: agree, propose, broadcast, apply over the decision group
    checkpoint.py   what an EDGCState checkpoint holds, and the checks a loaded one passes
    reducer.py      `GradientReducer`, the abstraction every sync method implements; the DDP hooks
    steps.py        one step's record (what it planned, sent and measured) and its metrics
    totals.py       a step's values for the host, by name: sent as one device tensor, read once
    gradients.py    the gradients a reducer is handed (sparse, any layout) and how each is averaged raw
    jobs.py         how bucket jobs run: fixed order, buckets fused into batches, a side stream
    lowrank.py      the PowerSGD engine: rank-r compression, error feedback, warm-started Q
    layout.py       how one call's tensors are grouped by shape and laid out in flat buffers
    engine_state.py what the engine keeps between steps; commit, rollback, snapshot of a step
    rank_change.py  how each warm-start Q follows a rank change (keep the energy, add the residual's)
    factors.py      shapes, cross-process seeds and orthonormalisation of low-rank factors
    orthonormal_choice.py which orthonormalisation a device runs: timed once, agreed, kept in checkpoints
    entropy.py      GDS, the gradient data sampler: cheap gradient-entropy estimates
    rank_model.py   CQM: rank ↔ truncation error ↔ entropy
    rank_control.py DAC's window controller: when to compress and at which rank
    plans.py        what a step is planned to do, what a rank decision reads and what it carries
    budget.py       the byte budget: a mean rank spent early, re-planned every window
    signals.py      the budget signals (schedule, gradnorm, entropy, error): names, series, need
    registry.py     registries by name (signals, rank mappings, sync methods): one entry per name
    rank_rules.py   the paper's rank mappings and the noise gate on the entropy trend
    rank_split.py   how a state's rank is shared among its experts' matrices (uniform, by tokens routed)
    profiling.py    sync-time tables {rank → seconds}, the r_max rule, a controller's profiling run
    alignment.py    DAC stage alignment: per-stage ranks so all stages finish their sync together
    pipeline.py     `StageAligner`: DAC across pipeline stages, one `EDGCState` per stage
    interstage.py   low-rank activation gradients between pipeline stages, with error feedback
    fsdp.py         EDGC as FSDP2/HSDP's replica all-reduce (`register_fsdp_comm_hook`)
    fsdp_adapter.py the one place that reads FSDP2's private state (its parameter groups, the hook's buffer)
    experts.py      mixture of experts: stacked experts synced over their expert-data-parallel group
    mesh.py         the one `DeviceMesh` (dp_replicate, pp, dp_shard, ep, tp) every group comes from
    comm.py         collectives over one process group (or a mesh dimension)
    baselines.py    baseline compressors (casts, top-k, random-k, QSGD) as `GradientReducer`s
    error_feedback.py the error-feedback sync methods' one base: M = G + e, the residual kept, checkpoints
    sync_methods.py the registry of sync methods the tools know by name (the baselines, and yours)
    outer_sync.py   DiLoCo's quantised outer sync (b bits a value, error feedback), error-feedback decay and heal
    two_stage.py    the two-stage compressed all-reduce (all-to-all, owners reduce, all-gather): DiLoCo's default
    codecs.py       its codecs: a run of values to a message of bytes and back (b-bit codes in bit planes)
    outer_alloc.py  the quantised outer sync with the bits per tensor where a byte removes the most error
    outer_sparse.py the sparse outer syncs: chunked top-k, coded indices, 2-bit values, error feedback
    timing.py       device-timeline timestamps, the library's only device→host reads
    events.py       what EDGC decides, said through Python's logging (logger "edgc", group rank 0)
    fingerprint.py  once per window, the ranks compare what must be identical on all; raise where not
    agreement.py    at the first step, the ranks compare the settings that must agree; raise where not
    guards.py       how a state is used: a group created after it, DDP's group and model, synchronize()
    streams.py      streams and stream-ordered memory, device-agnostic (torch.cpu's stand-ins off CUDA)
    finite.py       finiteness flags on the device that no sum can overflow
    detached.py     what an unpickled state holds in place of its `Communicator`
    torch_adapter.py the one place that reads PyTorch's private members (version counters, views' bases)
    integrations/   glue for training stacks (Lightning)
"""

from .agreement import SettingsDiffer
from .baselines import CastState, QSGDState, RandomKState, TopKState
from .comm import barrier_before_exit
from .config import EDGCConfig, LowRankConfig, field_docs
from .entropy import EntropySampler, gaussian_entropy, histogram_entropy
from .factors import orthogonalize_
from .fingerprint import ReplicasDiverged
from .lowrank import LowRankCompressor
from .rank_control import WindowController
from .rank_model import ErrorModel, error_curve_mc, error_curve_mp
from .rank_rules import delta_target, limit_rank, register_rank_mapping
from .reducer import AllReduceState, GradientReducer, allreduce_hook, edgc_hook
from .signals import register_signal
from .state import EDGCState
from .sync_methods import register_sync_method

__all__ = [
    "EDGCConfig",
    "LowRankConfig",
    "EDGCState",
    "edgc_hook",
    "AllReduceState",
    "allreduce_hook",
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
