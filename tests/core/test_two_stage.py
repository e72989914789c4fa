"""The two-stage compressed all-reduce (`edgc.sync.two_stage`) and its codec (`edgc.sync.codecs`): the codec's
contract over rows, buckets sized from the run, the messages bit for bit as before at a fixed bucket
size, three gloo processes ending bit-identical with the error feedback of both stages conserved value
by value, a spare whose error feedback its Δ leaves alone, the divisor exact, a rollback that leaves
each M in the error feedback, the owner's error feedback dropped when the group changes, decayed with
the rest and dropped at a heal, flat error feedback whose entries are views, and an exact resume."""

import hashlib
import logging
import math

import pytest
import torch
from distributed_harness import run_distributed

from edgc.distributed.comm import Communicator, Pending
from edgc.sync.codecs import QuantCodec
from edgc.sync.flat_buffers import TARGET_BUCKETS, bucket_plan, flat_run
from edgc.sync.outer_sync import decay_error_feedback, heal_error_feedback
from edgc.sync.sync_methods import TWO_STAGE, sync_method
from edgc.sync.two_stage import Partition, TwoStageQuantState

SHAPES = [(300, 7), (5,), (1000,)]
NAMES = ["a", "b", "c"]
N_VALUES = sum(math.prod(s) for s in SHAPES)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_codec_decodes_what_encode_returned_row_by_row_as_over_all_rows(bits):
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
        rows = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(7 * n))
        messages = torch.empty(5, codec.message_bytes(n), dtype=torch.uint8)
        sent = codec.encode_rows(rows, messages)
        for row, one, values in zip(rows, messages, sent):  # each row's message is its own encoding
            alone = torch.empty_like(one)
            assert torch.equal(codec.encode(row, alone), values) and torch.equal(alone, one)
        into = torch.full((5, n), 7.0, dtype=torch.float64)
        assert torch.equal(codec.decode_rows(messages, n, torch.float64, out=into), sent) and torch.equal(into, sent)
    with pytest.raises(ValueError, match="block"):
        QuantCodec(bits, block=12)


def test_buckets_are_sized_from_the_run_in_whole_rows():
    xl = 1_557_611_200  # GPT-2 XL's parameters
    for members in (2, 3, 12):
        size, count = bucket_plan(xl, members, None, 256)
        assert size % (members * 256) == 0 and count == TARGET_BUCKETS  # 32 collectives a sync
        assert bucket_plan(xl, members, 2**19, 256) == (2**19, math.ceil(xl / 2**19))  # fixed: as given
    size, count = bucket_plan(4_000_000, 3, None, 256)
    assert size >= 2**19 and count == math.ceil(4_000_000 / size)  # small runs: buckets of at least 2^19
    p = Partition((300, 5, 1000), members=3, rank=1, bucket=500)
    assert p.buckets() == [(0, 500, 167), (500, 1000, 167), (1000, 1305, 102)] and p.total == 1305
    assert p.owned() == 167 + 167 + 102
    assert p.pieces(290, 310) == [(0, 290, 300, 0), (1, 0, 5, 10), (2, 0, 5, 15)]
    flat = torch.zeros(30)
    views = [flat[:10].view(2, 5), flat[10:30]]
    assert flat_run(views) is not None and flat_run(views).data_ptr() == flat.data_ptr()
    assert flat_run([flat[:10], flat[11:30]]) is None and flat_run([torch.zeros(3), torch.zeros(3)]) is None


def test_the_registry_holds_the_third_kind():
    entry = sync_method("quant3-2s")
    assert entry.collective == TWO_STAGE
    state = entry.build(None)
    assert isinstance(state, TwoStageQuantState) and state.bits == 3 and state.rollback_keeps_input
    assert state.bucket_values is None and state.buckets(10**9, 4)[1] == TARGET_BUCKETS


