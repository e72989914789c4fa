"""`edgc bench --tp/--pp`: TP × PP × DP settings, their validation and the train flags (no network)."""

from pathlib import Path

import pytest

from edgc_bench.cli import check_training, settings_from
from edgc_bench.run import train_args
from edgc_bench.table import pipeline_table, rows
from edgc_cli.errors import CLIError
from edgc_cli.main import build_parser


def parse(*flags):
    return settings_from(build_parser(only="bench").parse_args(["bench", *flags]))


def flag(args, name):
    return args[args.index(name) + 1]


def test_tp_pp_put_one_whole_model_on_each_host():
    s = parse("--tp", "2", "--pp", "2", "--interstage", "cooldown", "--interstage-rank", "4")
    assert (s.pipeline, s.nproc, s.grad_accum, s.methods) == (True, 4, 4, ("none", "powersgd@rmax", "edgc"))
    args = train_args(s, "powersgd@rmax", Path("out"), 8)
    assert [flag(args, k) for k in ("--tp", "--pp", "--grad-accum", "--interstage", "--interstage-rank")] == [
        "2",
        "2",
        "4",
        "cooldown",
        "4",
    ]
    assert flag(args, "--powersgd-rank") == "8"
    check_training(s)  # a valid edgc train configuration


def test_tp_without_pp_sends_no_interstage_flags_and_plain_runs_none():
    s = parse("--tp", "2")
    assert (s.nproc, s.grad_accum) == (2, 1)
    args = train_args(s, "edgc", Path("o"), None)
    assert flag(args, "--tp") == "2" and "--interstage" not in args
    plain = train_args(parse(), "none", Path("o"), None)
    assert not any(f in plain for f in ("--tp", "--pp", "--grad-accum", "--interstage"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--pp", "2", "--fsdp"), "cannot be combined with --fsdp"),
        (("--interstage", "all"), "needs --pp > 1"),
        (("--pp", "2", "--nproc", "3"), "must be tp × pp = 2"),
        (("--pp", "4", "--grad-accum", "2"), "must be ≥ pp = 4"),
        (("--pp", "2", "--grad-accum", "3"), "multiple of --grad-accum = 3"),
        (("--pp", "2", "--methods", "none,topk"), "not available with --tp/--pp"),
        (
            (
                "--tp",
                "0",
            ),
            "--tp: must be ≥ 1",
        ),
    ],
)
def test_bad_combinations_fail_with_one_line(flags, message):
    with pytest.raises(CLIError, match=message) as info:
        parse(*flags)
    assert "\n" not in str(info.value)


def test_training_check_rejects_a_layout_the_model_cannot_take():
    with pytest.raises(CLIError, match="tp"):
        check_training(parse("--tp", "5", "--preset", "tiny"))  # 5 divides neither heads nor width


def record(step, sent, raw, seconds):
    return {
        "step": step,
        "rank": None,
        "comm_time_s": 0.1,
        "step_time_s": 1.0,
        "compress_time_s": 0.0,
        "tokens_per_s": 100.0,
        "bytes_sent": 2e6,
        "wall_s": step,
        "interstage_bytes_sent": sent,
        "interstage_bytes_raw": raw,
        "interstage_time_s": seconds,
    }


def test_pipeline_table_reports_interstage_bytes_and_time():
    run = {
        "train": [record(1, 100, 400, 0.2), record(2, 300, 400, 0.4)],
        "eval": [{"val_loss": 5.0, "val_ppl": 148.4, "wall_s": 2, "step": 2}],
    }
    out = rows({"none": run}, None, pipeline=True)
    row = out[0]
    assert (row["interstage_sent_per_step"], row["interstage_raw_per_step"]) == (200, 400)
    assert row["interstage_s"] == pytest.approx(0.3) and row["comm_s"] == pytest.approx(0.1)  # our all-reduce is timed
    text = pipeline_table(out)
    assert "| 0.000 (0.000) | 0.50 | 0.300 | 30% |" in text and "our all-reduce per stage" in text
