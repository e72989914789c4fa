"""The pipeline's point-to-point traffic: every message in a `dist.batch_isend_irecv` batch, posted
in an order that cannot deadlock where sends wait for their receives (NCCL, messages over its buffer).

gloo buffers sends, so a gloo run finishes whatever the order. These tests record each rank's
batches in a real gloo run of `PipelineStep` and replay them under NCCL's worst case: each rank
runs its batches one after another on one stream; within a running batch all ops progress, but
ops to the same peer in the same direction one after another; a send completes only together
with its receive, while both their batches run.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness
from distributed_harness import only_batched_point_to_point, run_distributed  # noqa: E402


@dataclass
class Op:
    kind: str  # "send" or "recv"
    edge: tuple[int, int]  # (sender, receiver)
    number: int  # the k-th message on this edge: NCCL matches sends and receives by order
    size: int
    done: bool = False


def stuck_under_rendezvous(logs: list[list[list[tuple]]]) -> dict[int, list]:
    """Replays every rank's batches (``logs[rank]`` as `only_batched_point_to_point` records them)
    under rendezvous semantics; returns {rank: the batches it never finished} (empty: no deadlock)."""
    batches: list[list[list[Op]]] = []
    counts: dict[tuple, int] = {}
    where: dict[tuple, tuple[int, int, Op]] = {}  # (kind, edge, number) -> (rank, batch, op)
    for rank, log in enumerate(logs):
        batches.append([])
        for index, batch in enumerate(log):
            ops = []
            for kind, peer, size in batch:
                edge = (rank, peer) if kind == "send" else (peer, rank)
                number = counts[kind, edge] = counts.get((kind, edge), -1) + 1
                ops.append(Op(kind, edge, number, size))
                where[kind, edge, number] = (rank, index, ops[-1])
            batches[-1].append(ops)
    head = [0] * len(batches)

    def ready(op: Op, batch: list[Op]) -> bool:  # earlier ops on its edge and direction are done
        return all(o.done for o in batch[: batch.index(op)] if o.kind == op.kind and o.edge == op.edge)

    progressed = True
    while progressed:
        progressed = False
        for rank, rank_batches in enumerate(batches):
            while head[rank] < len(rank_batches) and all(op.done for op in rank_batches[head[rank]]):
                head[rank] += 1
            if head[rank] == len(rank_batches):
                continue
            batch = rank_batches[head[rank]]
            for op in batch:
                partner = where.get(("recv" if op.kind == "send" else "send", op.edge, op.number))
                if op.done or partner is None or head[partner[0]] != partner[1]:
                    continue
                peer_batch = batches[partner[0]][partner[1]]
                if ready(op, batch) and ready(partner[2], peer_batch):
                    assert op.size == partner[2].size, f"message {op.edge} #{op.number}: sizes differ"
                    op.done = partner[2].done = progressed = True
    return {
        rank: rank_batches[head[rank] :] for rank, rank_batches in enumerate(batches) if head[rank] < len(rank_batches)
    }


def test_the_replay_finds_the_deadlock_of_unbatched_1f1b_and_passes_its_batched_form():
    # 2 stages, 2 micro-batches, each send/recv on its own: stage 0 sends activation 1 before it
    # receives gradient 0, stage 1 sends gradient 0 before it receives activation 1.
    a, g = 64, 64
    unbatched = [
        [[("send", 1, a)], [("send", 1, a)], [("recv", 1, g)], [("recv", 1, g)]],
        [[("recv", 0, a)], [("send", 0, g)], [("recv", 0, a)], [("send", 0, g)]],
    ]
    assert set(stuck_under_rendezvous(unbatched)) == {0, 1}
    batched = [
        [[("send", 1, a)], [("send", 1, a), ("recv", 1, g)], [("recv", 1, g)]],
        [[("recv", 0, a)], [("send", 0, g), ("recv", 0, a)], [("send", 0, g)]],
    ]
    assert stuck_under_rendezvous(batched) == {}
    # a header read before its payload's receive is posted: fine when the header goes first
    header_first = [[[("recv", 1, 3)], [("recv", 1, g)]], [[("send", 0, 3), ("send", 0, g)]]]
    assert stuck_under_rendezvous(header_first) == {}


def _pipeline_steps(rank, world, mode, schedule, micro):
    """Two training steps and one evaluation of a tiny GPT-2 cut into ``world`` stages; returns
    the batches this rank posted, its losses and its inter-stage bytes (sent, raw) per step."""
    from edgc_train.config import TrainConfig
    from edgc_train.model import build_model, model_shape
    from edgc_train.rank_grid import make_grid
    from edgc_train.schedule import PipelineStep
    from edgc_train.stage import GPT2Stage

    cfg = TrainConfig(
        pp=world,
        compressor="none",
        interstage=mode,
        interstage_rank=2,
        pp_schedule=schedule,
        grad_accum=micro,
        micro_batch=2,
        seq_len=16,
        vocab_size=300,
        n_layer=world,
        n_embd=32,
        n_head=2,
        eval_batches=micro,
        device="cpu",
    )
    torch.manual_seed(0)
    full = build_model(model_shape("tiny", 300, 16, n_layer=world, n_embd=32, n_head=2))
    x = torch.randint(0, 300, (micro * 2, 16))
    log: list = []
    with only_batched_point_to_point(log):
        grid = make_grid("cpu", world)
        step = PipelineStep(cfg, grid, GPT2Stage(full, grid.stage, world), torch.device("cpu"))
        results = [step.train_step(x, x.roll(-1, 1)) for _ in range(2)]
        val_loss = step.eval_loss(x, x.roll(-1, 1))
    return (
        log,
        [loss for loss, _ in results],
        val_loss,
        [(timing["interstage_bytes_sent"], timing["interstage_bytes_raw"]) for _, timing in results],
    )


@pytest.mark.parametrize(
    "stages, mode, schedule, micro",
    [(2, "off", "1f1b", 3), (2, "all", "1f1b", 3), (3, "cooldown", "1f1b", 4), (3, "off", "gpipe", 3)],
)
def test_pipeline_traffic_is_batched_and_cannot_deadlock_when_sends_wait(stages, mode, schedule, micro):
    results = run_distributed(_pipeline_steps, stages, mode, schedule, micro, timeout=180)
    logs = [log for log, *_ in results]
    assert stuck_under_rendezvous(logs) == {}
    for stage, log in enumerate(logs):  # each rank's first batch (where NCCL creates the group's
        # communicator, with every rank of the group) reaches all of its neighbours
        assert {peer for _, peer, _ in log[0]} == {s for s in (stage - 1, stage + 1) if 0 <= s < stages}
    _, losses, val_loss, interstage_bytes = results[-1]  # the last stage computes the loss
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses) and math.isfinite(val_loss)
    m, n = 2 * 16, 32  # (micro-batch · tokens, hidden): rank 2 is smaller than raw
    for sent, raw in interstage_bytes:
        assert raw == micro * 4 * m * n
        assert (sent < raw) if mode != "off" else (sent == raw)
    # what stage 0 receives besides the first batch's handshake: raw gradients, or headers and
    # payloads (rank-2 factors; raw in cooldown's earlier micro-batches)
    expected = {"off": {m * n}, "all": {3, (m + n) * 2}, "cooldown": {3, m * n, (m + n) * 2}}[mode]
    assert {size for batch in logs[0][1:] for kind, _, size in batch if kind == "recv"} == expected
