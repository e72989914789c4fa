"""`edgc train`: flags and config file -> validated TrainConfig -> (torchrun) -> train().

Every user error is found before any work starts (no data preparation, no process group, no folder
created) and reported as one line with exit code 2: unknown compressor, bad numbers, missing, empty,
unreadable or binary data or data too small for one batch, an existing ``--out`` folder, a
missing/corrupt/mismatched checkpoint on ``--resume``. Under `--nproc N` this all happens in the
launching process, before torchrun starts a worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from edgc_cli.errors import CLIError

from .config import TrainConfig, field_help, merge_edgc

# Flags that may be given with --resume (they do not change what is computed).
RESUME_OK = {"progress", "tensorboard"}


def _bool_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainConfig) if f.type in ("bool", bool)}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train GPT-2 with a gradient compressor (runs under torchrun)",
        description="Train a GPT-2 model data-parallel with a DP gradient compressor. Run it under "
        "`torchrun --nproc_per_node N`, or pass --nproc N to have it start torchrun itself. "
        "See docs/train.md.",
    )
    p.add_argument("--out", metavar="RUN_DIR", help="new run folder (must not exist)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    p.add_argument(
        "--auto-resume",
        action="store_true",
        dest="auto_resume",
        help="with --out: if RUN_DIR exists from an earlier attempt of this same command (e.g. "
        "torchrun --max-restarts after a worker died), continue it from its latest checkpoint",
    )
    p.add_argument("--config", metavar="FILE", help="JSON or TOML file of config fields (flags override it)")
    p.add_argument("--nproc", metavar="N", help="start N processes on this host via torch.distributed.run")
    p.add_argument(
        "--stop-at",
        metavar="STEP",
        dest="stop_at",
        help="stop after this optimizer step, checkpointed, as if interrupted (continue with --resume)",
    )
    docs = {name: doc.replace("%", "%%") for name, doc in field_help().items()}  # argparse formats help with %
    bools = _bool_fields()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "edgc":
            p.add_argument(
                "--edgc",
                metavar="KEY=VALUE",
                action="append",
                default=argparse.SUPPRESS,
                help=docs[f.name] + " Repeatable; VALUE is JSON (16, 0.5, true, null) or a string.",
            )
        elif f.name in bools:
            p.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=docs[f.name]
            )
        else:
            p.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, metavar=f.name.upper(), help=docs[f.name])
    p.set_defaults(func=run)


# ------------------------------------------------------------------------- parsing values
def _convert(name: str, raw: str, annotation: str):
    """Turn a flag string into the field's type; the error names the flag."""
    optional = "None" in annotation
    if optional and raw.lower() in ("none", "null"):
        return None
    flag = "--" + name.replace("_", "-")
    if annotation.startswith("int"):
        try:
            return int(raw)
        except ValueError:
            raise CLIError(f"{flag}: expected an integer, got {raw!r}") from None
    if annotation.startswith("float"):
        try:
            return float(raw)
        except ValueError:
            raise CLIError(f"{flag}: expected a number, got {raw!r}") from None
    return raw


def parse_edgc_flags(items: list[str]) -> dict:
    """``--edgc KEY=VALUE`` flags as an EDGCConfig table: ``engine.FIELD`` keys (the engine's, as
    torchtitan's ``--edgc.engine.FIELD``) in its ``engine`` table."""
    from edgc.config import ENGINE_FIELDS

    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CLIError(f"--edgc: expected KEY=VALUE, got {item!r}")
        if key in ENGINE_FIELDS:
            raise CLIError(f"--edgc {key}: it is an engine field, --edgc engine.{key}={value}")
        try:
            value = json.loads(value)
        except ValueError:
            pass  # bare strings such as rank_mapping=cqm
        table, _, name = key.rpartition(".")
        if table not in ("", "engine"):
            raise CLIError(f"--edgc {key}: EDGCConfig has no table {table!r} (only engine.FIELD)")
        out = merge_edgc(out, {"engine": {name: value}} if table else {name: value})
    return out


def flag_values(args: argparse.Namespace) -> dict:
    """The TrainConfig fields given explicitly on the command line, converted to their types."""
    values = {}
    for f in dataclasses.fields(TrainConfig):
        if not hasattr(args, f.name):
            continue
        raw = getattr(args, f.name)
        if f.name == "edgc":
            values["edgc"] = parse_edgc_flags(raw)
        elif isinstance(raw, bool):
            values[f.name] = raw
        else:
            values[f.name] = _convert(f.name, raw, str(f.type))
    return values


