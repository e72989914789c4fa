"""Pipeline × data parallelism for `edgc train --pp P`: GPT-2 split into P stages.

Process grid (world = P × D): global rank = d·P + stage, so a whole pipeline (replica d) sits
on consecutive ranks — one host under ``torchrun --nproc_per_node P`` — and each stage's
data-parallel group spans the hosts, which is where gradient compression pays. Stage s's D
replicas form its data-parallel group; the P stages of replica d form pipeline group d; stage 0
and stage P−1 of replica d share the tied word embedding (group "embedding d").

One optimizer step:
1. our own pipeline schedule (1F1B or GPipe, ``isend``/``irecv``, see `PipelineStep`) runs
   ``grad_accum`` micro-batches forward and backward; activations travel raw, activation
   gradients raw or, with ``--interstage all|cooldown``, as low-rank factors with error feedback
   per micro-batch slot (`edgc.interstage`; this changes the model's gradient, lazily: what a
   step does not send is added to the same slot's gradient next step);
2. each stage synchronises its gradients over its DP group with its compressor
   (``state.synchronize``, no DDP — DDP inside pipeline stages is unreliable, env.md §3);
3. the tied embedding: the DP-averaged gradients of stage 0's ``wte`` and stage P−1's
   ``lm_head`` are summed over the embedding group (uncompressed), so both copies get the
   true gradient and stay identical;
4. the global gradient norm is clipped over the whole pipeline, then AdamW steps per stage.

With ``--compressor edgc``, stage 0 leads (entropy-driven rank) and the other stages follow
the DAC alignment (`edgc.pipeline.StageAligner`), which needs each stage's measured sync-time
table: every stage profiles at start-up even when r_max is given.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import edgc
from edgc.interstage import InterStageCompressor, compresses, interstage_rank, recv_gradient, send_gradient
from edgc.pipeline import StageAligner
from edgc.timing import Clock

from .compressors import METRIC_KEYS, Compressor
from .rendezvous import dist_timeout


# ---------------------------------------------------------------------------- process grid
@dataclass
class Grid:
    rank: int
    world: int
    stages: int
    replicas: int
    stage: int  # this rank's pipeline stage
    replica: int  # this rank's data-parallel index
    dp_group: Any
    pp_group: Any
    embedding_group: Any  # None unless this rank holds a tied-embedding copy (first or last stage)
    tp: int = 1  # tensor-parallel degree T
    tp_rank: int = 0
    tp_group: Any = None  # None when tp = 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def global_rank(self, stage: int, replica: int, tp_rank: int | None = None) -> int:
        return (replica * self.stages + stage) * self.tp + (self.tp_rank if tp_rank is None else tp_rank)


def make_grid(rank: int, world: int, stages: int, tp: int = 1) -> Grid:
    """Create every group on every rank, in the same order (new_group is collective).

    rank = (replica·P + stage)·T + tp_rank: a TP group is T consecutive ranks (one host), a
    pipeline P·T consecutive ones; one DP group per (TP rank, stage), one pipeline group and one
    embedding group per (TP rank, replica), one TP group per (stage, replica).
    """
    if world % (stages * tp):
        raise ValueError(f"pp × tp: world size {world} is not a multiple of {stages} stages × {tp} TP ranks")
    replicas = world // (stages * tp)
    rest, tp_rank = divmod(rank, tp)
    replica, stage = divmod(rest, stages)

    def at(s: int, d: int, t: int) -> int:
        return (d * stages + s) * tp + t

    dp_group = pp_group = embedding_group = tp_group = None
    timeout = dist_timeout()  # the default group's; new_group's own default is 30 min on gloo
    for t in range(tp):
        for s in range(stages):
            group = dist.new_group([at(s, d, t) for d in range(replicas)], timeout=timeout)
            if (t, s) == (tp_rank, stage):
                dp_group = group
    for t in range(tp):
        for d in range(replicas):
            group = dist.new_group([at(s, d, t) for s in range(stages)], timeout=timeout)
            if (t, d) == (tp_rank, replica):
                pp_group = group
    if stages > 1:
        for t in range(tp):
            for d in range(replicas):
                group = dist.new_group([at(0, d, t), at(stages - 1, d, t)], timeout=timeout)
                if (t, d) == (tp_rank, replica) and stage in (0, stages - 1):
                    embedding_group = group
    if tp > 1:
        for s in range(stages):
            for d in range(replicas):
                group = dist.new_group([at(s, d, t) for t in range(tp)], timeout=timeout)
                if (s, d) == (stage, replica):
                    tp_group = group
    return Grid(rank, world, stages, replicas, stage, replica, dp_group, pp_group, embedding_group,
                tp, tp_rank, tp_group)


# ---------------------------------------------------------------------------- stage modules
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


def layer_split(n_layer: int, stages: int) -> list[range]:
    """Contiguous blocks per stage, as even as possible (earlier stages get the extra block)."""
    base, extra = divmod(n_layer, stages)
    bounds, start = [], 0
    for s in range(stages):
        size = base + (1 if s < extra else 0)
        if size < 1:
            raise ValueError(f"pp: {stages} stages need at least {stages} transformer blocks, the model has {n_layer}")
        bounds.append(range(start, start + size))
        start += size
    return bounds


class GPT2Stage(nn.Module):
    """Stage s of a ``GPT2LMHeadModel``: [embeddings] → blocks → [final LayerNorm, LM head]."""

    def __init__(self, model, stage: int, stages: int, tp_rank: int = 0, tp: int = 1, tp_group=None):
        super().__init__()
        transformer = model.transformer
        self.first, self.last = stage == 0, stage == stages - 1
        if self.first:
            self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop
        blocks = [transformer.h[i] for i in layer_split(len(transformer.h), stages)[stage]]
        if tp > 1:
            from .tensor_parallel import TPBlock

            blocks = [TPBlock(block, tp_rank, tp, tp_group) for block in blocks]
        self.h = nn.ModuleList(blocks)
        if self.last and self.first:  # one stage (--tp without --pp): the weight stays tied
            self.ln_f = transformer.ln_f
            self.lm_head = model.lm_head
        elif self.last:
            self.ln_f = transformer.ln_f
            # The LM head shares its weight with wte in the full model; on its own stage it is a
            # separate copy kept equal by summing both gradients (see module docstring, step 3).
            self.lm_head = torch.nn.utils.skip_init(nn.Linear, model.lm_head.in_features,
                                                    model.lm_head.out_features, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(model.lm_head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x

    def tied_weight(self) -> torch.Tensor | None:
        if self.first and self.last:
            return None  # tied in place
        if self.first:
            return self.wte.weight
        if self.last:
            return self.lm_head.weight
        return None


def module_width(module: GPT2Stage) -> int:
    """The hidden size of the activations between stages."""
    return module.h[0].ln_1.normalized_shape[0]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------------------- compressors per stage
class StageCompressor(Compressor):
    """A stage's gradient sync over its DP group: ``none``, ``powersgd``, ``optimus-cc`` or ``edgc``."""

    def __init__(self, name: str, module: GPT2Stage, grid: Grid, cfg):
        self.name, self.module, self.grid = name, module, grid
        self.aligner: StageAligner | None = None
        self.replicated_bytes = 0  # --tp: bytes of the replicated parameters' raw DP all-reduce
        # The activation-gradient sender (every stage but the first) when --interstage is on.
        self.interstage = (InterStageCompressor(seed=cfg.seed)
                           if getattr(cfg, "interstage", "off") != "off" and grid.stage > 0 else None)
        compress = name in ("powersgd", "edgc") or (name == "optimus-cc" and grid.stage < cfg.selective_stages)
        if not compress:
            self.state: edgc.GradientReducer = edgc.AllReduceState(grid.dp_group, model=module)
        elif name == "edgc":
            self.state = edgc.EDGCState(grid.dp_group, cfg.edgc_config(), model=module,
                                        follower=grid.stage > 0, always_profile=grid.stages > 1)
            self.aligner = StageAligner(self.state, grid.stage, grid.stages, grid.pp_group, tp_group=grid.tp_group)
        else:  # one static rank: on every stage (powersgd) or on the first k (optimus-cc)
            self.state = edgc.EDGCState(grid.dp_group, cfg.edgc_config(), model=module)  # static for these two

    def synchronize(self, backward_times: list[float]) -> float:
        start = time.perf_counter()
        if self.grid.tp > 1:
            # The compressor gets this rank's TP shards; replicated parameters (LayerNorms,
            # row-parallel biases, embeddings, LM head) are averaged raw, so the TP ranks' copies
            # stay identical whatever rank each TP rank's DP group chose.
            from .tensor_parallel import is_sharded

            named = list(self.module.named_parameters())
            self.state.synchronize([(n, p) for n, p in named if is_sharded(p)])
            self.replicated_bytes = self._mean_raw([p for _, p in named if not is_sharded(p)])
        else:
            self.state.synchronize(self.module.named_parameters())
        seconds = time.perf_counter() - start
        if self.aligner is not None:
            for sample in backward_times:
                self.aligner.record_backward_time(sample)
            self.aligner.after_sync()
        return seconds

    def _mean_raw(self, parameters: list) -> int:
        """Plain all-reduce-mean of these gradients over the DP group (one flat buffer); its bytes."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return 0
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.grid.dp_group)
        flat /= self.grid.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat.numel() * flat.element_size()

    def entropy_rank(self) -> int | None:
        """The pipeline's entropy-driven rank (stage 0's, from the latest DAC window boundary), or
        None while stage 0 does not compress. Not this stage's own DP rank: DAC may leave a
        stage's DP sync raw because it has slack on the DP link, which says nothing about the
        inter-stage link."""
        return self.aligner.leader_rank if self.aligner is not None else None

    def step_metrics(self) -> dict[str, Any]:
        m = self.state.last_step_metrics or {}
        return {k: m.get(k) for k in METRIC_KEYS}

    def state_dict(self) -> Any:
        return {"state": self.state.state_dict(), "aligner": self.aligner.state_dict() if self.aligner else None,
                "interstage": self.interstage.state_dict() if self.interstage else None}

    def load_state_dict(self, sd: Any) -> None:
        self.state.load_state_dict(sd["state"])
        if self.aligner is not None:
            self.aligner.load_state_dict(sd["aligner"])
        if self.interstage is not None and sd.get("interstage") is not None:
            self.interstage.load_state_dict(sd["interstage"], device=next(self.module.parameters()).device)


# ---------------------------------------------------------------------------- one optimizer step
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
            from .tensor_parallel import tp_squared_norm

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


# ---------------------------------------------------------------------------- per-stage metrics
SPANS = ("interstage", "interstage_wire", "interstage_compress", "forward")  # PipelineStep._spans, logged as <key>_s
STAGE_FIELDS = ("rank", "sync_s", "backward_end", "sync_end", "t_b_s", "predicted_s", "budget_s",
                "bytes_sent", "bytes_raw", "elements_sent", "elements_raw", "interstage_rank",
                "interstage_bytes_sent", "interstage_bytes_raw", "interstage_s", "interstage_wire_s",
                "interstage_compress_s", "forward_s", "backward_s", "pipeline_s")


def stage_metrics(step: PipelineStep, timing: dict) -> list[dict]:
    """Each stage's numbers for replica 0, TP rank 0 (gathered on every rank; rank 0 writes them)."""
    grid, compressor = step.grid, step.compressor
    m = compressor.state.last_step_metrics or {}
    plan = compressor.aligner.last_plan if compressor.aligner else None
    mine = [m.get("rank"), timing["sync_s"], timing["backward_end"], timing["sync_end"],
            compressor.aligner.last_backward_time if compressor.aligner else None,
            plan[grid.stage].predicted if plan else None, plan[grid.stage].budget if plan else None,
            (m.get("bytes_sent") or 0) + compressor.replicated_bytes, (m.get("bytes_raw") or 0) + compressor.replicated_bytes,
            m.get("elements_sent"), m.get("elements_raw"),
            step.interstage_rank, timing["interstage_bytes_sent"], timing["interstage_bytes_raw"],
            timing["interstage_s"], timing["interstage_wire_s"], timing["interstage_compress_s"], timing["forward_s"],
            timing["backward_s"], timing["pipeline_s"]]
    row = torch.tensor([math.nan if v is None else float(v) for v in mine], dtype=torch.float64, device=step.device)
    rows = [torch.empty_like(row) for _ in range(grid.world)]
    dist.all_gather(rows, row)
    first_backward_end = min(float(rows[grid.global_rank(s, 0, 0)][2]) for s in range(grid.stages))
    out = []
    for s in range(grid.stages):
        values = dict(zip(STAGE_FIELDS, rows[grid.global_rank(s, 0, 0)].tolist()))
        replica_ranks = {str(rows[grid.global_rank(s, d, 0)][0].item()) for d in range(grid.replicas)}
        tp_ranks = {str(rows[grid.global_rank(s, d, t)][0].item()) for d in range(grid.replicas) for t in range(grid.tp)}
        for key in ("bytes_sent", "bytes_raw", "elements_sent", "elements_raw"):  # all TP ranks' shards
            column = STAGE_FIELDS.index(key)
            values[key] = sum(float(rows[grid.global_rank(s, 0, t)][column]) for t in range(grid.tp))
        out.append({
            "stage": s,
            "rank": None if math.isnan(values["rank"]) else int(values["rank"]),
            "replicas_agree": len(replica_ranks) == 1,  # every replica of the stage used this rank
            "tp_agree": len(tp_ranks) == 1,  # … and every TP rank of every replica (1 when tp = 1)
            "sync_time_s": values["sync_s"],
            # when this stage's backward ended / its sync ended, after the earliest backward end
            "backward_end_s": values["backward_end"] - first_backward_end,
            "sync_finish_s": values["sync_end"] - first_backward_end,
            "t_b_s": None if math.isnan(values["t_b_s"]) else values["t_b_s"],
            "predicted_s": None if math.isnan(values["predicted_s"]) else values["predicted_s"],
            "budget_s": None if math.isnan(values["budget_s"]) else values["budget_s"],
            # the activation gradients this stage sent to stage s − 1 (0 on stage 0); rank None = raw
            "interstage_rank": None if math.isnan(values["interstage_rank"]) else int(values["interstage_rank"]),
            **{k: int(values[k]) if not math.isnan(values[k]) else 0
               for k in ("bytes_sent", "bytes_raw", "elements_sent", "elements_raw",
                         "interstage_bytes_sent", "interstage_bytes_raw")},
            # seconds this step (edgc.timing.Clock): activation-gradient exchanges and, with --interstage
            # on, their payload transfers and compress/decompress (PipelineStep._spans), forward and
            # backward compute summed over the micro-batches, the whole schedule
            **{k: values[k] for k in ("interstage_s", "interstage_wire_s", "interstage_compress_s", "forward_s",
                                      "backward_s", "pipeline_s")},
        })
    return out


