"""One optimizer step of a pipeline stage: our own 1F1B / GPipe schedule (`PipelineStep`).

Point-to-point contract (`PipelineStep._communicate`). Every message goes through
``dist.batch_isend_irecv`` on the pipeline's group (``grid.pp_group``), posted as Megatron's
non-interleaved 1F1B posts them: what a stage sends and receives at one point of its schedule is
ONE batch, a lone message a batch of one. NCCL runs a group's batched traffic on one stream per
rank, in posting order, and a message larger than its buffer completes only when both ends run;
stage s's [send activation i, receive gradient j] and stage s+1's [send gradient j, receive
activation i] are each one batch, so neither stage's send waits behind a receive of its own that
the other stage only serves after its send. The points:

- warm-up (P − s − 1 forwards; all of them under GPipe): [receive activation], forward,
  [send activation];
- before the steady state: [receive activation];
- steady state, per micro-batch: forward, [send activation + receive gradient], backward,
  [send gradient + receive the next activation] (the last one: [send gradient]);
- cool-down: [receive gradient], backward, [send gradient];
- evaluation, per micro-batch: [receive activation], forward, [send activation].

A stage without that neighbour leaves its part out (the first stage receives no activation
and sends no gradient, the last the reverse). A compressed gradient (``--interstage``) is a
header and a payload (`edgc.interstage`'s wire contract): the sender posts both in its batch;
the receiver posts the header's receive in its batch and receives the payload in a batch of its
own, its size known from the rank both stages agree on (no host read per micro-batch; the step's
headers are checked once at its end). A batch that receives is waited on at once (its sends with it:
on NCCL it is one work) and its buffers may then be read; a batch that only sends is waited
on at the step's end, and its tensors are kept until then. Before the first step every stage
posts one batch with both neighbours (`_connect_neighbours`): NCCL creates the group's
communicator on the group's first batched call, which every rank of the group must join.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from edgc.interstage import MODES, IncomingGradient, check_headers, compresses, interstage_rank, send_gradient_ops
from edgc.timing import Clock, to_host

from .mesh import Grid
from .stage import GPT2Stage, module_width, next_token_loss
from .stage_sync import StageCompressor
from .tensor_parallel import tp_squared_norm


class BackwardTimer:
    """t_b samples: the duration of each micro-batch backward this stage runs (our schedule calls it).

    On CUDA a pair of events brackets each ``torch.autograd.backward`` call on the current stream
    and the elapsed times are read at the step's end (`take`, after the schedule), so they time
    kernel execution, not launch. Elsewhere (CPU) execution is synchronous and the wall clock
    around the call is the execution time.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.samples: list[float] = []
        self._events: list[tuple[Any, Any]] = []
        self._started: Any = None

    def start(self) -> None:
        if self.device.type == "cuda":
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started, end))
        else:
            self.samples.append(time.perf_counter() - self._started)
        self._started = None

    def take(self) -> list[float]:
        for begin, end in self._events:
            end.synchronize()
            self.samples.append(begin.elapsed_time(end) / 1e3)
        self._events = []
        samples, self.samples = self.samples, []
        return samples


SPANS = ("interstage", "interstage_wire", "interstage_compress", "forward")  # PipelineStep._spans, logged as <key>_s
ACTIVATION, GRADIENT = 0, 1  # message tags (gloo matches on them; NCCL matches by order)
_UNVERIFIED = object()  # no received rank confirmed by a header yet (a new run, a resume)


def wait_all(works: list) -> None:
    for work in works:
        work.wait()


@dataclass
class RawGradient:
    """The receive of an uncompressed activation gradient (mode off): its size is known, no header."""

    op: dist.P2POp


