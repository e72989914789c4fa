"""`edgc experiment diloco --regime frontier`: its defaults, the tuning grid, the schedule, the losses a run
tracks (a world of one), and the summary drawn from runs: paired Δ % per outer step, what holds, the pictures."""

from __future__ import annotations

import argparse
import math

import pytest

from edgc_cli.main import main
from edgc_experiments import diloco_regime as regime
from edgc_experiments.diloco_regime_summary import family_stats, headline, summarise
from edgc_experiments.diloco_runs import inner_lr_factor, method_arm, train


def test_the_frontier_regime_fills_its_own_defaults_and_leaves_given_flags_alone():
    args = argparse.Namespace(regime="frontier", steps=None, tiny=False, models=None, inner=None, sync_every=None)
    args.__dict__.update(methods="torchft,quant3-2s", replicas=None, outer_momentum=None)
    setting = argparse.Namespace(steps=120)
    regime.resolve(args, setting)
    assert (args.models, args.sync_every, args.replicas, args.outer_momentum) == ("gpt2,llama", "15", 4, 0.9)
    assert args.methods == "torchft,quant3-2s" and setting.steps == 1800
    assert [c for c in regime.evals(120) if c % 5] == [] and {20, 60, 120} <= set(regime.evals(120))
    assert regime.checkpoints(8) == [8] and regime.checkpoints(120) == [20, 60, 120]


def test_the_reference_tunes_the_inner_rate_of_torchft_and_the_sparse_syncs_only():
    def arm(name):
        return method_arm(name)

    assert regime.tunes_inner(arm("torchft")) and regime.tunes_inner(arm("sparse128-tiles-decay0.95-mom0-lr1"))
    assert not regime.tunes_inner(arm("quant3-2s"))
    base = {"outer_lr": 2.0, "method": "edgc"}
    assert regime.tuned(base, (0.5, 1.25)) == {"outer_lr": 1.0, "method": "edgc", "inner_lr": 1.25}
    runs = {"a": {"val_loss": 3.0}, "b": {"val_loss": None}, "c": {"val_loss": 2.5}}
    assert regime.best(runs) == "c" and regime.best({"b": {"val_loss": None}}) is None


def test_the_inner_rate_warms_up_linearly_then_follows_a_cosine_to_zero():
    assert inner_lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert inner_lr_factor(9, 100, 10) == pytest.approx(1.0)
    assert inner_lr_factor(10, 100, 10) == pytest.approx(1.0)
    assert inner_lr_factor(55, 100, 10) == pytest.approx(0.5)
    assert inner_lr_factor(50, 100) == pytest.approx(0.5)  # no warm-up: the cosine from the first step


def test_a_run_with_evals_validates_at_them_and_logs_every_outer_step():
    from edgc_experiments.diloco_families import family

    fam = family("gpt2", size=regime.FRONTIER_SIZE)
    arm = {"sync_every": 3, "inner": "adamw", "outer_lr": 0.7, "outer_momentum": 0.9, **method_arm("torchft")}
    run = train(0, 1, fam, {**arm, "warmup": 3, "evals": [2, 4]}, 5, 12)
    assert set(run["val"]) == {"2", "4"} and run["val_loss"] == run["val"]["4"] and run["diverged_at"] is None
    assert len(run["outer"]) == 4 and all(math.isfinite(o["train_loss"]) for o in run["outer"])
    diverged = train(0, 1, fam, {**arm, "outer_lr": 1e30, "evals": [4]}, 5, 12)
    assert diverged["diverged_at"] is not None and diverged["val_loss"] is None


def runs_of(deltas: dict, seeds=(1, 2, 3), steps=(20, 60, 120)) -> dict:
    """torchft at loss 4 + seed/100 at every eval, each method Δ % above it; bytes 100 against the method's."""
    runs = {}
    for method, (delta, sent) in deltas.items():
        runs[method] = {
            str(s): {
                "val": {str(c): (4 + s / 100) * (1 + delta(c, s) / 100) for c in steps},
                "bytes": sent,
                "outer_steps": steps[-1],
                "outer": [{"relative_error": 0.5}],
                "wall_s": 60.0,
                "val_loss": 4.0,
                "arm": {"outer_lr": 1.0, "inner_lr": 1.0},
            }
            for s in seeds
        }
    return runs


