"""`ReduceStats`: what one call of a sync method sent and how well it compressed, the value every job
returns to the step runner (`edgc.runner.jobs`), summed into the step's record."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ReduceStats:
    """What one call sent and how well it compressed (local view).

    ``error_sq``, ``norm_sq`` and ``nonfinite`` may be 0-dim device tensors: they are read once,
    at the end of the optimizer step, never per bucket.
    """

    elements_raw: int = 0  # elements an uncompressed all-reduce would have sent
    elements_sent: int = 0
    bytes_raw: int = 0
    bytes_sent: int = 0
    error_sq: float | torch.Tensor = 0.0  # ‖M − Ĝ‖² of what was read (when measured; `ERROR_SAMPLE`), unscaled
    norm_sq: float | torch.Tensor = 0.0  # ‖M‖² of what was read (when measured; `ERROR_SAMPLE`), unscaled
    nonfinite: bool | torch.Tensor = False  # the group saw a NaN/Inf: the averaged gradients are NaN
    measured_scale: float = 1.0  # what error_sq and norm_sq are multiplied by: elements per element read
    ranks: dict[str, int] = field(default_factory=dict)  # per parameter; 0 = sent raw
