"""DiLoCo with EDGC's outer sync on a plain process group (`edgc.integrations.diloco.DiLoCo`), 2 gloo processes.

One start-up runs every case on both ranks (float64): a plain run (every outer step compressed,
replicas and the shared EDGC state bit-identical, bytes below raw); exact resume (a state_dict
taken mid-run, loaded into new objects, continues bit for bit as the uninterrupted run did), also
with two streaming fragments whose syncs overlap the inner steps; and an outer step that is not
committed (a test stand-in for torchft's verdict), through which the error feedback is conserved
exactly and Q, the step and the controller roll back.
"""

import io

import pytest
import torch
from models import TinyTransformer, batch, flat_parameters, loss_fn

from edgc import EDGCConfig, LowRankConfig
from edgc.integrations.diloco import DiLoCo

SYNC_EVERY = 4
OUTER_STEPS = 8
CONFIG = dict(
    r_max=4,
    rank_budget=2,
    window=2,
    warmup_fraction=0.0,
    min_warmup_steps=0,
    warmup_error_test=False,
    iteration_sample_ratio=1.0,
    engine=LowRankConfig(min_compression_rate=1.0),
)
pytestmark = pytest.mark.timeout(240)


class Discarding(DiLoCo):
    """Discards the outer steps (attempts, counted from 0) in ``discard`` on every rank, as torchft's
    manager would after a failed collective, and checks on the spot that nothing was lost."""

    def __init__(self, *args, discard=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.state.defer_commit = True  # every outer step waits for the verdict, as under torchft
        self.discard, self.attempts, self.checked, self.records = set(discard), 0, [], []

    def _prepare(self, fragment):
        self._before = {
            "error": {n: e.clone() for n, e in self.state.compressor.error.items()},
            "q": {n: q.clone() for n, q in self.state.compressor.q.items()},
            "step": self.state.step,
            "controller": repr(self.state.controller.state_dict()),
        }
        super()._prepare(fragment)

    def _should_commit(self):
        committed = self.attempts not in self.discard
        self.attempts += 1
        self.state.settle()
        self.state.commit_step() if committed else self.state.rollback_step()
        return committed

    def _record(self, fragment, committed):
        super()._record(fragment, committed)
        self.records.append(self.last_outer_step)

    def _carry_raw(self, fragment):
        super()._carry_raw(fragment)
        state, before = self.state, self._before
        ranks = state.last_step_metrics["ranks"]
        compressed = [n for n in fragment.names if ranks.get(n)]
        for name, sent in zip(fragment.names, fragment.kept):
            if name in compressed:  # e = e_before + Δ, bit for bit
                matrix = sent.reshape(sent.shape[0], -1)
                assert torch.equal(state.compressor.error[name], before["error"].get(name, 0) + matrix), name
            else:
                assert torch.equal(self._carry[name], sent), name  # sent raw: carried into the next Δ
        assert state.step == before["step"] and repr(state.controller.state_dict()) == before["controller"]
        assert state.compressor.q.keys() == before["q"].keys()
        assert all(torch.equal(state.compressor.q[n], q) for n, q in before["q"].items())
        self.checked.append((len(compressed), len(fragment.names) - len(compressed)))


def training(fragments: int, seed: int, dtype=torch.float64) -> tuple:
    """(model, inner Adam, outer Nesterov SGD, fragments): one, or the embeddings with the head and the blocks."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab=64, width=32, layers=1, heads=2).to(dtype)
    inner = torch.optim.Adam(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    parts = [model]
    if fragments == 2:
        ends = torch.nn.ModuleDict({"embed": model.embed, "head": model.head})
        ends.register_parameter("position", model.position)
        parts = [ends, model.blocks]
    return model, inner, outer, parts


def build(fragments: int, delay: int, discard=(), seed: int = 0, iterations: int = 1):
    model, inner, outer, parts = training(fragments, seed)
    config = EDGCConfig(total_steps=OUTER_STEPS * fragments, **CONFIG)
    diloco = Discarding(
        None,
        parts,
        inner,
        outer,
        SYNC_EVERY * fragments,
        config,
        fragment_sync_delay=delay,
        discard=discard,
        power_iterations=iterations,
    )
    return model, inner, diloco


def train(rank, inner_steps, fragments=1, delay=0, discard=(), resume_at=None, iterations=1):
    """``inner_steps`` inner steps; at ``resume_at`` everything is saved, rebuilt from another seed and loaded."""
    model, inner, diloco = build(fragments, delay, discard, iterations=iterations)
    diloco.__enter__()
    for step in range(inner_steps):
        if step == resume_at:
            model, inner, diloco = reloaded((model, inner, diloco), build(fragments, delay, discard, seed=1))
        loss_fn(model, *batch(rank, step, vocab=64)).backward()
        inner.step()
        inner.zero_grad()
    diloco.__exit__(None, None, None)
    globals_ = torch.cat([t.reshape(-1) for f in diloco._fragments for t in f.original])  # θ_global
    return {
        "params": flat_parameters(model),
        "global": globals_,
        "shared": diloco.state.shared_state_dict(),
        "checked": diloco.checked,
        "error": {n: e.clone() for n, e in diloco.state.compressor.error.items()},
        "bytes": dict(diloco.state.totals),
        "records": diloco.records,
    }


def reloaded(running: tuple, rebuilt: tuple) -> tuple:
    """(model, inner optimizer, DiLoCo) ``rebuilt`` (from another seed) with everything of ``running``
    saved and loaded, as a resumed run does; ``running`` leaves its context, ``rebuilt`` enters it."""
    model, inner, diloco = running
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}, saved)
    diloco.__exit__(None, None, None)
    model, inner, diloco = rebuilt
    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["inner"])
    diloco.load_state_dict(state["diloco"])
    diloco.__enter__()
    return model, inner, diloco


def worker(rank, world_size):
    steps = OUTER_STEPS * SYNC_EVERY
    return {
        "plain": train(rank, steps),
        "resumed": train(rank, steps, resume_at=steps // 2 + 1),
        "streaming": train(rank, steps * 2, fragments=2, delay=1),
        "streaming_resumed": train(rank, steps * 2, fragments=2, delay=1, resume_at=steps),
        "discarded": train(rank, steps, discard={2, 5}),
        "two_iterations": train(rank, steps, iterations=2),
    }


@pytest.fixture(scope="module")
def results():
    from distributed_harness import run_distributed

    return run_distributed(worker, 2)


def same_shared(a, b):
    assert a["step"] == b["step"] and a["controller"] == b["controller"]
    q, other = a["compressor"]["q"], b["compressor"]["q"]
    return q.keys() == other.keys() and all(torch.equal(q[n], other[n]) for n in q)


@pytest.mark.parametrize("case", ["plain", "streaming", "discarded", "two_iterations"])
def test_replicas_stay_identical_and_the_outer_sync_compresses(results, case):
    first, second = results[0][case], results[1][case]
    assert torch.equal(first["global"], second["global"])
    if case != "streaming":  # there the fragment synced first has taken inner steps since
        assert torch.equal(first["params"], second["params"])
    assert same_shared(first["shared"], second["shared"])  # rank decisions and Q: the same on both ranks
    committed = {"streaming": 2 * OUTER_STEPS, "discarded": OUTER_STEPS - 2}.get(case, OUTER_STEPS)
    assert first["shared"]["step"] == committed
    assert 0 < first["bytes"]["bytes_sent"] < 0.5 * first["bytes"]["bytes_raw"]


@pytest.mark.parametrize("case", ["resumed", "streaming_resumed"])
def test_a_resumed_run_continues_bit_for_bit(results, case):
    for rank in range(2):
        uninterrupted, resumed = results[rank][case.replace("resumed", "").strip("_") or "plain"], results[rank][case]
        assert torch.equal(uninterrupted["params"], resumed["params"])
        assert torch.equal(uninterrupted["global"], resumed["global"])
        assert same_shared(uninterrupted["shared"], resumed["shared"])
        assert uninterrupted["error"].keys() == resumed["error"].keys()
        assert all(torch.equal(e, resumed["error"][n]) for n, e in uninterrupted["error"].items())


def test_an_uncommitted_outer_step_conserves_the_error_feedback_exactly(results):
    for rank in range(2):
        checked = results[rank]["discarded"]["checked"]
        assert len(checked) == 2  # both discarded outer steps were checked (float64, bit for bit)
        assert all(compressed > 0 and raw > 0 for compressed, raw in checked)  # matrices in e, vectors carried
    assert not torch.equal(results[0]["discarded"]["params"], results[0]["plain"]["params"])


def test_a_second_power_iteration_costs_its_bytes_and_lowers_the_error(results):
    one, two = results[0]["plain"], results[0]["two_iterations"]
    # The first outer steps match (same Δ, same Q warm start); the second iteration sends P and Q again.
    first, second = one["records"][0], two["records"][0]
    assert second["rank"] == first["rank"] and second["bytes_sent"] > first["bytes_sent"]
    assert second["relative_error"] < first["relative_error"]
