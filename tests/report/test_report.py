"""`edgc report` builds every plot and the summary table; `edgc demo` checks its arguments.

The run folders are written here in the `edgc train` contract format (config.json + metrics.jsonl with
the keys train.py writes), with numbers shaped like a real tiny-preset run, so the tests take seconds.
``test_report_from_real_runs`` additionally trains two 4-step runs of a shrunken model (1 process each)
and builds the report from them, so the format cannot drift from what `edgc train` really writes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgc_cli.main import main as edgc_main
from edgc_train import demo
from edgc_train.report import build_report
from edgc_train.report_plots import PLOTS
from edgc_train.report_runs import ReportError, load_run

PARAMS = ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.0.ln_1.bias"]
RAW_BYTES = 17_094_656


def write_run(
    path: Path,
    compressor: str,
    steps: int = 40,
    window: int = 5,
    warmup: int = 6,
    eval_every: int = 10,
    truncate_last: bool = False,
    budget: float | None = None,
) -> Path:
    """A run folder as `edgc train` writes it; the EDGC rank walks 16 → 12 → 8 → 10 over the windows."""
    path.mkdir(parents=True)
    edgc = None
    if compressor == "edgc":
        edgc = {
            "r_max": 16,
            "r_min": 4,
            "window": window,
            "adaptive": True,
            "rank_mapping": "cqm",
            "entropy_estimator": "gaussian",
            "iteration_sample_ratio": 0.5,
            "warmup_fraction": 0.15,
            "warmup_error_test": True,
            "rank_step": 4,
            "total_steps": steps,
        }
        if budget is not None:
            edgc.update(rank_budget=budget, budget_signal="schedule")
    config = {
        "preset": "tiny",
        "n_params": 4_270_000,
        "world_size": 2,
        "micro_batch": 8,
        "seq_len": 128,
        "grad_accum": 1,
        "steps": steps,
        "compressor": compressor,
        "seed": 1337,
        "edgc": edgc,
        "device_type": "cpu",
        "started_at": "2026-11-21T23:00:00+00:00",
    }
    (path / "config.json").write_text(json.dumps(config))
    lines, wall, spent = [], 0.0, []
    ranks = [16, 12, 8, 10, 10, 8, 6, 8]
    for step in range(1, steps + 1):
        compressed = compressor == "edgc" and step > warmup
        rank = ranks[min(len(ranks) - 1, (step - warmup - 1) // window)] if compressed else None
        comm = 0.02 + 0.002 * (rank or 40) + (0.3 if step == 2 else 0.0)
        step_time = 1.0 + comm + (0.05 if compressed else 0.0) + (0.5 if step == 1 else 0.0)
        wall += step_time
        sent = RAW_BYTES if rank is None else RAW_BYTES * rank // 200
        entropy = (
            -4.5 - 1.5 * (1 - math.exp(-step / 10)) + 0.05 * math.sin(step)
            if compressor == "edgc" and step % 2 == 1
            else None
        )
        spent += [rank] if rank is not None else []
        mean_rank = sum(spent) / len(spent) if budget is not None and spent else None
        lines.append(
            {
                "kind": "train",
                "step": step,
                "wall_s": wall,
                "loss": 8.3 * math.exp(-step / 30) + 2.5,
                "mean_rank": mean_rank,
                "lr": 1e-3,
                "step_time_s": step_time,
                "compute_time_s": 1.0,
                "comm_time_s": comm,
                "compress_time_s": 0.05 if compressed else 0.0,
                "tokens_per_s": 2048 / step_time,
                "phase": "compress" if compressed else "warmup",
                "rank": rank,
                "ranks": {p: (rank or 0) for p in PARAMS},
                "entropy": entropy,
                "relative_error": 0.3 if compressed else None,
                "elements_sent": sent // 4,
                "elements_raw": RAW_BYTES // 4,
                "bytes_sent": sent,
                "bytes_raw": RAW_BYTES,
            }
        )
        if step % eval_every == 0 or step == steps:
            wall += 1.5
            val = 8.3 * math.exp(-step / 30) + 2.6 + (0.02 if compressor == "edgc" else 0.0)
            lines.append({"kind": "eval", "step": step, "wall_s": wall, "val_loss": val, "val_ppl": math.exp(val)})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if truncate_last:
        text += '{"kind": "train", "step": 41, "wal'
    (path / "metrics.jsonl").write_text(text)
    return path


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    return write_run(tmp_path / "runs" / "none", "none"), write_run(tmp_path / "runs" / "edgc", "edgc")


def check_report(out: Path, labels: list[str], ratios: bool = True) -> str:
    for name in PLOTS:
        png = out / name
        assert png.is_file(), name
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, (name, len(data))
    md = (out / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    header = table[0]
    for label in labels:
        assert any(row.startswith(f"| {label} |") for row in table[2:]), (label, table)
    assert ("bytes/step vs uncompressed" in header) == ratios
    for name in PLOTS:
        assert f"]({name})" in md
    return md


def test_report_two_runs(two_runs, capsys):
    none, edgc = two_runs
    assert edgc_main(["report", str(none), str(edgc)]) == 0
    out = none.parent / "report"  # default: next to the first run
    md = check_report(out, ["none (DDP all-reduce)", "edgc"])
    edgc_row = next(line for line in md.splitlines() if line.startswith("| edgc |"))
    cells = [c.strip() for c in edgc_row.strip("|").split("|")]
    header = [
        c.strip()
        for c in md.splitlines()[[line.startswith("|") for line in md.splitlines()].index(True)].strip("|").split("|")
    ]
    ratio = float(cells[header.index("bytes/step vs uncompressed")].rstrip("×"))
    assert 0.05 < ratio < 0.4  # 6 raw steps of 40, the rest at rank/200 of the raw size
    assert "medians over steps 4–end" in md
    assert "6–10: r=16" not in md and "7–11: r=16" in md  # rank schedule (steps: rank)
    printed = capsys.readouterr().out
    assert "report.md" in printed and "× of none (DDP all-reduce)" in printed


def test_report_names_the_budget_only_for_a_budgeted_run(tmp_path):
    """Under a byte budget the summary states budget and spending, and the captions do not claim the
    entropy drives the rank; without one they explain the paper's rule."""
    none = write_run(tmp_path / "none", "none")
    budgeted = write_run(tmp_path / "edgc", "edgc", budget=10.0)
    md = (build_report([none, budgeted], tmp_path / "b")["markdown"]).read_text()
    assert "Byte budget: mean rank 10 (signal `schedule`)" in md and "against the byte budget" in md
    assert "EDGC turns the change in this mean" not in md
    paper = write_run(tmp_path / "paper", "edgc")
    md = (build_report([none, paper], tmp_path / "p")["markdown"]).read_text()
    assert "Byte budget" not in md and "EDGC turns the change in this mean" in md
    md = (build_report([none, budgeted, paper], tmp_path / "both")["markdown"]).read_text()
    assert "Under a byte budget" in md and "EDGC turns the change in this mean" in md  # each mode explained


