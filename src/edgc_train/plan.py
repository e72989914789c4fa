"""Several `edgc train` jobs, one after another, in the same torchrun workers: one launch, several runs.

    python -m edgc_train.plan --nproc N PLAN.json

A process costs seconds of interpreter and imports (torch, DTensor, transformers) before its first
step, more than a short job's training; a plan pays them once for all its jobs. PLAN is a JSON list of
steps, run in order on every rank:

* ``{"train": [ARG, ...]}``: ``edgc train ARG ...`` (without ``--nproc``), as each worker of
  ``edgc train --nproc N`` runs it: the same flags, checks, ``--resume`` verification and training;
* ``{"cut_back": [RUN, COPY, STEP]}``: rank 0 copies the run folder RUN to COPY without its step-STEP
  checkpoint and its summary (a run interrupted before that checkpoint, for a ``--resume`` to continue);
  the other ranks wait for the copy.

A step may carry ``"nproc": K`` (K ≤ N): ranks 0..K-1 alone take it, in a process group of K (K = 1:
a plain single-process run, no group to join). Steps of a smaller world come last (the ``nproc`` never
grows along the plan): a rank that no later step needs is done. The first step that fails stops the
launch: torchrun reports the failed worker and the launcher exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

# How long a rank waits at a step's barrier for rank 0 (a copy of a run folder: seconds).
BARRIER_TIMEOUT = timedelta(seconds=300)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def check_plan(plan: list[dict], nproc: int) -> None:
    """Each step is one of the two kinds, and its ``nproc`` is within the launch and never grows."""
    world = nproc
    for i, step in enumerate(plan):
        if len({"train", "cut_back"} & set(step)) != 1:
            raise ValueError(f"plan step {i}: needs exactly one of 'train' or 'cut_back', got {sorted(step)}")
        size = step.get("nproc", nproc)
        if not 1 <= size <= world:
            raise ValueError(f"plan step {i}: nproc {size} must be in [1, {world}] (never above the step before)")
        world = size


def cut_back(run_dir: Path, copy: Path, step: int) -> None:
    """``copy`` = ``run_dir`` without its ``step`` checkpoint and summary: an interrupted run to resume."""
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / f"step_{step:06d}")
    (copy / "summary.json").unlink()


def store_barrier(name: str, rank: int, size: int) -> None:
    """Ranks 0..size-1 wait for each other on torchrun's store (no process group lives between steps)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=BARRIER_TIMEOUT
    )
    key = f"edgc/plan/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{name}"
    if store.add(key, 1) == size:
        store.set(f"{key}/all", "")
    store.wait([f"{key}/all"])


def train_step(argv: list[str]) -> int:
    """``edgc train`` ``argv`` in this process, as a torchrun worker of it runs; its exit code (2 and one line
    on stderr for a user error)."""
    from edgc_cli.errors import CLIError

    from . import cli

    parser = argparse.ArgumentParser(prog="edgc")
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["train", *argv])
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        print(f"edgc train: error: {exc}", file=sys.stderr, flush=True)
        return 2


def run_step(index: int, step: dict, rank: int, size: int) -> int:
    """This rank's part of one step; its exit code."""
    if "cut_back" in step:
        if rank == 0:
            run_dir, copy, at = step["cut_back"]
            cut_back(Path(run_dir), Path(copy), int(at))
        if size > 1:
            store_barrier(f"step{index}", rank, size)
        return 0
    saved = {key: os.environ.get(key) for key in TORCHRUN_ENV}
    try:
        if size == 1:  # a plain `edgc train`: it makes its own group of one
            for key in TORCHRUN_ENV:
                os.environ.pop(key, None)
        else:
            os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(size)
        return train_step(step["train"])
    finally:
        for key, value in saved.items():
            if value is not None:
                os.environ[key] = value


def work(plan_file: Path) -> int:
    """A torchrun worker: every step of the plan this rank takes part in."""
    plan = json.loads(plan_file.read_text())
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    check_plan(plan, world)
    for index, step in enumerate(plan):
        size = step.get("nproc", world)
        if rank >= size:
            return 0  # no later step is this rank's (their nproc never grows)
        code = run_step(index, step, rank, size)
        if code:
            print(f"rank {rank}: plan step {index} failed (exit {code}): {step}", file=sys.stderr, flush=True)
            return code
    return 0


def launch(nproc: int, plan_file: Path) -> int:
    """torchrun of ``nproc`` of this module's workers, as `edgc train --nproc` starts its own (no second
    interpreter). Returns 0, or 1 when a worker failed."""
    from .cli import launch_torchrun

    check_plan(json.loads(plan_file.read_text()), nproc)
    return launch_torchrun(nproc, [str(plan_file)], worker=("edgc_train.plan",))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_train.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, help="start N workers under torchrun (omitted in a worker)")
    parser.add_argument("plan", type=Path, help="the JSON list of steps")
    args = parser.parse_args(argv)
    if args.nproc is not None:
        return launch(args.nproc, args.plan)
    return work(args.plan)


if __name__ == "__main__":
    sys.exit(main())
