"""The training loop: GPT-2 on one text corpus, data parallel, gradients synchronised by a compressor.

Read top to bottom, like nanoGPT's train.py: set up processes -> data -> model + compressor ->
optimizer -> (resume) -> loop { micro-batches, sync, step, log, eval, checkpoint } -> summary.

Timing, per optimizer step (all in seconds, wall clock on this rank, rank 0 is logged):

- ``step_time_s``: from fetching the first micro-batch to the end of ``optimizer.step()``
  (with a CUDA synchronize first, so queued kernels are counted).
- ``comm_time_s``: time spent in the data-parallel gradient collectives, as reported by the hook.
  Our hooks (``none``, ``powersgd``, ``edgc``) run their collectives synchronously inside the hook and
  time each one, summed over buckets. ``torch-powersgd`` is timed from hook call to completion of its
  future, so its compression work is included there (see compressors.py).
- ``compress_time_s``: time in compression/decompression (P/Q products, orthogonalisation, entropy
  sampling), as reported by the hook; ``entropy_time_s`` is EDGC's entropy-sampling part of it
  (0 on steps that are not sampled, absent for other compressors).
- ``compute_time_s = step_time_s - comm_time_s - compress_time_s``: forward, backward, optimizer.
- ``collectives``: collectives issued by the gradient sync in the step (counted by our engine's
  Communicator; for ``torch-powersgd`` the hook's known pattern per bucket).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import socket
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from edgc.comm import barrier_before_exit

from . import checkpoint as ckpt
from .compressors import build as build_compressor
from .compressors import ddp_kwargs
from .config import TrainConfig
from .data import BlockSampler, prepare_data, val_batches
from .model import build_model, count_parameters, model_shape
from .rendezvous import dist_timeout, join_process_group

# Fields of config.json beyond TrainConfig's own (the report tool reads these).
RUN_FORMAT = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SOLO_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


def setup_distributed(cfg: TrainConfig) -> tuple[int, int, int, torch.device]:
    """Join the process group (torchrun's env:// variables; a 1-process group when run without torchrun)."""
    if "RANK" not in os.environ:  # plain `edgc train`: a group of one, so the same DDP code path runs
        # (train() removes these again, so a caller in the same process is not left "under torchrun")
        os.environ.update(SOLO_ENV, MASTER_PORT=str(free_port()))
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("device cuda requested but CUDA is not available")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    # (not a plain init_process_group: under torchrun a restarted worker could read the keys of the
    # attempt before it; see rendezvous.py)
    join_process_group(backend, dist_timeout())
    return rank, world, local_rank, device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up to 1, then cosine down to ``min_lr_ratio`` at the last step (a multiplier of lr)."""
    warmup, total, floor = cfg.resolved_warmup_steps, cfg.steps, cfg.min_lr_ratio

    def f(step: int) -> float:  # step = optimizer steps already taken
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # Weight decay on matrices only (nanoGPT/GPT-2 practice): biases and LayerNorm gains stay free.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


def open_step_log(path: Path, resume_step: int | None):
    """Open a per-step JSON-lines log for appending: truncated on a fresh run, and on resume cut
    back to the checkpoint (lines after it belong to steps that will be run again)."""
    if resume_step is None:
        path.unlink(missing_ok=True)
    elif path.exists():
        keep = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step]
        ckpt.atomic_write_bytes(path, "".join(line + "\n" for line in keep).encode())
    return open(path, "a")


class CommTrace:
    """``comm_trace/rank{R}.jsonl`` on every rank: each DP collective's seconds per step, in issue
    order. Rank 0's ``comm_time_s`` includes waiting for slower peers; the last rank to reach a
    collective waits for nobody, so the minimum over ranks of each collective is its time on the
    link (``edgc simulate --calibrate`` compares the α–β model with that)."""

    def __init__(self, run_dir: Path, rank: int, enabled: bool, resume_step: int | None):
        self.path = run_dir / "comm_trace" / f"rank{rank}.jsonl" if enabled else None
        self.resume_step, self.f = resume_step, None

    def write(self, step: int, durations) -> None:
        if self.path is None:
            return
        if self.f is None:  # opened at the first step's end: by then rank 0 has created the run folder
            self.path.parent.mkdir(exist_ok=True)
            self.f = open_step_log(self.path, self.resume_step)
        self.f.write(json.dumps({"step": step, "collective_s": list(durations or [])}) + "\n")
        self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


class MetricsLog:
    """``metrics.jsonl`` (flushed per line) and optionally TensorBoard; rank 0 only."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, resume_step: int | None):
        self.enabled, self.tb, self.f = enabled, None, None
        if not enabled:
            return
        self.f = open_step_log(run_dir / "metrics.jsonl", resume_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=(resume_step + 1) if resume_step else None)
            except ImportError:  # tensorboard is optional
                self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "rank"):
                    self.tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])
                elif key == "rank" and value is not None:
                    self.tb.add_scalar(f"{record['kind']}/rank", value, record["step"])

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        if self.tb is not None:
            self.tb.close()
        self.f = self.tb = None


