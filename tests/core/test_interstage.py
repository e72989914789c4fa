"""edgc.parallel.interstage: compressed activation gradients between pipeline stages (Optimus-CC's CB + LEP)."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import only_batched_point_to_point, run_distributed

from edgc.parallel.interstage import (
    HEADER_BYTES,
    InterStageCompressor,
    decompress,
    effective_rank,
    interstage_rank,
    wire_bytes,
)
from edgc_probes.host_reads import CountHostReads


def test_error_feedback_conserves_the_stage_gradient_in_float64():
    torch.manual_seed(0)
    compressor = InterStageCompressor(seed=3)
    for _ in range(4):
        for slot in range(3):
            grad = torch.randn(2, 16, 12, dtype=torch.float64)
            old = compressor.residuals.get(slot, torch.zeros(32, 12, dtype=torch.float64)).clone()
            packet = compressor.compress(slot, grad, rank=2)
            sent = decompress(packet).reshape(32, 12)
            assert packet.rank == 2 and sent.dtype == torch.float64
            residual = compressor.residuals[slot]
            # sent + residual = original gradient (+ what this slot carried over from its last step)
            torch.testing.assert_close(sent + residual, grad.reshape(32, 12) + old, rtol=0, atol=1e-12)
            assert residual.abs().sum() > 0  # rank 2 of a 32 × 12 random matrix is lossy


def test_slots_keep_separate_residuals_and_raw_flushes_the_residual():
    compressor = InterStageCompressor()
    g0, g1 = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    compressor.compress(0, g0, 1)
    compressor.compress(1, g1, 1)
    r0 = compressor.residuals[0].clone()
    packet = compressor.compress(0, g0, None)  # raw: everything goes, residual included
    assert packet.rank == 0 and 0 not in compressor.residuals and 1 in compressor.residuals
    torch.testing.assert_close(decompress(packet), g0 + r0, rtol=0, atol=1e-12)


def test_bytes_on_the_wire_equal_the_formula():
    compressor = InterStageCompressor()
    m, n = 4 * 32, 64  # (micro-batch · tokens, hidden)
    for rank in (1, 4, 8):
        packet = compressor.compress(0, torch.randn(4, 32, n), rank)
        assert packet.payload.numel() == (m + n) * rank
        assert packet.nbytes == wire_bytes(m, n, rank) == HEADER_BYTES + 4 * (m + n) * rank
    packet = compressor.compress(0, torch.randn(4, 32, n), None)
    assert packet.nbytes == wire_bytes(m, n, 0) == HEADER_BYTES + 4 * m * n
    sent, raw = compressor.take_bytes()
    assert sent == sum(wire_bytes(m, n, r) for r in (1, 4, 8, 0)) and raw == 4 * 4 * m * n
    assert effective_rank(8, 8, 4) == 0  # (8 + 8)·4 ≥ 64: raw is not larger


def test_the_edgc_rank_follows_the_dp_rank_within_bounds():
    assert interstage_rank(None, 2, 8) is None  # DP sync not compressing: raw
    assert [interstage_rank(r, 2, 8) for r in (1, 2, 5, 8, 32)] == [2, 2, 5, 8, 8]
    assert interstage_rank(6, 1, 16, scale=0.5) == 3


def _roundtrip(rank, world, ranks, known):
    """Packets at ``ranks`` from rank 1 to rank 0; with ``known`` the receiver passes each one's rank."""
    import torch.distributed as dist

    from edgc.parallel.interstage import IncomingGradient, check_headers, send_gradient

    torch.manual_seed(1)
    grads = [torch.randn(2, 8, 16) for _ in ranks]
    with only_batched_point_to_point():
        if rank == 1:
            compressor = InterStageCompressor()
            works = []
            for slot, r in enumerate(ranks):
                works += send_gradient(compressor.compress(slot, grads[slot], r), 0, tag=1)
            for work, _ in works:
                work.wait()
            return None
        marks: list = []
        with CountHostReads() as counted:
            incoming = []
            for r in ranks:
                packet = IncomingGradient((2, 8, 16), 1, tag=1, **({"rank": r} if known else {}))
                for work in dist.batch_isend_irecv([packet.op]):
                    work.wait()
                packet.gradient = packet.finish(mark=lambda: marks.append(len(marks)))
                incoming.append(packet)
        reads = counted.reads
        check_headers(incoming)
    assert len(marks) == 2 * len(ranks)  # the timing hook: once after each header, once after each payload
    # Without the rank, one host read per packet (its header, at once); with it, none until the
    # headers are checked together.
    assert reads == (0 if known else len(ranks)), reads
    incoming[0].header[0] += 1  # a packet whose rank is not the one expected
    try:
        check_headers(incoming)
        caught = not known  # nothing to check without expectations
    except RuntimeError as error:
        caught = "disagree on the rank" in str(error)
    return [packet.gradient for packet in incoming], caught


