"""One optimizer step of a pipeline stage: our own 1F1B / GPipe schedule (`PipelineStep`).

Point-to-point contract (`StageLink.communicate`, stage_link.py). Every message goes through
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
header and a payload (`edgc.parallel.interstage`'s wire contract): the sender posts both in its batch;
the receiver posts the header's receive in its batch and receives the payload in a batch of its
own, its size known from the rank both stages agree on (no host read per micro-batch; the step's
headers are checked once at its end). A batch that receives is waited on at once (its sends with it:
on NCCL it is one work) and its buffers may then be read; a batch that only sends is waited
on at the step's end, and its tensors are kept until then. Before the first step every stage
posts one batch with both neighbours (`StageLink.connect_neighbours`): NCCL creates the group's
communicator on the group's first batched call, which every rank of the group must join.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
import torch.distributed as dist

from .rank_grid import Grid
from .stage import GPT2Stage, module_width, next_token_loss
from .stage_link import StageLink
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


class PipelineStep:
    """Everything one rank does per optimizer step in PP × DP training.

    The schedule is our own (1F1B or GPipe), so that the activation gradients can travel as
    low-rank factors (`edgc.parallel.interstage`) and each micro-batch backward can be timed exactly
    (`BackwardTimer`).

    Its point-to-point traffic follows the contract in the module docstring (`StageLink`).
    """

    def __init__(self, cfg, grid: Grid, module: GPT2Stage, device: torch.device):
        self.cfg, self.grid, self.module, self.device = cfg, grid, module, device
        self.micro = cfg.grad_accum
        self.compressor = StageCompressor(cfg.compressor, module, grid, cfg)
        self.timer = BackwardTimer(device)
        activation_shape = (cfg.micro_batch, cfg.seq_len, module_width(module))
        self.link = StageLink(cfg, grid, self.compressor, activation_shape, device)

    @property
    def interstage_rank(self) -> int | None:
        """The rank of this step's compressed activation gradients (None: sent raw, or none sent)."""
        return self.link.interstage_rank

    # ------------------------------------------------------------------ the schedule
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
        start = self.link.clock.stamp() if train else None
        output = self.module(inputs)
        if self.grid.last:
            target = y[index * self.cfg.micro_batch : (index + 1) * self.cfg.micro_batch]
            loss = next_token_loss(output, target)
            losses.append(loss.detach())
            output = loss / self.micro  # gradients are the mean over micro-batches
        if train:
            self.link.spans["forward"].append((start, self.link.clock.stamp()))
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
            inputs, _ = self.link.communicate(receive_activation=True)
            inputs, output = self._forward(index, inputs, x, y, losses, train=True)
            saved.append((inputs, output))
            self.link.communicate(activation=output)
        inputs = self.link.communicate(receive_activation=True)[0] if warmup < micro else None
        for index in range(warmup, micro):
            inputs, output = self._forward(index, inputs, x, y, losses, train=True)
            saved.append((inputs, output))
            _, grad = self.link.communicate(activation=output, receive_gradient=index - warmup)
            input_grad = self._backward(*saved.popleft(), grad)  # micro-batch index − warmup's
            inputs, _ = self.link.communicate(
                gradient=(index - warmup, input_grad), receive_activation=index < micro - 1
            )
        for index in range(micro - warmup, micro):
            _, grad = self.link.communicate(receive_gradient=index)
            self.link.communicate(gradient=(index, self._backward(*saved.popleft(), grad)))
        self.link.end_step()
        return losses

    @staticmethod
    def _mean(losses: list[torch.Tensor]) -> float | None:
        return float(torch.stack(losses).float().mean()) if losses else None

    def train_step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> tuple[float | None, dict]:
        timing = {}
        self.link.begin_step()
        start = self.link.clock.stamp()
        loss = self._mean(self._run_train(x, y))
        end = self.link.clock.stamp()
        timing["backward_end"] = time.monotonic()
        backward_times = self.timer.take()
        timing["pipeline_s"] = self.link.clock.seconds(start, end)
        timing["backward_s"] = sum(backward_times)
        for key, spans in self.link.spans.items():
            timing[f"{key}_s"] = sum(self.link.clock.seconds(a, b) for a, b in spans)
        timing["sync_s"] = self.compressor.synchronize(backward_times)
        timing["sync_end"] = time.monotonic()
        timing["interstage_bytes_sent"], timing["interstage_bytes_raw"] = self.link.bytes
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
                inputs, _ = self.link.communicate(receive_activation=True)
                self.link.communicate(activation=self._forward(index, inputs, x, y, losses, train=False)[1])
            self.link.wait_in_flight()
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
