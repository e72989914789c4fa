"""Sync methods for DiLoCo's outer step beside EDGC's PowerSGD, and what DiLoCo does with any
method's error feedback (decay, heal).

`QuantizedState`: the pseudo-gradients M = Δ + e quantised to ``bits`` bits per value (2 ≤ bits ≤ 8)
with one fp32 scale (max |x| / L) per chunk of ``chunk`` values, rounded to the nearest of the 2L + 1
levels −L…L (L = 2^(bits−1) − 1: two bits are the three levels −1, 0, 1), packed
bits-tight and all-gathered; every rank averages the dequantised messages in rank order (replicas
stay bit-identical) and keeps e ← M − its own dequantised message. Bytes per rank for N values:
⌈N·b/8⌉ + 4·⌈N/chunk⌉, against 4·N raw: 8 bits ≈ 0.25×, 4 ≈ 0.13×, 3 ≈ 0.09×, 2 ≈ 0.07×.

Rounding to nearest is biased per value but the error feedback carries the remainder (as for
`edgc.sync.baselines.TopKState`); stochastic rounding (`edgc.sync.baselines.QSGDState`) would add noise the
error feedback then also carries.
"""

from __future__ import annotations

import math

import torch

from ..distributed.comm import Communicator
from ..runner.error_feedback import ErrorFeedback
from ..runner.reducer import GradientReducer
from .error_feedback import ErrorFeedbackReducer

HEAL_POLICIES = ("zero", "keep", "peer")


def levels(bits: int) -> int:
    """L: the largest level magnitude of a ``bits``-bit code."""
    return 2 ** (bits - 1) - 1


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes < 2^bits as bytes, 8 codes in ``bits`` bytes (little-endian in a 64-bit word)."""
    n = codes.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.int64, device=codes.device)
    padded[:n] = codes
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (padded.view(-1, 8) << shifts).sum(dim=1, keepdim=True)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).view(-1)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of `pack`: the first ``n`` codes, int64."""
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.view(-1, bits).to(torch.int64) << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((words >> shifts) & ((1 << bits) - 1)).view(-1)[:n]


def check_chunk(chunk: int) -> None:
    if not (isinstance(chunk, int) and chunk >= 8):
        raise ValueError(f"chunk: must be an integer ≥ 8, got {chunk!r}")


def quantize(x: torch.Tensor, bits: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in 0..2L, fp32 scale per ``chunk`` values) of the flat ``x`` at ``bits``."""
    n, top = x.numel(), levels(bits)
    blocks = torch.zeros(math.ceil(n / chunk) * chunk, dtype=torch.float32, device=x.device)
    blocks[:n] = x
    blocks = blocks.view(-1, chunk)
    scale = blocks.abs().amax(dim=1) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (blocks / safe.unsqueeze(1)).round_().clamp_(-top, top).add_(top)
    return codes.view(-1)[:n].to(torch.int64), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int, chunk: int) -> torch.Tensor:
    """The values `quantize`'s codes and scales stand for."""
    n = codes.numel()
    values = torch.zeros(scale.numel() * chunk, dtype=torch.float32, device=codes.device)
    values[:n] = codes.to(torch.float32) - levels(bits)
    return values.view(-1, chunk).mul_(scale.unsqueeze(1)).view(-1)[:n]


def message_bytes(n: int, bits: float, chunk: int) -> float:
    """Bytes of ``n`` values at ``bits`` bits a value, with a scale per ``chunk`` values."""
    return math.ceil(n / 8) * bits + 4 * math.ceil(n / chunk)


