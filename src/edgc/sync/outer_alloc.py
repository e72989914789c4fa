"""`AllocatedQuantState`: DiLoCo's quantised outer sync with the bits chosen per tensor, where each
byte removes the most error (the CQM's rank ↔ error model taken from rank to bits per value).

Every outer step, each rank quantises each tensor's M = Δ + e at every candidate width (`CANDIDATES`
bits) and measures the squared error of each; the table (tensors × candidates) is averaged over the
group, so every rank holds the same one and takes the same choice. The choice starts every tensor at
the narrowest width and then, greedily, widens the tensor whose next width removes the most squared
error per extra byte, while the step's bytes stay within the budget of ``bits`` bits per value on
average (scales included). This is the classic reverse water-filling of bit allocation; for
convex error curves the greedy choice is optimal among the candidates.

Costs beside `edgc.sync.outer_sync.QuantizedState` at the same mean width: one all-reduce of
tensors × candidates values, a quantisation per candidate per tensor, and one host read of the
table per outer step (fine for an outer step that comes every tens of inner steps).
"""

from __future__ import annotations

import heapq
import math

import torch

from ..device.timing import host_reads_allowed
from .error_feedback import ErrorFeedbackReducer
from .outer_sync import check_chunk, dequantize, message_bytes, pack, quantize, unpack

CANDIDATES = (2, 3, 4, 6, 8)


def allocate(
    errors: list[list[float]],
    sizes: list[int],
    chunk: int,
    budget_bytes: float,
    candidates: tuple[int, ...] = CANDIDATES,
) -> list[int]:
    """Bits per tensor: start at ``candidates[0]``, widen where the error falls most per byte within the budget.

    ``errors[t][c]``: tensor t's squared error at ``candidates[c]``; ``sizes[t]``: its values."""
    costs = [[message_bytes(n, b, chunk) for b in candidates] for n in sizes]
    return [candidates[c] for c in allocate_by_cost(errors, costs, budget_bytes)]


def allocate_by_cost(errors: list[list[float]], costs: list[list[int]], budget_bytes: float) -> list[int]:
    """The candidate index per tensor: each starts at its first (cheapest) candidate; then, greedily, the
    tensor whose next candidate removes the most squared error per extra byte moves up, while the
    bytes stay within ``budget_bytes``. ``errors[t][c]`` and ``costs[t][c]``: tensor t at candidate c,
    costs rising with c."""
    choice = [0] * len(costs)
    spent = sum(row[0] for row in costs)
    heap = []

    def offer(t: int) -> None:
        c = choice[t]
        if c + 1 < len(costs[t]):
            gain = (errors[t][c] - errors[t][c + 1]) / max(1, costs[t][c + 1] - costs[t][c])
            heapq.heappush(heap, (-gain, t))

    for t in range(len(costs)):
        offer(t)
    while heap:
        negative_gain, t = heapq.heappop(heap)
        extra = costs[t][choice[t] + 1] - costs[t][choice[t]]
        if negative_gain >= 0 or spent + extra > budget_bytes:
            continue  # no gain, or it does not fit: a smaller step of another tensor may
        choice[t] += 1
        spent += extra
        offer(t)
    return choice


class AllocatedQuantState(ErrorFeedbackReducer):
    """Quantised outer sync with bits per tensor by measured error per byte (see the module docstring);
    `edgc.sync.outer_sync.QuantizedState`'s codes, at a width per tensor."""

    method = "allocated"
    ARGUMENTS = ("mean_bits", "chunk")  # its argument ``bits`` is kept as mean_bits
    ERROR_ROLLBACK = "restore"  # as `QuantizedState`'s

    def __init__(
        self, process_group=None, *, bits: float = 3.0, chunk: int = 256, error_feedback: bool = True, model=None
    ):
        """``bits``: the mean bits a value over the step (scales included, between the narrowest and the
        widest of `CANDIDATES`); ``process_group``, ``chunk``, ``error_feedback`` and ``model`` as
        `QuantizedState`'s."""
        super().__init__(process_group, error_feedback=error_feedback, model=model)
        check_chunk(chunk)
        self.bits, self.chunk = CANDIDATES[-1], chunk  # the widest: its checkpoint's "bits", as ever
        if not CANDIDATES[0] <= bits <= CANDIDATES[-1]:
            raise ValueError(f"bits: the mean width must be in [{CANDIDATES[0]}, {CANDIDATES[-1]}], got {bits!r}")
        self.mean_bits = float(bits)
        self.last_bits: dict[str, int] = {}  # the last step's choice, by parameter name

    def _choose(self, names: list[str], parts: list[torch.Tensor]) -> list[int]:
        errors = torch.stack(
            [
                torch.stack(
                    [(part - self._decoded(*quantize(part, b, self.chunk), b)).square().sum() for b in CANDIDATES]
                )
                for part in parts
            ]
        ).double()
        with host_reads_allowed():  # the module docstring's one read per outer step
            table = self.comm.mean_(errors).tolist()  # identical on every rank: the same choice everywhere
        sizes = [p.numel() for p in parts]
        budget = sum(message_bytes(n, self.mean_bits, self.chunk) for n in sizes)
        return allocate(table, sizes, self.chunk, budget)

    def _reduce(self, names, grads, flat) -> None:
        corrected = self._corrected(names, grads)
        parts = list(corrected.split([g.numel() for g in grads]))
        widths = self._choose(names, parts)
        self.last_bits = dict(zip(names, widths))
        messages, sent_local = [], []
        for part, bits in zip(parts, widths):
            codes, scale = quantize(part, bits, self.chunk)
            messages += [pack(codes, bits), scale.view(torch.uint8)]
            sent_local.append(self._decoded(codes, scale, bits))
        message = torch.cat(messages)
        average = torch.zeros_like(corrected)
        for received in self.comm.all_gather(message):
            average.add_(self._decode(received, parts, widths).to(average.dtype))
        average.div_(self.comm.world_size)
        self._finish(
            names,
            grads,
            flat,
            corrected,
            torch.cat(sent_local).to(corrected.dtype),
            average,
            message.numel(),
            message.numel(),
        )

    def _decode(self, message: torch.Tensor, parts: list[torch.Tensor], widths: list[int]) -> torch.Tensor:
        values, offset = [], 0
        for part, bits in zip(parts, widths):
            n = part.numel()
            packed_bytes, scale_bytes = math.ceil(n / 8) * bits, 4 * math.ceil(n / self.chunk)
            codes = unpack(message[offset : offset + packed_bytes], bits, n)
            scale = message[offset + packed_bytes : offset + packed_bytes + scale_bytes].clone().view(torch.float32)
            offset += packed_bytes + scale_bytes
            values.append(self._decoded(codes, scale, bits))
        return torch.cat(values)

    def _decoded(self, codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
        return dequantize(codes, scale, bits, self.chunk)

    def _settle_step(self, record, totals) -> dict:
        sizes = {n: int(math.prod(s)) for n, s in self.parameter_shapes.items()}
        total = sum(sizes.get(n, 0) for n in self.last_bits)
        mean = sum(b * sizes.get(n, 0) for n, b in self.last_bits.items()) / total if total else None
        return {**super()._settle_step(record, totals), "mean_bits": mean, "bits": dict(self.last_bits)}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bits": self.bits, "chunk": self.chunk, "mean_bits": self.mean_bits}