# ---------------------------------------------------------------------------- the runner used by train.py
class PipelineRunner:
    """`edgc train --pp P`: this rank's stage of the model; same interface as `train.DataParallelRunner`."""

    def __init__(self, cfg, data, rank: int, world: int, device: torch.device):
        from .data import BlockSampler
        from .model import build_model, count_parameters, model_shape
        from .train import seed_everything

        self.cfg, self.data, self.device = cfg, data, device
        self.grid = make_grid(rank, world, cfg.pp, cfg.tp)
        # Stages 0 and P−1 of one replica read the same blocks (inputs and targets).
        self.sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, self.grid.replica,
                                    self.grid.replicas, cfg.seed)
        seed_everything(cfg.seed)  # the full model is built identically everywhere, then cut
        self.shape = model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
        full = build_model(self.shape, cfg.dropout)
        self.n_params = count_parameters(full)
        self.module = GPT2Stage(full, self.grid.stage, self.grid.stages, self.grid.tp_rank, self.grid.tp,
                                self.grid.tp_group).to(device)
        self.step = PipelineStep(cfg, self.grid, self.module, device)
        self.compressor = self.step.compressor
        tp_part = (lambda t: f"_tp{t}") if cfg.tp > 1 else (lambda t: "")
        self.shard = f"_stage{self.grid.stage}{tp_part(self.grid.tp_rank)}"
        self.saves_shard = self.grid.replica == 0
        self.shards = tuple(f"_stage{s}{tp_part(t)}" for s in range(self.grid.stages) for t in range(self.grid.tp))
        self.dp_group = self.grid.dp_group
        self.tokens_per_step = self.grid.replicas * cfg.micro_batch * cfg.grad_accum * cfg.seq_len

    def _batch(self, blocks) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.from_numpy(np.concatenate([b[0] for b in blocks])).to(self.device)
        y = torch.from_numpy(np.concatenate([b[1] for b in blocks])).to(self.device)
        return x, y

    def train_step(self) -> tuple[float | None, dict]:
        # Every stage advances the sampler so all ranks hold the same position in checkpoints.
        x, y = self._batch([self.sampler.next_batch() for _ in range(self.cfg.grad_accum)])
        loss, timing = self.step.train_step(x, y)
        stages = stage_metrics(self.step, timing)
        totals = {k: sum(s[k] for s in stages) for k in ("bytes_sent", "bytes_raw", "elements_sent", "elements_raw",
                                                          "interstage_bytes_sent", "interstage_bytes_raw")}
        # bytes of the whole pipeline (replica 0); inter-stage seconds summed over its stages
        return loss, {"stages": stages, **totals, "interstage_time_s": sum(s["interstage_s"] for s in stages)}

    def mean_loss(self, local: float | None) -> float:
        """Mean over replicas of the last stage's mean micro-batch loss."""
        loss = torch.tensor([local if self.grid.last else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss)
        return loss.item() / (self.grid.replicas * self.grid.tp)  # every TP rank of the last stage has it

    def evaluate(self) -> float:
        """Validation through the pipeline (forward only), ``grad_accum`` micro-batches at a time."""
        from .data import val_batches

        cfg = self.cfg
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        chunk: list = []
        for batch in val_batches(self.data.val, cfg.seq_len, cfg.micro_batch, cfg.eval_batches,
                                 self.grid.replica, self.grid.replicas):
            chunk.append(batch)
            if len(chunk) == cfg.grad_accum:
                x, y = self._batch(chunk)
                loss = self.step.eval_loss(x, y)
                if loss is not None:
                    totals += torch.tensor([loss * y.numel(), y.numel()], dtype=torch.float64, device=self.device)
                chunk = []
        dist.all_reduce(totals)
        return (totals[0] / totals[1]).item()
