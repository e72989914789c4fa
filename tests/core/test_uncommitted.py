"""Uncommitted steps (``defer_commit``): a discarded step loses nothing and counts nowhere."""

import copy

import pytest
import torch
from models import TinyTransformer, batch, loss_fn
from test_ddp import ADAPTIVE

from edgc import EDGCConfig, EDGCState


def make(defer: bool):
    torch.manual_seed(0)
    model = TinyTransformer().double()
    state = EDGCState(None, EDGCConfig(**ADAPTIVE), model=model)
    state.defer_commit = defer
    return model, state, torch.optim.SGD(model.parameters(), lr=0.05)


def sync_step(model, state, step):
    model.zero_grad()
    tokens, targets = batch(0, step)
    loss_fn(model, tokens, targets).backward()
    state.synchronize(model.named_parameters())


def shared(state):
    return {
        "step": state.step,
        "controller": copy.deepcopy(state.controller.state_dict()),
        "history": list(state.sampler.history),
        "q": {n: q.clone() for n, q in state.compressor.q.items()},
    }


def test_committed_steps_are_bit_identical_to_plain_steps():
    runs = []
    for defer in (False, True):
        model, state, optimizer = make(defer)
        for step in range(10):
            sync_step(model, state, step)
            optimizer.step()
            state.commit_step()
        runs.append((model, state))
    (plain_model, plain), (deferred_model, deferred) = runs
    assert plain.last_step_metrics["phase"] == "compress"
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), deferred_model.parameters()))
    for kind in ("q", "error"):
        ours, theirs = getattr(plain.compressor, kind), getattr(deferred.compressor, kind)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_rollback_puts_the_whole_step_into_error_feedback_and_restores_shared_state():
    model, state, optimizer = make(True)
    for step in range(8):  # into the compress phase, past a decision (window = 3)
        sync_step(model, state, step)
        optimizer.step()
        state.commit_step()
    assert state.controller.phase == "compress"
    before, error_before = shared(state), {n: e.clone() for n, e in state.compressor.error.items()}
    model.zero_grad()
    tokens, targets = batch(0, 8)
    loss_fn(model, tokens, targets).backward()
    gradients = {n: p.grad.detach().clone().reshape(p.shape[0], -1) for n, p in model.named_parameters()}
    state.synchronize(model.named_parameters())
    assert state.pending and state.step == 9
    state.rollback_step()
    assert not state.pending and state.last_step_metrics["committed"] is False
    after = shared(state)
    assert after["step"] == before["step"] and after["controller"] == before["controller"]
    assert after["history"] == before["history"]
    assert all(torch.equal(after["q"][n], before["q"][n]) for n in before["q"])
    compressed = [n for n, r in state.last_step_metrics["ranks"].items() if r]
    assert compressed and set(compressed) <= set(state.compressor.error)
    for name in compressed:  # float64 model: e_after = e_before + G exactly
        expected = error_before.get(name, torch.zeros_like(gradients[name])) + gradients[name]
        assert torch.equal(state.compressor.error[name], expected), name
    # The step is redone (as the next attempt would): the result is a normal committed step.
    sync_step(model, state, 8)
    state.commit_step()
    assert state.step == 9 and not state.pending


def test_rollback_zeroes_a_non_finite_step_and_keeps_q():
    model, state, optimizer = make(True)
    for step in range(6):
        sync_step(model, state, step)
        optimizer.step()
        state.commit_step()
    q_before = {n: q.clone() for n, q in state.compressor.q.items()}
    model.zero_grad()
    tokens, targets = batch(0, 6)
    (loss_fn(model, tokens, targets) * float("nan")).backward()
    state.synchronize(model.named_parameters())
    assert state.last_step_metrics["nonfinite"]
    state.rollback_step()
    assert all(torch.isfinite(e).all() for e in state.compressor.error.values())
    assert all(torch.equal(state.compressor.q[n], q) for n, q in q_before.items())


def test_an_unresolved_step_refuses_the_next_one():
    model, state, _ = make(True)
    sync_step(model, state, 0)
    with pytest.raises(RuntimeError, match="commit_step"):
        sync_step(model, state, 1)
