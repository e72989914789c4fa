"""Compressed inter-stage traffic: low-rank activation gradients with per-slot error feedback.

Optimus-CC's compressed backpropagation with lazy error propagation (anchors.md §2.6), for the
activation gradient a pipeline stage sends back to its predecessor. The gradient of one
micro-batch, viewed as G (tokens × hidden) = (shape[:-1] flattened, shape[-1]), is sent as two
factors instead of G:

    M ← G + e[slot]                 e[slot]: what this micro-batch slot failed to send last step
    P ← M · Q[slot]                 Q warm-started from this slot's previous step
    P ← orth(P)
    Q ← Mᵀ · P
    sent  Ĝ = P · Qᵀ                the receiver rebuilds Ĝ from P (m × r) and Q (n × r)
    e[slot] ← M − Ĝ                 kept by the sender, added to the same slot next step

so sent + residual = original gradient + old residual, exactly (up to rounding). A slot is the
micro-batch's index inside the optimizer step (0 … grad_accum − 1): the same slot of the next
step is the closest thing to "the same gradient later" a pipeline has.

When (m + n)·r ≥ m·n the factors would not be smaller and G is sent raw (and the slot's residual
is flushed into it). Rank 0 (or None) means "send raw".

Wire contract (`send_gradient_ops` / `IncomingGradient`, and `send_gradient` / `recv_gradient`
that post them on their own). Every message goes through `dist.batch_isend_irecv`, never a lone
``isend``/``recv``: NCCL runs all of a group's batched point-to-point traffic on one stream, so a
stage that sends one thing and receives another at the same point of its schedule must post both
in one batch, or two stages that each send first wait for each other. One packet is two messages
from sender to receiver, in this order:

1. an int64 header [r, m, n] (`HEADER_BYTES`);
2. one payload buffer: for r > 0, P then Q ((m + n)·r values), for r = 0 the raw gradient (m·n
   values); fp32 (fp64 for fp64 gradients: the receiver passes the same dtype).

`wire_bytes(m, n, r, element_size)` is that size. The sender posts both sends in ONE batch, with
whatever else it posts at that point of its schedule, and keeps the buffers (the ops hold them)
until that batch's works are done. The receiver puts the header's receive in the batch it posts at
its matching point; once that batch has been waited on, it receives the payload in a batch of its
own. So the sender's batch completes only after the receiver's second batch is posted; that cannot
deadlock, as the header goes first and the receiver's first batch needs nothing else from the
sender. The payload's size depends on r, and a receive of the wrong size must never be posted (on
NCCL a size mismatch is undefined: a hang or a corrupted buffer, long before any check could report
it). So the size comes from agreed state or from the header first. A receiver whose ``rank`` comes
from numbers both sides agree on (as `edgc_train`'s schedule takes them: the pipeline's all-gathered
entropy rank and a configuration the stages compared when they connected) takes the size from it
and reads no header on the host per packet; `check_headers` then checks every packet's header
against it with one host read, where the step may synchronise. Where that agreed state has just
changed (a new window's rank, a resume), ``verify`` reads the first packet's header before its
payload is posted: on a disagreement the payload is received at the header's size, so the sender's
batch completes, and the receive raises. A receiver that does not know r reads the header first
(one host read per packet). Either way every packet describes itself.

With NCCL, a group's first batched point-to-point call creates the group's communicator, and
every rank of the group must take part in it: begin with one batch on every rank of the group
(as `edgc_train.schedule.PipelineStep` does with its neighbours) or a collective on it.

Rank policy (`interstage_rank`): with EDGC the inter-stage rank follows the pipeline's
entropy-driven rank r_0 (stage 0's, as `edgc.parallel.pipeline.StageAligner` shares it at every window
boundary) times `scale`, clamped to the inter-stage bounds [r_min, r_max]; while stage 0 is not
compressing (EDGC's warm-up), inter-stage traffic is raw too. It does not follow the sending
stage's own DAC-aligned DP rank: DAC may leave a stage's DP sync raw because that stage has slack
on the DP link, which says nothing about the inter-stage link. Static compressors use r_max.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..device.timing import state_to_device, state_to_host, to_device, to_host
from ..distributed.mesh import as_process_group
from ..engine.factors import orthogonalize_
from ..runner.error_feedback import ErrorFeedback
from ..runner.seeds import stable_seed

HEADER = 3  # int64 values: rank, rows, columns
HEADER_BYTES = HEADER * 8


def wire_bytes(m: int, n: int, rank: int, element_size: int = 4) -> int:
    """Bytes one gradient takes on the wire: header + factors (rank > 0) or the raw matrix."""
    return HEADER_BYTES + element_size * ((m + n) * rank if rank > 0 else m * n)


def effective_rank(m: int, n: int, rank: int | None) -> int:
    """The rank a (m × n) gradient is sent at: 0 (raw) when factors would not be smaller."""
    if not rank or rank <= 0:
        return 0
    r = min(rank, m, n)
    return r if (m + n) * r < m * n else 0


MODES = ("off", "all", "cooldown")


def compresses(mode: str, index: int, micro_batches: int, stages: int) -> bool:
    """Whether micro-batch ``index``'s activation gradient goes out compressed under ``mode``.

    ``cooldown``: only the last P − 1 backwards, run after stage 0's last forward in 1F1B, when
    nothing is left to overlap the transfer with (the pipeline's critical path). One policy for
    the training schedule and the simulator, so their byte counts cannot drift apart.
    """
    if mode not in MODES:
        raise ValueError(f"interstage mode must be one of {MODES}, got {mode!r}")
    if mode == "all":
        return True
    return mode == "cooldown" and index >= micro_batches - (stages - 1)


def interstage_rank(dp_rank: int | None, r_min: int, r_max: int, scale: float = 1.0) -> int | None:
    """EDGC's inter-stage rank from an entropy-driven DP rank: round(dp_rank · scale) within [r_min, r_max]."""
    if dp_rank is None:
        return None
    return max(r_min, min(r_max, int(round(dp_rank * scale))))


@dataclass
class Packet:
    """What goes on the wire for one micro-batch gradient."""

    rank: int  # 0 = raw
    shape: torch.Size
    payload: torch.Tensor  # P and Q concatenated (flat), or the raw matrix (flat)

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.payload.numel() * self.payload.element_size()


class InterStageCompressor:
    """Sender side: rank-r compression with error feedback per micro-batch slot (``feedback``, an
    `edgc.runner.error_feedback.ErrorFeedback` keyed by slot)."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        self.seed, self.dtype = seed, dtype
        self.feedback = ErrorFeedback()
        self.qs: dict[int, torch.Tensor] = {}
        self.bytes_sent = 0
        self.bytes_raw = 0

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        """slot → its residual (``feedback``'s table)."""
        return self.feedback.table

    def _q(self, slot: int, n: int, rank: int, device: torch.device) -> torch.Tensor:
        q = self.qs.get(slot)
        if q is None or q.shape != (n, rank):
            generator = torch.Generator().manual_seed(stable_seed(self.seed, "interstage", slot, n, rank))
            q = to_device(torch.randn(n, rank, generator=generator, dtype=self.dtype), device)
        return q

    def compress(self, slot: int, grad: torch.Tensor, rank: int | None) -> Packet:
        """The packet for this slot's gradient; updates the slot's residual and warm-start Q."""
        shape = grad.shape
        n = shape[-1]
        m = grad.numel() // n
        dtype = torch.float64 if grad.dtype == torch.float64 else self.dtype
        matrix = grad.detach().reshape(m, n).to(dtype)
        residual = self.residuals.get(slot)
        if residual is not None and residual.shape == matrix.shape:
            matrix = matrix + residual
        r = effective_rank(m, n, rank)
        if r == 0:
            self.residuals.pop(slot, None)  # everything is sent: nothing left over
            payload = matrix.reshape(-1).clone()
        else:
            q = self._q(slot, n, r, matrix.device).to(dtype)
            p = matrix @ q
            orthogonalize_(p.unsqueeze(0))
            q = matrix.t() @ p
            self.residuals[slot] = matrix - p @ q.t()
            self.qs[slot] = q.detach().to(self.dtype).clone()
            payload = torch.cat([p.reshape(-1), q.reshape(-1)])
        packet = Packet(r, shape, payload)
        self.bytes_sent += packet.nbytes
        self.bytes_raw += m * n * grad.element_size()
        return packet

    def take_bytes(self) -> tuple[int, int]:
        """(bytes sent, bytes an uncompressed transfer would have sent) since the last call."""
        out = (self.bytes_sent, self.bytes_raw)
        self.bytes_sent = self.bytes_raw = 0
        return out

    def state_dict(self) -> dict:
        """The residuals (`ErrorFeedback.state_dict`'s format) and the warm-start Q per slot, on the host.

        Returns:
            ``{"error": {slot: tensor}, "qs": {slot: tensor}}``.
        """
        return {**self.feedback.state_dict(), "qs": state_to_host(self.qs)}

    def load_state_dict(self, state: dict, device: torch.device | None = None) -> None:
        """Residuals and Q onto ``device`` (used on the compute stream alone: no stream to keep them for);
        a state saved with the residuals under ``"residuals"`` (before the one format) loads too.

        Args:
            state: `state_dict`'s.
            device: where they are used (None: left where they are).
        """
        qs = {int(k): v for k, v in state["qs"].items()}
        self.qs = state_to_device(qs, device, None) if device else qs
        self.feedback.load_state_dict(state, what="interstage", key=int)
        if device:
            self.feedback.to(device)


def decompress(packet: Packet) -> torch.Tensor:
    """The gradient the receiver uses: P · Qᵀ (or the raw matrix), in the original shape."""
    n = packet.shape[-1]
    m = math.prod(packet.shape) // n
    if packet.rank == 0:
        return packet.payload.reshape(packet.shape)
    p = packet.payload[: m * packet.rank].reshape(m, packet.rank)
    q = packet.payload[m * packet.rank :].reshape(n, packet.rank)
    return (p @ q.t()).reshape(packet.shape)


# ---------------------------------------------------------------------------- the send/recv contract
def send_gradient_ops(packet: Packet, dst: int, group=None, tag: int = 0) -> list:
    """The sends of one packet, header then payload, for the caller to post in one batch (with
    what else it sends or receives at that point). The ops hold the buffers: keep them until the
    batch's works are done. ``group``: a process group or a 1-D mesh (``dst`` is a global rank)."""
    group = as_process_group(group)
    n = packet.shape[-1]
    m = math.prod(packet.shape) // n
    header = to_device(torch.tensor([packet.rank, m, n], dtype=torch.int64), packet.payload.device)
    return [dist.P2POp(dist.isend, header, dst, group, tag), dist.P2POp(dist.isend, packet.payload, dst, group, tag)]


def send_gradient(packet: Packet, dst: int, group=None, tag: int = 0) -> list:
    """Non-blocking send of one packet as a batch of its own; returns (work, ops) pairs: wait on
    the works before the buffers are reused (the ops keep them alive)."""
    ops = send_gradient_ops(packet, dst, group, tag)
    return [(work, ops) for work in dist.batch_isend_irecv(ops)]


class IncomingGradient:
    """The receiving side of one packet, in two steps (see the wire contract above).

    ``op`` receives the header: post it in the batch of the receiver's point of the schedule.
    After that batch has been waited on, `finish` receives the payload in a batch of its own and
    returns the decompressed gradient. ``rank``: the rank the sender compresses this gradient at
    (None: raw), when the receiver knows it from agreed state; left out, `finish` reads it from the
    header. ``verify``: that agreed state has just changed: read the header before the payload and
    raise if it disagrees (after receiving the payload at the header's size)."""

    UNKNOWN = object()

    def __init__(
        self,
        shape,
        src: int,
        dtype: torch.dtype = torch.float32,
        device=None,
        group=None,
        tag: int = 0,
        rank: int | None | object = UNKNOWN,
        verify: bool = False,
    ):
        self.shape, self.src, self.dtype, self.device, self.tag = torch.Size(shape), src, dtype, device, tag
        self.verify = verify
        self.group = as_process_group(group)
        self.n = self.shape[-1]
        self.m = math.prod(self.shape) // self.n
        self.expected = None if rank is IncomingGradient.UNKNOWN else effective_rank(self.m, self.n, rank)
        self.header = torch.empty(HEADER, dtype=torch.int64, device=device)
        self.op = dist.P2POp(dist.irecv, self.header, src, self.group, tag)

    def finish(self, mark: Callable[[], None] | None = None) -> torch.Tensor:
        """``mark`` (a timing hook, e.g. a clock stamp) is called once the header is in and once the
        payload has arrived: the span between the two is the payload's transfer."""
        if self.expected is not None and not self.verify:
            rank, m, n = self.expected, self.m, self.n  # the header is checked later (`check_headers`)
        else:
            rank, m, n = to_host(self.header)  # the packet's one host read
        if mark is not None:
            mark()
        disagreement = self.expected is not None and (rank, m, n) != (self.expected, self.m, self.n)
        if m * n != math.prod(self.shape) and not disagreement:
            raise RuntimeError(f"interstage: got a {m}×{n} gradient for an activation of shape {tuple(self.shape)}")
        payload = torch.empty((m + n) * rank if rank else m * n, dtype=self.dtype, device=self.device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, payload, self.src, self.group, self.tag)]):
            work.wait()
        if disagreement:  # received at the header's size, so that the sender is not left waiting
            raise RuntimeError(_disagreeing(self.src, [rank, m, n], [self.expected, self.m, self.n]))
        if mark is not None:
            mark()
        return decompress(Packet(rank, self.shape, payload)).to(self.dtype)


