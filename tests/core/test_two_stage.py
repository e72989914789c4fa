"""The two-stage compressed all-reduce (`edgc.sync.two_stage`) and its codec (`edgc.sync.codecs`): the codec's
contract, three gloo processes ending bit-identical with the error feedback of both stages
conserved, a spare that contributes zeros, a rollback that leaves each M in the error feedback,
the owner's error feedback dropped when the group changes, and an exact resume from a checkpoint."""

import logging
import math

import pytest
import torch
from distributed_harness import run_distributed

from edgc.distributed.comm import Communicator
from edgc.sync.codecs import QuantCodec, pack_planes, unpack_planes
from edgc.sync.sync_methods import TWO_STAGE, sync_method
from edgc.sync.two_stage import Partition, TwoStageQuantState

SHAPES = [(300, 7), (5,), (1000,)]
NAMES = ["a", "b", "c"]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codec_decodes_what_encode_returned_and_zeros_to_zeros(bits):
    codec = QuantCodec(bits, block=64)
    for n in (1, 8, 9, 63, 64, 65, 1000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        message = torch.empty(codec.message_bytes(n), dtype=torch.uint8)
        sent = codec.encode(x, message)
        assert message.numel() % 4 == 0 and message.numel() == 4 * math.ceil(
            (4 * math.ceil(n / 64) + math.ceil(n / 8) * bits) / 4
        )
        assert torch.equal(sent, codec.decode(message, n))
        step = x.abs().max() / (2 ** (bits - 1) - 1)
        assert (sent - x).abs().max() <= step / 2 + 1e-6  # the nearest level (a block's scale ≤ the max)
        assert torch.equal(codec.decode(torch.zeros_like(message), n), torch.zeros(n))
    codes = torch.randint(0, 2**bits, (8 * 17,), dtype=torch.uint8)
    packed = torch.empty(17 * bits, dtype=torch.uint8)
    pack_planes(codes, bits, packed)
    back = torch.empty_like(codes)
    unpack_planes(packed, bits, back)
    assert torch.equal(back, codes)
    with pytest.raises(ValueError, match="block"):
        QuantCodec(bits, block=12)


def test_partition_cuts_buckets_into_chunks_and_finds_the_tensors():
    p = Partition((300, 5, 1000), members=3, rank=1, bucket=500)
    assert p.buckets() == [(0, 500, 167), (500, 1000, 167), (1000, 1305, 102)]
    assert p.owned() == 167 + 167 + 102
    assert p.pieces(290, 310) == [(0, 290, 300, 0), (1, 0, 5, 10), (2, 0, 5, 15)]


def test_the_registry_holds_the_third_kind():
    entry = sync_method("quant3-2s")
    assert entry.collective == TWO_STAGE
    state = entry.build(None)
    assert isinstance(state, TwoStageQuantState) and state.bits == 3 and state.rollback_keeps_input


def three_steps(rank, world_size, spare=False, bucket=500):
    """Three calls of random tensors; per step: the output, M, e and the owner's error feedback before and after."""
    torch.manual_seed(rank)
    state = TwoStageQuantState(None, bits=3, bucket_values=bucket)
    if spare:  # group rank 2 is a spare: three members own the chunks, two contribute
        state.attach(SpareCommunicator(rank))
    steps = []
    for _ in range(3):
        grads = [torch.randn(s) for s in SHAPES]
        m = torch.cat([(g + state.error.get(n, torch.zeros(s))).reshape(-1) for n, g, s in zip(NAMES, grads, SHAPES)])
        owner_before = state.owner_error.get("a", (None, torch.zeros(0)))[1].clone()
        state.reduce_tensors(NAMES, grads, last=True)
        steps.append(
            {
                "out": torch.cat([g.reshape(-1) for g in grads]),
                "m": m,
                "e": torch.cat([state.error[n].reshape(-1) for n in NAMES]),
                "owner_before": owner_before.sum(),
                "owner_after": state.owner_error["a"][1].sum(),
            }
        )
    return steps, state.last_step_metrics


class SpareCommunicator(Communicator):
    def __init__(self, rank):
        super().__init__(None)
        self.world_size, self.rank = 2, (rank if rank < 2 else -1)  # participants, and this one's place

    @property
    def group_size(self):
        return 3

    @property
    def group_rank(self):
        return dist_rank()


def dist_rank():
    import torch.distributed as dist

    return dist.get_rank()


def test_three_processes_end_identical_and_conserve_both_error_feedbacks():
    results = run_distributed(three_steps, 3)
    for step in range(3):
        outs = [r[0][step]["out"] for r in results]
        assert all(torch.equal(outs[0], o) for o in outs[1:])  # every rank decoded the same bytes
        mean_m = sum(r[0][step]["m"] for r in results) / 3
        mean_e = sum(r[0][step]["e"] for r in results) / 3
        owners_before = sum(r[0][step]["owner_before"] for r in results)
        owners_after = sum(r[0][step]["owner_after"] for r in results)
        # output + mean of the new e + the owners' new error feedback = mean M + the owners' old
        assert torch.isclose((outs[0] + mean_e).sum() + owners_after, mean_m.sum() + owners_before, atol=1e-3)
        assert (outs[0] - mean_m).norm() < 0.5 * mean_m.norm()
    metrics = results[0][1]
    n = sum(math.prod(s) for s in SHAPES)
    buckets = Partition((2100, 5, 1000), 3, 0, 500).buckets()
    payload = sum(3 * QuantCodec(3).message_bytes(chunk) for _, _, chunk in buckets)
    assert metrics["bytes_sent"] == payload and metrics["bytes_raw"] == 4 * n
    assert metrics["collectives"] == 2 * len(buckets) == 14  # an all-to-all and an all-gather per bucket


def test_a_spare_contributes_zeros_and_keeps_its_whole_m():
    results = run_distributed(three_steps, 3, True)
    first = results[0][0][0]
    assert all(torch.equal(first["out"], r[0][0]["out"]) for r in results)
    assert torch.equal(results[2][0][0]["e"], results[2][0][0]["m"])  # the spare sent nothing
    mean_m = (results[0][0][0]["m"] + results[1][0][0]["m"]) / 2  # the two participants' average
    assert (first["out"] - mean_m).norm() < 0.5 * mean_m.norm()


def test_a_rolled_back_step_leaves_each_m_in_the_error_feedback():
    state = TwoStageQuantState(None, bits=3, bucket_values=100)
    state.defer_commit = True
    grads = [torch.randn(s) for s in SHAPES]
    state.reduce_tensors(NAMES, [g.clone() for g in grads], last=True)
    state.commit_step()
    partition, kept = state.owner_error["a"]
    kept.copy_(0.01 * torch.randn_like(kept))  # a world of one re-encodes its own average exactly: give it some
    owner = kept.clone()
    m = [g + state.error[n] for n, g in zip(NAMES, grads)]
    state.reduce_tensors(NAMES, [g.clone() for g in grads], last=True)
    assert not torch.equal(state.owner_error["a"][1], owner)
    state.rollback_step("a test")
    assert all(torch.allclose(state.error[n], mm, atol=1e-6) for n, mm in zip(NAMES, m))
    assert torch.equal(state.owner_error["a"][1], owner) and state.step == 1


def test_the_owners_error_feedback_is_dropped_with_a_line_when_the_group_changes(caplog):
    state = TwoStageQuantState(None, bits=2, bucket_values=100)
    state.reduce_tensors(NAMES, [torch.randn(s) for s in SHAPES], last=True)
    mine = state.owner_error["a"][0]
    state.owner_error["a"] = (Partition((2100, 5, 1000), 3, 1, 100), torch.ones(1100))  # another quorum's
    with caplog.at_level(logging.INFO, logger="edgc"):
        state.reduce_tensors(NAMES, [torch.zeros(s) for s in SHAPES], last=True)
    assert state.owner_error["a"][0] == mine and state.owner_error["a"][1].numel() == mine.owned()
    assert "error feedback of 'a' is dropped: the group changed (3 members, rank 1 → 1, rank 0)" in caplog.text


def test_a_checkpoint_resumes_exactly():
    torch.manual_seed(0)
    grads = [[torch.randn(s) for s in SHAPES] for _ in range(3)]
    state = TwoStageQuantState(None, bits=3, bucket_values=300)
    state.reduce_tensors(NAMES, [g.clone() for g in grads[0]], last=True)
    saved = state.state_dict()
    resumed = TwoStageQuantState(None, bits=3, bucket_values=300)
    resumed.load_state_dict(saved)
    for step in (1, 2):
        a, b = [g.clone() for g in grads[step]], [g.clone() for g in grads[step]]
        state.reduce_tensors(NAMES, a, last=True)
        resumed.reduce_tensors(NAMES, b, last=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="not a quantized-2s"):
        resumed.load_state_dict({"format": "edgc-baseline/1", "method": "quantized"})