def test_a_sync_launches_as_many_kernels_at_twelve_groups_as_at_two(monkeypatch):
    from edgc_probes.dispatch_count import DispatchCounter
    from edgc_probes.stand_ins import counting_communicator

    monkeypatch.setattr("edgc.sync.flat_buffers.MIN_BUCKET_VALUES", 2048)  # sixteen buckets of a small run
    flat = torch.randn(16 * 3072)  # 3072 values a bucket: whole rows at 2 and at 12 groups
    tensors = [part.view(-1, 8) for part in flat.split([2**14, 2**13, 16 * 3072 - 2**14 - 2**13])]
    counted = {}
    for groups in (2, 12):
        state = TwoStageQuantState(None, bits=3)
        comm = counting_communicator(groups)
        state.attach(comm)
        state.reduce_tensors(["a", "b", "c"], tensors, last=True)  # the error feedback is made here
        issued = len(comm.issued)
        with DispatchCounter() as counter:
            state.reduce_tensors(["a", "b", "c"], tensors, last=True)
        counted[groups] = (counter.total, len(comm.issued) - issued)
    assert counted[2][1] == counted[12][1] == 2 * TARGET_BUCKETS  # two collectives a bucket
    assert counted[12][0] <= 1.1 * counted[2][0]


class Mirror(Communicator):
    """``members`` ranks that all send what this one sends; every message is recorded."""

    def __init__(self, members):
        super().__init__(None)
        self.world_size, self.rank, self.sent = members, 0, []

    def all_to_all_async(self, out, tensor):  # every member's message for this rank's chunk: this rank's
        self.sent.append(tensor.clone())
        mine = tensor.view(self.world_size, -1)[self.rank]
        return Pending(out.copy_(mine.repeat(self.world_size)), None, None, self.clock)

    def all_gather_into_async(self, out, tensor):
        self.sent.append(tensor.clone())
        return Pending(out.copy_(tensor.repeat(self.world_size)), None, None, self.clock)


# sha256 of three calls' outputs and messages in buckets of 500 values, made by the chunk-by-chunk
# implementation the rows replaced (the parent of the commit that added this test): the same bytes
BEFORE = {
    (1, torch.float32): "2fae0a94c08430ff223cf34b5f3eef25b54e4da8fda6b7d42cd32ae0948d7a83",
    (3, torch.float32): "2c1fb2e2f08ca30cef63852a1238511c4feb9f51dcfa8619cc16d09ae59fb847",
    (3, torch.float64): "cbd8dc113ee6cb271f9862fcd782691161c2c3b7bf8cc38513c469a1eb60187f",
    (4, torch.float32): "eac9f51dd4948add9a75177de6cfbdafb76eb4b783f7d88257234642eb7202aa",
}
# … and of three gloo processes' outputs, error feedback and owners' error feedback (`three_steps`)
BEFORE_BY_RANK = [
    "05506eb799e7d7c456e30e21127be019a3b8a0cdaa1047a38639cf33633487d8",
    "9617fc7721b94e8f851d1ed7f347155eac92a1cafcd66c99afd127e21de0c3cd",
    "985b373157e48de8c9b1ec48acef7232b42573e355b78e6b27c4682b3127d63c",
]


@pytest.mark.parametrize("members,dtype", list(BEFORE))
def test_at_a_fixed_bucket_size_the_messages_are_those_of_before_bit_for_bit(members, dtype):
    torch.manual_seed(0)
    state = TwoStageQuantState(None, bits=3, bucket_values=500)
    comm = Mirror(members)
    state.attach(comm)
    digest = hashlib.sha256()
    for _ in range(3):
        grads = [torch.randn(s, dtype=dtype) for s in SHAPES]
        state.reduce_tensors(NAMES, grads, last=True)
        for g in grads:
            digest.update(g.numpy().tobytes())
    assert len(comm.sent) == 3 * 2 * 7  # three calls of seven buckets, two collectives each
    for message in comm.sent:
        digest.update(message.numpy().tobytes())
    assert digest.hexdigest() == BEFORE[(members, dtype)]


class SpareCommunicator(Communicator):
    """Group rank 2 is a spare: three members own the chunks, two contribute."""

    def __init__(self, rank):
        super().__init__(None)
        self.world_size, self.rank, self._member = 2, (rank if rank < 2 else -1), rank

    @property
    def group_size(self):
        return 3

    @property
    def group_rank(self):
        return self._member


