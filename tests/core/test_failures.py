"""Bad input and failures: non-finite gradients, corrupt or mismatched state, dead peers, fuzzed configs."""

import dataclasses
import io
import math
import os
import time
import warnings

import pytest
import torch
from distributed_harness import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st
from models import TinyTransformer, batch, flat_parameters, loss_fn
from test_ddp import ADAPTIVE, build, train

from edgc import EDGCConfig, EDGCState, LowRankConfig, edgc_hook

# ---------------------------------------------------------------------------- non-finite gradients


def inf_worker(rank, world_size, poison_step, steps):
    model, ddp, state, optimizer, calls = build(ADAPTIVE)
    snapshots, skipped = {}, []
    for step in range(steps):
        calls.append(0)
        tokens, targets = batch(rank, step)
        optimizer.zero_grad()
        loss = loss_fn(ddp, tokens, targets)
        if step == poison_step and rank == 1:
            loss = loss * float("inf")  # one rank overflows
        if step == poison_step:
            snapshots["before"] = {
                k: {n: t.clone() for n, t in v.items()}
                for k, v in state.compressor.state_dict().items()
                if k in ("q", "error")
            }
            snapshots["entropies"] = list(state.sampler.history)
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        if finite:
            optimizer.step()  # what a GradScaler does: skip the step when a gradient is not finite
        else:
            skipped.append(step)
        if step == poison_step:
            snapshots["metrics"] = dict(state.last_step_metrics)  # reading them settles the step's values
            snapshots["after"] = state.compressor.state_dict()
    return {
        "rank": rank,
        "params": flat_parameters(model),
        "skipped": skipped,
        "snapshots": snapshots,
        "history": state.sampler.history,
        "phase": state.last_step_metrics["phase"],
    }


def test_inf_on_one_rank_reaches_every_optimizer_keeps_q_and_clears_residuals():
    poison = 6  # compressing by then (warm-up floor is 2) and an entropy-sampled step
    results = run_distributed(inf_worker, 2, poison, 10)
    for result in results:
        assert result["skipped"] == [poison]  # every rank saw the non-finite average
        assert result["snapshots"]["metrics"]["nonfinite"] and result["phase"] == "compress"
        before, after = result["snapshots"]["before"], result["snapshots"]["after"]
        for kind in before:
            assert before[kind].keys() == after[kind].keys()
            for name in before[kind]:
                # Q is kept bit for bit; the residual is cleared on every rank (a GradScaler would
                # halve its scale after such a step; see EngineMemory.end_step).
                expected = torch.zeros_like(before[kind][name]) if kind == "error" else before[kind][name]
                assert torch.equal(expected, after[kind][name]), (kind, name)
        assert all(math.isfinite(value) for _, value in result["history"])
        assert torch.isfinite(result["params"]).all()
    assert torch.equal(results[0]["params"], results[1]["params"])


# ---------------------------------------------------------------------------- decisions cannot diverge


def skewed_input_worker(rank, world_size, steps):
    model, ddp, state, optimizer, calls = build(ADAPTIVE)
    if rank == 1:  # a rank whose decision inputs are wildly different from rank 0's
        state.sampler.estimate = lambda sample, bounds=None: 1000.0 - 37.0 * len(state.sampler.history)
    for step in range(steps):
        calls.append(0)
        tokens, targets = batch(rank, step)
        optimizer.zero_grad()
        loss_fn(ddp, tokens, targets).backward()
        optimizer.step()
    return state.controller.schedule, state.sampler.values()[-3:], flat_parameters(model)


def test_rank_decision_is_broadcast_even_when_inputs_differ_across_ranks():
    (schedule0, entropy0, params0), (schedule1, entropy1, params1) = run_distributed(skewed_input_worker, 2, 12)
    assert entropy0 != entropy1  # the inputs really differ …
    assert schedule0 == schedule1 and len(schedule0) >= 2  # … the decisions do not
    assert torch.equal(params0, params1)


# ---------------------------------------------------------------------------- dead peer


def dying_worker(rank, world_size, die_at):
    model, ddp, state, optimizer, calls = build(ADAPTIVE)
    started = time.monotonic()
    try:
        for step in range(20):
            calls.append(0)
            if rank == 1 and step == die_at:
                os._exit(17)  # a killed worker: no goodbye
            tokens, targets = batch(rank, step)
            optimizer.zero_grad()
            loss_fn(ddp, tokens, targets).backward()
            optimizer.step()
    except Exception as exc:  # the survivor must fail, not hang
        return {"error": repr(exc), "seconds": time.monotonic() - started}
    return {"error": None}


