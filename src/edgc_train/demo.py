"""`edgc demo` (what `make run` runs): uncompressed vs EDGC on the tiny GPT-2, then the report.

Two `edgc train` jobs with 2 processes each, identical but for the compressor, into OUT/none and
OUT/edgc, then `edgc report` into OUT/report, then the headline numbers on the terminal.

The EDGC run sets its knobs explicitly, because the defaults are for long runs on a real network:

- ``r_max=16, r_min=4``: on one host (loopback) the start-up profiling would find no rank faster than
  an uncompressed all-reduce and switch compression off, so the ceiling is given instead.
- ``window=10``: a rank decision every 10 steps, so a short run holds about eight of them.
- ``rank_budget=8``: a byte budget of a mean rank of 8 over the compressed steps (half the factor
  bytes of static PowerSGD at r_max), spent early by the default ``schedule`` signal, so the rank
  steps down from 16 towards 4: what beat static PowerSGD at equal bytes in `edgc experiment pareto`.
  Without a budget (the paper's rank rules) the noise gate keeps r_max through so short a run: the
  entropy drift between its windows is inside the samples' own noise.
- the uncompressed warm-up stays at the harness default for the run length (10 % of the steps).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from edgc_cli.errors import CLIError

DEFAULT_OUT = Path("runs/demo")
DEFAULT_STEPS = 120
DEFAULT_NPROC = 2
EDGC_FIELDS = {"r_max": 16, "r_min": 4, "window": 10, "rank_budget": 8}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train the tiny GPT-2 uncompressed and with EDGC (2 processes), then write the report",
        description="What `make run` runs: two `edgc train` jobs on the tiny preset, identical except for the "
        "compressor (none, then edgc with a short window so the rank visibly adapts), then "
        "`edgc report` on both. About 6 minutes on 2 CPU cores.",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help=f"new folder for the two runs and the report (default {DEFAULT_OUT}, or "
        f"{DEFAULT_OUT}-<timestamp> when that exists); an existing folder is refused",
    )
    p.add_argument(
        "--steps",
        metavar="N",
        default=str(DEFAULT_STEPS),
        help=f"optimizer steps per run (default {DEFAULT_STEPS}; at least 40 so that several rank windows fit)",
    )
    p.add_argument(
        "--nproc",
        metavar="N",
        default=str(DEFAULT_NPROC),
        help=f"data-parallel processes per run (default {DEFAULT_NPROC})",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit without running them")
    p.set_defaults(func=run)


def _int(flag: str, raw: str, low: int) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise CLIError(f"{flag}: expected an integer, got {raw!r}") from None
    if value < low:
        raise CLIError(f"{flag}: must be ≥ {low}, got {value}")
    return value


def resolve_out(raw: str | None, now: datetime | None = None) -> Path:
    """The demo folder: --out (must not exist), else runs/demo, else runs/demo-<timestamp>."""
    if raw is not None:
        out = Path(raw)
        if out.exists():
            raise CLIError(f"--out: {out} already exists; choose a new folder (a demo never overwrites runs)")
        return out
    if not DEFAULT_OUT.exists():
        return DEFAULT_OUT
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    out = DEFAULT_OUT.parent / f"{DEFAULT_OUT.name}-{stamp}"
    if out.exists():
        raise CLIError(f"{out} already exists; pass --out DIR")
    return out


def train_args(out: Path, compressor: str, steps: int, nproc: int) -> list[str]:
    """The `edgc train` arguments of one demo run (everything shared, except the compressor)."""
    args = [
        "train",
        "--nproc",
        str(nproc),
        "--out",
        str(out / compressor),
        "--preset",
        "tiny",
        "--steps",
        str(steps),
        "--eval-every",
        str(max(1, steps // 6)),
        "--compressor",
        compressor,
    ]
    if compressor == "edgc":
        for key, value in EDGC_FIELDS.items():
            args += ["--edgc", f"{key}={value}"]
    return args


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "edgc_cli.main", *args]


def _shell(cmd: list[str]) -> str:
    import shlex

    return " ".join(shlex.quote(c) for c in (["edgc", *cmd[3:]] if cmd[1:3] == ["-m", "edgc_cli.main"] else cmd))


def run(args: argparse.Namespace) -> int:
    steps = _int("--steps", args.steps, 40)
    nproc = _int("--nproc", args.nproc, 1)
    out = resolve_out(args.out)
    jobs = [
        ("uncompressed", "none", train_args(out, "none", steps, nproc)),
        ("EDGC", "edgc", train_args(out, "edgc", steps, nproc)),
    ]
    report_dir = out / "report"
    if args.dry_run:
        for _, _, job in jobs:
            print(_shell(_command(job)))
        print(_shell(_command(["report", str(out / "none"), str(out / "edgc"), "--out", str(report_dir)])))
        return 0

    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    print(
        f"edgc demo: {steps} steps of the tiny GPT-2 with {nproc} processes, uncompressed and with EDGC, into {out}/",
        flush=True,
    )
    for i, (name, compressor, job) in enumerate(jobs, 1):
        print(f"\n[{i}/3] {name}: {_shell(_command(job))}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call(_command(job), env=env)
        if code != 0:
            raise CLIError(f"the {name} training run failed (exit code {code}); see {out / compressor}")
        print(f"[{i}/3] {name} run took {time.perf_counter() - t0:.0f} s", flush=True)

    print(f"\n[3/3] report: edgc report {out / 'none'} {out / 'edgc'} --out {report_dir}", flush=True)
    from .report import ReportError, build_report

    try:
        result = build_report([out / "none", out / "edgc"], report_dir)
    except ReportError as exc:
        raise CLIError(str(exc)) from None
    lines = headline(result, time.perf_counter() - start)
    print("\n".join(lines))
    (out / "headline.txt").write_text("\n".join(lines).strip() + "\n")  # what docs/report.md quotes
    return 0


def headline(result: dict, seconds: float) -> list[str]:
    from .report_runs import format_schedule

    base, runs = result["baseline"], result["runs"]
    edgc = next(r for r in runs if r is not base)
    b, e = base.stats, edgc.stats

    def val(s: dict) -> str:
        return f"val loss {s['val_loss']:.4f}, PPL {s['val_ppl']:.1f}"

    lines = [
        "",
        f"edgc demo finished in {seconds / 60:.1f} min.",
        f"  report:        {result['markdown']}  (plots: {', '.join(p.name for p in result['plots'])})",
        f"  uncompressed:  {val(b)}, {b['bytes_per_step'] / 1e6:.2f} MB sent per step",
        f"  EDGC:          {val(e)}, {e['bytes_per_step'] / 1e6:.2f} MB sent per step "
        f"({e['bytes_per_step'] / b['bytes_per_step']:.3f}× uncompressed over the whole run, "
        f"{e['compressed_bytes_per_step'] / b['bytes_per_step']:.3f}× while compressing)"
        if e["compressed_bytes_per_step"]
        else f"  EDGC:          {val(e)} (never compressed)",
        f"  val loss EDGC − uncompressed: {e['val_loss'] - b['val_loss']:+.4f}",
        f"  median step: {e['median_step_s'] * 1000:.0f} ms EDGC vs {b['median_step_s'] * 1000:.0f} ms uncompressed "
        "(native DDP, whose overlapped all-reduce has no separate time; one host: loopback makes communication "
        "cheap, so bytes are the number to watch)",
        f"  EDGC rank schedule (steps: rank): {format_schedule(edgc)}",
    ]
    return lines
