"""`edgc experiment diloco` on a model of one narrow layer: the arms it plans, the pairing, one small run."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from edgc_cli.main import main
from edgc_experiments import diloco_pairs as diloco


def args(**overrides) -> argparse.Namespace:
    values = dict(pairs="8:2,16:4", iterations_at="16:4", per_step_rank=1, outer_lr=0.7, outer_momentum=0.5)
    return argparse.Namespace(**{**values, **overrides})


def test_the_plan_pairs_equal_bytes_and_brackets_the_second_iteration():
    arms = diloco.plan(args())
    assert list(arms) == ["H8-r2", "H16-r4", "H16-r4-2it", "H16-r8", "H16-full", "step-r1"]  # reference first
    assert {n: a["rank"] / a["sync_every"] for n, a in arms.items() if n in ("H8-r2", "H16-r4")} == {
        "H8-r2": 0.25,
        "H16-r4": 0.25,
    }
    assert arms["H16-r4-2it"]["power_iterations"] == 2 and arms["H16-full"]["rank"] is None
    assert arms["step-r1"]["per_step"] and "power_iterations" not in arms["H16-r8"]
    assert list(diloco.plan(args(iterations_at="", per_step_rank=0))) == ["H8-r2", "H16-r4"]


def test_paired_deltas_are_per_seed_against_the_reference():
    def result(val, sent):
        return {"val_loss": val, "bytes": sent, "outer": [{"relative_error": 0.5, "error_feedback": 2.0}]}

    results = {
        "ref": {"1": result(3.0, 100), "2": result(3.2, 100)},
        "arm": {"1": result(2.9, 110), "2": result(3.0, 90)},
    }
    p = diloco.paired(results, "arm", "ref", [1, 2])
    assert p["deltas"] == pytest.approx([-0.1, -0.2]) and p["mean"] == pytest.approx(-0.15)
    assert p["low"] < p["mean"] < p["high"] and p["bytes_ratio"] == pytest.approx(1.0)
    assert p["relative_error"] == 0.5 and p["error_feedback"] == 2.0


def test_a_small_run_writes_paired_results(tmp_path):
    flags = [
        "experiment",
        "diloco-pairs",
        "--tiny",
        "--steps",
        "8",
        "--pairs",
        "2:1,4:1",
        "--iterations-at",
        "2:1",
        "--seeds",
        "2",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--out",
        str(tmp_path),
    ]
    assert main(flags) == 0
    out = tmp_path / "diloco-pairs"
    data = json.loads((out / "results.json").read_text())
    assert list(data["paired"]) == ["H2-r1", "H4-r1", "H2-r1-2it", "H2-r2", "H2-full", "step-r1"]
    for name, p in data["paired"].items():
        assert len(p["deltas"]) == 2 and all(math.isfinite(d) for d in p["deltas"]), name
    paired = data["paired"]
    assert paired["H2-r1"]["deltas"] == [0.0, 0.0]
    assert paired["H2-full"]["bytes_ratio"] > 5 * paired["H2-r2"]["bytes_ratio"] > 5  # compression sends less
    # the second iteration sends the factors again: as many bytes as twice the rank
    assert paired["H2-r1-2it"]["bytes"] == pytest.approx(paired["H2-r2"]["bytes"], rel=0.01)
    assert set(data["comparisons"]) == {"H2-r1-2it − H2-r1", "H2-r1-2it − H2-r2"}
    assert "**Headline:** at the same bytes" in (out / "summary.md").read_text()
    assert (out / "diloco.png").stat().st_size > 1000 and len(list((out / "runs").glob("*.json"))) == 12


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pairs", "8:x"], "--pairs"),
        (["--pairs", "8:0"], "--pairs"),
        (["--steps", "20", "--pairs", "16:2"], "--steps"),
        (["--seeds", "1"], "--seeds"),
        (["--outer-momentum", "1"], "--outer-momentum"),
    ],
)
def test_bad_flags_fail_before_writing(tmp_path, capsys, argv, message):
    assert main(["experiment", "diloco-pairs", "--tiny", *argv, "--out", str(tmp_path / "root")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "root").exists()
