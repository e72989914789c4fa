"""One optimizer step of a pipeline stage: our own 1F1B / GPipe schedule (`PipelineStep`)."""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from edgc.interstage import compresses, interstage_rank, recv_gradient, send_gradient
from edgc.timing import Clock

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


class PipelineStep:
    """Everything one rank does per optimizer step in PP × DP training.

    The schedule is our own (1F1B or GPipe with ``isend``/``irecv``), so that the activation
    gradients can travel as low-rank factors (`edgc.interstage`) and each micro-batch backward
    can be timed exactly (`BackwardTimer`). Sends never block (their works are waited on at the
    step's end) and receives do, so the only waits are the data dependencies of the schedule.
    Tags: 0 activations (forward), 1 activation gradients (backward).
    """

    def __init__(self, cfg, grid: Grid, module: GPT2Stage, device: torch.device):
        self.cfg, self.grid, self.module, self.device = cfg, grid, module, device
        self.micro = cfg.grad_accum
        self.mode = getattr(cfg, "interstage", "off")
        self.compressor = StageCompressor(cfg.compressor, module, grid, cfg)
        self.timer = BackwardTimer(device)
        self.activation_shape = (cfg.micro_batch, cfg.seq_len, module_width(module))
        self.interstage_rank: int | None = None  # the rank of this step's compressed gradients
        self._sends: list = []
        self._bytes = [0, 0]  # activation-gradient bytes sent, raw, this step
        # Stamps of this step's spans, turned into seconds once at its end (no host sync per
        # micro-batch on CUDA): "interstage" = each activation-gradient exchange (sender: compress
        # and issue the send; receiver: blocked in the receive, which includes waiting for the
        # next stage's backward, and decompress), "forward" = each micro-batch's forward compute; with
        # --interstage on, also the parts "interstage_wire" (receiver: the payload's transfer, from its
        # header's arrival) and "interstage_compress" (sender: compress; receiver: decompress).
        self.clock = Clock(device)
        self._spans: dict[str, list] = {key: [] for key in SPANS}

    # ------------------------------------------------------------------ point to point
    def _prev(self) -> int:
        return self.grid.global_rank(self.grid.stage - 1, self.grid.replica)

    def _next(self) -> int:
        return self.grid.global_rank(self.grid.stage + 1, self.grid.replica)

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(self.activation_shape, dtype=torch.float32, device=self.device)
        dist.recv(buffer, src, tag=tag)
        return buffer

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self._sends.append((dist.isend(tensor, dst, tag=tag), tensor))

    def _wait_sends(self) -> None:
        for entry in self._sends:
            entry[0].wait()
        self._sends = []

    def _compresses(self, index: int) -> bool:
        """Whether micro-batch ``index``'s activation gradient goes out compressed."""
        return compresses(self.mode, index, self.micro, self.grid.stages)

    def _send_gradient(self, index: int, grad: torch.Tensor) -> None:
        start = self.clock.stamp()
        raw = grad.numel() * grad.element_size()
        if self.compressor.interstage is None:
            self._send(grad, self._prev(), tag=1)
            self._bytes[0] += raw
            self._bytes[1] += raw
        else:
            rank = self.interstage_rank if self._compresses(index) else None
            packet = self.compressor.interstage.compress(index, grad, rank)
            self._spans["interstage_compress"].append((start, self.clock.stamp()))
            self._sends.extend(send_gradient(packet, self._prev(), tag=1))
            self._bytes[0] += packet.nbytes
            self._bytes[1] += raw
        self._spans["interstage"].append((start, self.clock.stamp()))

    def _recv_gradient(self) -> torch.Tensor:
        start = self.clock.stamp()
        if self.mode == "off":
            grad = self._recv(self._next(), tag=1)
            self._spans["interstage"].append((start, self.clock.stamp()))
            return grad
        marks: list = []  # header arrived, payload arrived
        grad = recv_gradient(self.activation_shape, self._next(), device=self.device, tag=1,
                             mark=lambda: marks.append(self.clock.stamp()))
        end = self.clock.stamp()
        self._spans["interstage_wire"].append((marks[0], marks[1]))
        self._spans["interstage_compress"].append((marks[1], end))
        self._spans["interstage"].append((start, end))
        return grad

    # ------------------------------------------------------------------ the schedule
    def _choose_interstage_rank(self) -> int | None:
        cfg, compressor = self.cfg, self.compressor
        if compressor.interstage is None:
            return None
        if compressor.name == "edgc":
            # EDGC: follow the pipeline's entropy-driven rank within the inter-stage bounds; raw
            # while stage 0 is not compressing (EDGC's warm-up holds for this traffic too).
            return interstage_rank(compressor.entropy_rank(), cfg.interstage_min_rank, cfg.interstage_rank)
        return cfg.interstage_rank

    def _forward(self, index: int, x: torch.Tensor | None, y: torch.Tensor | None, losses: list, train: bool):
        if self.grid.first:
            inputs = x[index * self.cfg.micro_batch:(index + 1) * self.cfg.micro_batch]
        else:
            inputs = self._recv(self._prev(), tag=0)
            if train:
                inputs.requires_grad_(True)
        start = self.clock.stamp() if train else None
        output = self.module(inputs)
        if self.grid.last:
            target = y[index * self.cfg.micro_batch:(index + 1) * self.cfg.micro_batch]
            loss = next_token_loss(output, target)
            losses.append(loss.detach())
            output = loss / self.micro  # gradients are the mean over micro-batches
        if train:
            self._spans["forward"].append((start, self.clock.stamp()))
        if not self.grid.last:
            self._send(output, self._next(), tag=0)
        return inputs, output

    def _backward(self, index: int, inputs: torch.Tensor, output: torch.Tensor) -> None:
        grad = None if self.grid.last else self._recv_gradient()
        self.timer.start()
        torch.autograd.backward(output, grad)
        self.timer.stop()
        if not self.grid.first:
            self._send_gradient(index, inputs.grad)

    def _run_train(self, x, y) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        micro, stages, stage = self.micro, self.grid.stages, self.grid.stage
        warmup = micro if self.cfg.pp_schedule == "gpipe" else min(stages - stage - 1, micro)
        saved: dict[int, tuple] = {}
        backward_next = 0
        for index in range(micro):
            saved[index] = self._forward(index, x, y, losses, train=True)
            if index >= warmup:
                self._backward(backward_next, *saved.pop(backward_next))
                backward_next += 1
        while backward_next < micro:
            self._backward(backward_next, *saved.pop(backward_next))
            backward_next += 1
        self._wait_sends()
        return losses

    @staticmethod
    def _mean(losses: list[torch.Tensor]) -> float | None:
        return float(torch.stack(losses).float().mean()) if losses else None

    def train_step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> tuple[float | None, dict]:
        timing = {}
        self.interstage_rank = self._choose_interstage_rank()
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
                self._forward(index, x, y, losses, train=False)
            self._wait_sends()
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
