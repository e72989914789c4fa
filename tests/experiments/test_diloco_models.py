"""`edgc experiment diloco` across model families: method names, torchft's DiLoCo on the plain-group
manager against edgc's uncompressed DiLoCo, a quantised arm's bytes, the spectrum probe, bad flags."""

import math

import pytest
import torch

from edgc_cli.main import main
from edgc_experiments.diloco import method_arm
from edgc_experiments.diloco_families import family
from edgc_experiments.diloco_runs import energy_shares, train

ARM = {"sync_every": 3, "inner": "adamw", "outer_lr": 0.7, "outer_momentum": 0.5}


def test_method_names_parse_into_arms():
    assert method_arm("torchft") == {"method": "torchft"}
    assert method_arm("raw") == {"method": "edgc", "rank": None}
    assert method_arm("rank8-noef") == {"method": "edgc", "rank": 8, "decay": 0.0}
    assert method_arm("quant3-decay0.5+heal=peer") == {
        "method": "edgc",
        "rank": None,
        "sync": "quant3",
        "decay": 0.5,
        "heal_policy": "peer",
    }
    assert method_arm("quant3-2s") == {"method": "edgc", "rank": None, "sync": "quant3-2s"}
    # any registered sync method; the outer optimizer per arm (SparseLoCo's: no momentum, lr 1)
    assert method_arm("sparse64-decay0.95-mom0-lr1") == {
        "method": "edgc",
        "rank": None,
        "sync": "sparse64",
        "decay": 0.95,
        "outer_momentum": 0.0,
        "outer_lr": 1.0,
    }
    for bad in ("quant9", "torchft-noef", "rank", "quant3-3s", "sparse64-x1", "rank8-noef-decay0.5"):
        with pytest.raises(ValueError):
            method_arm(bad)


def test_a_two_stage_method_is_paired_with_torchft_and_with_its_one_stage_twin():
    from edgc_experiments.diloco import _pairs

    cell = {"torchft": {}, "quant3": {}, "quant3-2s": {}, "quant3-2s+heal=zero": {}}
    assert _pairs(dict.fromkeys(cell), cell) == [
        ("torchft", "torchft"),
        ("quant3", "torchft"),
        ("quant3-2s", "torchft"),
        ("quant3-2s", "quant3"),
        ("quant3-2s+heal=zero", "quant3-2s"),
    ]
    assert _pairs({"quant3-2s": {}}, {"torchft": {}, "quant3-2s": {}}) == [("quant3-2s", "torchft")]


@pytest.fixture(scope="module")
def cnn():
    return family("cnn")


def test_torchft_diloco_and_edgc_sending_raw_take_the_same_steps(cnn):
    """A world of one: the same initialisation, data and outer steps give the same model."""
    runs = {
        name: train(0, 1, cnn, {**ARM, **method_arm(name), "spectrum": [1, 4]}, 5, 6) for name in ("torchft", "raw")
    }
    assert runs["torchft"]["val_loss"] == pytest.approx(runs["raw"]["val_loss"], rel=1e-6)
    # edgc adds one flag element (4 bytes) per outer step to the raw all-reduce
    assert runs["raw"]["bytes"] == runs["raw"]["bytes_raw"] + 4 * 2 == runs["torchft"]["bytes"] + 8
    spectrum = runs["torchft"]["spectrum"]
    for kind in ("pseudo_gradient", "gradient"):
        assert 0 < spectrum[kind]["1"] <= spectrum[kind]["4"] <= 1


def test_the_llama_family_trains_alike_under_torchft_and_edgc_sending_raw():
    llama = family("llama")
    runs = {name: train(0, 1, llama, {**ARM, **method_arm(name)}, 5, 6) for name in ("torchft", "raw")}
    assert runs["torchft"]["val_loss"] == pytest.approx(runs["raw"]["val_loss"], rel=1e-6)
    assert runs["torchft"]["val_loss"] < math.log(llama.corpus.vocab_size)  # it learned in 6 steps