def test_a_dead_peer_makes_the_survivor_fail_quickly_instead_of_hanging():
    survivor = run_distributed(dying_worker, 2, 4, timeout=120, expect_dead=[1])[0]
    assert survivor["error"] is not None and "Connection" in survivor["error"]
    assert survivor["seconds"] < 60  # well within the process group's timeout


# ---------------------------------------------------------------------------- state loading


def small_state(steps=6, world_size_override=None):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, width=16, layers=1, heads=2, seq_len=8)
    state = EDGCState(None, EDGCConfig(**dict(ADAPTIVE, engine=LowRankConfig(min_compression_rate=0.5))), model=model)
    for step in range(steps):
        tokens, targets = batch(0, step, vocab=32, seq_len=8)
        model.zero_grad()
        loss_fn(model, tokens, targets).backward()
        state.synchronize(model.named_parameters())
    saved = state.state_dict()
    if world_size_override:
        saved["world_size"] = world_size_override
    return model, saved


def test_resume_on_another_world_size_resets_only_error_feedback():
    model, saved = small_state(world_size_override=2)
    assert saved["compressor"]["error"]
    fresh = EDGCState(None, EDGCConfig(**dict(ADAPTIVE, engine=LowRankConfig(min_compression_rate=0.5))), model=model)
    with pytest.warns(UserWarning, match="world size changed from 2 to 1"):
        fresh.load_state_dict(saved)
    assert fresh.compressor.error == {}
    assert fresh.step == saved["step"] and fresh.controller.schedule == saved["controller"]["schedule"]
    assert (
        fresh.sampler.history == saved["sampler"]["history"]
        and fresh.compressor.q.keys() == saved["compressor"]["q"].keys()
    )


@pytest.mark.parametrize(
    "corrupt", ["not a dict", "format", "missing", "controller", "profiling", "shape", "unknown name"]
)
def test_corrupt_or_mismatched_state_is_rejected_and_changes_nothing(corrupt):
    model, saved = small_state()
    name = next(iter(saved["compressor"]["error"]))
    if corrupt == "not a dict":
        saved = [1, 2, 3]
    elif corrupt == "format":
        saved["format"] = "edgc-state/0"
    elif corrupt == "missing":
        del saved["sampler"]
    elif corrupt == "controller":
        saved["controller"]["phase"] = "sideways"
    elif corrupt == "profiling":
        saved["profile_seconds"] = [0.5]
    elif corrupt == "shape":
        saved["compressor"]["error"][name] = torch.zeros(3, 3)
    else:
        saved["compressor"]["q"]["no.such.param"] = torch.zeros(4, 2)
    fresh = EDGCState(None, EDGCConfig(**dict(ADAPTIVE, engine=LowRankConfig(min_compression_rate=0.5))), model=model)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match="EDGC state"):
        fresh.load_state_dict(saved)
    after = fresh.state_dict()
    assert after["step"] == before["step"] and after["controller"] == before["controller"]
    assert after["compressor"]["error"].keys() == before["compressor"]["error"].keys()


def pickled_state_worker(rank, world_size, split, total):
    model, ddp, state, optimizer, calls = build(ADAPTIVE)
    train(rank, ddp, state, optimizer, calls, 0, split)
    buffer = io.BytesIO()  # the pattern PyTorch documents for its PowerSGD state: pickle the live state
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state}, buffer)
    train(rank, ddp, state, optimizer, calls, split, total)
    uninterrupted = flat_parameters(model)

    def restored(config_kwargs):
        model, ddp, state, optimizer, calls = build(config_kwargs, seed=123)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        return model, ddp, state, optimizer, calls

    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)  # the rest of the checkpoint loads as ever
    model, ddp, _, optimizer, calls = restored(None)
    ddp.register_comm_hook(checkpoint["state"], edgc_hook)
    try:
        train(rank, ddp, None, optimizer, calls, split, total)
        refusal = None
    except RuntimeError as exc:
        refusal = str(exc)
    # The way the refusal names, from the unpickled state itself: nothing is lost.
    model, ddp, state, optimizer, calls = restored(ADAPTIVE)
    state.load_state_dict(checkpoint["state"].state_dict())
    train(rank, ddp, state, optimizer, calls, split, total)
    return uninterrupted, flat_parameters(model), refusal


