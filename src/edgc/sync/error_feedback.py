"""`ErrorFeedbackReducer`: the one base of the sync methods that keep error feedback, and the checks and
checkpoint format the two-stage all-reduce shares with it (its error feedback is written in place,
bucket by bucket, and has an owner's part). What is kept is `edgc.runner.error_feedback.ErrorFeedback`'s.

Error feedback: e ← (G + e) − C(G + e), the part of this rank's corrected gradient its compressed
message did not carry, added to the next step's gradient, so mean over ranks of (decompressed + e)
equals mean of (G + e). It is kept per parameter name (``feedback``, ``error`` its table), so a
checkpoint survives another DDP bucket layout, and is dropped at a load whose world size differs
(residuals are per rank; not under torchft, `edgc.distributed.comm.Communicator.residuals_per_rank`).

A subclass implements ``_reduce`` with `ErrorFeedbackReducer._corrected` (M = G + e) and
`ErrorFeedbackReducer._finish` (the average written, e ← M − what it sent, the call's statistics), and
names its constructor's own arguments in ``ARGUMENTS`` (agreed across the group, `edgc.distributed.agreement`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runner.error_feedback import ErrorFeedback
from ..runner.reducer import GradientReducer
from ..runner.stats import ReduceStats

BASELINE_FORMAT = "edgc-baseline/1"
COMPRESSED = {"phase": "compress", "rank": None, "entropy": None}  # a method's part of its step metrics


def unpack(packed: torch.Tensor, grads: list[torch.Tensor], flat: torch.Tensor | None) -> None:
    """Write the flat ``packed`` into ``grads`` (nothing where it is DDP's bucket buffer ``flat`` itself)."""
    if flat is not None and packed.data_ptr() == flat.data_ptr():
        return
    offset = 0
    for g in grads:
        g.view(-1).copy_(packed[offset : offset + g.numel()].to(g.dtype))
        offset += g.numel()


def check_format(state: dict, method: str) -> None:
    if not isinstance(state, dict) or state.get("format") != BASELINE_FORMAT or state.get("method") != method:
        raise ValueError(f"not a {method} compressor state (expected format {BASELINE_FORMAT!r})")


def method_settings(reducer: GradientReducer) -> dict[str, Any]:
    """``error_feedback`` and the class's ``ARGUMENTS``, each under ``Class.name``: what the group agrees on."""
    named = {"error_feedback": reducer.error_feedback, **{name: getattr(reducer, name) for name in reducer.ARGUMENTS}}
    return {f"{type(reducer).__name__}.{key}": value for key, value in named.items()}


def load_feedback(reducer: GradientReducer, feedback: ErrorFeedback, state: dict, load_rest: Callable) -> None:
    """Load a saved state: its error feedback into ``feedback`` (checked against the reducer's method and
    parameters, before anything changes), the rest by ``load_rest``; the error feedback dropped where the
    world size changed (residuals are per rank: not under torchft,
    `edgc.distributed.comm.Communicator.residuals_per_rank`).

    Args:
        reducer: the state loading.
        feedback: its error feedback.
        state: the saved state (`ErrorFeedback.state_dict`'s format at its top level).
        load_rest: `GradientReducer.load_state_dict` of the reducer.
    """
    check_format(state, reducer.method)
    feedback.load_state_dict(state, shapes=reducer.parameter_shapes, what=reducer.method)
    load_rest(state)
    if reducer.comm.residuals_per_rank and int(state["world_size"]) != reducer.comm.world_size:
        feedback.drop()  # residuals are per rank: they cannot be split or merged


class ErrorFeedbackReducer(GradientReducer):
    """Shared part of the sparsifiers and the quantisers: M = G + e in fp32, the EF update, checkpoints.

    ``error_feedback``: keep what a sync did not carry for the next; ``process_group`` and ``model``: as
    `GradientReducer`'s."""

    method = ""
    ARGUMENTS: tuple[str, ...] = ()  # the constructor's own arguments, kept under their names: agreed
    ERROR_ROLLBACK = "keep"  # what a rolled-back step leaves of the error feedback (`ErrorFeedback.rollback`)

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        error_feedback: bool = True,
        model: nn.Module | None = None,
    ):
        super().__init__(process_group, model=model)
        # name -> this rank's residual, fp32, the parameter's shape
        self.feedback = ErrorFeedback(error_feedback, rollback=self.ERROR_ROLLBACK)
        self._call = 0  # calls (buckets) so far in this step

    def _plan_step(self, record) -> None:
        self._call = 0

    def agreed_settings(self, device: torch.device) -> dict[str, Any]:
        """`GradientReducer.agreed_settings`, with ``error_feedback`` and the subclass's `ARGUMENTS`."""
        return {**super().agreed_settings(device), **method_settings(self)}

    @property
    def error_feedback(self) -> bool:
        """Whether it keeps what a sync did not carry for the next."""
        return self.feedback.enabled

    @property
    def error(self) -> dict[str, torch.Tensor]:
        """This rank's error feedback by parameter name (the state's own tensors)."""
        return self.feedback.table

    def error_feedbacks(self) -> list[ErrorFeedback]:
        """`GradientReducer.error_feedbacks`: ``feedback``."""
        return [self.feedback]

    def _corrected(self, names: list[str], grads: list[torch.Tensor]) -> torch.Tensor:
        """M = G + e as one flat fp32 (fp64 for fp64 gradients) vector."""
        dtype = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
        parts = []
        for name, g in zip(names, grads):
            part = g.reshape(-1).to(dtype)
            error = self.feedback.get(name)
            if error is not None and error.numel() == g.numel():
                part = part + error.reshape(-1).to(dtype)
            parts.append(part)
        return torch.cat(parts)

    def _finish(
        self,
        names: list[str],
        grads: list[torch.Tensor],
        flat: torch.Tensor | None,
        corrected: torch.Tensor,
        sent_local: torch.Tensor,
        average: torch.Tensor,
        elements_sent: int,
        bytes_sent: int,
    ) -> None:
        """Write ``average`` into the gradients; e ← corrected − sent_local; record the metrics."""
        if flat is not None:
            flat.copy_(average.to(flat.dtype))  # grads are views into DDP's bucket buffer
        else:
            unpack(average, grads, flat)
        residual = corrected - sent_local
        self.feedback.keep_split(names, grads, residual)
        n = corrected.numel()
        # Device values, read once when the step is settled (`GradientReducer.settle`).
        self._add_stats(
            ReduceStats(
                n,
                elements_sent,
                n * grads[0].element_size(),
                bytes_sent,
                error_sq=torch.dot(residual, residual),
                norm_sq=torch.dot(corrected, corrected),
                ranks={name: 0 for name in names},
            )
        )
        self._call += 1

    def _settle_step(self, record, totals) -> dict:
        return dict(COMPRESSED)

    def state_dict(self) -> dict:
        return {"format": BASELINE_FORMAT, "method": self.method, **super().state_dict(), **self.feedback.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        load_feedback(self, self.feedback, state, super().load_state_dict)
        if self.device is not None:
            self._on_device(self.device)
