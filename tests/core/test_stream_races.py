"""The CUDA path's stream order and host synchronisations, checked on the CPU (`edgc_bench.stream_check`).

One process over gloo, on the accelerator's kernels (`LowRankCompressor.force_accelerator_kernels`):
every step under the checker must show no two unordered accesses on different streams, no memory
freed while another stream may use it, and no host synchronisation from the library outside
`edgc.timing.host_reads_allowed`. Each test covers a path where a defect was found: the step's
end (its device values), FSDP2's bf16 reduce buffer, a resume and a heal (state loaded between
steps), DiLoCo's delayed fragment sync (issued from a worker thread, with blocking copies).
"""

import io
import threading

import pytest
import torch
from distributed_harness import run_distributed
from models import TinyTransformer, batch, loss_fn
from test_ddp import ADAPTIVE, build
from test_fsdp import COMPRESS, VOCAB
from test_fsdp import batch as fsdp_batch
from test_fsdp import build as fsdp_build
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from edgc import EDGCConfig
from edgc.fsdp import hsdp_mesh
from edgc.integrations.diloco import DiLoCo
from edgc_bench.stream_check import StreamChecker

DDP_BUCKET_MB = 0.25  # several buckets, so several jobs in flight at once


def accelerator_kernels(state) -> None:
    state.compressor.force_accelerator_kernels = True
    state.profiler.compressor.force_accelerator_kernels = True


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
    return {
        **out,
        "races": checker.races,
        "host_syncs": [str(s) for s in checker.host_syncs],
        "report": checker.report(),
    }


def ddp_worker(rank, world_size, steps):
    model, ddp, state, optimizer, calls = build(ADAPTIVE, DDP_BUCKET_MB)
    accelerator_kernels(state)
    return checked(lambda checker: ddp_steps(ddp, state, optimizer, calls, 0, steps, checker))


def test_ddp_hook_steps_are_ordered_and_never_wait_for_the_device():
    """Warm-up, r_max profiling and compressed steps at moving ranks, measured errors included: the
    step's device values are packed and copied on the jobs' stream, never read on another (a
    device value cast on the compute stream and stacked on the side stream raced)."""
    (result,) = run_distributed(ddp_worker, 1, 12, timeout=600)
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
    (result,) = run_distributed(fsdp_worker, 1, 8, reduce_dtype, timeout=600)
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
    (result,) = run_distributed(loaded_state_worker, 1, 7, 11, timeout=600)
    assert set(result["phases"]) == {"compress"}, result["phases"]
    assert result["races"] == [], result["report"]
    assert result["syncs_per_step"] == [0] * 4, result["report"]


def diloco_worker(rank, world_size, outer_steps):
    """Streaming DiLoCo, two fragments, each sync started 2 inner steps before its outer step."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, width=32, layers=1, heads=2)
    ends = nn.ModuleDict({"embed": model.embed, "head": model.head})
    ends.register_parameter("position", model.position)
    inner = torch.optim.Adam(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    config = EDGCConfig(
        total_steps=outer_steps,
        r_max=4,
        rank_budget=2,
        window=2,
        warmup_fraction=0.0,
        min_warmup_steps=0,
        warmup_error_test=False,
        min_compression_rate=1.0,
    )
    diloco = DiLoCo(None, [ends, model.blocks], inner, outer, sync_every=8, config=config, fragment_sync_delay=2)
    accelerator_kernels(diloco.state)
    issued = []  # (inner step, thread) of every collective
    original_issue = diloco.state.comm._issue

    def issue(*args, **kwargs):
        issued.append((diloco._local_step, threading.get_ident()))
        return original_issue(*args, **kwargs)

    diloco.state.comm._issue = issue

    def run(checker):
        syncs = []
        with diloco:
            for step in range(outer_steps * 4):
                before = len(checker.host_syncs)
                loss_fn(model, *batch(0, step, vocab=64)).backward()
                inner.step()
                inner.zero_grad()
                syncs.append(len(checker.host_syncs) - before)
        return {"syncs_per_step": syncs, "phases": [diloco.last_outer_step["phase"]]}

    result = checked(run)
    return {
        **result,
        "issue_steps": sorted({step for step, _ in issued}),
        "other_threads": sum(thread != threading.get_ident() for _, thread in issued),
    }


def test_diloco_delayed_sync_is_issued_from_the_training_thread_and_overlaps_inner_steps():
    """Every collective from the training thread (a worker thread drove a second communicator's
    order against the inner steps'), spread over the inner steps between a sync's start and its
    outer step, with no race and no host synchronisation in any inner step."""
    (result,) = run_distributed(diloco_worker, 1, 4, timeout=600)
    assert result["phases"] == ["compress"], result["phases"]
    assert result["other_threads"] == 0
    assert result["issue_steps"] == [2, 3], result["issue_steps"]  # started at step 2, its Q at step 3
    assert result["races"] == [], result["report"]
    assert result["syncs_per_step"] == [0] * 16, result["report"]


def two_stage_worker(rank, world_size, outer_steps):
    """DiLoCo's default outer sync (two-stage, 4 buckets a sync), Streaming DiLoCo's two fragments, each
    sync started 2 inner steps early; every third outer step rolled back (as torchft's verdict would)."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, width=32, layers=1, heads=2)
    ends = nn.ModuleDict({"embed": model.embed, "head": model.head})
    ends.register_parameter("position", model.position)
    inner = torch.optim.Adam(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    diloco = DiLoCo(None, [ends, model.blocks], inner, outer, sync_every=8, fragment_sync_delay=2)
    diloco.state.bucket_values = 4096
    diloco.state.defer_commit = True
    verdicts = iter([True, True, False] * outer_steps)

    def should_commit():
        committed = next(verdicts)
        diloco.state.commit_step() if committed else diloco.state.rollback_step("a test")
        return committed

    diloco._should_commit = should_commit

    def run(checker):
        syncs, committed = [], []
        with diloco:
            for step in range(outer_steps * 4):
                before = len(checker.host_syncs)
                loss_fn(model, *batch(0, step, vocab=64)).backward()
                inner.step()
                inner.zero_grad()
                syncs.append(len(checker.host_syncs) - before)
                if diloco._local_step == 0:
                    committed.append(diloco.last_outer_step["committed"])
        return {"syncs_per_step": syncs, "committed": committed}

    return checked(run)


def test_the_two_stage_outer_sync_and_its_rollback_race_nothing():
    """Its buckets' collectives, the owner's reduction and a rollback's read of the kept messages on
    the caller's stream: no race, no host synchronisation in any inner step."""
    (result,) = run_distributed(two_stage_worker, 1, 4, timeout=600)
    assert False in result["committed"] and True in result["committed"]
    assert result["races"] == [], result["report"]
    assert result["syncs_per_step"] == [0] * 16, result["report"]