def test_a_quantised_arm_sends_under_a_tenth_and_heals(cnn):
    run = train(0, 1, cnn, {**ARM, **method_arm("quant3"), "heal": (1, "zero")}, 5, 6)
    assert 0.05 < run["bytes"] / run["bytes_raw"] <= 0.10 and math.isfinite(run["val_loss"])
    assert [o["relative_error"] is not None for o in run["outer"]] == [True, True]


def test_energy_shares_of_a_rank_one_matrix():
    u, v = torch.randn(8, 1), torch.randn(1, 6)
    assert energy_shares([u @ v], [1, 2])["1"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--methods", "rank8,torchft"], "the first must be torchft"),
        (["--models", "lstm"], "--models"),
        (["--methods", "torchft,quant9"], "quant9"),
        (["--no-train", "--reuse", "/nonexistent"], "--no-train: no cell"),
    ],
)
def test_bad_flags_exit_with_one_line(tmp_path, capsys, argv, message):
    assert main(["experiment", "diloco", "--steps", "60", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_runs_are_reused_per_seed_at_the_same_outer_steps(tmp_path):
    from edgc_experiments.common import write_json
    from edgc_experiments.diloco import reused

    (tmp_path / "runs").mkdir()
    run = {"val_loss": 2.0, "outer_steps": 20}
    write_json(tmp_path / "runs" / "gru-sgd-H6.json", {"torchft": {"1": run, "2": run}, "quant3": {"1": run}})
    arms = {"torchft": {}, "quant3": {}}
    assert reused([str(tmp_path)], "gru/sgd/H6", arms, [1, 2], 20) == {
        "torchft": {"1": run, "2": run},
        "quant3": {"1": run},  # an interrupted run's seeds: the rest are trained
    }
    assert reused([str(tmp_path)], "gru/sgd/H6", arms, [1, 2], 4) == {}  # other outer steps
    assert reused([str(tmp_path / "none")], "gru/sgd/H6", arms, [1], 20) == {}


def test_equal_bytes_holds_a_method_against_torchft_and_the_default_only_where_it_sent_no_more():
    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC as default
    from edgc_experiments.diloco import _equal_bytes

    def runs(loss, sent):
        return {str(s): {"val_loss": loss + s / 100, "bytes": sent, "outer": []} for s in (1, 2)}

    fast = {"torchft": runs(2.0, 100), default: runs(2.0, 10), "sparse64": runs(2.1, 1)}
    slow = {"torchft": runs(2.2, 30), default: runs(2.2, 3), "sparse64": runs(2.3, 0.3)}
    cells = [("cnn", "adamw", h, dict.fromkeys(fast)) for h in (3, 10)]
    rows = _equal_bytes(cells, {"cnn/adamw/H3": fast, "cnn/adamw/H10": slow}, [1, 2], [3, 10])
    held = {(row[2], row[3]): row[4] for row in rows}
    # torchft at H3 sends more than torchft at H10: no row; the default at H3 sends more than at H10: none
    assert held == {
        (f"{default} H3", "torchft H10"): "0.333",
        ("sparse64 H3", "torchft H10"): "0.033",
        ("sparse64 H3", f"{default} H10"): "0.333",
    }


def test_the_frontier_holds_a_method_only_where_its_interval_lies_inside_the_bound():
    from edgc_experiments.diloco_frontier import frontier_rows, holds

    def p(low, high, ratio):
        return {"mean": (low + high) / 2, "low": low, "high": high, "bytes_ratio": ratio}

    assert holds(p(-0.9, 0.9, 1)) and not holds(p(-0.2, 1.1, 1)) and not holds(p(-1.5, -1.1, 1))
    stats = {("a/H30", "quant3"): p(-0.5, 0.5, 0.098), ("b/H30", "quant3"): p(-0.2, 0.4, 0.098)}
    stats |= {("a/H30", "sparse64"): p(0.2, 0.8, 0.0068), ("b/H30", "sparse64"): p(1.5, 3.0, 0.0069)}
    cells = [("a", "adamw", 30, dict.fromkeys(["torchft", "quant3", "sparse64"]))]
    rows = frontier_rows(stats, cells)
    assert [row[:3] for row in rows] == [["sparse64", "0.0069", "1/2"], ["quant3", "0.0980", "2/2"]]
    assert rows[0][3].startswith("b/H30 +2.25") and rows[1][3] == "–"
