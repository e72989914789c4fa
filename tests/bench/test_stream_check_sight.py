"""What the CPU stream checker must see as a GPU would (`edgc_probes.stream_check`): short stream
programs that CUDA gets wrong, one per thing an earlier checker could not see, each beside its
ordered twin, which must pass."""

import io
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from edgc.device import streams
from edgc.device.timing import host_reads_allowed
from edgc_probes.stream_check import StreamChecker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from distributed_harness import run_distributed  # noqa: E402

HERE = str(Path(__file__).parent)
CPU = torch.device("cpu")
KINDS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast")


def issue(kind: str, tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(the tensor the collective writes, its work), one of each kind the library issues."""
    if kind == "all_reduce":
        return tensor, dist.all_reduce(tensor, async_op=True)
    if kind == "broadcast":
        return tensor, dist.broadcast(tensor, src=0, async_op=True)
    if kind == "all_gather":
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        return out[0], dist.all_gather(out, tensor, async_op=True)
    out = torch.empty(tensor.numel() * dist.get_world_size(), device=CPU)
    if kind == "all_gather_into_tensor":
        return out, dist.all_gather_into_tensor(out, tensor, async_op=True)
    out = torch.empty_like(tensor)
    return out, dist.all_to_all_single(out, tensor, async_op=True)


def per_work_worker(rank, world_size):
    """Per kind: issue a then b, wait for a only, read b (a race), then wait for b and read it again."""
    found = {}
    for kind in KINDS:
        with StreamChecker(library=HERE) as checker:
            _, first = issue(kind, torch.ones(8, device=CPU))
            second_out, second = issue(kind, torch.ones(8, device=CPU))
            first.wait()
            second_out * 2  # b's result, read after a's end only
            unordered = len(checker.races)
            second.wait()
            second_out * 2
        found[kind] = (unordered, len(checker.races) - unordered)
    return found


def test_a_work_wait_orders_that_work_alone_for_every_collective_kind():
    """NCCL's ``Work.wait`` makes the current stream wait for that work's end, not for every collective
    issued so far: "wait for a, read b" is a race, whatever the kind."""
    ((found),) = run_distributed(per_work_worker, 1)
    assert found == dict.fromkeys(KINDS, (1, 0)), found


def side_write_elsewhere(how: str, wait: bool) -> StreamChecker:
    """A device tensor written on a side stream from another thread; the main thread reads it."""
    with StreamChecker(library=HERE) as checker:
        x = torch.zeros(4, device=CPU)
        side = streams.new_stream(CPU)
        side.wait_stream(streams.current_stream(CPU))

        def write():
            with streams.using(side):
                x.add_(1)

        if how == "thread":
            thread = threading.Thread(target=write)
            thread.start()
            thread.join()
        elif how == "executor":
            with ThreadPoolExecutor(max_workers=1) as pool:
                pool.submit(write).result()
        else:
            future = torch.futures.Future()
            done = future.then(lambda _: write())
            threading.Thread(target=future.set_result, args=(None,)).start()
            done.wait()
        if wait:
            streams.current_stream(CPU).wait_stream(side)
        x.mul(2)
    return checker


@pytest.mark.parametrize("how", ["thread", "executor", "future"])
def test_work_on_other_threads_is_seen(how):
    """The DDP hook runs on autograd's device thread on CUDA, torchft heals on an executor's thread:
    what they queue is checked as the main thread's is."""
    assert len(side_write_elsewhere(how, wait=False).races) == 1
    assert side_write_elsewhere(how, wait=True).races == []


@pytest.mark.parametrize("ordered", [False, True])
def test_a_pinned_copy_is_read_by_the_host_only_after_its_event(ordered):
    """A non-blocking copy into pinned memory returns at once on CUDA: the host reads the old bytes
    unless it waits for an event after the copy, allowed host read or not."""
    with StreamChecker(library=HERE) as checker:
        x = torch.arange(4.0, device=CPU)
        host = torch.empty(4, pin_memory=streams.pins(CPU))
        host.copy_(x, non_blocking=True)
        done = streams.current_stream(CPU).record_event()
        with host_reads_allowed():
            if ordered:
                done.synchronize()
            values = host.tolist()
    assert values == [0.0, 1.0, 2.0, 3.0]
    assert len(checker.races) == (not ordered), checker.report()
    assert checker.host_syncs == []


@pytest.mark.parametrize("wait", ["none", "after the free", "before the free", "record_stream"])
def test_memory_is_judged_at_its_free(wait):
    """The caching allocator gives a freed block back to its stream at the free: a wait queued after
    the free cannot protect the side stream's read of it; a wait before it or a ``record_stream``
    (an event on the side stream at the free, which a reuse waits for) can."""
    with StreamChecker(library=HERE) as checker:
        side = streams.new_stream(CPU)
        x = torch.ones(1000, device=CPU)  # allocated on the compute stream
        side.wait_stream(streams.current_stream(CPU))
        with streams.using(side):
            y = x * 3
        if wait == "before the free":
            streams.current_stream(CPU).wait_stream(side)
        elif wait == "record_stream":
            streams.record_stream(x, side)
        del x
        if wait == "after the free":
            streams.current_stream(CPU).wait_stream(side)
        torch.ones(1000, device=CPU)  # the compute stream may reuse the block now
    assert len(checker.races) == (wait in ("none", "after the free")), checker.report()
    assert y.sum() == 3000


def test_a_tensor_made_before_the_checker_is_a_finding_unless_declared():
    made_before = torch.ones(4)
    with StreamChecker(library=HERE) as checker:
        made_before.add(1)
    assert len(checker.races) == 1 and "unknown origin" in checker.races[0], checker.report()
    with StreamChecker(library=HERE) as checker:
        checker.adopt(made_before)
        made_before.add(1)
    assert checker.races == [], checker.report()


def test_a_loaded_checkpoint_is_on_the_host_and_its_move_to_the_device_waits():
    """A checkpoint's tensors are host tensors in pageable memory: a blocking ``.to(device)`` of one
    makes the host wait; `edgc.device.timing.to_device` (pinned, non-blocking) does not."""
    saved = io.BytesIO()
    torch.save({"e": torch.ones(4)}, saved)
    with StreamChecker(library=HERE) as checker:
        loaded = torch.load(io.BytesIO(saved.getvalue()))["e"]
        loaded.to(CPU)
        from edgc.device.timing import to_device

        to_device(loaded, CPU)
    assert [sync.kind for sync in checker.host_syncs] == ["blocking .to(device) of a host tensor"], checker.report()
    assert checker.races == [], checker.report()


def test_the_host_syncs_beyond_value_reads_are_counted():
    with StreamChecker(library=HERE) as checker:
        a = torch.eye(3, device=CPU) * 2
        torch.linalg.cholesky(a)
        torch.linalg.cholesky_ex(a)  # no error check on the host
        torch.linalg.inv(a)
        torch.linalg.eigh(a)
        repeats = torch.ones(3, dtype=torch.long, device=CPU)
        torch.repeat_interleave(repeats, repeats)
        torch.repeat_interleave(repeats, repeats, output_size=3)  # sized by the caller
        torch.empty(9).copy_(a.reshape(-1), non_blocking=True)  # into pageable memory: CUDA waits
        torch.empty(9, pin_memory=True).copy_(a.reshape(-1), non_blocking=True)  # into pinned memory: no wait
        streams.current_stream(CPU).synchronize()
        torch.cpu.synchronize()
    kinds = [sync.kind for sync in checker.host_syncs]
    assert kinds == [
        "_linalg_check_errors",
        "_linalg_check_errors",
        "_linalg_eigh",
        "repeat_interleave without output_size",
        "copy_ device → pageable host memory",
        "Stream.synchronize",
        "synchronize",
    ], checker.report()
