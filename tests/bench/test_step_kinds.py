"""Every step kind counted (`edgc_bench.step_kinds`): what each adds to a static step, on a small
GPT-2, and the committed figures of the engine page (docs/engine/step-kinds.json)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from edgc_bench.step_kinds import DILOCO_COUNTS, KINDS, _hooks, config_of, process_peak
from edgc_probes.dispatch_count import count_hook_step
from edgc_probes.gpt2_layout import gpt2_parameters

ROOT = Path(__file__).resolve().parents[2]
FIGURES = json.loads((ROOT / "docs" / "engine" / "step-kinds.json").read_text())
COST = json.loads((ROOT / "docs" / "engine" / "cost.json").read_text())


@pytest.fixture(scope="module")
def counts():
    named = gpt2_parameters("tiny")
    return {kind: count_hook_step(named, rank=8, config=config_of(kind, 8), **_hooks(kind)) for kind in KINDS}


def per_element(count, value):
    return count.per_compressed_element(value)


def test_every_kind_is_a_compressed_step_of_its_own_kind(counts):
    assert {kind: count.phase for kind, count in counts.items()} == dict.fromkeys(KINDS, "compress")
    assert counts["rank-change"].rank == 4 and counts["static"].rank == 8


def test_a_rank_change_that_keeps_its_matrices_rebuilds_the_arena_in_place(counts):
    """No second arena beside the old one, nothing of it copied. The new rank's factors (P and two Q
    buffers) are built while the old ones are still read for the warm start, so the peak may pass
    static's by those, which at a small model's widths are a large share of an element's bytes; a
    second fp32 arena would add 4 B an element on top."""
    static, change = counts["static"], counts["rank-change"]
    extra = per_element(change, change.peak_state_bytes) - per_element(static, static.peak_state_bytes)
    assert extra < 4.0
    # no zero-filled arena (4 B an element); the new factors buffer is zero-filled, a fraction of one
    assert per_element(change, change.bytes_by_op.get("zeros", 0)) < 1.0


def test_torchfts_uncommitted_step_holds_one_spare_arena(counts):
    static, torchft = counts["static"], counts["torchft"]
    spare = per_element(torchft, torchft.peak_state_bytes) - per_element(static, static.peak_state_bytes)
    assert spare == pytest.approx(4.0, abs=0.05)  # the fp32 residual beside M
    assert torchft.bytes == static.bytes


def test_a_sampled_step_reads_no_whole_pass_more_than_a_static_one(counts, monkeypatch):
    """The error is read from a row sample of M and of the residual, and the entropy sample is
    gathered in one copy: neither is a pass over the matrices (4 B per element each). A small model's
    calls are below the row sample's size (measured exactly) and its entropy sample a large share of
    it: both made small here, as they are beside GPT-2 XL's matrices."""
    import edgc.engine.lowrank

    monkeypatch.setattr(edgc.engine.lowrank, "ERROR_SAMPLE", 1 << 10)
    config = replace(config_of("sampled", 8), entropy_sample_cap=1000)
    sampled, static = count_hook_step(gpt2_parameters("tiny"), rank=8, config=config), counts["static"]
    assert per_element(sampled, sampled.bytes - static.bytes) < 1.0
    exact = counts["sampled"]  # every row read: M and e, 8 B per element
    assert per_element(exact, exact.bytes - static.bytes) > per_element(sampled, sampled.bytes - static.bytes) + 7


def test_the_committed_figures_are_this_engines_static_step_and_the_page_shows_them(load_producer):
    static = FIGURES["kinds"]["static"]
    assert (static["dispatches"], static["bytes"], static["memory"]) == (
        COST["dispatches"],
        COST["bytes"],
        COST["memory"]["float32"],
    )
    script = load_producer("step-kinds")
    page = (ROOT / "docs" / "concepts" / "engine.md").read_text()
    assert script.block(FIGURES) in page
    pace = script.pace_block(FIGURES, json.loads(script.BEFORE.read_text()))  # the engine page's and the GPU page's
    assert pace in page and pace in (ROOT / "docs" / "gpu.md").read_text()


def test_the_committed_outer_sync_is_diloco_s_default():
    """A new default outer sync is recounted (python -m edgc_bench.step_kinds --diloco-only --out …; the
    script), at every model and number of groups, within its limits."""
    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC

    outers = FIGURES["diloco"]
    assert outers and all(outer["method"] == DEFAULT_OUTER_SYNC for outer in outers)
    assert {(outer["model"], outer["groups"]) for outer in outers} == set(DILOCO_COUNTS)
    for outer in outers:  # launches and collectives flat in the model and the groups; a byte a parameter in flight
        assert outer["dispatches"] <= 2000 and outer["rollback_dispatches"] <= 2000 and outer["collectives"] <= 64
        assert outer["transient_per_param"] <= 1.0
    for model in {outer["model"] for outer in outers}:
        counts = [outer["dispatches"] for outer in outers if outer["model"] == model]
        assert max(counts) <= 1.1 * min(counts)


def test_the_process_peak_holds_at_least_the_error_feedback():
    """Real tensors at GPT-2 XL widths, embeddings alone: the fp32 error feedback (4 B per element) is
    held, and a step's transients add to it."""
    peak = process_peak("static", layers=0)
    assert peak["compressed_elements"] > 80_000_000
    assert 4.0 <= peak["peak_beyond_gradients"] < 16.0
