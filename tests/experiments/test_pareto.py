"""The pareto instrument: its arms spend the same bytes, its statistics are paired, and a tiny run works end to end."""

import json
import math

import pytest

from edgc import EDGCConfig, LowRankConfig
from edgc.control.budget import spent_rank_steps
from edgc.control.rank_control import WindowController
from edgc.policies.plans import DecisionInputs
from edgc_cli.main import main
from edgc_experiments.pareto import arms
from edgc_experiments.pareto_summary import paired
from edgc_experiments.pareto_train import compressor_fields


@pytest.mark.parametrize("budget", [2, 4, 8])
def test_every_arm_spends_the_budget_of_static(budget):
    plan = arms(budget, 400, ["schedule", "gradnorm"], ["hand-3", "hand-2"], True)
    static = {k: v for k, v in plan["static"].items() if k != "shadow_ranks"}
    assert plan["cold"] == {**static, "cold_start": True}  # static, without the warm start
    assert plan["static"]["shadow_ranks"] == (budget,)  # an independent twin: where two iterations settle apart
    assert plan["alt-warm"]["shadow_ranks"] == (budget // 2, budget + budget // 2)  # the alternation's two ranks
    assert plan["alt-warm"]["shadow_twin"] == "run" and "shadow_twin" not in plan["static"]  # static: independent
    for name, fields in plan.items():
        controller = WindowController(EDGCConfig.from_dict(compressor_fields(fields)))
        for step in range(400):  # no signal moves a hand-set or schedule run; gradnorm sees no series: need 0
            plan = controller.plan(step)
            if plan.decision:
                inputs = DecisionInputs(plan)
                controller.apply(inputs, controller.propose(inputs))
        spent, steps = spent_rank_steps(controller.schedule, 400)
        assert steps == 360, name
        assert spent / steps == pytest.approx(budget, rel=0.02), name


def test_paired_statistics_pair_by_seed():
    runs = {
        "static": {
            "1": {"val_loss": 5.0, "bytes": 100, "mean_rank": 4, "rank_changes": 0},
            "2": {"val_loss": 6.0, "bytes": 100, "mean_rank": 4, "rank_changes": 0},
        },
        "arm": {
            "1": {"val_loss": 4.9, "bytes": 100, "mean_rank": 4, "rank_changes": 3},
            "2": {"val_loss": 5.9, "bytes": 102, "mean_rank": 4, "rank_changes": 3},
        },
    }
    p = paired(runs, "arm", [1, 2])
    assert p["deltas"] == pytest.approx([-0.1, -0.1]) and p["mean"] == pytest.approx(-0.1)
    assert p["low"] == pytest.approx(-0.1) and p["high"] == pytest.approx(-0.1)  # no spread: a point interval
    assert p["bytes_ratio"] == pytest.approx(1.01)


def test_tiny_pareto_run_writes_paired_results_and_reuses_runs(tmp_path, capsys):
    flags = [
        "experiment",
        "pareto",
        "--tiny",
        "--steps",
        "12",
        "--budgets",
        "2",
        "--seeds",
        "2",
        "--signals",
        "schedule",
        "--hand-set",
        "",
        "--jobs",
        "1",
    ]
    assert main([*flags, "--out", str(tmp_path / "a")]) == 0
    out = tmp_path / "a" / "pareto"
    data = json.loads((out / "results.json").read_text())
    p = data["paired"]["2"]["budget-schedule"]
    assert len(p["deltas"]) == 2 and all(math.isfinite(d) for d in p["deltas"])
    assert p["bytes_ratio"] == pytest.approx(1.0, rel=0.1)
    assert "**Headline:** b=2: budget controller" in (out / "summary.md").read_text()
    assert (out / "pareto.png").stat().st_size > 1000 and len(list((out / "runs").glob("*.json"))) == 4
    capsys.readouterr()
    assert main([*flags, "--out", str(tmp_path / "b"), "--reuse", str(out)]) == 0
    assert "4 reused" in capsys.readouterr().out
    again = json.loads((tmp_path / "b" / "pareto" / "results.json").read_text())
    assert again["paired"] == data["paired"]


def test_change_cost_is_fast_minus_slow_alternation_per_extra_change():
    from edgc_experiments.pareto_summary import change_cost_text

    def run(loss, changes):
        return {"val_loss": loss, "bytes": 100, "mean_rank": 4, "rank_changes": changes}

    seeds = [1, 2, 3]
    runs = {
        "alt-warm": {str(s): run(5.0 + 0.012 + 0.001 * s, 17) for s in seeds},
        "alt-truncate": {str(s): run(5.0 + 0.024 + 0.001 * s, 17) for s in seeds},
        "alt3-warm": {str(s): run(5.0 + 0.001 * s, 5) for s in seeds},
        "alt3-truncate": {str(s): run(5.0 + 0.001 * s, 5) for s in seeds},
    }
    runs["static"] = runs["alt3-warm"]
    runs["cold"] = {str(s): run(5.0 + 0.036 + 0.001 * s, 0) for s in seeds}
    stats = {name: paired(runs, name, seeds) for name in runs}
    text = change_cost_text(4, runs, stats, seeds, 360)
    assert stats["per-step-cold"]["mean"] == pytest.approx(0.0001)  # 0.036 over 360 compressed steps
    assert "What a warm start is worth" in text
    assert stats["per-change-warm"]["mean"] == pytest.approx(0.001)  # 0.012 over 12 extra changes
    assert stats["per-change-truncate"]["mean"] == pytest.approx(0.002)
    assert stats["warm-vs-truncate"]["mean"] == pytest.approx(-0.012)
    assert "Per change" in text and "12 extra changes" in text
    del runs["alt3-truncate"]  # without the slow arms: only the fast alternation's paragraph
    assert "Per change" not in change_cost_text(4, runs, {n: paired(runs, n, seeds) for n in runs}, seeds, 360)


def test_a_cold_start_redraws_every_q_alike_and_keeps_its_shape():
    import torch

    from edgc_experiments.pareto_train import redraw_q

    q = {"b": torch.ones(5, 2), "a": torch.ones(7, 3)}
    redraw_q(q, seed=1, step=10)
    again = {"b": torch.ones(5, 2), "a": torch.ones(7, 3)}
    redraw_q(again, seed=1, step=10)
    assert {n: t.shape for n, t in q.items()} == {"b": (5, 2), "a": (7, 3)}
    assert all(torch.equal(q[n], again[n]) for n in q)  # the same draw for the same (seed, step)
    assert not torch.equal(q["a"], torch.ones(7, 3))
    later = {"b": torch.ones(5, 2), "a": torch.ones(7, 3)}
    redraw_q(later, seed=1, step=11)
    assert not torch.equal(later["a"], q["a"])  # a new draw every step


def test_run_keys_hold_the_resolved_config_and_older_records_are_not_reused(tmp_path):
    from edgc_experiments.common import Setting
    from edgc_experiments.pareto_runs import resolved_config, reusable_runs, run_key

    setting = vars(Setting(steps=400))
    explicit = {"r_max": 4, "r_min": 4, "adaptive": False}
    config = resolved_config(explicit)
    assert config["engine"]["rank_change"] == EDGCConfig().engine.rank_change and config["r_max"] == 4  # defaults too
    assert resolved_config({**explicit, "cold_start": True}) == {**config, "cold_start": True}
    runs = tmp_path / "old" / "runs"
    runs.mkdir(parents=True)
    new_key = run_key(setting, config, 1)
    older_key = json.dumps({"setting": setting, "seed": 2, "fields": explicit}, sort_keys=True)
    for name, key in (("new", new_key), ("older", older_key)):
        (runs / f"{name}.json").write_text(json.dumps({"key": key, "result": {"val_loss": 5.0}}))
    said = []
    found = reusable_runs([str(tmp_path / "old")], said.append)
    assert list(found) == [new_key]
    assert said == ["  --reuse: 1 records from before run keys held the whole config are not reused"]


def test_a_run_keyed_by_a_config_with_the_engine_fields_flat_is_reused_under_its_nested_key(tmp_path):
    from edgc_experiments.common import Setting
    from edgc_experiments.pareto_runs import resolved_config, reusable_runs, run_key

    setting = vars(Setting(steps=400))
    config = resolved_config({"r_max": 4, "r_min": 4, "adaptive": False, "cold_start": True})
    flat = {**{k: v for k, v in config.items() if k != "engine"}, **config["engine"]}  # as earlier versions keyed it
    runs = tmp_path / "old" / "runs"
    runs.mkdir(parents=True)
    (runs / "flat.json").write_text(json.dumps({"key": run_key(setting, flat, 1), "result": {"val_loss": 5.0}}))
    found = reusable_runs([str(tmp_path / "old")], [].append)
    nested_key = run_key(setting, config, 1)
    assert list(found) == [nested_key] and found[nested_key]["result"] == {"val_loss": 5.0}


def test_rank_change_flag_sets_every_arm_but_the_alternations():
    plan = arms(4, 400, ["schedule"], ["hand-3"], True, rank_change="truncate")
    assert {name: fields.get("engine", {}).get("rank_change") for name, fields in plan.items()} == {
        "static": "truncate",
        "budget-schedule": "truncate",
        "hand-3": "truncate",
        "cold": "truncate",
        "alt-warm": "warm",
        "alt-truncate": "truncate",
        "alt3-warm": "warm",
        "alt3-truncate": "truncate",
    }
    assert "engine" not in arms(4, 400, ["schedule"], [], False)["budget-schedule"]  # EDGCConfig's default


# ---------------------------------------------------------------------------- cost of a change in compression error


def shadow_records(excess_by_step, ranks):
    """Records as `change_cost.shadow_record` writes them: the run's error = shadow's + excess."""
    return [
        [step, rank, 0.5 + excess, {"2": 0.5, "6": 0.5}]
        for step, (rank, excess) in enumerate(zip(ranks, excess_by_step))
    ]


def test_change_costs_sum_the_excess_from_each_change_to_the_next():
    from edgc_experiments.change_cost import change_costs

    ranks = [6] * 4 + [2] * 4 + [6] * 4
    excess = [0.3, 0.1, 0.0, 0.0] + [0.2, 0.0, 0.0, 0.0] + [0.4, 0.2, 0.0, 0.04]
    costs = change_costs(shadow_records(excess, ranks))
    # the first window begins at the warm-up, not at a change: not counted
    assert [(c["step"], c["rise"]) for c in costs["changes"]] == [(4, False), (8, True)]
    assert [c["cost"] for c in costs["changes"]] == pytest.approx([0.2, 0.64])
    assert [c["first"] for c in costs["changes"]] == pytest.approx([0.2, 0.4])  # what the change threw away at once
    assert costs["settled_excess"] == pytest.approx((0.0 + 0.0 + 0.0 + 0.04) / 4)  # last halves of those windows


def test_halving_compares_the_new_rule_with_half_the_old_per_seed():
    from edgc_experiments.change_cost import halving, summarise

    ranks = [6] * 3 + [2] * 3 + [6] * 3 + [2] * 3

    def runs(rise, fall):  # per seed, an excess on the first step after each change, a little larger each seed
        return {
            str(s): {
                "shadow": shadow_records(
                    [0, 0, 0, fall * (1 + s / 100), 0, 0, rise * (1 + s / 100), 0, 0, fall * (1 + s / 100), 0, 0], ranks
                )
            }
            for s in (1, 2, 3)
        }

    per_rule = summarise({"warm": runs(rise=0.1, fall=0.1), "truncate": runs(rise=0.4, fall=0.2)}, [1, 2, 3])
    assert per_rule["warm"]["rises"]["per_seed"] == pytest.approx([0.101, 0.102, 0.103])
    assert per_rule["truncate"]["falls"]["per_seed"] == pytest.approx([0.202, 0.204, 0.206])
    assert per_rule["truncate"]["all"]["mean"] == pytest.approx(1.02 * (0.2 + 0.4 + 0.2) / 3)
    halved = halving(per_rule)
    assert halved["ratio"] == pytest.approx(0.1 / (0.8 / 3))
    assert halved["high"] < 0  # warm costs less than half of truncate, in every seed
    assert halving(summarise({"warm": runs(0.4, 0.2), "truncate": runs(0.1, 0.1)}, [1, 2, 3]))["low"] > 0
    # the excess sits on each change's first step here, so the first-step measure agrees with the sums
    assert per_rule["warm"]["first"]["rises"]["per_seed"] == pytest.approx([0.101, 0.102, 0.103])
    assert halving(per_rule, first=True)["ratio"] == pytest.approx(halved["ratio"])
    assert summarise({"warm": {"1": {"val_loss": 5.0}}}, [1]) is None  # runs from before the instrument


def test_steady_excess_is_a_static_runs_mean_excess_over_its_twin():
    from edgc_experiments.change_cost import steady_excess

    runs = {str(s): {"shadow": [[step, 4, 0.5 + 0.01 * s, {"4": 0.5}] for step in range(10)]} for s in (1, 2, 3)}
    excess = steady_excess(runs, [1, 2, 3], 4)
    assert excess["per_seed"] == pytest.approx([0.01, 0.02, 0.03]) and excess["mean"] == pytest.approx(0.02)
    assert steady_excess(runs, [1, 2, 3], 2) is None  # no twin at that rank
    assert steady_excess({"1": {"val_loss": 5.0}}, [1], 4) is None  # runs from before the instrument


def test_shadow_records_the_compressors_own_error_and_its_own_power_iteration():
    import torch

    from edgc.distributed.comm import Communicator
    from edgc.engine.lowrank import LowRankCompressor
    from edgc_experiments.change_cost import Shadows

    compressor, comm = LowRankCompressor(LowRankConfig(min_compression_rate=0.0)), Communicator()
    shadows = Shadows(compressor, [2, 4], twin="run")
    independent = Shadows(compressor, [2], twin="independent")
    weight, bias = torch.nn.Parameter(torch.zeros(12, 9)), torch.nn.Parameter(torch.zeros(9))
    named = [("w", weight), ("b", bias)]
    generator = torch.Generator().manual_seed(5)
    for step in range(4):
        weight.grad, bias.grad = torch.randn(12, 9, generator=generator), torch.randn(9, generator=generator)
        shadows.before_sync(named)
        independent.before_sync(named)
        stats = compressor.reduce(["w"], [weight.grad], 2, comm, measure_error=True)
        shadows.after_sync(named, step, 2)
        independent.after_sync(named, step, 2)
        _, rank, run, by_rank = shadows.records[-1]
        assert rank == 2 and set(by_rank) == {2, 4}
        assert run == pytest.approx(float(stats.error_sq / stats.norm_sq), rel=1e-5)  # the engine's own measure
        assert by_rank[4] < by_rank[2] < 1  # a higher rank approximates the same matrices better
        assert by_rank[2] == pytest.approx(run, abs=1e-6)  # the twin at the run's rank is the run: no excess
        # the first columns of a rank-4 power iteration are a rank-2 one (Q's signs aside)
        torch.testing.assert_close(shadows.twins[4].q["w"][:, :2].abs(), shadows.twins[2].q["w"].abs())
    assert shadows.twins[2].q["w"].shape == (9, 2) and "b" not in shadows.twins[2].q  # vectors are not matrices
    assert not shadows.twins[2].error and compressor.error  # the twins keep no error feedback of their own
    assert independent.records[0][3][2] != pytest.approx(shadows.records[0][3][2], abs=1e-6)  # another start
    with pytest.raises(ValueError, match="twin"):
        Shadows(compressor, [2], twin="twin")
