"""The CPU stream-race checker itself (`edgc_probes.stream_check`): it flags what CUDA would get wrong
and passes what is ordered, on hand-made stream programs."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from edgc.device import streams
from edgc.device.timing import host_reads_allowed
from edgc_probes.stream_check import StreamChecker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from distributed_harness import run_distributed  # noqa: E402

HERE = os.path.dirname(__file__)
CPU = torch.device("cpu")


def side_write(wait_before_read: bool) -> StreamChecker:
    with StreamChecker(library=HERE) as checker:
        side = streams.new_stream(CPU)
        x = torch.zeros(4, device=CPU)
        side.wait_stream(streams.current_stream(CPU))
        with streams.using(side):
            x.add_(1)
        if wait_before_read:
            streams.current_stream(CPU).wait_stream(side)
        x.mul(2)
    return checker


def test_a_read_of_another_streams_write_needs_a_wait():
    assert len(side_write(False).races) == 1
    assert side_write(True).races == []


@pytest.mark.parametrize("ordering", ["none", "event", "host"])
def test_an_event_orders_what_was_queued_before_it(ordering):
    with StreamChecker(library=HERE) as checker:
        side = streams.new_stream(CPU)
        x, y = torch.zeros(4, device=CPU), torch.zeros(4, device=CPU)
        side.wait_stream(streams.current_stream(CPU))
        with streams.using(side):
            x.add_(1)
            done = side.record_event()
            y.add_(1)  # after the event: unordered with the compute stream's read below either way
        if ordering == "event":
            streams.current_stream(CPU).wait_event(done)
        elif ordering == "host":
            done.synchronize()
        x + y
    assert len(checker.races) == (2 if ordering == "none" else 1), checker.report()
    assert len(checker.host_syncs) == (ordering == "host")  # the host waited, from this (counted) folder


def test_host_synchronisations_are_counted_outside_the_allowed_points():
    with StreamChecker(library=HERE) as checker:
        x = torch.arange(4.0, device=CPU)  # a device tensor (explicit device)
        x.sum().item()
        x.tolist()
        x[x > 1]  # boolean-mask indexing: its size depends on values
        torch.as_tensor(2.0, device=CPU)  # copied from pageable host memory
        torch.full((), 2.0, device=CPU)  # a fill: no copy
        host = torch.arange(4.0)  # a host tensor: reading it waits for nothing
        host.tolist()
        host.to(CPU, non_blocking=True)
        with host_reads_allowed():
            x.sum().item()
    kinds = [sync.kind for sync in checker.host_syncs]
    assert kinds == [
        "_local_scalar_dense",
        "tolist",
        "index with a boolean mask",
        "torch.as_tensor of host data with device=",
    ], checker.report()


def collective_worker(rank, world_size, wait):
    with StreamChecker() as checker:
        x = torch.ones(8, device=CPU)
        work = dist.all_reduce(x, async_op=True)
        if wait:
            work.wait()
        out = x * 2
        if not wait:
            work.wait()
    return len(checker.races), out.sum().item()


def test_a_collectives_result_is_read_after_its_wait():
    ((unordered, _),) = run_distributed(collective_worker, 1, False)
    ((ordered, total),) = run_distributed(collective_worker, 1, True)
    assert unordered == 1 and ordered == 0 and total == 16
