"""DiLoCo on a plain process group with a registered sync method as its outer sync (2 gloo processes):
the replicas stay bit-identical, the bytes are the method's, a discarded outer step loses nothing."""

import pytest
import torch
from models import TinyTransformer, batch, flat_parameters, loss_fn

from edgc.integrations.diloco import DiLoCo

SYNC_EVERY, OUTER_STEPS = 4, 6
pytestmark = pytest.mark.timeout(240)


class DiscardingThird(DiLoCo):
    """The third outer step is discarded on every rank (as torchft's manager would after a failed collective)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.state.defer_commit = True
        self.attempts, self.conserved = 0, []

    def _prepare(self, fragment):
        self._error_before = {n: e.clone() for n, e in self.state.error.items()}
        super()._prepare(fragment)

    def _should_commit(self):
        committed, self.attempts = self.attempts != 2, self.attempts + 1
        self.state.commit_step() if committed else self.state.rollback_step()
        if not committed:  # the error feedback as before the step (decayed once), the step's Δ carried whole
            kept = dict(zip(self._syncing_names, self._syncing_kept))
            self.conserved.append(
                all(torch.equal(self.state.error[n], 0.5 * e) for n, e in self._error_before.items()) and len(kept) > 0
            )
        return committed

    def _perform(self):
        self._syncing_names, self._syncing_kept = self._syncing.names, self._syncing.kept
        super()._perform()


def worker(rank, world_size):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, width=32, layers=1, heads=2)
    inner = torch.optim.Adam(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    diloco = DiscardingThird(None, [model], inner, outer, SYNC_EVERY, sync_method="quant3", error_feedback_decay=0.5)
    with diloco:
        for step in range(OUTER_STEPS * SYNC_EVERY):
            loss_fn(model, *batch(rank, step, vocab=64)).backward()
            inner.step()
            inner.zero_grad()
    return {
        "params": flat_parameters(model),
        "totals": dict(diloco.state.totals),
        "conserved": diloco.conserved,
        "carried": sorted(diloco._carry),
        "error": sum(float(e.abs().sum()) for e in diloco.state.error.values()),
    }


def test_a_quantised_outer_sync_keeps_replicas_identical_and_loses_nothing():
    from distributed_harness import run_distributed

    a, b = run_distributed(worker, 2)
    assert torch.equal(a["params"], b["params"])
    assert 0.05 < a["totals"]["bytes_sent"] / a["totals"]["bytes_raw"] < 0.10
    assert a["conserved"] == [True] and b["conserved"] == [True] and a["error"] > 0
    assert a["carried"] == []  # the carried Δ went into the next outer step


def test_an_unknown_sync_method_is_one_line():
    model = torch.nn.Linear(4, 4)
    inner, outer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ValueError, match="not registered"):
        DiLoCo(None, [model], inner, outer, 4, sync_method="int7")
    with pytest.raises(ValueError, match="error_feedback_decay"):
        DiLoCo(None, [model], inner, outer, 4, error_feedback_decay=1.5)
