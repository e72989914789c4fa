"""The simulator's inter-stage model: compressed backward p2p in the 1F1B timeline, the cool-down's
transfer count, bytes from edgc.parallel.interstage.wire_bytes, and --tp/--pp/--interstage on the CLI."""

import random

import pytest

from edgc.parallel.interstage import wire_bytes
from edgc_sim import cost_model as cm
from edgc_sim.cli import with_layout
from edgc_sim.hardware import CLUSTERS
from edgc_sim.interstage_model import InterStage, gradient_ranks, step_bytes
from edgc_sim.iteration import IterationModel
from edgc_sim.presets import PRESETS


def random_pipeline(rng, P, m):
    t_fwd = [rng.uniform(0.5, 2) for _ in range(P)]
    t_bwd = [rng.uniform(1, 4) for _ in range(P)]
    p2p = [rng.uniform(0, 1) for _ in range(P - 1)]
    return t_fwd, t_bwd, p2p


@pytest.mark.parametrize("seed", range(20))
def test_cheaper_backward_transfers_never_slow_the_timeline_and_equal_ones_change_nothing(seed):
    rng = random.Random(seed)
    P, m = rng.randint(2, 5), rng.randint(1, 9)
    t_fwd, t_bwd, p2p = random_pipeline(rng, P, m)
    raw = cm.one_f_one_b_timeline(t_fwd, t_bwd, m, p2p)
    assert cm.one_f_one_b_timeline(t_fwd, t_bwd, m, p2p, p2p) == raw  # p2p_bwd_s = p2p_s: identical
    cheaper = [[t * rng.uniform(0, 1) for _ in range(m)] for t in p2p]
    compressed = cm.one_f_one_b_timeline(t_fwd, t_bwd, m, p2p, cheaper)
    for p in range(P):
        assert compressed.flush_end[p] <= raw.flush_end[p] + 1e-12
        for i in range(m):
            assert compressed.bwd_end[p][i] <= raw.bwd_end[p][i] + 1e-12


def test_backward_waits_count_the_idle_time_before_backwards():
    # 2 stages, 1 micro-batch: stage 0 runs F (1 s), then waits for stage 1's F (1 s) and B (2 s)
    # plus the gradient's transfer (0.5 s) before its own backward
    timeline = cm.one_f_one_b_timeline([1.0, 1.0], [2.0, 2.0], 1, [0.0], [0.5])
    assert cm.backward_waits(timeline, 2, 1) == pytest.approx([3.5, 0.0])
    with pytest.raises(ValueError, match="needs 3 values"):
        cm.one_f_one_b_timeline([1.0, 1.0], [2.0, 2.0], 3, [0.0], [[0.1, 0.2]])


@pytest.mark.parametrize("P,m", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_cooldown_compresses_exactly_the_last_p_minus_1_transfers_per_boundary(P, m):
    rows, cols, k = 512, 256, 8
    ranks = gradient_ranks("cooldown", k, m, P, rows, cols)
    assert ranks == [0] * (m - (P - 1)) + [k] * (P - 1)
    assert gradient_ranks("all", k, m, P, rows, cols) == [k] * m
    assert gradient_ranks("off", k, m, P, rows, cols) == [None] * m


def test_step_bytes_are_wire_bytes_per_compressed_gradient():
    P, m, rows, cols, k = 4, 8, 512, 256, 8
    sent, raw = step_bytes("cooldown", [None, k, k, k], m, P, rows, cols)
    per_boundary = (m - (P - 1)) * wire_bytes(rows, cols, 0) + (P - 1) * wire_bytes(rows, cols, k)
    assert (sent, raw) == ((P - 1) * per_boundary, (P - 1) * m * rows * cols * 4)
    assert step_bytes("off", [None] * P, m, P, rows, cols) == (raw, raw)  # no header on the raw path
    # EDGC's warm-up: rank None through the compressed path is raw plus a header per gradient
    assert step_bytes("all", [None, None], 2, 2, rows, cols) == (2 * wire_bytes(rows, cols, 0), 2 * rows * cols * 4)
    # factors that would not be smaller go raw (edgc.parallel.interstage.effective_rank)
    assert step_bytes("all", [None, 300], 1, 2, 400, 400)[0] == wire_bytes(400, 400, 0)


def model(mode, rank=8, preset="gpt2-2.5b", cluster="v100x32"):
    return IterationModel(PRESETS[preset], CLUSTERS[cluster], InterStage(mode, rank))


def test_iteration_model_compressed_backward_is_faster_and_off_is_unchanged():
    off, plain = model("off"), IterationModel(PRESETS["gpt2-2.5b"], CLUSTERS["v100x32"])
    assert off.timeline == plain.timeline and off.interstage_compress_s == 0
    for mode in ("all", "cooldown"):
        m = model(mode)
        assert max(m.timeline.flush_end) < max(off.timeline.flush_end)
        assert m.iteration((None,) * m.P).iteration_s < off.iteration((None,) * m.P).iteration_s
        assert m.interstage_compress_s > 0
    par, spec = PRESETS["gpt2-2.5b"].parallel, PRESETS["gpt2-2.5b"].model
    rows, cols = par.micro_batch * spec.seq_len, spec.hidden
    assert model("all").interstage_bytes == (
        (par.pp - 1) * par.micro_batches * wire_bytes(rows, cols, 8),
        (par.pp - 1) * par.micro_batches * rows * cols * 4,
    )
    # cool-down sends P - 1 compressed gradients per boundary, the rest raw
    m = par.micro_batches
    expected = (par.pp - 1) * ((m - par.pp + 1) * wire_bytes(rows, cols, 0) + (par.pp - 1) * wire_bytes(rows, cols, 8))
    assert model("cooldown").interstage_bytes[0] == expected


def test_interstage_config_is_validated():
    with pytest.raises(ValueError, match="interstage mode"):
        InterStage("sometimes")
    with pytest.raises(ValueError, match="rank must be >= 1"):
        InterStage("all", 0)


def test_layout_override_keeps_the_world_and_checks_it():
    preset = PRESETS["gpt2-2.5b"]  # TP4 PP4 DP2, 32 GPUs
    changed = with_layout(preset, 2, 2)
    assert (changed.parallel.tp, changed.parallel.pp, changed.parallel.dp) == (2, 2, 8)
    assert with_layout(preset, None, None) is preset
    with pytest.raises(ValueError, match="not a multiple of tp x pp"):
        with_layout(preset, 3, 4)
    with pytest.raises(ValueError, match="must divide"):
        with_layout(preset, 32, 1)


def test_cli_simulate_tp_pp_interstage(capsys):
    from edgc_cli.main import main

    assert (
        main(
            [
                "simulate",
                "--preset",
                "gpt2-345m",
                "--tp",
                "2",
                "--pp",
                "2",
                "--interstage",
                "cooldown",
                "--interstage-rank",
                "16",
                "--iterations",
                "2000",
                "--window",
                "100",
                "--no-plot",
                "--method",
                "powersgd",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "TP2 PP2 DP4" in out and "inter-stage activation gradients (cooldown, rank 16)" in out
    assert main(["simulate", "--preset", "gpt2-345m", "--pp", "5", "--no-plot"]) != 0
    assert "not a multiple of tp x pp" in capsys.readouterr().err
    assert (
        main(["simulate", "--preset", "gpt2-345m", "--pp", "1", "--tp", "2", "--interstage", "all", "--no-plot"]) != 0
    )
    assert "needs pp > 1" in capsys.readouterr().err