def test_report_out_flag_single_run_no_baseline(tmp_path):
    run = write_run(tmp_path / "only", "edgc", truncate_last=True)
    out = tmp_path / "elsewhere" / "rep"
    result = build_report([run], out)
    md = check_report(out, ["only (edgc)"], ratios=False)
    assert "No uncompressed run" in md and "truncated last metrics line" in md
    assert result["runs"][0].stats["steps"] == 40


def test_report_uncompressed_only_still_draws_every_plot(tmp_path):
    run = write_run(tmp_path / "base", "none")
    out = tmp_path / "rep"
    build_report([run], out)
    check_report(out, ["base (none: DDP all-reduce)"])


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no such run folder"),
        (lambda p: p.mkdir(), "no config.json"),
        (lambda p: (p.mkdir(), (p / "config.json").write_text("{")), "unreadable"),
        (lambda p: (p.mkdir(), (p / "config.json").write_text("{}")), "no metrics.jsonl"),
        (
            lambda p: (p.mkdir(), (p / "config.json").write_text("{}"), (p / "metrics.jsonl").write_text("")),
            "no training steps",
        ),
        (
            lambda p: (
                p.mkdir(),
                (p / "config.json").write_text("{}"),
                (p / "metrics.jsonl").write_text('garbage\n{"kind": "eval", "step": 1}\n'),
            ),
            "bad line",
        ),
    ],
)
def test_bad_run_folder_is_one_line_error(tmp_path, capsys, setup, message):
    bad = tmp_path / "bad"
    setup(bad)
    with pytest.raises(ReportError, match=message):
        load_run(bad)
    assert edgc_main(["report", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgc report: error:") and message in err and "\n" not in err


def test_same_run_twice_refused(two_runs, capsys):
    none, _ = two_runs
    assert edgc_main(["report", str(none), str(none)]) == 2
    assert "twice" in capsys.readouterr().err


def _train(out: Path, compressor: str) -> None:
    """A real 6-step `edgc train` run of a shrunken tiny model, 1 process (about 10 s)."""
    cmd = [
        sys.executable,
        "-m",
        "edgc_cli.main",
        "train",
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--n-layer",
        "1",
        "--n-embd",
        "64",
        "--n-head",
        "2",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--eval-batches",
        "1",
        "--no-progress",
        "--no-tensorboard",
        "--compressor",
        compressor,
    ]
    if compressor == "edgc":
        cmd += [
            "--edgc",
            "r_max=4",
            "--edgc",
            "r_min=2",
            "--edgc",
            "window=2",
            "--edgc",
            "iteration_sample_ratio=1",
            "--edgc",
            "warmup_fraction=0.3",
            "--edgc",
            "rank_mapping=cqm",
            "--edgc",
            "entropy_estimator=gaussian",
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_report_from_real_runs(tmp_path):
    none, edgc = tmp_path / "none", tmp_path / "edgc"
    _train(none, "none")
    _train(edgc, "edgc")
    result = build_report([none, edgc], tmp_path / "report")
    check_report(tmp_path / "report", ["none (DDP all-reduce)", "edgc"])
    stats = {r.label: r.stats for r in result["runs"]}
    assert (
        stats["edgc"]["first_compressed_step"] is not None
        and stats["none (DDP all-reduce)"]["first_compressed_step"] is None
    )
    assert stats["edgc"]["bytes_per_step"] < stats["none (DDP all-reduce)"]["bytes_per_step"]
    assert stats["edgc"]["entropy_samples"] == 6 and stats["none (DDP all-reduce)"]["val_loss"] is not None


# ------------------------------------------------------------------------------------------ demo
def test_demo_refuses_existing_out(tmp_path, capsys):
    existing = tmp_path / "demo"
    existing.mkdir()
    assert edgc_main(["demo", "--out", str(existing)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "\n" not in err.strip()
    assert list(existing.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    "flag, value, message",
    [("--steps", "ten", "expected an integer"), ("--steps", "10", "must be ≥ 40"), ("--nproc", "0", "must be ≥ 1")],
)
def test_demo_rejects_bad_numbers(tmp_path, capsys, flag, value, message):
    assert edgc_main(["demo", "--out", str(tmp_path / "d"), flag, value]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_demo_default_out_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert demo.resolve_out(None) == Path("runs/demo")
    Path("runs/demo").mkdir(parents=True)
    other = demo.resolve_out(None)
    assert other != Path("runs/demo") and other.name.startswith("demo-") and not other.exists()


def test_demo_dry_run_commands(tmp_path, capsys):
    out = tmp_path / "d"
    assert edgc_main(["demo", "--out", str(out), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and not out.exists()
    none, edgc, report = lines
    for line in (none, edgc):
        assert "train --nproc 2" in line and "--preset tiny" in line and f"--steps {demo.DEFAULT_STEPS}" in line
    assert "--compressor none" in none and "--edgc" not in none
    assert "--compressor edgc" in edgc and "--edgc r_max=16" in edgc and "--edgc rank_budget=8" in edgc
    assert report.startswith("edgc report") and str(out / "report") in report


def test_demo_train_arguments_are_valid(tmp_path):
    """Both jobs' flags pass `edgc train`'s own validation (nothing is trained or created)."""
    from edgc_cli.main import build_parser
    from edgc_train.cli import resolve

    parser = build_parser(only="train")
    for compressor in ("none", "edgc"):
        argv = demo.train_args(tmp_path / "d", compressor, demo.DEFAULT_STEPS, 2)
        args = parser.parse_args(argv)
        cfg, run_dir, resume, _ = resolve(args, world_size=2)
        assert cfg.compressor == compressor and run_dir == tmp_path / "d" / compressor and not resume
        if compressor == "edgc":
            e = cfg.edgc_config
            assert (e.r_max, e.r_min, e.window, e.rank_budget, e.budget_signal) == (16, 4, 10, 8.0, "schedule")
            assert e.total_steps == demo.DEFAULT_STEPS  # the budget is a mean over the run: the harness sets its length
    assert not (tmp_path / "d").exists()
