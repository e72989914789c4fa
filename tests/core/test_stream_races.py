"""The CUDA path's stream order and host synchronisations, checked on the CPU (`edgc_bench.stream_check`).

One process over gloo, on the accelerator's kernels (`EngineState.force_accelerator_kernels`):
every step under the checker must show no two unordered accesses on different streams, no memory
freed while another stream may use it, and no host synchronisation from the library outside
`edgc.timing.host_reads_allowed`. Each test covers a path where a defect was found: the step's
end (its device values), FSDP2's bf16 reduce buffer, a resume and a heal (state loaded between
steps).
"""
import io

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from distributed_harness import run_distributed
from edgc.fsdp import hsdp_mesh
from edgc_bench.stream_check import StreamChecker
from models import batch, loss_fn
from test_ddp import ADAPTIVE, build
from test_fsdp import COMPRESS, VOCAB
from test_fsdp import batch as fsdp_batch
from test_fsdp import build as fsdp_build

DDP_BUCKET_MB = 0.25  # several buckets, so several jobs in flight at once


def accelerator_kernels(state) -> None:
    state.compressor.force_accelerator_kernels = True
    state._profiler.force_accelerator_kernels = True


def ddp_steps(ddp, state, optimizer, calls, start, stop, checker=None) -> dict:
    """Steps ``start``..``stop`` (under ``checker`` if given); the phases and host syncs per step."""
    phases, syncs = [], []
    for step in range(start, stop):
        calls.append(0)  # the counting hook of test_ddp.build counts into it
        before = len(checker.host_syncs) if checker else 0
        tokens, targets = batch(0, step)
        loss = loss_fn(ddp, tokens, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        phases.append(state.last_step_metrics["phase"])  # the step's one host read, allowed
        syncs.append(len(checker.host_syncs) - before if checker else 0)
    return {"phases": phases, "syncs_per_step": syncs}


def checked(run) -> dict:
    """``run(checker)`` under a checker; what it found, as plain data."""
    with StreamChecker() as checker:
        out = run(checker)
    return {**out, "races": checker.races, "host_syncs": [str(s) for s in checker.host_syncs],
            "report": checker.report()}


def ddp_worker(rank, world_size, steps):
    model, ddp, state, optimizer, calls = build(ADAPTIVE, DDP_BUCKET_MB)
    accelerator_kernels(state)
    return checked(lambda checker: ddp_steps(ddp, state, optimizer, calls, 0, steps, checker))


def test_ddp_hook_steps_are_ordered_and_never_wait_for_the_device():
    """Warm-up, r_max profiling and compressed steps at moving ranks, measured errors included: the
    step's device values are packed and copied on the jobs' stream, never read on another (a
    device value cast on the compute stream and stacked on the side stream raced)."""
    result, = run_distributed(ddp_worker, 1, 12, timeout=600)
    assert "compress" in result["phases"] and "warmup" in result["phases"], result["phases"]
    assert result["races"] == [], result["report"]
    assert result["syncs_per_step"] == [0] * 12, result["report"]


def fsdp_worker(rank, world_size, steps, reduce_dtype):
    mesh = hsdp_mesh(1)
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)  # fp32 parameters
    model, state, optimizer = fsdp_build(mesh, False, COMPRESS, mp_policy=policy)
    accelerator_kernels(state)

    def run(checker):
        phases, syncs = [], []
        for step in range(steps):
            before = len(checker.host_syncs)
            tokens, targets = fsdp_batch(0, step)
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB).float(), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            phases.append(state.last_step_metrics["phase"])
            syncs.append(len(checker.host_syncs) - before)
        return {"phases": phases, "syncs_per_step": syncs}

    return checked(run)


@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float32])
def test_fsdp_reduce_buffer_outlives_its_use(reduce_dtype):
    """FSDP2 frees its bf16 reduce-scatter output after the hook; the block goes back to the
    reduce-scatter stream, which has not waited for the all-reduce stream the hook ran on (nor for
    the jobs' stream): without ``record_stream`` the next group's reduce-scatter may reuse it while
    Ĝ is still being written into it. In fp32 the jobs go on after the hook (`edgc.fsdp`), and
    the step's close orders the optimizer after them."""
    result, = run_distributed(fsdp_worker, 1, 8, reduce_dtype, timeout=600)
    assert "compress" in result["phases"], result["phases"]
    assert result["races"] == [], result["report"]
    assert result["syncs_per_step"] == [0] * 8, result["report"]


def loaded_state_worker(rank, world_size, split, stop):
    """A run resumed from a checkpoint at ``split`` and, in it, a heal from a peer's shared state
    (what torchft's manager calls, `TorchFTEDGCState._heal`) two steps later."""
    model, ddp, state, optimizer, calls = build(ADAPTIVE, DDP_BUCKET_MB)
    accelerator_kernels(state)
    ddp_steps(ddp, state, optimizer, calls, 0, split)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "edgc": state.state_dict()}, buffer)
    peer = state.shared_state_dict()
    model, ddp, state, optimizer, calls = build(ADAPTIVE, DDP_BUCKET_MB, seed=1)
    accelerator_kernels(state)

    def run(checker):
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        state.load_state_dict(saved.pop("edgc"))
        del saved  # the checkpoint's tensors live on in the state alone, as in a real resume
        resumed = ddp_steps(ddp, state, optimizer, calls, split, split + 2, checker)
        state.load_shared_state_dict(peer)  # a heal: the device is known, the state moves at once
        healed = ddp_steps(ddp, state, optimizer, calls, split + 2, stop, checker)
        return {key: resumed[key] + healed[key] for key in resumed}

    return checked(run)


def test_state_loaded_between_steps_stays_alive_until_the_jobs_stream_is_done_with_it():
    """Q and error feedback loaded from a checkpoint or a peer are read by the jobs' stream and
    replaced there (the arenas): memory the compute stream allocated must be recorded on the jobs'
    stream, or backward may reuse it while the jobs still read it."""
    result, = run_distributed(loaded_state_worker, 1, 7, 11, timeout=600)
    assert set(result["phases"]) == {"compress"}, result["phases"]
    assert result["races"] == [], result["report"]
    assert result["syncs_per_step"] == [0] * 4, result["report"]

