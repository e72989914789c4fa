"""docs/extending.md's two extensions, run as the page writes them: each of its files is written out
and imported (which registers it), then goes through the tools that read the registries: `edgc
train` in this process, the simulator's price of a step, the pareto experiment (the bench's methods:
tests/bench/test_extending_bench.py); and the tools know neither name before the import nor after
the registrations are undone."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from edgc import EDGCConfig
from edgc.policies.signals import SIGNALS
from edgc.sync.sync_methods import SYNC_METHODS
from edgc_cli.errors import CLIError
from edgc_cli.main import build_parser, main
from edgc_train.config import TrainConfig

from .conftest import FAST, read_metrics
from .extension_page import page_extensions


@pytest.fixture
def extensions(tmp_path):
    folder = tmp_path / "extensions"
    folder.mkdir()
    with page_extensions(folder) as modules:
        yield modules


def test_a_compressor_in_one_file_runs_in_train_and_simulator(extensions, tmp_path, cache_dir):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--out",
                str(run),
                "--steps",
                "3",
                "--ckpt-every",
                "-1",
                "--eval-every",
                "0",
                "--compressor",
                "int8",
                "--cache-dir",
                str(cache_dir),
                *FAST,
            ]
        )
        == 0
    )
    steps = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert len(steps) == 3 and all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["phase"] == "compress" and steps[-1]["bytes_sent"] < steps[-1]["bytes_raw"] / 3  # 1 byte of 4

    from edgc_sim.bench_link import BenchLink
    from edgc_sim.step_model import compress_model, wire_parts

    link = BenchLink(alpha_s=1e-4, bytes_per_s=1e8, burst_bytes=0.0)
    assert wire_parts("int8", 4, [1e6], link) == (link.latency_s(4, True), link.bytes_s(4, 1e6, True))  # all-gather
    assert wire_parts("fp16", 4, [1e6], link) == (link.latency_s(4), link.bytes_s(4, 1e6))  # all-reduce
    assert compress_model("int8", None, {}, None) is None  # not modelled: the bench's measured time stands


def test_a_budget_signal_in_one_file_steers_the_budget_in_train_and_pareto(extensions, tmp_path, cache_dir):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--out",
                str(run),
                "--steps",
                "12",
                "--ckpt-every",
                "0",
                "--eval-every",
                "0",
                "--compressor",
                "edgc",
                "--edgc",
                "r_max=4",
                "--edgc",
                "rank_budget=2",
                "--edgc",
                "window=3",
                "--edgc",
                "budget_signal=peak",
                "--cache-dir",
                str(cache_dir),
                *FAST,
            ]
        )
        == 0
    )
    decisions = [r for r in read_metrics(run) if r["kind"] == "decision"]
    assert decisions and all(d["signal"] == "peak" and 0 <= d["need"] <= 1 for d in decisions)
    (checkpoint,) = run.glob("checkpoints/*/edgc_rank0.pt")
    sampler = torch.load(checkpoint, weights_only=False)["sampler"]
    peaks = sampler["series"]["peak"]  # measured wherever the entropy was, and kept with the checkpoint
    assert [s for s, _ in peaks] == [s for s, _ in sampler["history"]] and len(peaks) >= 3
    assert all(math.isfinite(v) for _, v in peaks)

    from edgc_experiments import common, pareto
    from edgc_experiments.pareto_train import compressor_fields

    args = build_parser(only="experiment").parse_args(["experiment", "pareto", "--signals", "schedule,peak"])
    pareto.validate(args, common.setting_from_args(args))
    arm = pareto.arms(4, 400, ["peak"], [], False)["budget-peak"]
    assert EDGCConfig(**compressor_fields(arm)).budget_signal == "peak"
    args.signals = "schedule,vibes"
    with pytest.raises(CLIError, match="--signals"):
        pareto.validate(args, common.setting_from_args(args))


def test_the_tools_know_the_names_only_while_the_registrations_hold(tmp_path):
    def accepted(make, field: str) -> bool:
        try:
            make()
        except ValueError as refusal:
            assert field in str(refusal)  # refused for the name, not for another setting
            return False
        return True

    def known() -> tuple[bool, bool]:
        """Whether the budget config takes ``peak`` and the harness's config ``int8``."""
        return (
            accepted(
                lambda: EDGCConfig(r_max=4, rank_budget=2, total_steps=100, budget_signal="peak"), "budget_signal"
            ),
            accepted(lambda: TrainConfig(compressor="int8"), "compressor"),
        )

    assert known() == (False, False)
    with page_extensions(tmp_path):
        assert known() == (True, True)
    assert known() == (False, False)
    assert "int8" not in SYNC_METHODS and "peak" not in SIGNALS and "my_compressor" not in sys.modules
