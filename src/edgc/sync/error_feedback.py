"""`ErrorFeedbackReducer`: the one base of the sync methods that keep error feedback, and the parts of
it the two-stage all-reduce shares without being one (its error feedback is written in place, bucket
by bucket, and has an owner's part).

Error feedback: e ← (G + e) − C(G + e), the part of this rank's corrected gradient its compressed
message did not carry, added to the next step's gradient, so mean over ranks of (decompressed + e)
equals mean of (G + e). It is kept per parameter name (``error``), so a checkpoint survives another
DDP bucket layout, and is dropped at a load whose world size differs (residuals are per rank; not
under torchft, `edgc.distributed.comm.Communicator.residuals_per_rank`).

A subclass implements ``_reduce`` with `ErrorFeedbackReducer._corrected` (M = G + e) and
`ErrorFeedbackReducer._finish` (the average written, e ← M − what it sent, the call's statistics), and
names its constructor's own arguments in ``ARGUMENTS`` (agreed across the group, `edgc.distributed.agreement`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..device.timing import state_to_device, state_to_host
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


def checked_error(reducer: GradientReducer, state: dict) -> dict[str, torch.Tensor]:
    """The error feedback table of a saved state, checked against the reducer's method and parameters."""
    method = reducer.method
    check_format(state, method)
    error = state.get("error")
    if not isinstance(error, dict):
        raise ValueError(f"corrupt {method} state: 'error' must be a table of tensors")
    shapes = reducer.parameter_shapes
    for name, tensor in error.items():
        shape = shapes.get(name)
        if shapes and shape is None:
            raise ValueError(f"{method} state has error feedback for {name!r}, which the model does not have")
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{method} state error of {name!r} has shape {tuple(tensor.shape)}, the parameter needs {shape}"
            )
    return dict(error)


class ErrorFeedbackReducer(GradientReducer):
    """Shared part of the sparsifiers and the quantisers: M = G + e in fp32, the EF update, checkpoints.

    ``error_feedback``: keep what a sync did not carry for the next; ``process_group`` and ``model``: as
    `GradientReducer`'s."""

    method = ""
    ARGUMENTS: tuple[str, ...] = ()  # the constructor's own arguments, kept under their names: agreed
    ROLLBACK_RESTORES_ERROR = False  # a rolled-back step puts back the error feedback from before it

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        error_feedback: bool = True,
        model: nn.Module | None = None,
    ):
        super().__init__(process_group, model=model)
        self.error_feedback = bool(error_feedback)
        self.error: dict[str, torch.Tensor] = {}  # name -> this rank's residual, fp32, the parameter's shape
        self._call = 0  # calls (buckets) so far in this step

    def _plan_step(self, record) -> None:
        self._call = 0

    def agreed_settings(self, device: torch.device) -> dict[str, Any]:
        """`GradientReducer.agreed_settings`, with ``error_feedback`` and the subclass's `ARGUMENTS`."""
        return {**super().agreed_settings(device), **method_settings(self)}

    def error_table(self) -> dict[str, torch.Tensor]:
        """`GradientReducer.error_table`: ``error``."""
        return self.error

    def _on_device(self, device: torch.device) -> None:
        # The jobs' stream reads a loaded error feedback and replaces it (`edgc.device.timing.state_to_device`).
        self.error = state_to_device(self.error, device, self._jobs.stream)

    def _corrected(self, names: list[str], grads: list[torch.Tensor]) -> torch.Tensor:
        """M = G + e as one flat fp32 (fp64 for fp64 gradients) vector."""
        dtype = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
        parts = []
        for name, g in zip(names, grads):
            part = g.reshape(-1).to(dtype)
            error = self.error.get(name) if self.error_feedback else None
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
        if self.error_feedback:
            offset = 0
            for name, g in zip(names, grads):
                self.error[name] = residual[offset : offset + g.numel()].view(g.shape).clone()
                offset += g.numel()
        n = corrected.numel()
        # Device values, read once at the end of the step (`GradientReducer._close_step`).
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

    # Uncommitted steps (torchft's verdict), where ``ROLLBACK_RESTORES_ERROR``: the residual is the state to restore.
    def _snapshot(self) -> dict:
        snapshot = super()._snapshot()
        return {**snapshot, "error": dict(self.error)} if self.ROLLBACK_RESTORES_ERROR else snapshot

    def _restore(self, snapshot: dict) -> None:
        super()._restore(snapshot)
        if self.ROLLBACK_RESTORES_ERROR:
            self.error = snapshot["error"]

    def state_dict(self) -> dict:
        return {
            "format": BASELINE_FORMAT,
            "method": self.method,
            **super().state_dict(),
            "error": state_to_host(self.error),
        }

    def load_state_dict(self, state: dict) -> None:
        error = checked_error(self, state)
        super().load_state_dict(state)
        self.error = error
        if self.comm.residuals_per_rank and int(state["world_size"]) != self.comm.world_size:
            self.error.clear()  # residuals are per rank: they cannot be split or merged
        if self.device is not None:
            self._on_device(self.device)