def test_the_summary_pairs_each_outer_step_and_counts_what_holds(tmp_path):
    compare = runs_of(
        {
            "torchft": (lambda c, s: 0.0, 100.0),
            "quant3-2s": (lambda c, s: 0.1 * (s - 2), 9.8),
            "sparse128-tiles-decay0.95-mom0-lr1": (lambda c, s: 600 / c + 0.1 * s, 1.3),
        }
    )
    stats = family_stats(compare, list(compare), [1, 2, 3])
    assert stats["quant3-2s"]["payload"] == pytest.approx(0.098)
    sparse = stats["sparse128-tiles-decay0.95-mom0-lr1"]["steps"]
    assert sparse[20]["mean"] == pytest.approx(30.2, abs=1e-6) and sparse[120]["mean"] == pytest.approx(5.2)
    text = headline(["gpt2"], {"gpt2": stats})
    assert "quant3-2s (0.098×) 1/1" in text and "sparse128-tiles-decay0.95-mom0-lr1 (0.013×) 0/1" in text
    assert "+30.20 % at 20 → +10.20 % at 60 → +5.20 % at 120" in text  # the gap against the syncs
    data = {"gpt2": {"tuning": {m: {"outer×1 inner×1": compare[m]["1"]} for m in compare}, "compare": compare}}
    args = argparse.Namespace(replicas=4, sync_every="15", tune_outer="1", tune_inner="", tune_on=None, models="gpt2")
    setting = argparse.Namespace(steps=1800, seed=1)
    chosen = {"gpt2": {m: "outer×1 inner×1" for m in compare}}
    result = summarise(tmp_path, setting, args, [1, 2, 3], list(compare), data, chosen)
    summary = (tmp_path / "summary.md").read_text()
    assert "**Headline:**" in summary and "| gpt2 | quant3-2s | 1 · ×1 | 0.0980 |" in summary
    assert "Cost: a cell" in summary and "1.0 min" in summary and "CPU-minutes" not in summary
    assert (tmp_path / "frontier.png").stat().st_size > 0 and (tmp_path / "curves.png").stat().st_size > 0
    assert result["paired"]["gpt2 quant3-2s 120"]["mean"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tune-outer", "1,x"], "--tune-outer"),
        (["--tune-outer", ""], "--tune-outer"),
        (["--sync-every", "15,30"], "one H"),
        (["--methods", "quant3-2s,torchft"], "the first must be torchft"),
        (["--tune-on", "gru"], "--tune-on"),
    ],
)
def test_bad_frontier_flags_exit_with_one_line(tmp_path, capsys, argv, message):
    assert main(["experiment", "diloco", "--regime", "frontier", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_a_stopped_regime_pairs_the_seeds_it_has_and_names_every_run_it_lacks(tmp_path):
    compare = runs_of({"torchft": (lambda c, s: 0.0, 100.0), "quant3-2s": (lambda c, s: 0.5, 9.8)}, seeds=(1,))
    for method in compare:
        compare[method]["1"]["cpu_s"] = 180.0
    sparse = "sparse128-senders-decay0.95-mom0-lr1"
    tuning = {m: {"outer×1 inner×1": compare[m]["1"]} for m in compare}
    tuning[sparse] = {
        "outer×1 inner×1": {**compare["quant3-2s"]["1"], "val": {"20": 4.4, "60": 4.2, "120": 4.1}, "bytes": 1.3}
    }
    data = {"gpt2": {"tuning": tuning, "compare": compare}, "llama": {"tuning": {}, "compare": {}}}
    args = argparse.Namespace(replicas=4, sync_every="15", tune_outer="1,2", tune_inner="", tune_on="gpt2")
    args.models = "gpt2,llama"
    chosen = {f: {m: "outer×1 inner×1" for m in ["torchft", "quant3-2s", sparse]} for f in data}
    setting = argparse.Namespace(steps=1800, seed=1)
    result = summarise(tmp_path, setting, args, [1, 2, 3], [*compare, sparse], data, chosen)
    summary = (tmp_path / "summary.md").read_text()
    assert "quant3-2s (0.098×) 0/1 (seeds: gpt2 1 of 3)" in result["headline"]  # one seed holds nothing
    assert "+0.50 (1 seed: no interval)" in summary
    assert "runs that counted their CPU time took 3.0 CPU-minutes each" in summary and "at least 1.5 min" in summary
    assert "tuning quant3-2s: 1 of 2 grid points" in summary and "quant3-2s at seeds 2, 3" in summary
    assert f"{sparse} at seeds 1, 2, 3" in summary and "llama: tuning" not in summary
    assert "llama: torchft at seeds 1, 2, 3" in summary
    assert "+9.73 at 20 → +4.74 at 60 → +2.24 at 120" in summary  # vs torchft 4.01 at the tuning seed
    empty = {f: {"tuning": data[f]["tuning"], "compare": {}} for f in data}
    for picture in ("frontier.png", "curves.png"):
        (tmp_path / picture).unlink()
    result = summarise(tmp_path, setting, args, [1, 2, 3], [*compare, sparse], empty, chosen)
    assert "no comparison seed has finished" in result["headline"] and (tmp_path / "curves.png").stat().st_size > 0
    assert (
        f"closest at ≤ 0.02× payload {sparse} (0.013×), +9.73 at 20 → +4.74 at 60 → +2.24 at 120" in result["headline"]
    )


def test_every_finished_run_is_written_before_the_next_starts(tmp_path, monkeypatch):
    from edgc_experiments import diloco_runs

    calls = []

    def one_run(family, arms, seed, steps, replicas, **kw):
        calls.append(arms)
        if len(calls) == 2:
            raise RuntimeError("the machine restarted")
        return [{"val_loss": 3.0, "diverged_at": None, "wall_s": 6.0}]

    monkeypatch.setattr(diloco_runs, "train_runs", one_run)
    store = regime.FamilyRuns(tmp_path, "gpt2", [])
    (tmp_path / "runs").mkdir()
    args = argparse.Namespace(no_train=False, replicas=4)
    arms = {("a", "k"): {"outer_lr": 1.0}, ("b", "k"): {"outer_lr": 2.0}}
    with pytest.raises(RuntimeError):
        regime._train(args, argparse.Namespace(steps=30, cache_dir=None), "gpt2", store, "tuning", 7, arms, print)
    assert [len(c) for c in calls] == [1, 1]  # one run per set of processes
    again = regime.FamilyRuns(tmp_path / "next", "gpt2", [str(tmp_path)])
    assert again.get("tuning", "a", "k", {"outer_lr": 1.0})["val_loss"] == 3.0
    assert again.get("tuning", "b", "k", {"outer_lr": 2.0}) is None
