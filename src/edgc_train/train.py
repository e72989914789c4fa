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

import hashlib
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from edgc.distributed.comm import barrier_before_exit

from . import checkpoint as ckpt
from .config import TrainConfig
from .data import prepare_data
from .rendezvous import dist_timeout, join_process_group
from .run_folder import CommTrace, EDGCRecords, MetricsLog, write_run_config, write_summary
from .runner import DataParallelRunner, seed_everything

SOLO_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def setup_distributed(cfg: TrainConfig) -> tuple[int, int, int, torch.device]:
    """Join the process group (torchrun's env:// variables; a 1-process group when run without torchrun)."""
    alone = "RANK" not in os.environ
    if alone:  # plain `edgc train`: a group of one, so the same DDP code path runs
        # (train() removes these again, so a caller in the same process is not left "under torchrun")
        os.environ.update(SOLO_ENV)
    rank, world, local_rank = (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK", 0)),
    )
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
    join_process_group(backend, dist_timeout(), alone=alone)
    return rank, world, local_rank, device


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


def verify_replicas(module: torch.nn.Module, group) -> None:
    """Data-parallel replicas must hold bit-identical parameters: checked before every checkpoint (which
    refuses to save drift) and at the end of every run, checkpointed or not.

    Sharded (FSDP) parameters are compared by their local shards: replicas of a shard hold the same."""
    digest = hashlib.sha256()
    for name, p in module.state_dict().items():
        p = p.to_local() if hasattr(p, "to_local") else p
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest.hexdigest(), group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(
            f"data-parallel replicas diverged (parameter digests {sorted(set(digests))}); "
            "no checkpoint of inconsistent replicas is saved"
        )


def save_checkpoint(
    run_dir: Path, step: int, wall_s: float, rank: int, world: int, runner, optimizer, scheduler, cfg: TrainConfig
) -> None:
    """Every rank writes its files of ``step`` (the replicas were verified just before: `verify_replicas`)."""
    tmp = ckpt.tmp_dir_for(run_dir, step)
    if rank == 0:
        if tmp.exists():  # left by a run that crashed while saving this step: incomplete by definition
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    ckpt.save_rank_files(tmp, rank, runner.sampler.state_dict(), runner.compressor.state_dict())
    if runner.saves_shard:  # one writer per model shard (the whole model, or one pipeline stage)
        ckpt.save_model_shard(tmp, runner.shard, *ckpt.model_and_optimizer_state(runner.module, optimizer))
    if rank == 0:
        trainer = {
            "step": step,
            "wall_s": wall_s,
            "world_size": world,
            "compressor": cfg.compressor,
            "config": cfg.to_dict(),
        }
        ckpt.save_trainer_files(tmp, scheduler.state_dict(), trainer)
    dist.barrier()  # every rank's files are on disk
    if rank == 0:
        ckpt.finalize(tmp, ckpt.step_dir(run_dir, step), world, runner.shards)
    dist.barrier()  # nobody runs ahead of a checkpoint that is not in place yet


def make_runner(cfg: TrainConfig, data, rank: int, world: int, local_rank: int, device: torch.device):
    if cfg.moe_experts:
        from .moe_runner import MoERunner

        return MoERunner(cfg, data, rank, world, local_rank, device)
    if cfg.fsdp:
        from .fsdp_runner import FSDPRunner

        return FSDPRunner(cfg, data, rank, world, local_rank, device)
    if cfg.pp > 1 or cfg.tp > 1:
        from .pipeline_runner import PipelineRunner

        return PipelineRunner(cfg, data, rank, world, device)
    return DataParallelRunner(cfg, data, rank, world, local_rank, device)


