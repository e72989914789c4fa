"""edgc — Entropy-driven Dynamic Gradient Compression for PyTorch distributed training.

    from edgc import EDGCConfig, EDGCState, edgc_hook
    state = EDGCState(process_group=None, config=EDGCConfig(total_steps=10_000), model=ddp_model)
    ddp_model.register_comm_hook(state, edgc_hook)
"""
from .baselines import CastState, QSGDState, RandomKState, TopKState
from .comm import barrier_before_exit
from .config import EDGCConfig, field_docs
from .entropy import EntropySampler, gaussian_entropy, histogram_entropy
from .lowrank import LowRankCompressor, orthogonalize_
from .rank_control import WindowController, delta_target, limit_rank
from .rank_model import ErrorModel, error_curve_mc, error_curve_mp
from .reducer import AllReduceState, GradientReducer, allreduce_hook, edgc_hook
from .state import EDGCState

__all__ = [
    "EDGCConfig", "EDGCState", "edgc_hook", "AllReduceState", "allreduce_hook", "GradientReducer",
    "LowRankCompressor", "EntropySampler", "WindowController", "ErrorModel",
    "histogram_entropy", "gaussian_entropy", "error_curve_mc", "error_curve_mp",
    "delta_target", "limit_rank", "orthogonalize_", "field_docs",
    "CastState", "TopKState", "RandomKState", "QSGDState", "barrier_before_exit",
]
__version__ = "0.1.0"
