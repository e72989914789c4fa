"""DiLoCo's two-stage outer sync (`quant3-2s`, `edgc.sync.two_stage`) on a plain process group, 3 gloo
processes, syncs of several buckets: replicas bit-identical, a rank sending 4/3 of a payload under a tenth; Streaming
DiLoCo's fragments with their syncs started an inner step early (``fragment_sync_delay``) too; and
a checkpoint taken mid-run (the owners' error feedback in it) resumes bit for bit."""

import pytest
import torch
from models import batch, flat_parameters, loss_fn

from edgc.integrations.diloco import DiLoCo

from .test_diloco import reloaded, training

SYNC_EVERY, OUTER_STEPS, BUCKET = 4, 6, 3000  # the model's 17,376 values: 6 buckets a sync
pytestmark = pytest.mark.timeout(240)


def build(fragments: int, delay: int, seed: int = 0):
    model, inner, outer, parts = training(fragments, seed, torch.float32)
    diloco = DiLoCo(None, parts, inner, outer, SYNC_EVERY * fragments, fragment_sync_delay=delay)
    diloco.state.bucket_values = BUCKET
    return model, inner, diloco


def train(rank, fragments=1, delay=0, resume_at=None):
    """The run's inner steps; at ``resume_at`` everything is saved, rebuilt from another seed and loaded."""
    model, inner, diloco = build(fragments, delay)
    diloco.__enter__()
    for step in range(OUTER_STEPS * SYNC_EVERY * fragments):
        if step == resume_at:
            model, inner, diloco = reloaded((model, inner, diloco), build(fragments, delay, seed=1))
        loss_fn(model, *batch(rank, step, vocab=64)).backward()
        inner.step()
        inner.zero_grad()
    diloco.__exit__(None, None, None)
    return {
        "params": flat_parameters(model),
        "global": torch.cat([t.reshape(-1) for f in diloco._fragments for t in f.original]),
        "totals": dict(diloco.state.totals),
        "owner": sorted((k, float(v.abs().sum())) for k, (_, v) in diloco.state.owner_error.items()),
        "collectives": diloco.state.last_step_metrics["collectives"],
        "method": diloco.last_outer_step["method"],
    }


def worker(rank, world_size):
    steps = OUTER_STEPS * SYNC_EVERY
    return {
        "plain": train(rank),
        "resumed": train(rank, resume_at=steps // 2 + 1),
        "streaming": train(rank, fragments=2, delay=1),
        "streaming_resumed": train(rank, fragments=2, delay=1, resume_at=steps + 1),
    }


@pytest.fixture(scope="module")
def results():
    from distributed_harness import run_distributed

    return run_distributed(worker, 3)


def test_the_default_outer_sync_is_two_stage_and_keeps_replicas_identical(results):
    for case in ("plain", "streaming"):
        first = results[0][case]
        assert first["method"] == "quant3-2s"
        for other in results[1:]:
            assert torch.equal(first["global"], other[case]["global"])
        # what a rank sends: 2 (N − 1)/N = 4/3 of the 3-bit payload (0.098× the raw bytes)
        assert 0.12 < first["totals"]["bytes_sent"] / first["totals"]["bytes_raw"] < 0.14
    assert torch.equal(results[0]["plain"]["params"], results[2]["plain"]["params"])
    assert results[0]["plain"]["collectives"] == 2 * 6  # an all-to-all and an all-gather per bucket
    owners = [total for r in results for _, total in r["plain"]["owner"]]
    assert len(owners) == 3 and all(total > 0 for total in owners)  # each rank owns chunks with a remainder


@pytest.mark.parametrize("case", ["resumed", "streaming_resumed"])
def test_a_resumed_run_continues_bit_for_bit(results, case):
    for rank in range(3):
        uninterrupted, resumed = (
            results[rank][case.replace("_resumed", "").replace("resumed", "plain")],
            results[rank][case],
        )
        assert torch.equal(uninterrupted["params"], resumed["params"])
        assert torch.equal(uninterrupted["global"], resumed["global"])
        assert uninterrupted["owner"] == resumed["owner"]
