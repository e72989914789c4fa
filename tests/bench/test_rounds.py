"""`edgc bench --rounds`: the method list again in reverse order, on a machine that slows down.

No network: the hosts, the calibration and the training runs are replaced by synthetic run folders
whose step times grow with every launch, as on a shared VM drifting over minutes.
"""

import contextlib
import json
import re
from pathlib import Path

import pytest

from edgc_bench import repeats, rounds
from edgc_bench import run as bench_run

BASE_STEP_S = {"none": 2.0, "nosync": 0.8, "powersgd@rmax": 1.0, "edgc": 0.9}  # true EDGC × floor: 1.125
DRIFT = 0.05  # each launch runs 5 % slower than the one before


def synthetic_run(step_s: float, rank: int | None) -> list[dict]:
    records, wall = [], 0.0
    for step in range(1, 11):
        wall += step_s
        records.append(
            {
                "kind": "train",
                "step": step,
                "wall_s": wall,
                "step_time_s": step_s,
                "comm_time_s": 0.0,
                "compress_time_s": 0.0,
                "compute_time_s": step_s,
                "entropy_time_s": 0.0,
                "phase": "warmup" if step <= 2 else "compress",
                "rank": None if step <= 2 else rank,
                "bytes_sent": 100,
                "tokens_per_s": 1 / step_s,
            }
        )
        if step % 5 == 0:
            records.append({"kind": "eval", "step": step, "wall_s": wall, "val_loss": 3.0 - step / 10, "val_ppl": 1.0})
    return records


@pytest.fixture
def fake_hosts(monkeypatch):
    """Replace the namespaces, the link calibration and torchrun; record the order of the launches."""
    launched = []

    def launch(net, s, argv, log_path, timeout_s):
        flags = dict(zip(argv, argv[1:]))  # each flag with the value after it
        method = flags["--compressor"] + ("@" + flags["--powersgd-rank"] if "--powersgd-rank" in flags else "")
        out = Path(flags["--out"])
        out.mkdir(parents=True)
        name = "powersgd@rmax" if method.startswith("powersgd@") else method
        step_s = BASE_STEP_S[name] * (1 + DRIFT) ** len(launched)
        launched.append(name)
        rank = 8 if name in ("edgc", "powersgd@rmax") else None
        out.joinpath("metrics.jsonl").write_text("\n".join(json.dumps(r) for r in synthetic_run(step_s, rank)))
        out.joinpath("config.json").write_text(json.dumps({"powersgd_rank": flags.get("--powersgd-rank")}))
        log_path.write_text("")
        return [0, 0]

    monkeypatch.setattr(bench_run, "Network", lambda hosts, rate: contextlib.nullcontext(None))
    monkeypatch.setattr(bench_run, "run_calibration", lambda net, s, out: [])
    monkeypatch.setattr(bench_run, "launch", launch)
    monkeypatch.setattr("edgc_train.data.prepare_data", lambda *a, **k: None)
    return launched


def test_rounds_reverse_the_order_and_their_mean_cancels_a_steady_drift(tmp_path, fake_hosts):
    settings = bench_run.BenchSettings(methods=("none", "nosync", "powersgd@rmax", "edgc"), rounds=2)
    summary = bench_run.run_bench(settings, tmp_path, "edgc bench --rounds 2", say=lambda *a: None)
    assert fake_hosts == ["none", "edgc", "nosync", "powersgd@rmax", "powersgd@rmax", "nosync", "edgc", "none"]
    assert summary["rounds"] == ["round-1", "round-2"] and summary["r_max"] == 8
    # Round 2's static PowerSGD runs at round 1's r_max (EDGC's largest rank there).
    config = json.loads((tmp_path / "round-2" / "runs" / "powersgd-rmax" / "config.json").read_text())
    assert config["powersgd_rank"] == "8"
    measured = [repeats.measure(tmp_path / name) for name in summary["rounds"]]
    ratios = [m["edgc_floor_x"] for m in measured]
    # Each round is off by the drift between EDGC's launch and the floor's (±5 %)…
    assert ratios[0] == pytest.approx(1.125 / 1.05) and ratios[1] == pytest.approx(1.125 * 1.05)
    # …their mean is within 0.2 % of the true 1.125, which a single round misses by 5 %.
    assert sum(ratios) / 2 == pytest.approx(1.125, rel=2e-3)
    text = (tmp_path / "bench.md").read_text()
    assert "| round-1 |" not in text and f"| {tmp_path.name}/round-1 |" in text
    mean_line = next(line for line in text.splitlines() if line.startswith("- EDGC step × floor, mean of 2 rounds"))
    assert re.search(r"mean of 2 rounds: 1\.12\d \(rounds 1\.071–1\.181; target ≤ 1\.15\): holds", mean_line)
    assert "[round-2](round-2/bench.md)" in text
    round_text = (tmp_path / "round-2" / "bench.md").read_text()
    assert "round-2 of 2 (order powersgd@rmax, nosync, edgc, none)" in round_text
    # The repeats view and the re-rendering both see the rounds.
    view = repeats.render([tmp_path])
    assert f"| {tmp_path.name}/round-2 |" in view
    assert f"- {tmp_path.name} as one bench: EDGC step × floor, mean of 2 rounds: 1.12" in view
    rounds.rewrite(tmp_path)
    assert (tmp_path / "bench.md").read_text() == text


def test_a_single_round_is_the_bench_as_before(tmp_path, fake_hosts):
    settings = bench_run.BenchSettings(methods=("none", "nosync", "powersgd@rmax", "edgc"))
    summary = bench_run.run_bench(settings, tmp_path, "edgc bench", say=lambda *a: None)
    assert fake_hosts == ["none", "edgc", "nosync", "powersgd@rmax"]
    assert "rows" in summary and not (tmp_path / "round-1").exists()
    assert "whole bench" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rounds", "0"], "--rounds: must be in [1, 9], got 0"),
        (
            ["--rounds", "2", "--torchft"],
            "--rounds: repeats the method comparison; drop it with --torchft or --link-only",
        ),
    ],
)
def test_bad_rounds_get_one_line(flags, message):
    import argparse

    from edgc_bench import cli
    from edgc_cli.errors import CLIError

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    with pytest.raises(CLIError, match=re.escape(message)):
        cli.settings_from(parser.parse_args(["bench", *flags]))