@pytest.mark.parametrize("known", [False, True])
def test_point_to_point_roundtrip_over_gloo(known):
    ranks = [4, None, 2]
    (received, caught), _ = run_distributed(_roundtrip, 2, ranks, known, timeout=120)
    assert caught
    torch.manual_seed(1)
    grads = [torch.randn(2, 8, 16) for _ in ranks]
    reference = InterStageCompressor()
    for slot, r in enumerate(ranks):
        torch.testing.assert_close(received[slot], decompress(reference.compress(slot, grads[slot], r)))
    torch.testing.assert_close(received[1], grads[1])  # raw


def _agreed_steps(rank, world, steps, packets, disagree_at):
    """Stage 1 sends ``packets`` compressed gradients a step to stage 0 at the agreed rank of the step (4,
    then 2 from step 2 on: a new window's rank); the receiver verifies the first packet after each change
    by its header, checks the rest at the step's end. All under the CPU stream checker, built under it.
    At step ``disagree_at`` the sender keeps rank 4 (it missed the new window's rank)."""
    import torch.distributed as dist

    from edgc.parallel.interstage import IncomingGradient, check_headers, send_gradient_ops
    from edgc_probes.stream_check import StreamChecker

    def agreed(step):
        return 4 if step < 2 else 2

    caught, received = None, []
    with StreamChecker() as checker, only_batched_point_to_point():
        compressor = InterStageCompressor()
        verified = None
        for step in range(steps):
            if rank == 1:
                with checker.device():
                    grads = [torch.randn(2, 8, 16) for _ in range(packets)]
                sent_rank = 4 if step == disagree_at else agreed(step)
                ops = [
                    op
                    for slot, g in enumerate(grads)
                    for op in send_gradient_ops(compressor.compress(slot, g, sent_rank), 0, tag=1)
                ]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                continue
            incoming = []
            try:
                for _ in range(packets):
                    verify = agreed(step) != verified
                    packet = IncomingGradient((2, 8, 16), 1, tag=1, rank=agreed(step), verify=verify)
                    verified = agreed(step)
                    for work in dist.batch_isend_irecv([packet.op]):
                        work.wait()
                    received.append(packet.finish())
                    incoming.append(packet)
                check_headers(incoming)
            except RuntimeError as error:
                caught = (step, "disagree on the rank" in str(error))
                break
    return {
        "caught": caught,
        "received": len(received),
        "races": checker.races[:3],
        "syncs": [str(s) for s in checker.host_syncs],
    }


def test_the_interstage_path_under_the_stream_checker():
    """Several steps in a row, the agreed rank changing once: no race, no host synchronisation outside
    the allowed header reads (the verified first packet after each change, the step's check)."""
    for result in run_distributed(_agreed_steps, 2, 4, 2, None, timeout=120):
        assert result["races"] == [] and result["syncs"] == [], result
        assert result["caught"] is None


def test_a_disagreeing_rank_is_caught_by_the_header_read_first():
    """The receiver's agreed rank changes to 2 at step 2, the sender's does not: the receiver reads the
    first packet's header before sizing its payload by its own rank, receives the payload at the
    header's size (the sender's batch completes: nobody hangs) and raises."""
    receiver, sender = run_distributed(_agreed_steps, 2, 3, 1, 2, timeout=120)
    assert sender["caught"] is None and receiver["received"] == 2
    assert receiver["caught"] == (2, True), receiver