class PipelineStep:
    """Everything one rank does per optimizer step in PP × DP training.

    The schedule is our own (1F1B or GPipe), so that the activation gradients can travel as
    low-rank factors (`edgc.interstage`) and each micro-batch backward can be timed exactly
    (`BackwardTimer`).

    Its point-to-point traffic follows the contract in the module docstring.
    """

    def __init__(self, cfg, grid: Grid, module: GPT2Stage, device: torch.device):
        self.cfg, self.grid, self.module, self.device = cfg, grid, module, device
        self.micro = cfg.grad_accum
        self.mode = getattr(cfg, "interstage", "off")
        self.compressor = StageCompressor(cfg.compressor, module, grid, cfg)
        self.timer = BackwardTimer(device)
        self.activation_shape = (cfg.micro_batch, cfg.seq_len, module_width(module))
        self.interstage_rank: int | None = None  # the rank of this step's compressed gradients (sent)
        self._received_rank: int | None = None  # … and of those it receives
        self._verified_rank: object = _UNVERIFIED  # the received rank the last header read first confirmed
        self._in_flight: list = []  # (works, ops) of this step's send-only batches: the ops keep the buffers
        self._incoming: list[IncomingGradient] = []  # this step's compressed receives, their headers checked at its end
        self._bytes = [0, 0]  # activation-gradient bytes sent, raw, this step
        # Stamps of this step's spans, turned into seconds once at its end (no host sync per
        # micro-batch on CUDA): "interstage" = each activation-gradient exchange (sender: compress
        # and post the batch carrying the gradient; receiver: post the batch that receives it, with
        # what that batch sends, wait, which includes the next stage's backward, and decompress),
        # "forward" = each micro-batch's forward compute; with --interstage on, also the parts
        # "interstage_wire" (receiver: the payload's transfer, from its header's arrival) and
        # "interstage_compress" (sender: compress; receiver: decompress).
        self.clock = Clock(device)
        self._spans: dict[str, list] = {key: [] for key in SPANS}
        self._connect_neighbours()

    # ------------------------------------------------------------------ point to point
    def _prev(self) -> int:
        return self.grid.global_rank(self.grid.stage - 1, self.grid.replica)

    def _next(self) -> int:
        return self.grid.global_rank(self.grid.stage + 1, self.grid.replica)

    def _op(self, op, tensor: torch.Tensor, peer: int, tag: int) -> dist.P2POp:
        return dist.P2POp(op, tensor, peer, self.grid.pp_group, tag)

    def _wait_in_flight(self) -> None:
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

    def _connect_neighbours(self) -> None:
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

    def _communicate(
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
            self._spans["interstage"].append((sent_from, self.clock.stamp()))
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
            self._bytes[0] += raw
            self._bytes[1] += raw
            return [self._op(dist.isend, grad.detach().contiguous(), self._prev(), GRADIENT)]
        start = self.clock.stamp()
        rank = self.interstage_rank if self._compresses(index) else None
        packet = self.compressor.interstage.compress(index, grad, rank)
        self._spans["interstage_compress"].append((start, self.clock.stamp()))
        self._bytes[0] += packet.nbytes
        self._bytes[1] += raw
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
            self._spans["interstage"].append((start, self.clock.stamp()))
            return incoming.op.tensor
        marks: list = []  # header in, payload arrived
        grad = incoming.finish(mark=lambda: marks.append(self.clock.stamp()))
        end = self.clock.stamp()
        self._spans["interstage_wire"].append((marks[0], marks[1]))
        self._spans["interstage_compress"].append((marks[1], end))
        self._spans["interstage"].append((start, end))
        return grad

    # ------------------------------------------------------------------ the schedule
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

    def _forward(
        self,
        index: int,
        inputs: torch.Tensor | None,
        x: torch.Tensor | None,
        y: torch.Tensor | None,
        losses: list,
        train: bool,
    ) -> tuple:
        """Micro-batch ``index``'s forward on ``inputs`` (the received activation; on the first
        stage its slice of ``x``); returns (inputs, output), output being the scaled loss on the last."""
        if self.grid.first:
            inputs = x[index * self.cfg.micro_batch : (index + 1) * self.cfg.micro_batch]
        elif train:
            inputs.requires_grad_(True)
        start = self.clock.stamp() if train else None
        output = self.module(inputs)
        if self.grid.last:
            target = y[index * self.cfg.micro_batch : (index + 1) * self.cfg.micro_batch]
            loss = next_token_loss(output, target)
            losses.append(loss.detach())
            output = loss / self.micro  # gradients are the mean over micro-batches
        if train:
            self._spans["forward"].append((start, self.clock.stamp()))
        return inputs, output

    def _backward(self, inputs: torch.Tensor, output: torch.Tensor, grad: torch.Tensor | None):
        """Backward of one micro-batch; returns the gradient of its inputs (None on the first stage)."""
        self.timer.start()
        torch.autograd.backward(output, grad)
        self.timer.stop()
        return None if self.grid.first else inputs.grad

    def _run_train(self, x, y) -> list[torch.Tensor]:
        """1F1B (GPipe: every forward first), communicating as the class docstring lists."""
        losses: list[torch.Tensor] = []
        micro, stages, stage = self.micro, self.grid.stages, self.grid.stage
        warmup = micro if self.cfg.pp_schedule == "gpipe" else min(stages - stage - 1, micro)
        saved: collections.deque = collections.deque()  # (inputs, output) awaiting their backward
        for index in range(warmup):
            inputs, _ = self._communicate(receive_activation=True)
            inputs, output = self._forward(index, inputs, x, y, losses, train=True)
            saved.append((inputs, output))
            self._communicate(activation=output)
        inputs = self._communicate(receive_activation=True)[0] if warmup < micro else None
        for index in range(warmup, micro):
            inputs, output = self._forward(index, inputs, x, y, losses, train=True)
            saved.append((inputs, output))
            _, grad = self._communicate(activation=output, receive_gradient=index - warmup)
            input_grad = self._backward(*saved.popleft(), grad)  # micro-batch index − warmup's
            inputs, _ = self._communicate(gradient=(index - warmup, input_grad), receive_activation=index < micro - 1)
        for index in range(micro - warmup, micro):
            _, grad = self._communicate(receive_gradient=index)
            self._communicate(gradient=(index, self._backward(*saved.popleft(), grad)))
        self._wait_in_flight()
        check_headers(self._incoming)  # the step's one read of the compressed gradients' headers
        return losses

    @staticmethod
    def _mean(losses: list[torch.Tensor]) -> float | None:
        return float(torch.stack(losses).float().mean()) if losses else None

    def train_step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> tuple[float | None, dict]:
        timing = {}
        self.interstage_rank = self._choose_interstage_rank()
        self._received_rank = self._choose_interstage_rank(receiving=True)
        self._incoming = []
        self._bytes = [0, 0]
        self._spans = {key: [] for key in SPANS}
        if self.compressor.interstage is not None:
            self.compressor.interstage.take_bytes()
        start = self.clock.stamp()
        loss = self._mean(self._run_train(x, y))
        end = self.clock.stamp()
        timing["backward_end"] = time.monotonic()
        backward_times = self.timer.take()
        timing["pipeline_s"] = self.clock.seconds(start, end)
        timing["backward_s"] = sum(backward_times)
        for key, spans in self._spans.items():
            timing[f"{key}_s"] = sum(self.clock.seconds(a, b) for a, b in spans)
        timing["sync_s"] = self.compressor.synchronize(backward_times)
        timing["sync_end"] = time.monotonic()
        timing["interstage_bytes_sent"], timing["interstage_bytes_raw"] = self._bytes
        self._sum_tied_gradients()
        if self.cfg.grad_clip > 0:
            self._clip_gradients(self.cfg.grad_clip)
        return loss, timing

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor | None, y: torch.Tensor | None) -> float | None:
        self.module.eval()
        try:
            losses: list[torch.Tensor] = []
            for index in range(self.micro):
                inputs, _ = self._communicate(receive_activation=True)
                self._communicate(activation=self._forward(index, inputs, x, y, losses, train=False)[1])
            self._wait_in_flight()
            return self._mean(losses)
        finally:
            self.module.train()

    def _sum_tied_gradients(self) -> None:
        weight = self.module.tied_weight()
        if self.grid.stages == 1 or self.grid.embedding_group is None or weight is None:
            return
        dist.all_reduce(weight.grad, group=self.grid.embedding_group)

    def _clip_gradients(self, max_norm: float) -> None:
        """torch's clip_grad_norm_ over the whole model: all stages and TP shards (the tied weight once)."""
        skip = self.module.lm_head.weight if (self.module.last and self.grid.stages > 1) else None
        if self.grid.tp > 1:  # shards summed over the TP group, replicated parameters counted once
            squares = tp_squared_norm(self.module.parameters(), self.grid.tp_group, skip).to(self.device)
        else:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None and p is not skip]
            squares = torch.stack([g.detach().float().square().sum() for g in grads]).sum().double().reshape(1)
        dist.all_reduce(squares, group=self.grid.pp_group)
        total = float(squares.sqrt())
        coefficient = min(1.0, max_norm / (total + 1e-6))
        if coefficient < 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coefficient)