def resume_from_checkpoint(run_dir: Path, runner, optimizer, scheduler, rank: int, world: int, device, log):
    """Load the run's latest checkpoint into this rank's parts; returns its step and wall time."""
    ckpt_dir = ckpt.latest_checkpoint(run_dir)
    trainer = ckpt.verify(ckpt_dir, world)
    ckpt.load_model_and_optimizer_state(
        runner.module,
        optimizer,
        ckpt.load(ckpt_dir / f"model{runner.shard}.pt", device),
        ckpt.load(ckpt_dir / f"optimizer{runner.shard}.pt", device),
    )
    scheduler.load_state_dict(ckpt.load(ckpt_dir / "scheduler.pt"))
    mine = ckpt.load(ckpt_dir / f"rank{rank}.pt")
    runner.sampler.load_state_dict(mine["sampler"])
    runner.compressor.load_state_dict(ckpt.load(ckpt_dir / f"edgc_rank{rank}.pt", device))
    ckpt.set_rng_state(mine["rng"])
    log(f"resuming {run_dir} from {ckpt_dir.name} (step {trainer['step']})")
    return trainer["step"], trainer["wall_s"]


def train_record(
    step: int, wall_s: float, loss: float, lr: float, step_time: float, tokens_per_step: int, sync: dict, extra: dict
) -> dict:
    """One training step's line of metrics.jsonl, from the sync's metrics and the runner's extras."""
    comm, compress = sync["comm_time_s"] or 0.0, sync["compress_time_s"] or 0.0
    # With the non-blocking hook comm overlaps compute: only the time the step waited on it
    # is not compute (comm_wait_s; the blocking methods wait for all of their comm).
    waited = sync.get("comm_wait_s")
    waited = comm if waited is None else waited
    return {
        "kind": "train",
        "step": step,
        "wall_s": wall_s,
        "loss": loss,
        "lr": lr,
        "step_time_s": step_time,
        "compute_time_s": max(0.0, step_time - waited - compress),
        "comm_time_s": comm,
        "comm_wait_s": waited,
        "compress_time_s": compress,
        "collectives": int(sync["collectives"] or 0),
        "tokens_per_s": tokens_per_step / step_time,
        "phase": sync["phase"],
        "rank": sync["rank"],
        "ranks": sync["ranks"] or {},
        "entropy": sync["entropy"],
        "entropy_time_s": sync.get("entropy_time_s"),
        "relative_error": sync["relative_error"],
        "rank_budget": sync.get("rank_budget"),
        "mean_rank": sync.get("mean_rank"),
        **{k: int(sync[k] or 0) for k in ("elements_sent", "elements_raw", "bytes_sent", "bytes_raw")},
        **extra,
    }


def eval_record(step: int, wall_s: float, val_loss: float) -> dict:
    return {
        "kind": "eval",
        "step": step,
        "wall_s": wall_s,
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 700)),
    }


def evaluate_verify_and_save(
    cfg: TrainConfig,
    run_dir: Path,
    step: int,
    last: int,
    t_start: float,
    rank,
    world,
    runner,
    optimizer,
    scheduler,
    metrics,
) -> None:
    """What a step may be due: an evaluation, the replicas compared, a checkpoint."""
    final = step == cfg.steps
    if final or (cfg.eval_every and step % cfg.eval_every == 0):
        metrics.write(eval_record(step, time.perf_counter() - t_start, runner.evaluate()))
    checkpoint = cfg.ckpt_every >= 0 and (final or step == last or (cfg.ckpt_every and step % cfg.ckpt_every == 0))
    if (checkpoint or final) and cfg.compressor != "nosync":  # nosync never syncs: drift by design
        if hasattr(runner, "verify_replicas"):  # replicas over more than one group (experts)
            runner.verify_replicas(verify_replicas)
        else:
            verify_replicas(runner.module, runner.dp_group)
    if checkpoint:
        save_checkpoint(run_dir, step, time.perf_counter() - t_start, rank, world, runner, optimizer, scheduler, cfg)