def check_headers(incoming: list[IncomingGradient]) -> None:
    """Every finished packet received at a known rank has the header [rank, m, n] its receiver
    expected (one host read for all of them: call it where the step may synchronise)."""
    known = [packet for packet in incoming if packet.expected is not None]
    if not known:
        return
    values = to_host(torch.cat([packet.header for packet in known]))
    for i, packet in enumerate(known):
        got, wanted = tuple(values[HEADER * i : HEADER * (i + 1)]), (packet.expected, packet.m, packet.n)
        if got != wanted:
            raise RuntimeError(_disagreeing(packet.src, list(got), list(wanted)))


def _disagreeing(src: int, got: list, wanted: list) -> str:
    return (
        f"interstage: a packet from rank {src} has header [rank, m, n] = {got}, its receiver expected "
        f"{wanted}: the two stages disagree on the rank"
    )


def recv_gradient(
    shape: torch.Size,
    src: int,
    dtype: torch.dtype = torch.float32,
    device=None,
    group=None,
    tag: int = 0,
    mark: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Blocking receive of one packet sent by `send_gradient`; returns the decompressed gradient.
    The header's receive is a batch of its own here; ``mark`` as in `IncomingGradient.finish`."""
    incoming = IncomingGradient(shape, src, dtype, device, group, tag)
    for work in dist.batch_isend_irecv([incoming.op]):
        work.wait()
    return incoming.finish(mark)
