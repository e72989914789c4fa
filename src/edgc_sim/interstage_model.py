"""The simulator's model of inter-stage traffic: raw activations forward, activation gradients back,
compressed as `edgc train --interstage` sends them (`edgc.parallel.interstage`).

Bytes come from the library itself (`edgc.parallel.interstage.wire_bytes`, `effective_rank`, `compresses`), so
a simulated step sends exactly what a training step logs: per stage boundary, one gradient per
micro-batch, each a (micro-batch · tokens) × hidden matrix; a compressed one is the header plus P and
Q, one sent raw through the compressed path the header plus the matrix (with ``off`` no header).
Every TP rank sends its own whole copy (what our schedule does; no scatter-gather for the factors).

Time of one transfer: alpha + bytes / beta of the link between the two stages; a compressed gradient
also costs its compress + decompress compute, the PowerSGD cost model of one matrix at that rank
(`cost_model.powersgd_compute_time`, the same call that prices the DP compression), charged to the
sender's backward: it runs right after it, before the send, on the critical path of the cool-down.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgc.parallel.interstage import MODES, compresses, effective_rank, wire_bytes

from . import cost_model as cm


@dataclass(frozen=True)
class InterStage:
    """How activation gradients travel between pipeline stages."""

    mode: str = "off"  #: off (raw) | all (every micro-batch compressed) | cooldown (the last P − 1 only)
    rank: int = 8  #: rank of the compressed gradients (--interstage-rank), >= 1

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"interstage mode must be one of {MODES}, got {self.mode!r}")
        if self.rank < 1:
            raise ValueError(f"interstage rank must be >= 1, got {self.rank}")


def gradient_ranks(mode: str, rank: int | None, micro_batches: int, stages: int, rows: int, cols: int) -> list:
    """Per micro-batch of one boundary: the rank its gradient is sent at (0 = raw), None with ``off``."""
    if mode == "off":
        return [None] * micro_batches
    return [
        effective_rank(rows, cols, rank) if compresses(mode, i, micro_batches, stages) else 0
        for i in range(micro_batches)
    ]


def gradient_bytes(rank: int | None, rows: int, cols: int, element_size: int = 4) -> int:
    """Bytes of one activation gradient on the wire (rank None: the ``off`` path, no header)."""
    return rows * cols * element_size if rank is None else wire_bytes(rows, cols, rank, element_size)


def step_bytes(
    mode: str, ranks: list, micro_batches: int, stages: int, rows: int, cols: int, element_size: int = 4
) -> tuple:
    """(sent, raw) bytes of one optimizer step's activation gradients on one TP rank of one replica:
    ``ranks[s]`` is the rank stage s sends at (s >= 1; ranks[0] is ignored, stage 0 sends nothing)."""
    sent = raw = 0
    for s in range(1, stages):
        for r in gradient_ranks(mode, ranks[s], micro_batches, stages, rows, cols):
            sent += gradient_bytes(r, rows, cols, element_size)
            raw += rows * cols * element_size
    return sent, raw


def transfer_s(nbytes: float, link: cm.AlphaBeta) -> float:
    """One point-to-point message over `link`."""
    return link.alpha_s + nbytes / link.bytes_per_s


def compress_s(
    rank: int | None,
    rows: int,
    cols: int,
    flops_per_s: float,
    mem_bytes_per_s: float,
    launch_s: float,
    element_size: int = 4,
    engine: cm.EngineRates | None = None,
) -> float:
    """Compress + decompress of one gradient sent at `rank` (0 for raw and None: nothing)."""
    if not rank:
        return 0.0
    return cm.powersgd_compute_time([(rows, cols)], rank, flops_per_s, mem_bytes_per_s, launch_s, element_size, engine)