def owners_by_value(state: TwoStageQuantState, rank: int) -> torch.Tensor:
    """This rank's owner error feedback placed at the run's values it owns (zero elsewhere)."""
    partition, owned = state.owner_error["a"]
    placed, at = torch.zeros(N_VALUES), 0
    for lo, hi, chunk in partition.buckets():
        first = lo + rank * chunk
        valid = max(0, min(chunk, hi - first))
        placed[first : first + valid] = owned[at : at + valid]
        assert not owned[at + valid : at + chunk].any()  # padding: nothing to keep
        at += chunk
    return placed


def three_steps(rank, world_size, spare=False, bucket=500):
    """Three calls of random tensors; per step: the output, M, e, the owners' error feedback placed by value."""
    torch.manual_seed(rank)
    state = TwoStageQuantState(None, bits=3, bucket_values=bucket)
    if spare:
        state.attach(SpareCommunicator(rank))
    steps, digest = [], hashlib.sha256()
    for _ in range(3):
        grads = [torch.randn(s) for s in SHAPES]
        e = torch.cat([state.error.get(n, torch.zeros(s)).reshape(-1) for n, s in zip(NAMES, SHAPES)])
        owner_before = owners_by_value(state, rank) if state.owner_error else torch.zeros(N_VALUES)
        m = torch.cat([g.reshape(-1) for g in grads]) + e
        state.reduce_tensors(NAMES, grads, last=True)
        out = torch.cat([g.reshape(-1) for g in grads])
        e_after = torch.cat([state.error[n].reshape(-1) for n in NAMES])
        steps.append({"out": out, "m": m, "e_before": e, "e": e_after, "owner_before": owner_before})
        steps[-1]["owner_after"] = owners_by_value(state, rank)
        for t in [*grads, *(state.error[n] for n in NAMES), state.owner_error["a"][1]]:
            digest.update(t.contiguous().numpy().tobytes())
    return steps, {**state.last_step_metrics, "digest": digest.hexdigest()}


def on_the_grid(rank, world_size):
    """The participants send the same values, all on their blocks' levels (each chunk's largest is 3, so
    its scale is 1): every stage encodes them exactly, and the average is exact when the divisor is.
    The spare sends random values and holds an error feedback of its own."""
    values = torch.randint(-3, 4, (N_VALUES,), generator=torch.Generator().manual_seed(5)).float()
    values[::30] = 3.0
    grads = [v.view(s).clone() for v, s in zip(values.split([math.prod(s) for s in SHAPES]), SHAPES)]
    state = TwoStageQuantState(None, bits=3, bucket_values=500)
    state.attach(SpareCommunicator(rank))
    if rank == 2:
        torch.manual_seed(9)
        grads = [torch.randn(s) for s in SHAPES]
        state.error.update({n: torch.randn(s) for n, s in zip(NAMES, SHAPES)})
    before = torch.cat([state.error.get(n, torch.zeros(s)).reshape(-1) for n, s in zip(NAMES, SHAPES)])
    state.reduce_tensors(NAMES, grads, last=True)
    return {
        "expected": values,
        "out": torch.cat([g.reshape(-1) for g in grads]),
        "e_before": before,
        "e": torch.cat([state.error[n].reshape(-1) for n in NAMES]),
    }