def say_how_it_ended(cfg: TrainConfig, run_dir: Path, step: int, master: bool, log) -> None:
    """How to go on from a stopped run, or the finished run's summary (written here)."""
    if step < cfg.steps and cfg.ckpt_every < 0:
        log(f"stopped at step {step} of {cfg.steps}; no checkpoint was written (--ckpt-every -1), so it cannot resume")
    elif step < cfg.steps:
        log(f"stopped at step {step} of {cfg.steps}; continue with: edgc train --resume {run_dir}")
    elif master:
        summary = write_summary(run_dir)
        log(
            f"done: {summary['steps']} steps in {summary['wall_s']:.1f} s, val_loss {summary['val_loss']:.4f} "
            f"(ppl {summary['val_ppl']:.1f}), median step {summary['median_step_time_s']:.3f} s, "
            f"waited on comm {summary['median_comm_wait_s']:.4f} s; run folder {run_dir}"
        )


def describe_run(cfg: TrainConfig, n_params: int, data, world: int) -> str:
    return (
        f"{cfg.preset}: {n_params / 1e6:.2f}M parameters, vocab {data.vocab_size}, "
        f"{data.meta['train_tokens']:,} train tokens, world size {world}, compressor {cfg.compressor}"
    )


def progress_bar(steps: int, step: int):
    from tqdm import tqdm

    return tqdm(total=steps, initial=step, desc="train", dynamic_ncols=True)


def timed_step(runner, optimizer, scheduler, device) -> tuple:
    """One optimizer step, forward and backward included: the local loss, the runner's extra metrics,
    the learning rate it used and its wall time (to the device's end on CUDA)."""
    t0 = time.perf_counter()
    local_loss, extra = runner.train_step()
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return local_loss, extra, lr, time.perf_counter() - t0


def leave_distributed(deterministic_before: bool, solo: bool) -> None:
    """Undo what setup_distributed set, so that a second run in this process starts clean."""
    dist.destroy_process_group()
    torch.use_deterministic_algorithms(deterministic_before)
    if solo:
        for key in SOLO_ENV:
            os.environ.pop(key, None)


def train(
    cfg: TrainConfig, run_dir: Path, resume: bool = False, stop_at: int | None = None, restart_in_place: bool = False
) -> int:
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
    metrics = trace = records = None
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
            step, wall_offset = resume_from_checkpoint(run_dir, runner, optimizer, scheduler, rank, world, device, log)
        elif master:
            run_dir.mkdir(parents=True, exist_ok=restart_in_place)  # a restart's old logs are truncated below
            write_run_config(run_dir, cfg, n_params, world, shape, data, device, runner.tokens_per_step)
        metrics = MetricsLog(run_dir, master, cfg.tensorboard, step if resume else None)
        trace = CommTrace(run_dir, rank, cfg.comm_trace, step if resume else None)
        records = EDGCRecords(log, metrics)  # what EDGC decides, as the library logs it (edgc.control.events)
        log(describe_run(cfg, n_params, data, world))

        # ---------------------------------------------------------------- the loop
        tokens_per_step = runner.tokens_per_step
        last = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
        progress = progress_bar(cfg.steps, step) if master and cfg.progress and step < last else None
        if progress is not None:
            log = records.say = progress.write  # notices go on their own line above the bar, not into it
        t_start = time.perf_counter() - wall_offset
        while step < last:
            local_loss, extra, lr, step_time = timed_step(runner, optimizer, scheduler, device)
            step += 1

            sync_metrics = compressor.step_metrics()
            loss_value = runner.mean_loss(local_loss)
            wall = time.perf_counter() - t_start
            metrics.write(train_record(step, wall, loss_value, lr, step_time, tokens_per_step, sync_metrics, extra))
            trace.write(step, sync_metrics.get("collective_s"))
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss is {loss_value} at step {step}; lower --lr or check the data")
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss_value:.3f}", rank=sync_metrics["rank"], refresh=False)

            evaluate_verify_and_save(
                cfg, run_dir, step, last, t_start, rank, world, runner, optimizer, scheduler, metrics
            )
        if progress is not None:
            progress.close()
        say_how_it_ended(cfg, run_dir, step, master, log)
        barrier_before_exit()
        return 0
    finally:
        for log_file in (records, metrics, trace):
            if log_file is not None:
                log_file.close()
        leave_distributed(deterministic_before, solo)