def _positive_int(flag: str, raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise CLIError(f"{flag}: expected an integer, got {raw!r}") from None
    if value < 1:
        raise CLIError(f"{flag}: must be ≥ 1, got {value}")
    return value


# ------------------------------------------------------------------------- checks before any work
def resolve(args: argparse.Namespace, world_size: int) -> tuple[TrainConfig, Path, bool, int | None]:
    """Validate everything; return (config, run folder, resume?, stop_at). Raises CLIError."""
    stop_at = _positive_int("--stop-at", args.stop_at)
    flags = flag_values(args)
    auto_resume = getattr(args, "auto_resume", False)
    if auto_resume and args.resume is not None:
        raise CLIError("--auto-resume goes with --out (the same command restarted); --resume RUN_DIR needs neither")
    if auto_resume and args.out is not None and Path(args.out).exists():
        return _restart(args, flags, world_size, stop_at)
    if args.resume is not None:
        from edgc.config import dotted_fields, nested_config_dict

        from . import checkpoint as ckpt  # (imported here: torch takes seconds, a new run's checks need none)
        from .run_folder import config_from_run

        if args.out is not None or args.config is not None:
            raise CLIError("--resume continues a run with its own config: do not combine it with --out or --config")
        changed = sorted(set(flags) - RESUME_OK)
        if changed:
            raise CLIError(
                f"--resume cannot change the run's config ({', '.join('--' + c.replace('_', '-') for c in changed)})"
            )
        run_dir = Path(args.resume)
        if not (run_dir / "config.json").is_file():
            raise CLIError(f"--resume: {run_dir} is not a run folder (no config.json)")
        try:
            cfg = config_from_run(run_dir)
            cfg = dataclasses.replace(cfg, **flags)
        except (ValueError, TypeError) as exc:
            raise CLIError(f"--resume: {run_dir / 'config.json'} is invalid: {exc}") from None
        latest = ckpt.latest_checkpoint(run_dir)
        if latest is None:
            raise CLIError(f"--resume: {run_dir} has no checkpoint to resume from")
        trainer = _verified_trainer(latest, world_size, "--resume")
        saved = {k: v for k, v in trainer.get("config", {}).items() if k not in RESUME_OK}
        saved["edgc"] = nested_config_dict(saved.get("edgc") or {})  # flat in a run begun before engine.FIELD
        now = {k: v for k, v in cfg.to_dict().items() if k not in RESUME_OK}
        if saved != now:
            diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
            raise CLIError(f"--resume: {latest / 'trainer.json'} does not match config.json ({', '.join(diff)})")
        saved_edgc = dotted_fields(json.loads((run_dir / "config.json").read_text()).get("edgc") or {})
        now_edgc = dotted_fields(cfg.edgc_config.to_dict()) if cfg.edgc_config is not None else {}
        if saved_edgc != now_edgc:  # e.g. the run-length scaling rules changed since the run started
            diff = sorted(k for k in saved_edgc.keys() | now_edgc.keys() if saved_edgc.get(k) != now_edgc.get(k))
            raise CLIError(f"--resume: the EDGC config derived now differs from config.json ({', '.join(diff)})")
        if trainer["step"] >= cfg.steps:
            raise CLIError(f"--resume: {run_dir} already finished all {cfg.steps} steps")
        if stop_at is not None and stop_at <= trainer["step"]:
            raise CLIError(f"--stop-at {stop_at} is not after the checkpoint's step {trainer['step']}")
        resume = True
    else:
        if args.out is None:
            raise CLIError("--out RUN_DIR is required (or --resume RUN_DIR)")
        run_dir = Path(args.out)
        if run_dir.exists():
            raise CLIError(f"--out: {run_dir} already exists; choose a new folder or --resume it")
        cfg = _fresh_config(args, flags)
        resume = False
    if cfg.fsdp and cfg.fsdp_shard and world_size % cfg.fsdp_shard:
        raise CLIError(
            f"--fsdp-shard {cfg.fsdp_shard}: the world size {world_size} is not a multiple of the shard degree"
        )
    if world_size % cfg.pp:
        raise CLIError(f"--pp {cfg.pp}: the world size {world_size} is not a multiple of the pipeline stages")
    _check_data(cfg, world_size)
    return cfg, run_dir, resume, stop_at


def _check_data(cfg: TrainConfig, world_size: int) -> None:
    """The data must be readable UTF-8 text with tokens enough for one global batch and one
    validation block, checked here so that a bad file is one line, not a traceback per worker."""
    from .data import DataError, check_split_sizes

    replicas = world_size // cfg.pp  # the data-parallel degree: ranks that read different blocks
    batch_blocks = replicas * cfg.micro_batch
    # A pipeline evaluates whole pipeline steps (grad_accum micro-batches) on replica 0's blocks,
    # every replica-th block of the split; data parallelism needs one block anywhere.
    eval_steps = cfg.grad_accum if cfg.pp > 1 else 1
    val_blocks = (eval_steps - 1) * cfg.micro_batch * replicas + 1
    block = cfg.seq_len + 1  # inputs and next-token targets; consecutive blocks share one token
    val_what = (
        f"one validation block of {block} tokens"
        if val_blocks == 1
        else f"one pipeline evaluation step ({val_blocks} blocks of {block} tokens)"
    )
    needs = {
        "training": (batch_blocks * cfg.seq_len + 1, f"one global batch of {batch_blocks} x {block} tokens"),
        "validation": (val_blocks * cfg.seq_len + 1, val_what),
    }
    try:
        check_split_sizes(
            cfg.data,
            cfg.vocab_size,
            cfg.val_fraction,
            cfg.max_chars,
            cfg.cache_dir,
            needs,
            "use more data or smaller --seq-len/--micro-batch",
        )
    except DataError as exc:
        raise CLIError(str(exc)) from None


def _fresh_config(args: argparse.Namespace, flags: dict) -> TrainConfig:
    """The config of a new run: defaults, then --config FILE, then flags."""
    values = {}
    try:
        if args.config is not None:
            values = load_config_file(args.config)
        file_edgc = values.get("edgc") or {}
        if not isinstance(file_edgc, dict):
            raise ValueError("edgc: must be a table of EDGCConfig fields")
        values.update({k: v for k, v in flags.items() if k != "edgc"})
        values["edgc"] = merge_edgc(file_edgc, flags.get("edgc", {}))
        return TrainConfig.from_dict(values)
    except (ValueError, TypeError) as exc:
        raise CLIError(str(exc)) from None


def _verified_trainer(latest: Path, world_size: int, flag: str) -> dict:
    """The checkpoint's trainer.json after its manifest checks out and its world size matches."""
    from . import checkpoint as ckpt

    try:
        trainer = ckpt.verify(latest)
    except ckpt.CheckpointError as exc:
        raise CLIError(str(exc)) from None
    if trainer.get("world_size") != world_size:
        raise CLIError(
            f"{flag}: {latest.name} was written by {trainer.get('world_size')} processes, "
            f"this run has {world_size}; resume with the same number"
        )
    return trainer


def _restart(args: argparse.Namespace, flags: dict, world_size: int, stop_at: int | None):
    """--auto-resume on an existing --out: the same command again, so continue where it stopped."""
    from . import checkpoint as ckpt
    from .run_folder import config_from_run

    run_dir = Path(args.out)
    cfg = _fresh_config(args, flags)
    if not (run_dir / "config.json").is_file():
        raise CLIError(f"--auto-resume: {run_dir} exists but is not a run folder (no config.json)")
    try:
        saved = config_from_run(run_dir)
    except (ValueError, TypeError) as exc:
        raise CLIError(f"--auto-resume: {run_dir / 'config.json'} is invalid: {exc}") from None
    now = {k: v for k, v in cfg.to_dict().items() if k not in RESUME_OK}
    before = {k: v for k, v in saved.to_dict().items() if k not in RESUME_OK}
    if now != before:
        diff = sorted(k for k in now if now[k] != before.get(k))
        raise CLIError(
            f"--auto-resume: {run_dir} was started with a different config ({', '.join(diff)}); use a new --out"
        )
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        return cfg, run_dir, False, stop_at  # died before its first checkpoint: start it again in place
    trainer = _verified_trainer(latest, world_size, "--auto-resume")
    if trainer["step"] >= cfg.steps:
        raise CLIError(f"--auto-resume: {run_dir} already finished all {cfg.steps} steps")
    return cfg, run_dir, True, stop_at


# ------------------------------------------------------------------------- entry point
def launch_torchrun(nproc: int, argv: list[str], worker: tuple[str, ...] = ("edgc_cli.main", "train")) -> int:
    """Run this command (``python -m`` ``worker`` ``argv``) under torchrun (``--standalone --nproc_per_node
    N``), as ``python -m torch.distributed.run`` would, but as the agent of this process: a second
    interpreter would import torch once more before any worker starts. Returns torchrun's exit status
    (1 when a worker failed, after its failure summary)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as run_agent

    # torchrun would set 1 thread per process and warn; split the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    agent_args = parse_args(["--standalone", f"--nproc_per_node={nproc}", "-m", *worker, *argv])
    try:
        run_agent(agent_args)
    except ChildFailedError as failure:
        print(failure.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def run(args: argparse.Namespace) -> int:
    nproc = _positive_int("--nproc", args.nproc)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if nproc is not None and under_torchrun:
        raise CLIError("--nproc starts torchrun itself; do not use it under torchrun")
    world_size = nproc or int(os.environ.get("WORLD_SIZE", 1))
    cfg, run_dir, resume, stop_at = resolve(args, world_size)
    if nproc is not None:
        argv = sys.argv[1:]
        argv = _strip_nproc(argv[argv.index("train") + 1 :])
        return launch_torchrun(nproc, argv)

    from .checkpoint import CheckpointError
    from .data import DataError
    from .train import train

    try:
        restart_in_place = getattr(args, "auto_resume", False) and not resume and run_dir.exists()
        return train(cfg, run_dir, resume=resume, stop_at=stop_at, restart_in_place=restart_in_place)
    except (DataError, CheckpointError, FloatingPointError) as exc:  # FloatingPointError: the loss diverged
        raise CLIError(str(exc)) from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON or TOML config file into a dict of TrainConfig fields (not yet validated)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            try:
                import tomllib  # Python ≥ 3.11
            except ImportError:
                raise ValueError(f"config file {path}: TOML needs Python 3.11 or newer; use JSON") from None

            values = tomllib.loads(text)
        else:
            values = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a table of fields")
    return values
