"""Jobs overlap on the one side stream: each job's gather and first product (up to its first
collective) are queued before the job before it waits for that collective, on DDP's path and on
FSDP2's; where FSDP2 reads the buffer right after its hook (a bf16 buffer it casts), each group's
job must end inside the hook instead."""

import types

import pytest
import torch
from distributed_harness import run_distributed
from models import batch, loss_fn
from test_ddp import build
from test_fsdp import COMPRESS, VOCAB
from test_fsdp import batch as fsdp_batch
from test_fsdp import build as fsdp_build
from test_overlap import STATIC
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from edgc import EDGCConfig, EDGCState
from edgc.parallel.fsdp import hsdp_mesh


def logging_jobs(state) -> list[list[tuple[str, int]]]:
    """Log, per step, when each job (numbered in start order) has issued its first collectives and
    when it is resumed to wait for them."""
    steps: list[list[tuple[str, int]]] = []
    original = state._reduce

    def logged(job, index, log):
        try:
            status = next(job)
            log.append(("issued", index))
            while True:
                yield status
                log.append(("waits", index))
                status = next(job)
        except StopIteration as done:
            return done.value

    def reduce(names, grads, flat):
        job = original(names, grads, flat)
        if not isinstance(job, types.GeneratorType):
            return job
        if not steps or steps[-1][0] != state.step:
            steps.append((state.step, []))
        log = steps[-1][1]
        return logged(job, sum(1 for event, _ in log if event == "issued"), log)

    state._reduce = reduce
    return steps


def overlapped(log: list[tuple[str, int]]) -> bool:
    """Whether every job's first collectives were issued before the job before it waited."""
    jobs = max(index for _, index in log) + 1
    return jobs > 1 and all(log.index(("issued", k + 1)) < log.index(("waits", k)) for k in range(jobs - 1))


def ddp_worker(rank, world_size, steps):
    model, ddp, _, optimizer, _ = build(None, bucket_cap_mb=0.05)
    state = EDGCState(None, EDGCConfig(**STATIC), model=ddp)
    ddp.register_comm_hook(state, lambda s, bucket: s.reduce_bucket(bucket))
    logs = logging_jobs(state)
    for step in range(steps):
        loss = loss_fn(ddp, *batch(rank, step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [(step, state.last_step_metrics["phase"], log) for step, log in logs]


def test_ddp_jobs_overlap():
    (result,) = run_distributed(ddp_worker, 1, 4)
    compressed = [log for step, _, log in result if step >= 2]
    assert len(compressed) == 2 and all(overlapped(log) for log in compressed), compressed


def fsdp_worker(rank, world_size, reduce_dtype, steps):
    model, state, optimizer = fsdp_build(
        hsdp_mesh(1),
        False,
        dict(COMPRESS, warmup_fraction=0.0, min_warmup_steps=1),
        mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype),
    )
    logs = logging_jobs(state)
    for step in range(steps):
        tokens, targets = fsdp_batch(rank, step)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB).float(), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    phases = [state.last_step_metrics["phase"]]
    return logs, phases


@pytest.mark.parametrize("reduce_dtype,overlaps", [(torch.float32, True), (torch.bfloat16, False)])
def test_fsdp_jobs_overlap_unless_fsdp_reads_the_buffer_after_its_hook(reduce_dtype, overlaps):
    ((logs, phases),) = run_distributed(fsdp_worker, 1, reduce_dtype, 3)
    assert phases == ["compress"], phases
    last = logs[-1][1]
    assert overlapped(last) == overlaps, last