def cases(rank, world_size):
    return {
        "random": three_steps(rank, world_size),
        "spare": three_steps(rank, world_size, True),
        "grid": on_the_grid(rank, world_size),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(cases, 3)


def check_conserved(runs, contributors):
    """Per step, value by value: output + mean of the contributors' new e + the owners' new error feedback
    = mean of the contributors' M + the owners' old; every rank the same output."""
    for step in range(3):
        outs = [r[0][step]["out"] for r in runs]
        assert len(outs) == 3 and all(torch.equal(outs[0], o) for o in outs[1:])
        mean_m = sum(runs[i][0][step]["m"] for i in contributors) / len(contributors)
        mean_e = sum(runs[i][0][step]["e"] for i in contributors) / len(contributors)
        before = sum(r[0][step]["owner_before"] for r in runs)
        after = sum(r[0][step]["owner_after"] for r in runs)
        assert torch.allclose(outs[0] + mean_e + after, mean_m + before, atol=1e-5)
        assert after.abs().sum() > 0  # the owners kept a remainder, where it belongs


def test_three_processes_end_identical_and_conserve_both_error_feedbacks_value_by_value(results):
    random = [r["random"] for r in results]
    check_conserved(random, [0, 1, 2])
    assert [r[1]["digest"] for r in random] == BEFORE_BY_RANK  # as before, bit for bit
    metrics = random[0][1]
    buckets = Partition((2100, 5, 1000), 3, 0, 500).buckets()
    payload = sum(3 * QuantCodec(3).message_bytes(chunk) for _, _, chunk in buckets)
    assert metrics["bytes_sent"] == payload * 2 * (3 - 1) // 3  # what a rank sends: 2 (N − 1)/N of it
    assert metrics["payload_bytes"] == payload and metrics["bytes_raw"] == 4 * N_VALUES
    assert metrics["collectives"] == 2 * len(buckets) == 14  # an all-to-all and an all-gather per bucket


def test_a_spare_keeps_its_error_feedback_and_its_delta_is_dropped(results):
    spare = [r["spare"] for r in results]
    check_conserved(spare, [0, 1])
    for step in range(3):
        assert torch.equal(spare[2][0][step]["e"], spare[2][0][step]["e_before"])


def test_the_average_divides_by_the_participants_value_by_value(results):
    grid = [r["grid"] for r in results]
    for rank in range(3):
        assert torch.equal(grid[rank]["out"], grid[rank]["expected"])  # (G + G + zeros) / 2 exactly
    assert not grid[0]["e"].any() and not grid[1]["e"].any()  # on the grid: nothing left over
    assert grid[2]["e_before"].any() and torch.equal(grid[2]["e"], grid[2]["e_before"])


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
    for n, mm in zip(NAMES, m):
        assert torch.allclose(state.error[n], mm, atol=1e-6)
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


def test_the_error_feedback_is_one_buffer_its_entries_views_decayed_and_healed_with_the_owners(caplog):
    state = TwoStageQuantState(None, bits=3)
    state.attach(Mirror(1))
    state.reduce_tensors(NAMES, [torch.randn(s) for s in SHAPES], last=True)
    table = state.error_table()
    assert [table[n].shape for n in NAMES] == [torch.Size(s) for s in SHAPES]
    storages = {table[n].untyped_storage().data_ptr() for n in NAMES}
    assert len(storages) == 1  # one flat buffer
    owners = state.group_error_table()
    assert list(owners) == ["a"]
    owners["a"].copy_(torch.randn_like(owners["a"]))  # a mirror re-encodes its own average exactly: give it some
    named, owned = {n: e.clone() for n, e in table.items()}, owners["a"].clone()
    decay_error_feedback(state, 0.5)  # DiLoCo's decay (-noef: 0) reaches the owners' too
    assert all(torch.equal(table[n], 0.5 * e) for n, e in named.items())
    assert torch.equal(state.group_error_table()["a"], 0.5 * owned)
    with caplog.at_level(logging.INFO, logger="edgc"):
        heal_error_feedback(state, state.comm, "keep", healed=True)
    assert state.group_error_table() == {} and "the owner's error feedback is dropped: a heal" in caplog.text
    table["a"].fill_(1.0)  # in place: the state's
    state.error["c"] = torch.full(SHAPES[2], 2.0)  # replaced: copied into the buffer at the next call
    grads = [torch.zeros(s) for s in SHAPES]
    state.reduce_tensors(NAMES, grads, last=True)
    # zero Δ, no owners' error feedback: the average is the error feedback, whole blocks of 1 and of 2
    # exactly (blocks of 256 values: a's first 2048 values, c's from 2304 on)
    assert torch.equal(grads[0].view(-1)[:2048], torch.ones(2048))
    assert torch.equal(grads[2].view(-1)[2304 - 2105 :], torch.full((3105 - 2304,), 2.0))


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
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="not a quantized-2s"):
        resumed.load_state_dict({"format": "edgc-baseline/1", "method": "quantized"})