def test_a_pickled_state_refuses_to_step_and_names_the_way_that_resumes_exactly():
    for uninterrupted, resumed, refusal in run_distributed(pickled_state_worker, 2, 7, 10):
        assert refusal is not None and "\n" not in refusal, refusal  # not a silent loss of error feedback
        assert "restored from a pickle" in refusal and "state_dict()" in refusal and "model=" in refusal
        assert torch.equal(uninterrupted, resumed)


def test_a_state_that_cannot_name_parameters_warns_once():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, width=16, layers=1, heads=2, seq_len=8)
    config = EDGCConfig(**dict(ADAPTIVE, engine=LowRankConfig(min_compression_rate=0.5)))
    for state, expected in ((EDGCState(None, config), 1), (EDGCState(None, config, model=model), 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                tokens, targets = batch(0, step, vocab=32, seq_len=8)
                model.zero_grad()
                loss_fn(model, tokens, targets).backward()
                state.synchronize(model.parameters())  # by tensor, not by name
        layout = [str(w.message) for w in caught if "bucket layout" in str(w.message)]
        assert len(layout) == expected, layout
        assert all("model=" in message for message in layout)


# ---------------------------------------------------------------------------- config fuzzing

ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from([f.name for f in dataclasses.fields(EDGCConfig)]), value=ANY_VALUE)
def test_fuzzed_config_values_are_accepted_or_rejected_clearly(field, value):
    try:
        config = EDGCConfig(**{field: value})
    except ValueError as exc:
        assert f"EDGCConfig.{field}" in str(exc)
        return
    # accepted: the value must actually be valid
    assert getattr(config, field) == value or (isinstance(value, float) and math.isnan(value))
    if field in ("iteration_sample_ratio", "gradient_sample_ratio"):
        assert 0 < value <= 1
    if field in ("window", "rank_step", "entropy_bins") or (field == "r_max" and value is not None):
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 1


def half_wire_overflow_worker(rank, world_size):
    from edgc import LowRankCompressor
    from edgc.distributed.comm import Communicator

    compressor = LowRankCompressor(EDGCConfig(r_max=4))
    # Finite in fp16, but P = M·Q (entries up to 4000·√1024 = 128000) and Q = Mᵀ·P are not: the
    # factors are scaled by a power of two on an fp16 wire, so nothing overflows.
    grad = torch.full((1024, 1024), 4000.0, dtype=torch.float16)
    stats = compressor.reduce(["w"], [grad], 4, Communicator())
    # fp32 gradients beyond the fp16 range on an fp16 wire: the factors cannot fit.
    wire = LowRankCompressor(EDGCConfig(r_max=4, engine=LowRankConfig(communication_dtype="float16")))
    overflow = torch.full((64, 64), 1e6)
    overflow_stats = wire.reduce(["w"], [overflow], 4, Communicator())
    return (
        bool(stats.nonfinite),
        float(grad[0, 0]),
        bool(overflow_stats.nonfinite),
        bool(torch.isnan(overflow).all()),
        sorted(compressor.q),
    )


def test_half_precision_wire_scales_factors_and_skips_a_step_that_still_overflows():
    for nonfinite, value, overflowed, all_nan, stored_q in run_distributed(half_wire_overflow_worker, 2):
        assert not nonfinite and value == 4000.0  # a rank-1 matrix, compressed exactly
        assert overflowed and all_nan  # the averaged factors overflowed: a NaN step, skipped by the optimizer
        assert stored_q == ["w"]


def test_profiling_sums_of_an_older_state_still_load():
    from edgc.control.profiling import profile_seconds

    assert profile_seconds([0.6, 1.8, 3]) == [0.6, 3, 1.8, 3]  # one step count for both sums
    assert profile_seconds([0.6, 3, 0.9, 1]) == [0.6, 3, 0.9, 1]


def _every_rank_fails(rank, world_size):
    raise ValueError(f"cause on rank {rank}")


def test_a_failed_distributed_call_reports_every_rank_that_failed():
    """The first report of a failure names a symptom as often as a cause (a peer that closed its
    connections): the harness waits briefly for the others' reports and names each rank's error."""
    with pytest.raises(RuntimeError) as raised:
        run_distributed(_every_rank_fails, 2, timeout=60)
    text = str(raised.value)
    assert "rank 0 failed" in text and "rank 1 failed" in text
    assert "cause on rank 0" in text and "cause on rank 1" in text
