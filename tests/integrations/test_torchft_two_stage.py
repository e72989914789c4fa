"""DiLoCo's two-stage outer sync on torchft (`edgc.sync.two_stage` through `edgc.integrations.torchft.DiLoCo`):
3 groups on gloo in one process, the all-to-all and all-gather issued on the quorum's process group
itself. A failed collective discards the outer step on every group with each M kept in the error
feedback (checked on the spot), a group killed in the middle of the all-to-all of a sync of several
buckets restarts and heals, and the replicas end bit-identical within 3 % of the failure-free loss."""

import logging

import pytest
import torch

from .diloco_harness import run_replicas
from .test_torchft_diloco import check_identical
from .torchft_harness import Faults

pytestmark = pytest.mark.timeout(300)
STEPS, BUCKET = 12, 4096  # the toy model's 59,264 values: 15 buckets a sync


class BeforeTheFirstQuorum:
    """What a sync state asks of torchft's Manager before its first quorum (which reports a world of one)."""

    _quorum_future = None
    _use_async_quorum = False

    def register_state_dict_fn(self, *args):
        pass

    def should_commit(self, timeout=None):
        return True


@pytest.mark.parametrize("method", ["quant3-2s", "quant3"])
def test_a_checkpoint_loaded_before_the_first_quorum_keeps_the_error_feedback(method):
    from edgc.integrations.torchft import managed_sync_state
    from edgc.sync.sync_methods import sync_method

    model = torch.nn.Linear(40, 30)
    grads = [torch.randn_like(p) for p in model.parameters()]
    names = [name for name, _ in model.named_parameters()]
    saved_by = sync_method(method).build(None, model=model)
    saved_by.reduce_tensors(names, grads, last=True)
    saved = {**saved_by.state_dict(), "world_size": 3}  # saved in a quorum of three
    state = managed_sync_state(method, BeforeTheFirstQuorum(), model, "outer").state
    assert state.comm.world_size == 1  # no quorum yet
    state.load_state_dict(saved)
    kept = state.error_table()
    assert sorted(kept) == sorted(names)
    for name, error in saved_by.error_table().items():
        assert error.any() and torch.equal(kept[name], error)


def test_the_place_in_the_quorum_is_the_process_groups_own_without_a_parent():
    from types import SimpleNamespace

    from edgc.integrations.torchft_managed import _group_place

    class Group:  # a spare's place: rank 2 of three members, two of them participants
        def rank(self):
            return 2

        def size(self):
            return 3

    assert _group_place(SimpleNamespace(_pg=Group()), -1, 2) == (2, 3)  # torchft's ProcessGroupBaby*
    assert _group_place(SimpleNamespace(_pg=SimpleNamespace(parent=Group())), -1, 2) == (2, 3)  # a wrapper


def test_a_group_killed_in_the_all_to_all_heals_and_nothing_is_lost(caplog):
    caplog.set_level(logging.INFO, logger="edgc")
    free = run_replicas(STEPS, tolerated_failures=0, sync="quant3-2s", bucket=BUCKET)
    assert "owner's error feedback" not in caplog.text  # one quorum throughout
    check_identical(free)
    # a rank sends 2 (N − 1)/N = 4/3 of the 3-bit payload, 0.049× the raw bytes of float64
    assert "discarded" not in free and 0.06 < free["results"][0]["bytes_ratio"] < 0.07
    # the others go on as two from outer step 5 and wait at 9 until the killed group is up again
    faults = Faults(failed_allreduce={(2, 2)}, kill_mid={(1, 5)}, restart_delay_s=5.0, wait_for_restart_at=9)
    run = run_replicas(STEPS, faults, sync="quant3-2s", bucket=BUCKET)
    check_identical(run)
    assert run["kills"] == 1 and (2, 2) in run["discarded"] and run["results"][1]["heals"] >= 1
    assert {step for _, step in run["discarded"]} <= {2, 5}  # only the outer steps in flight
    conserved = {(replica, step): counts for replica, step, *counts in run["conserved"]}
    assert conserved and conserved.keys() == set(run["discarded"]) and all(kept for kept, _ in conserved.values())
    loss, expected = run["results"][0]["loss"], free["results"][0]["loss"]
    assert abs(loss - expected) <= 0.03 * expected, (loss, expected)
    # the quorum shrank and grew again: the chunks changed owners and their error feedback was dropped
    # (the edgc logger speaks for group rank 0)
    assert "is dropped: the group changed (3 members, rank 0 → 2, rank 0)" in caplog.text
    assert "is dropped: the group changed (2 members, rank 0 → 3, rank 0)" in caplog.text


def test_streaming_fragments_with_overlapped_two_stage_syncs_lose_nothing_to_a_failed_all_to_all():
    """Two fragments taking turns, each sync started one inner step before its outer step; group 0's
    all-to-all of fragment 1's sync fails on it alone: it issues nothing more, its peers' all-gather
    times out, and no group commits that outer step."""
    run = run_replicas(
        8,
        Faults(failed_allreduce={(0, 5)}),
        tolerated_failures=0,
        streaming=True,
        delay=1,
        sync="quant3-2s",
        bucket=BUCKET,
    )
    check_identical(run, streaming=True)
    assert (0, 5) in run["discarded"] and {step for _, step in run["discarded"]} == {5} and run["kills"] == 0
    conserved = {(replica, step): counts for replica, step, *counts in run["conserved"]}
    assert conserved and conserved.keys() == set(run["discarded"]) and all(kept for kept, _ in conserved.values())