@torch.no_grad()
def evaluate(model: torch.nn.Module, data, cfg: TrainConfig, rank: int, world: int, device: torch.device) -> float:
    """Mean next-token loss over the fixed validation blocks, averaged over all ranks' tokens."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, tokens)
    for x, y in val_batches(data.val, cfg.seq_len, cfg.micro_batch, cfg.eval_batches, rank, world):
        x, y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)
        logits = model(input_ids=x).logits
        totals[0] += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum").double()
        totals[1] += y.numel()
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def verify_replicas(module: torch.nn.Module, group) -> None:
    """Data-parallel replicas must hold bit-identical parameters; a checkpoint refuses to save drift.

    Sharded (FSDP) parameters are compared by their local shards: replicas of a shard hold the same."""
    digest = hashlib.sha256()
    for name, p in module.state_dict().items():
        p = p.to_local() if hasattr(p, "to_local") else p
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest.hexdigest(), group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(f"data-parallel replicas diverged (parameter digests {sorted(set(digests))}); "
                           "not saving a checkpoint of inconsistent replicas")


def save_checkpoint(run_dir: Path, step: int, wall_s: float, rank: int, world: int, runner, optimizer, scheduler,
                    cfg: TrainConfig) -> None:
    if cfg.compressor != "nosync":  # the compute floor never syncs: its replicas drift by design
        verify_replicas(runner.module, runner.dp_group)
    tmp = ckpt.tmp_dir_for(run_dir, step)
    if rank == 0:
        if tmp.exists():  # left by a run that crashed while saving this step: incomplete by definition
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    ckpt.save_rank_files(tmp, rank, runner.sampler.state_dict(), runner.compressor.state_dict())
    if runner.saves_shard:  # one writer per model shard (the whole model, or one pipeline stage)
        ckpt.save_model_shard(tmp, runner.shard, *shard_states(runner, optimizer))
    if rank == 0:
        trainer = {"step": step, "wall_s": wall_s, "world_size": world, "compressor": cfg.compressor,
                   "config": cfg.to_dict()}
        ckpt.save_trainer_files(tmp, scheduler.state_dict(), trainer)
    dist.barrier()  # every rank's files are on disk
    if rank == 0:
        ckpt.finalize(tmp, ckpt.step_dir(run_dir, step), world, runner.shards)
    dist.barrier()  # nobody runs ahead of a checkpoint that is not in place yet


def shard_states(runner, optimizer) -> tuple[dict, dict]:
    """The model and optimizer state this rank writes (FSDP's runner turns DTensors into local tensors)."""
    if hasattr(runner, "shard_states"):
        return runner.shard_states(optimizer)
    return runner.module.state_dict(), optimizer.state_dict()


def load_shard_states(runner, model_sd: dict, optimizer_sd: dict, optimizer) -> None:
    if hasattr(runner, "load_shard_states"):
        runner.load_shard_states(model_sd, optimizer_sd, optimizer)
    else:
        runner.module.load_state_dict(model_sd)
        optimizer.load_state_dict(optimizer_sd)


class DataParallelRunner:
    """The whole model on every rank, wrapped in DDP; gradients synchronised by the compressor's hook.

    The runner interface (shared with `pipeline.PipelineRunner`): ``module`` (the parameters this
    rank trains), ``compressor``, ``sampler``, ``train_step()``, ``mean_loss()``, ``evaluate()``,
    the checkpoint shard this rank writes (``shard``, ``saves_shard``, ``shards``) and the group of
    its data-parallel replicas (``dp_group``, None = all ranks).
    """

    def __init__(self, cfg: TrainConfig, data, rank: int, world: int, local_rank: int, device: torch.device):
        self.cfg, self.data, self.rank, self.world, self.device = cfg, data, rank, world, device
        self.sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, rank, world, cfg.seed)
        seed_everything(cfg.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
        self.shape = model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
        self.module = build_model(self.shape, cfg.dropout).to(device)
        self.n_params = count_parameters(self.module)
        self.ddp = torch.nn.parallel.DistributedDataParallel(
            self.module, device_ids=[local_rank] if device.type == "cuda" else None, **ddp_kwargs(cfg.compressor))
        self.compressor = build_compressor(cfg.compressor, self.ddp, cfg)
        self.shard, self.saves_shard, self.shards = "", rank == 0, ("",)
        self.dp_group = None  # every rank is a replica
        self.tokens_per_step = world * cfg.micro_batch * cfg.grad_accum * cfg.seq_len

    def train_step(self) -> tuple[float, dict]:
        """Forward/backward over grad_accum micro-batches (synchronised on the last), then clip.
        Returns this rank's mean micro-batch loss and extra metrics for the train line."""
        cfg, loss_sum = self.cfg, 0.0
        for micro in range(cfg.grad_accum):
            x, y = self.sampler.next_batch()
            x, y = torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)
            # Gradients are synchronised (the hook runs) only on the last micro-batch.
            with self.sync_context(micro == cfg.grad_accum - 1):
                logits = self.ddp(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.item()
        self.compressor.after_backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), cfg.grad_clip)
        return loss_sum / cfg.grad_accum, {}

    def sync_context(self, sync: bool):
        """Where the micro-batch's backward runs: with or without the gradient sync."""
        return contextlib.nullcontext() if sync else self.ddp.no_sync()

    def mean_loss(self, local: float | None) -> float:
        """The logged loss: the mean over all ranks' micro-batches (one scalar all-reduce, untimed)."""
        loss = torch.tensor([local], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss)
        return loss.item() / self.world

    def evaluate(self) -> float:
        return evaluate(self.module, self.data, self.cfg, self.rank, self.world, self.device)


