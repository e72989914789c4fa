"""Every decision is said through Python's logging (`edgc.control.events`, logger ``edgc``), in one process.

Each event is one record whose message is one line and whose ``record.edgc`` carries its data: the
profiling verdict, the warm-up's end, each rank decision (the record `EDGCState.last_decision`
holds), a hand-set rank change, a non-finite step and a discarded one. Only a group's rank 0
speaks unless the filter is removed.
"""

import logging

import pytest
import torch
from torch import nn

from edgc import EDGCConfig, EDGCState, LowRankConfig
from edgc.control.profiling import describe_profiling_verdict
from edgc.runner.events import GROUP_RANK_ZERO, LOGGER

pytestmark = pytest.mark.filterwarnings("ignore:EDGCState. no process group")  # one process, on purpose


def run(config: EDGCConfig, steps: int, *, state: EDGCState | None = None, nan_at: int | None = None) -> EDGCState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 32))
    state = state or EDGCState(None, config, model=model)
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        model.zero_grad()
        loss = model(x).square().mean() * (float("nan") if step == nan_at else 1.0)
        loss.backward()
        state.synchronize(model.named_parameters())
        if state.defer_commit:
            state.rollback_step() if step == nan_at else state.commit_step()
    return state


def said(caplog, kind: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "edgc" and getattr(r, "edgc", {}).get("kind") == kind]


@pytest.fixture
def caplog_edgc(caplog):
    caplog.set_level(logging.INFO, logger="edgc")
    return caplog


def test_warmup_end_and_each_decision_are_one_line_each_with_their_data(caplog_edgc):
    config = EDGCConfig(r_max=8, r_min=2, window=3, total_steps=30, warmup_error_test=False, rank_budget=4)
    state = run(config, 16)
    [warmup] = said(caplog_edgc, "warmup_over")
    assert warmup.levelno == logging.INFO and warmup.edgc["step"] == config.warmup_floor()
    assert warmup.getMessage().startswith(f"step {config.warmup_floor()}: EDGC warm-up is over")
    assert warmup.edgc["cuda_graphs"] is False and "CUDA graphs" not in warmup.getMessage()
    decisions = said(caplog_edgc, "decision")
    assert decisions and decisions[-1].edgc == state.last_decision
    assert any(d.edgc["rank"] != d.edgc["old_rank"] for d in decisions)  # the budget moves the rank
    for record in caplog_edgc.records:
        assert "\n" not in record.getMessage() and record.getMessage() == record.edgc["message"]


def test_the_warmup_end_says_whether_cuda_graphs_are_on(caplog_edgc):
    config = EDGCConfig(
        r_max=4,
        window=3,
        total_steps=30,
        warmup_error_test=False,
        adaptive=False,
        engine=LowRankConfig(cuda_graphs=True),
    )
    run(config, config.warmup_floor() + 1)
    [warmup] = said(caplog_edgc, "warmup_over")
    assert warmup.edgc["cuda_graphs"] is True and "CUDA graphs on" in warmup.getMessage()


def test_the_profiling_verdict_says_r_max_or_why_compression_is_off(caplog_edgc):
    state = run(EDGCConfig(window=3, total_steps=30, profile_max_rank=4, profile_steps_per_rank=1), 8)
    verdict = state.controller.profiling_verdict()
    assert verdict is not None  # profiling is over (whether compression pays here is the timing's)
    [record] = said(caplog_edgc, "profiled") + said(caplog_edgc, "notice")
    assert record.edgc["message"] == describe_profiling_verdict(verdict)
    assert record.levelno == (logging.INFO if verdict["status"] == "found" else logging.WARNING)
    assert record.edgc["kind"] == ("profiled" if verdict["status"] == "found" else "notice")


def test_a_hand_set_rank_a_nonfinite_step_and_a_discarded_one_are_said(caplog_edgc):
    config = EDGCConfig.static(4, min_warmup_steps=2, window=100, rank_schedule=((6, 2),))
    run(config, 8)
    [moved] = said(caplog_edgc, "rank_set")
    assert moved.edgc == {**moved.edgc, "step": 6, "old_rank": 4, "rank": 2}
    state = EDGCState(None, EDGCConfig.static(4, min_warmup_steps=2, window=100))
    state.defer_commit = True
    caplog_edgc.clear()
    run(config, 6, state=state, nan_at=4)
    [nonfinite] = said(caplog_edgc, "nonfinite")
    [discarded] = said(caplog_edgc, "discarded")
    assert nonfinite.levelno == logging.WARNING and nonfinite.edgc["step"] == 4
    assert discarded.edgc["step"] == 4 and "the optimizer did not step" in discarded.getMessage()


def test_only_a_groups_rank_zero_speaks_unless_the_filter_is_removed(caplog_edgc):
    config = EDGCConfig.static(4, min_warmup_steps=2, window=100)
    state = EDGCState(None, config)
    state.comm.rank = 1  # as rank 1 of a group would be
    run(config, 4, state=state)
    assert not said(caplog_edgc, "warmup_over")
    LOGGER.removeFilter(GROUP_RANK_ZERO)
    try:
        state = EDGCState(None, config)
        state.comm.rank = 1
        run(config, 4, state=state)
    finally:
        LOGGER.addFilter(GROUP_RANK_ZERO)
    [record] = said(caplog_edgc, "warmup_over")
    assert record.edgc_rank == 1
