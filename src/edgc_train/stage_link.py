"""A pipeline stage's point-to-point traffic (`StageLink`): the batches schedule.py's contract posts,
the activation gradients raw or compressed, and the spans and bytes of a step."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from edgc.device.timing import Clock, to_host
from edgc.parallel.interstage import (
    MODES,
    IncomingGradient,
    check_headers,
    compresses,
    interstage_rank,
    send_gradient_ops,
)

from .rank_grid import Grid
from .stage_sync import StageCompressor

SPANS = ("interstage", "interstage_wire", "interstage_compress", "forward")  # StageLink.spans, logged as <key>_s
ACTIVATION, GRADIENT = 0, 1  # message tags (gloo matches on them; NCCL matches by order)
_UNVERIFIED = object()  # no received rank confirmed by a header yet (a new run, a resume)


def wait_all(works: list) -> None:
    for work in works:
        work.wait()


@dataclass
class RawGradient:
    """The receive of an uncompressed activation gradient (mode off): its size is known, no header."""

    op: dist.P2POp


class StageLink:
    """A pipeline stage's point-to-point traffic with its neighbours, as the contract in schedule.py's
    docstring posts it: the batches of each point of the schedule, the activation gradients sent raw
    or compressed (`edgc.parallel.interstage`) at the rank both stages agree on, and the step's spans and bytes.
    """

    def __init__(self, cfg, grid: Grid, compressor: StageCompressor, activation_shape: tuple, device: torch.device):
        self.cfg, self.grid, self.compressor, self.device = cfg, grid, compressor, device
        self.micro = cfg.grad_accum
        self.mode = getattr(cfg, "interstage", "off")
        self.activation_shape = activation_shape
        self.interstage_rank: int | None = None  # the rank of this step's compressed gradients (sent)
        self._received_rank: int | None = None  # … and of those it receives
        self._verified_rank: object = _UNVERIFIED  # the received rank the last header read first confirmed
        self._in_flight: list = []  # (works, ops) of this step's send-only batches: the ops keep the buffers
        self._incoming: list[IncomingGradient] = []  # this step's compressed receives, their headers checked at its end
        self.bytes = [0, 0]  # activation-gradient bytes sent, raw, this step
        # Stamps of this step's spans, turned into seconds once at its end (no host sync per
        # micro-batch on CUDA): "interstage" = each activation-gradient exchange (sender: compress
        # and post the batch carrying the gradient; receiver: post the batch that receives it, with
        # what that batch sends, wait, which includes the next stage's backward, and decompress),
        # "forward" = each micro-batch's forward compute; with --interstage on, also the parts
        # "interstage_wire" (receiver: the payload's transfer, from its header's arrival) and
        # "interstage_compress" (sender: compress; receiver: decompress).
        self.clock = Clock(device)
        self.spans: dict[str, list] = {key: [] for key in SPANS}
        self.connect_neighbours()

    def begin_step(self) -> None:
        """A new step's ranks (from the agreed numbers), and its spans, bytes and receives from zero."""
        self.interstage_rank = self._choose_interstage_rank()
        self._received_rank = self._choose_interstage_rank(receiving=True)
        self._incoming = []
        self.bytes = [0, 0]
        self.spans = {key: [] for key in SPANS}
        if self.compressor.interstage is not None:
            self.compressor.interstage.take_bytes()

    def end_step(self) -> None:
        """The step's sends waited on, and its one read of the compressed gradients' headers."""
        self.wait_in_flight()
        check_headers(self._incoming)

    def _prev(self) -> int:
        return self.grid.global_rank(self.grid.stage - 1, self.grid.replica)

    def _next(self) -> int:
        return self.grid.global_rank(self.grid.stage + 1, self.grid.replica)

    def _op(self, op, tensor: torch.Tensor, peer: int, tag: int) -> dist.P2POp:
        return dist.P2POp(op, tensor, peer, self.grid.pp_group, tag)

    def wait_in_flight(self) -> None:
        for works, _ in self._in_flight:
            wait_all(works)
        self._in_flight = []

    def _contract(self) -> list[float]:
        """What decides the size of every compressed activation gradient besides the pipeline's agreed
        entropy rank: it must be the same on both sides of a link."""
        cfg = self.cfg
        return [
            float(MODES.index(self.mode)),
            float(self.compressor.name == "edgc"),
            float(getattr(cfg, "interstage_rank", 0) or 0),
            float(getattr(cfg, "interstage_min_rank", 0) or 0),
            float(self.micro),
            float(self.grid.stages),
        ]

    def connect_neighbours(self) -> None:
        """Every stage exchanges the inter-stage contract (`_contract`) with each neighbour in one batch,
        so that the pipeline group's first batched call has all of its ranks (NCCL initialises the
        communicator there), and a disagreement is reported here, before any payload is sized by it."""
        token = torch.tensor(self._contract(), dtype=torch.float64, device=self.device)
        ops, theirs = [], []
        for near, (send_tag, receive_tag) in (
            (not self.grid.first and self._prev(), (GRADIENT, ACTIVATION)),
            (not self.grid.last and self._next(), (ACTIVATION, GRADIENT)),
        ):
            if near is False:
                continue
            theirs.append((near, torch.empty_like(token)))
            ops += [self._op(dist.isend, token, near, send_tag), self._op(dist.irecv, theirs[-1][1], near, receive_tag)]
        if ops:
            wait_all(dist.batch_isend_irecv(ops))
        mine = self._contract()
        for near, contract in theirs:
            if to_host(contract) != mine:
                raise RuntimeError(
                    f"pipeline: rank {near}'s inter-stage settings [mode, edgc, rank, min rank, micro-batches, "
                    f"stages] = {to_host(contract)} differ from this rank's {mine}: the compressed activation "
                    "gradients' sizes would disagree"
                )

    def communicate(
        self,
        *,
        activation: torch.Tensor | None = None,
        gradient: tuple | None = None,
        receive_activation: bool = False,
        receive_gradient: int | None = None,
    ) -> tuple:
        """One point of the schedule, posted as one batch: sends ``activation`` to the next stage,
        ``gradient`` = (micro-batch index, gradient) to the previous one, and receives what is
        asked for (``receive_gradient``: the index of the micro-batch whose gradient comes back);
        returns (activation, gradient) received, None where not asked or no neighbour."""
        ops: list[dist.P2POp] = []
        if activation is not None and not self.grid.last:
            ops.append(self._op(dist.isend, activation.detach().contiguous(), self._next(), ACTIVATION))
        sent_from = None
        if gradient is not None and not self.grid.first:
            sent_from = self.clock.stamp()
            ops += self._gradient_sends(*gradient)
        received = None
        if receive_activation and not self.grid.first:
            received = torch.empty(self.activation_shape, dtype=torch.float32, device=self.device)
            ops.append(self._op(dist.irecv, received, self._prev(), ACTIVATION))
        incoming = received_from = None
        if receive_gradient is not None and not self.grid.last:
            received_from = self.clock.stamp()
            incoming = self._gradient_receive(receive_gradient)
            ops.append(incoming.op)
        if not ops:
            return None, None
        works = dist.batch_isend_irecv(ops)
        if sent_from is not None:  # the sender's exchange ends once its batch is posted
            self.spans["interstage"].append((sent_from, self.clock.stamp()))
        if received is None and incoming is None:
            # Sends only: waited on at the step's end, and only then (a second wait on a finished
            # gloo work waits for a message that never comes); the ops keep their tensors alive.
            self._in_flight.append((works, ops))
            return None, None
        wait_all(works)
        grad = None if incoming is None else self._finish_gradient(incoming, received_from)
        return received, grad

    def _compresses(self, index: int) -> bool:
        """Whether micro-batch ``index``'s activation gradient goes out compressed."""
        return compresses(self.mode, index, self.micro, self.grid.stages)

    def _gradient_sends(self, index: int, grad: torch.Tensor) -> list[dist.P2POp]:
        """The ops that send micro-batch ``index``'s activation gradient to the previous stage."""
        raw = grad.numel() * grad.element_size()
        if self.compressor.interstage is None:
            self.bytes[0] += raw
            self.bytes[1] += raw
            return [self._op(dist.isend, grad.detach().contiguous(), self._prev(), GRADIENT)]
        start = self.clock.stamp()
        rank = self.interstage_rank if self._compresses(index) else None
        packet = self.compressor.interstage.compress(index, grad, rank)
        self.spans["interstage_compress"].append((start, self.clock.stamp()))
        self.bytes[0] += packet.nbytes
        self.bytes[1] += raw
        return send_gradient_ops(packet, self._prev(), self.grid.pp_group, tag=GRADIENT)

    def _gradient_receive(self, index: int) -> RawGradient | IncomingGradient:
        """What receives micro-batch ``index``'s activation gradient from the next stage (its ``op`` goes
        into the batch). Compressed, at the rank the sender takes from the same agreed numbers, so the
        payload's size is known without reading its header (checked once, at the step's end)."""
        if self.mode == "off":
            buffer = torch.empty(self.activation_shape, dtype=torch.float32, device=self.device)
            return RawGradient(self._op(dist.irecv, buffer, self._next(), GRADIENT))
        compressed = self._compresses(index)
        # The first compressed packet after the agreed rank changed (a new window's rank, a resume) is
        # sized from its header, read first: a disagreement raises before a wrong-sized receive.
        verify = compressed and self._received_rank != self._verified_rank
        incoming = IncomingGradient(
            self.activation_shape,
            self._next(),
            device=self.device,
            group=self.grid.pp_group,
            tag=GRADIENT,
            rank=self._received_rank if compressed else None,
            verify=verify,
        )
        if verify:
            self._verified_rank = self._received_rank
        self._incoming.append(incoming)
        return incoming

    def _finish_gradient(self, incoming: RawGradient | IncomingGradient, start) -> torch.Tensor:
        """The received gradient, once its batch was waited on; records the receiver's spans."""
        if isinstance(incoming, RawGradient):
            self.spans["interstage"].append((start, self.clock.stamp()))
            return incoming.op.tensor
        marks: list = []  # header in, payload arrived
        grad = incoming.finish(mark=lambda: marks.append(self.clock.stamp()))
        end = self.clock.stamp()
        self.spans["interstage_wire"].append((marks[0], marks[1]))
        self.spans["interstage_compress"].append((marks[1], end))
        self.spans["interstage"].append((start, end))
        return grad

    def _choose_interstage_rank(self, receiving: bool = False) -> int | None:
        """The rank of this step's compressed activation gradients: those this stage sends, or with
        ``receiving`` those it receives; from numbers every stage has alike, so sender and receiver
        agree (None: sent raw, or nothing to send)."""
        cfg, compressor = self.cfg, self.compressor
        if self.mode == "off" or (compressor.interstage is None and not receiving):
            return None
        if compressor.name == "edgc":
            # EDGC: follow the pipeline's entropy-driven rank within the inter-stage bounds; raw
            # while stage 0 is not compressing (EDGC's warm-up holds for this traffic too).
            return interstage_rank(compressor.entropy_rank(), cfg.interstage_min_rank, cfg.interstage_rank)
        return cfg.interstage_rank
