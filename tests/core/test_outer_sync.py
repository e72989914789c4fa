"""DiLoCo's quantised outer sync (`edgc.sync.outer_sync`): bit packing, the bytes on the wire, the rounding
error, error-feedback conservation, the registry's names, and what decay and heal do to a state's
error feedback; two gloo processes end with the same average."""

import math
import warnings

import pytest
import torch
from distributed_harness import run_distributed
from test_baselines import grads_of, reduce

from edgc.sync.outer_sync import (
    QuantizedState,
    decay_error_feedback,
    error_table,
    heal_error_feedback,
    levels,
    pack,
    unpack,
)
from edgc.sync.sync_methods import SYNC_METHODS, sync_method


@pytest.mark.parametrize("bits", range(2, 9))
def test_pack_round_trips_and_takes_bits_per_value(bits):
    n = 8 * 13 + 5  # not a multiple of 8
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8) * bits
    assert torch.equal(unpack(packed, bits, n), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_quantised_sync_counts_its_bytes_rounds_to_the_nearest_level_and_conserves(bits):
    grads = grads_of()
    state = QuantizedState(bits=bits, chunk=64)
    out = reduce(state, grads)
    n = sum(g.numel() for g in grads)
    metrics = state.last_step_metrics
    assert metrics["bytes_sent"] == math.ceil(n / 8) * bits + 4 * math.ceil(n / 64) == state.message_bytes(n)
    flat_in = torch.cat([g.reshape(-1) for g in grads])
    flat_out = torch.cat([o.reshape(-1) for o in out])
    residual = torch.cat([state.error[f"p{i}"].reshape(-1) for i in range(len(grads))])
    assert torch.allclose(flat_out + residual, flat_in, atol=1e-6)  # world of one: sent + e = M
    step = flat_in.abs().max() / levels(bits)
    assert residual.abs().max() <= step / 2 + 1e-6  # nearest of the levels (the chunk scales are ≤ the max)
    # the next step adds the residual back
    again = reduce(state, [torch.zeros_like(g) for g in grads])
    assert torch.allclose(
        torch.cat([o.reshape(-1) for o in again])
        + torch.cat([state.error[f"p{i}"].reshape(-1) for i in range(len(grads))]),
        residual,
        atol=1e-6,
    )


def test_registered_outer_sync_methods_build_with_their_bits():
    for bits in (8, 4, 3, 2):
        state = sync_method(f"quant{bits}").build(None)
        assert isinstance(state, QuantizedState) and state.bits == bits
    assert sync_method("topk5").build(None).ratio == 0.05
    with pytest.raises(ValueError, match="bits"):
        QuantizedState(bits=1)


# Every registered method that keeps error feedback: DiLoCo decays and heals it through `error_table`,
# so a method whose table came back empty would be left alone in silence.
WITH_ERROR_FEEDBACK = [name for name in SYNC_METHODS.names() if name not in ("fp16", "bf16")]


@pytest.mark.parametrize("method", WITH_ERROR_FEEDBACK)
def test_decay_and_heal_change_the_error_feedback_in_place(method):
    state = sync_method(method).build(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: this process alone
        reduce(state, grads_of())
    before = {n: e.clone() for n, e in error_table(state).items()}
    assert before and any(e.any() for e in before.values()), "the method's error feedback is in its table"
    decay_error_feedback(error_table(state), 0.5)
    assert all(torch.equal(error_table(state)[n], 0.5 * e) for n, e in before.items())
    heal_error_feedback(error_table(state), state.comm, "keep", healed=True)
    assert all(torch.equal(error_table(state)[n], 0.5 * e) for n, e in before.items())
    heal_error_feedback(error_table(state), state.comm, "peer", healed=True)  # a world of one: its own rank 0's
    assert all(torch.equal(error_table(state)[n], 0.5 * e) for n, e in before.items())
    heal_error_feedback(error_table(state), state.comm, "zero", healed=True)
    assert all(not e.any() for e in error_table(state).values())
    with pytest.raises(ValueError, match="heal policy"):
        heal_error_feedback(error_table(state), state.comm, "mean", healed=True)


def test_a_rolled_back_step_restores_the_error_feedback():
    state = QuantizedState(bits=3, chunk=64)
    reduce(state, grads_of())
    before = {n: e.clone() for n, e in state.error.items()}
    state.defer_commit = True
    reduce(state, grads_of(1))
    state.rollback_step()
    assert state.step == 1 and all(torch.equal(state.error[n], e) for n, e in before.items())


def _worker(rank, world_size, name):
    torch.manual_seed(100 + rank)
    grads = [torch.randn(40, 300), torch.randn(300)]
    state = sync_method(name).build(None)
    out = reduce(state, [g.clone() for g in grads])
    return {"in": grads, "out": out, "error": {k: v.clone() for k, v in state.error.items()}}


@pytest.mark.parametrize("name", ["quant3", "alloc3", "sparse64", "sparse64a"])  # the quantised and sparse syncs
def test_two_processes_agree_and_conserve(name):
    a, b = run_distributed(_worker, 2, name)
    for x, y in zip(a["out"], b["out"]):
        assert torch.equal(x, y)  # the same average on every rank
    for i in range(2):  # mean(sent) + mean(e) = mean(M)
        mean_in = (a["in"][i] + b["in"][i]) / 2
        mean_error = (a["error"][f"p{i}"] + b["error"][f"p{i}"]) / 2
        assert torch.allclose(a["out"][i] + mean_error, mean_in, atol=1e-5)


def test_allocation_spends_the_budget_where_a_byte_removes_the_most_error():
    from edgc.sync.outer_alloc import CANDIDATES, allocate

    sizes = [4096, 4096]
    quiet = [4.0**-b for b in CANDIDATES]  # error ∝ 4^-bits: each bit removes 3/4 of what is left
    loud = [100 * e for e in quiet]
    budget = sum(s / 8 * 3 + 4 * s / 256 for s in sizes)  # 3 bits per value on average
    bits = allocate([loud, quiet], sizes, 256, budget)
    assert bits[0] > 3 > bits[1]  # the loud tensor takes the bits
    spent = sum(s / 8 * b + 4 * s / 256 for s, b in zip(sizes, bits))
    assert spent <= budget
    assert allocate([quiet, quiet], sizes, 256, budget) == [3, 3]  # alike: alike


def test_allocated_sync_stays_within_its_budget_and_conserves():
    from edgc.sync.outer_alloc import AllocatedQuantState

    grads = grads_of()
    grads[2] *= 50  # one loud tensor (a small one: widening it fits the budget)
    state = AllocatedQuantState(bits=3.0, chunk=64)
    out = reduce(state, grads)
    metrics = state.last_step_metrics
    sizes = [g.numel() for g in grads]
    assert metrics["bytes_sent"] <= sum(math.ceil(n / 8) * 3 + 4 * math.ceil(n / 64) for n in sizes)
    assert metrics["bits"]["p2"] > 3 > metrics["bits"]["p0"]
    residual = torch.cat([state.error[f"p{i}"].reshape(-1) for i in range(len(grads))])
    assert torch.allclose(
        torch.cat([o.reshape(-1) for o in out]) + residual, torch.cat([g.reshape(-1) for g in grads]), atol=1e-4
    )