def make_runner(cfg: TrainConfig, data, rank: int, world: int, local_rank: int, device: torch.device):
    if cfg.fsdp:
        from .fsdp import FSDPRunner

        return FSDPRunner(cfg, data, rank, world, local_rank, device)
    if cfg.pp > 1 or cfg.tp > 1:
        from .pipeline import PipelineRunner

        return PipelineRunner(cfg, data, rank, world, device)
    return DataParallelRunner(cfg, data, rank, world, local_rank, device)


def train(cfg: TrainConfig, run_dir: Path, resume: bool = False, stop_at: int | None = None,
          restart_in_place: bool = False) -> int:
    """Run (or continue) training into ``run_dir``. Returns the process exit code.

    ``restart_in_place``: ``run_dir`` holds an earlier attempt of this same run that died before
    its first checkpoint (``--auto-resume``); start again there instead of refusing the folder."""
    if cfg.device != "cpu":
        # cuBLAS needs this for deterministic GEMMs; it must be set before the first CUDA call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    solo = "RANK" not in os.environ
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    rank, world, local_rank, device = setup_distributed(cfg)
    master = rank == 0
    log = print if master else (lambda *a, **k: None)
    metrics = trace = None
    try:
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        # ---------------------------------------------------------------- data
        data = prepare_data(cfg.data, cfg.vocab_size, cfg.val_fraction, cfg.max_chars, cfg.cache_dir, log=log)

        # ---------------------------------------------------------------- model, parallelism, compressor
        runner = make_runner(cfg, data, rank, world, local_rank, device)
        model, compressor, n_params, shape = runner.module, runner.compressor, runner.n_params, runner.shape
        optimizer = make_optimizer(model, cfg, device)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        # From here on each rank has its own random stream (dropout), restored exactly on resume.
        seed_everything(cfg.seed + 1 + rank)

        # ---------------------------------------------------------------- fresh run or resume
        step, wall_offset = 0, 0.0
        if resume:
            ckpt_dir = ckpt.latest_checkpoint(run_dir)
            trainer = ckpt.verify(ckpt_dir, world)
            load_shard_states(runner, ckpt.load(ckpt_dir / f"model{runner.shard}.pt", device),
                              ckpt.load(ckpt_dir / f"optimizer{runner.shard}.pt", device), optimizer)
            scheduler.load_state_dict(ckpt.load(ckpt_dir / "scheduler.pt"))
            mine = ckpt.load(ckpt_dir / f"rank{rank}.pt")
            runner.sampler.load_state_dict(mine["sampler"])
            compressor.load_state_dict(ckpt.load(ckpt_dir / f"edgc_rank{rank}.pt", device))
            ckpt.set_rng_state(mine["rng"])
            step, wall_offset = trainer["step"], trainer["wall_s"]
            log(f"resuming {run_dir} from {ckpt_dir.name} (step {step})")
        elif master:
            run_dir.mkdir(parents=True, exist_ok=restart_in_place)  # a restart's old logs are truncated below
            write_run_config(run_dir, cfg, n_params, world, shape, data, device, runner.tokens_per_step)
        metrics = MetricsLog(run_dir, master, cfg.tensorboard, step if resume else None)
        trace = CommTrace(run_dir, rank, cfg.comm_trace, step if resume else None)
        log(f"{cfg.preset}: {n_params / 1e6:.2f}M parameters, vocab {data.vocab_size}, "
            f"{data.meta['train_tokens']:,} train tokens, world size {world}, compressor {cfg.compressor}")

        # ---------------------------------------------------------------- the loop
        tokens_per_step = runner.tokens_per_step
        last = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
        progress = None
        if master and cfg.progress and step < last:
            from tqdm import tqdm

            progress = tqdm(total=cfg.steps, initial=step, desc="train", dynamic_ncols=True)
            log = progress.write  # notices go on their own line above the bar, not into it
        t_start = time.perf_counter() - wall_offset
        profiling_told = False
        while step < last:
            t0 = time.perf_counter()
            local_loss, extra = runner.train_step()
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - t0
            step += 1

            sync_metrics = compressor.step_metrics()
            loss_value = runner.mean_loss(local_loss)
            comm, compress = sync_metrics["comm_time_s"] or 0.0, sync_metrics["compress_time_s"] or 0.0
            # With the non-blocking hook comm overlaps compute: only the time the step waited on it
            # is not compute (comm_wait_s; the blocking methods wait for all of their comm).
            waited = sync_metrics.get("comm_wait_s")
            waited = comm if waited is None else waited
            metrics.write({
                "kind": "train", "step": step, "wall_s": time.perf_counter() - t_start, "loss": loss_value,
                "lr": lr, "step_time_s": step_time, "compute_time_s": max(0.0, step_time - waited - compress),
                "comm_time_s": comm, "comm_wait_s": waited, "compress_time_s": compress, "collectives": int(sync_metrics["collectives"] or 0),
                "tokens_per_s": tokens_per_step / step_time,
                "phase": sync_metrics["phase"], "rank": sync_metrics["rank"], "ranks": sync_metrics["ranks"] or {},
                "entropy": sync_metrics["entropy"], "entropy_time_s": sync_metrics.get("entropy_time_s"),
                "relative_error": sync_metrics["relative_error"],
                "rank_budget": sync_metrics.get("rank_budget"), "mean_rank": sync_metrics.get("mean_rank"),
                **{k: int(sync_metrics[k] or 0) for k in ("elements_sent", "elements_raw", "bytes_sent", "bytes_raw")},
                **extra,
            })
            trace.write(step, sync_metrics.get("collective_s"))
            if not profiling_told:
                profiling_told = tell_profiling_verdict(compressor, step, metrics, log)
            if sync_metrics.get("decision"):
                decision = sync_metrics["decision"]
                log(decision["message"])
                metrics.write({"kind": "decision", **decision})
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {step}; lower --lr or check the data")
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss_value:.3f}", rank=sync_metrics["rank"], refresh=False)

            final = step == cfg.steps
            if final or (cfg.eval_every and step % cfg.eval_every == 0):
                val_loss = runner.evaluate()
                metrics.write({"kind": "eval", "step": step, "wall_s": time.perf_counter() - t_start,
                               "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700))})
            if final or step == last or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
                save_checkpoint(run_dir, step, time.perf_counter() - t_start, rank, world, runner, optimizer,
                                scheduler, cfg)
        if progress is not None:
            progress.close()
        if step < cfg.steps:
            log(f"stopped at step {step} of {cfg.steps}; continue with: edgc train --resume {run_dir}")
        elif master:
            summary = write_summary(run_dir)
            log(f"done: {summary['steps']} steps in {summary['wall_s']:.1f} s, val_loss {summary['val_loss']:.4f} "
                f"(ppl {summary['val_ppl']:.1f}), median step {summary['median_step_time_s']:.3f} s, "
                f"waited on comm {summary['median_comm_wait_s']:.4f} s; run folder {run_dir}")
        barrier_before_exit()
        return 0
    finally:
        for log_file in (metrics, trace):
            if log_file is not None:
                log_file.close()
        dist.destroy_process_group()
        torch.use_deterministic_algorithms(deterministic_before)
        if solo:
            for key in (*SOLO_ENV, "MASTER_PORT"):
                os.environ.pop(key, None)


def tell_profiling_verdict(compressor, step: int, metrics, log) -> bool:
    """Once EDGC's profiling has decided: if it switched compression off (or left r_max at its floor),
    say so on one line and log a ``"kind": "notice"`` record (summary.json and the report show it).
    Returns True once there is nothing more to tell."""
    from edgc.rank_control import PROFILE, describe_profiling_verdict

    controller = getattr(getattr(compressor, "state", None), "controller", None)
    if controller is None:
        return True
    if controller.phase == PROFILE:
        return False
    verdict = controller.profiling_verdict()
    if verdict is not None:
        message = describe_profiling_verdict(verdict)
        log(f"step {step}: {message}")
        metrics.write({"kind": "notice", "step": step, "event": f"edgc_{verdict['status']}", "message": message,
                       **verdict})
    return True


def write_run_config(run_dir: Path, cfg: TrainConfig, n_params: int, world: int, shape: dict, data, device,
                     tokens_per_step: int) -> None:
    """``config.json``: the resolved TrainConfig plus what the run derived (contract for `edgc report`)."""
    resolved = cfg.to_dict()
    edgc_cfg = cfg.edgc_config() if cfg.uses_edgc_config else None
    resolved.update({
        "edgc": edgc_cfg.to_dict() if edgc_cfg is not None else None,  # the EDGCConfig actually used
        "edgc_overrides": cfg.edgc,  # what the user set; `--resume` rebuilds the config from this
        "format": RUN_FORMAT, "n_params": n_params, "world_size": world, "model": shape,
        "vocab_size_actual": data.vocab_size, "warmup_steps_resolved": cfg.resolved_warmup_steps,
        "tokens_per_step": tokens_per_step,
        "data_cache": str(data.dir), "train_tokens": data.meta["train_tokens"], "val_tokens": data.meta["val_tokens"],
        "device_type": device.type, "torch": torch.__version__,
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })
    ckpt.atomic_write_json(run_dir / "config.json", resolved)


def config_from_run(run_dir: Path) -> TrainConfig:
    """Rebuild the TrainConfig of an existing run from its ``config.json``."""
    values = json.loads((run_dir / "config.json").read_text())
    fields = set(TrainConfig.__dataclass_fields__)
    values["edgc"] = values.get("edgc_overrides") or {}
    return TrainConfig.from_dict({k: v for k, v in values.items() if k in fields})


def write_summary(run_dir: Path) -> dict:
    """``summary.json`` from the whole ``metrics.jsonl`` (so a resumed run summarises all its steps)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_lines = [r for r in lines if r["kind"] == "train"]
    last_eval = [r for r in lines if r["kind"] == "eval"][-1]
    summary = {
        "steps": train_lines[-1]["step"], "wall_s": train_lines[-1]["wall_s"],
        "final_loss": train_lines[-1]["loss"], "val_loss": last_eval["val_loss"], "val_ppl": last_eval["val_ppl"],
        "median_step_time_s": statistics.median(r["step_time_s"] for r in train_lines),
        "median_comm_time_s": statistics.median(r["comm_time_s"] for r in train_lines),
        # the part of the step spent waiting on collectives (comm_time_s sums overlapping spans)
        "median_comm_wait_s": statistics.median(r.get("comm_wait_s", r["comm_time_s"]) for r in train_lines),
        "median_compress_time_s": statistics.median(r["compress_time_s"] for r in train_lines),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in train_lines),
        "bytes_sent": sum(r["bytes_sent"] for r in train_lines), "bytes_raw": sum(r["bytes_raw"] for r in train_lines),
        "compression_notice": next((r for r in reversed(lines) if r["kind"] == "notice"), None),
        # The byte budget (EDGCConfig.rank_budget) and the mean rank the run actually spent on it.
        "rank_budget": train_lines[-1].get("rank_budget"), "mean_rank": train_lines[-1].get("mean_rank"),
        "rank_decisions": sum(1 for r in lines if r["kind"] == "decision"),
        "rank_changes": sum(1 for r in lines if r["kind"] == "decision" and r["rank"] != r["old_rank"]),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    ckpt.atomic_write_json(run_dir / "summary.json", summary)
    return summary