class QuantizedState(ErrorFeedbackReducer):
    """``bits``-bit quantisation with a scale per ``chunk`` values, all-gathered; error feedback (see the module "
    "docstring)."""

    method = "quantized"
    ARGUMENTS = ("bits", "chunk")
    ERROR_ROLLBACK = "restore"  # torchft's verdict: the residual from before a discarded step comes back

    def __init__(self, process_group=None, *, bits: int = 3, chunk: int = 256, error_feedback: bool = True, model=None):
        """``process_group``: the replicas' group (None: the default one); ``bits``: bits a value (2–8);
        ``chunk``: values per scale (≥ 8); ``error_feedback``: keep what a sync did not carry for the
        next; ``model``: names the tensors (so that checkpoints are keyed by parameter name)."""
        super().__init__(process_group, error_feedback=error_feedback, model=model)
        if not (isinstance(bits, int) and 2 <= bits <= 8):
            raise ValueError(f"bits: must be an integer in 2..8, got {bits!r}")
        check_chunk(chunk)
        self.bits, self.chunk = bits, chunk

    def quantize(self, x: torch.Tensor, bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes in 0..2L, fp32 scale per chunk) of the flat ``x`` at ``bits`` (default: the state's)."""
        return quantize(x, bits or self.bits, self.chunk)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, bits: int | None = None) -> torch.Tensor:
        return dequantize(codes, scale, bits or self.bits, self.chunk)

    def message_bytes(self, n: int) -> int:
        """Bytes one rank sends for ``n`` values."""
        return message_bytes(n, self.bits, self.chunk)

    def _reduce(self, names, grads, flat) -> None:
        corrected = self._corrected(names, grads)
        n, wire = corrected.numel(), self.bits
        codes, scale = self.quantize(corrected)
        packed = pack(codes, wire)
        message = torch.cat([packed, scale.view(torch.uint8)])
        sent_local = self.dequantize(codes, scale).to(corrected.dtype)
        average = torch.zeros_like(corrected)
        for part in self.comm.all_gather(message):
            their_scale = part[packed.numel() :].clone().view(torch.float32)
            average.add_(self.dequantize(unpack(part[: packed.numel()], wire, n), their_scale).to(average.dtype))
        average.div_(self.comm.world_size)
        self._finish(names, grads, flat, corrected, sent_local, average, message.numel(), message.numel())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bits": self.bits, "chunk": self.chunk}


# ---------------------------------------------------------------------------- error feedback tables
def error_table(state: GradientReducer) -> dict[str, torch.Tensor]:
    """The error feedback of a sync state by parameter name (`GradientReducer.error_table`: EDGC's engine's or
    an error-feedback baseline's); entries are the state's own tensors: changing them in place changes the state."""
    return state.error_table()


def _feedbacks(target: GradientReducer | dict[str, torch.Tensor]) -> list[ErrorFeedback]:
    """The error feedback of a state (`GradientReducer.error_feedbacks`), or a table's, as `ErrorFeedback`."""
    if isinstance(target, GradientReducer):
        return target.error_feedbacks()
    table = ErrorFeedback()
    table.table = target  # the caller's own tensors: changed in place
    return [table]


@torch.no_grad()
def decay_error_feedback(target: GradientReducer | dict[str, torch.Tensor], factor: float) -> None:
    """e ← factor · e for all the error feedback of a sync state (`GradientReducer.error_feedbacks`: its own
    and the part it keeps for the group where it has one, a two-stage sync's owners'), or of every entry
    of a table (1: unchanged, 0: error feedback off from here).

    Args:
        target: a sync state, or a table of error feedback.
        factor: the decay.
    """
    for feedback in _feedbacks(target):
        feedback.decay(factor)


@torch.no_grad()
def heal_error_feedback(
    target: GradientReducer | dict[str, torch.Tensor], comm: Communicator, policy: str, healed: bool
) -> None:
    """The error feedback of a replica that healed (``healed``) after a restart, a sync state's or a
    table's, by ``policy``: ``zero`` — none (what a restarted process has); ``keep`` — its own, as if it
    had not restarted; ``peer`` — rank 0's of ``comm``'s group, broadcast (every rank calls this: one
    broadcast per entry). The part a state keeps for the group (a two-stage sync's owners': chunks this
    rank owns, which no other rank holds) is dropped from a healed replica whatever the policy, with a
    line on the ``edgc`` logger.

    Args:
        target: a sync state, or a table of error feedback.
        comm: the replicas' communicator.
        policy: one of `HEAL_POLICIES`.
        healed: this replica is the one that healed.
    """
    if policy not in HEAL_POLICIES:
        raise ValueError(f"heal policy: one of {', '.join(HEAL_POLICIES)}, got {policy!r}")
    feedbacks = _feedbacks(target)
    table = feedbacks[0].table if feedbacks else {}
    for name in sorted(table):
        e = table[name]
        if policy == "peer":
            received = comm.broadcast(e.clone())
            if healed:
                e.copy_(received)
        elif policy == "zero" and healed:
            e.zero_()
    if healed and hasattr(target, "drop_group_error"):
        target.drop_group_error(f"a heal ({policy}): no other rank holds the chunks this one owns")
