"""The CUDA path's stream order and host synchronisations, checked on the CPU (`edgc_probes.stream_check`).

Two gloo processes, on the accelerator's kernels (`LowRankConfig.force_accelerator_kernels`),
everything built under the checker (nothing of unknown origin), several steps in a row, metrics
read where a user would (after the run), not after every step: a host read orders every stream
and would hide a race between one step and the next. Every scenario must show no two unordered
accesses on different streams, no memory freed while another stream may use it, no stale host
read and no host synchronisation from the library outside `edgc.device.timing.host_reads_allowed`.
torchft's DDP with a heal runs under the checker in tests/integrations/test_torchft.py, DiLoCo's
outer syncs in tests/integrations/test_diloco_stream_races.py.
"""

import io
import types
from dataclasses import replace

import torch
from distributed_harness import run_distributed
from models import TinyTransformer, batch, loss_fn
from test_ddp import ADAPTIVE
from test_fsdp import COMPRESS, VOCAB, Tiny
from test_fsdp import batch as fsdp_batch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import EDGCConfig, EDGCState, LowRankConfig, edgc_hook
from edgc.device import timing
from edgc.distributed import comm
from edgc.integrations.diloco import DiLoCo
from edgc.parallel.fsdp import hsdp_mesh, register_fsdp_comm_hook
from edgc_probes.stream_check import StreamChecker

# r_max profiled (ranks 8, 4, 2 and the plain sync), then adaptive ranks on an fp16 wire.
PROFILED = {key: value for key, value in ADAPTIVE.items() if key not in ("r_max", "r_min")} | dict(
    iteration_sample_ratio=0.5,
    profile_max_rank=8,
    profile_steps_per_rank=1,
    engine=LowRankConfig(communication_dtype="float16"),
)


def on_accelerator_kernels(**fields) -> EDGCConfig:
    """The config of ``fields`` whose engine (and its shadow syncs') runs the accelerator's kernels."""
    config = EDGCConfig(**fields)
    return replace(config, engine=replace(config.engine, force_accelerator_kernels=True))


def findings(checker: StreamChecker, **out) -> dict:
    syncs = [str(sync) for sync in checker.host_syncs]
    return {**out, "races": checker.races, "host_syncs": syncs, "report": checker.report()}


def check(result: dict) -> None:
    assert result["races"] == [], result["report"]
    assert result["host_syncs"] == [], result["report"]


class VirtualWire:
    """A clock that only the wire moves: every all-reduce's wait adds its bytes at 1 MB/s, and
    nothing else takes time. Profiling then finds compression faster whatever the checker's cost per
    kernel and however busy the machine is; a real sleep would make the verdict a timing race."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def wait(self, work, tensor):
        self.now += tensor.numel() * tensor.element_size() / 1e6
        return work.wait()


class VirtualWireWork:
    def __init__(self, wire, work, tensor):
        self.wire, self.work, self.tensor = wire, work, tensor

    def wait(self):
        return self.wire.wait(self.work, self.tensor)

    def is_completed(self):
        return False


class SlowerWireState(EDGCState):
    """Every all-reduce waits for its bytes at 1 MB/s on the process's virtual clock (`VirtualWire`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wire = VirtualWire()
        clock = types.SimpleNamespace(perf_counter=wire.perf_counter)
        timing.time = comm.time = clock
        issue = self.comm._all_reduce_work
        self.comm._all_reduce_work = lambda tensor, op: VirtualWireWork(wire, issue(tensor, op), tensor)


def ddp_worker(rank, world_size, steps):
    """Several DDP buckets, each its own job."""
    with StreamChecker() as checker:
        with checker.device():
            torch.manual_seed(0)
            model = TinyTransformer(vocab=256, width=128, layers=1, heads=2)
            ddp = DDP(model, bucket_cap_mb=0.25)
            state = SlowerWireState(None, on_accelerator_kernels(**PROFILED), model=ddp)
            ddp.register_comm_hook(state, edgc_hook)
            optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
        ddp_steps(rank, ddp, optimizer, 0, steps, vocab=256)
        metrics = state.last_step_metrics
    return findings(checker, phase=metrics["phase"], schedule=state.controller.schedule, r_max=state.controller.r_max)


def test_ddp_profiling_and_adaptive_ranks_are_ordered_and_never_wait_for_the_device():
    """Warm-up, r_max profiling (its shadow syncs copy DDP's buckets: on the compute stream, since the next
    step's backward writes the buckets there), compressed steps at moving ranks on an fp16 wire, the
    replicas' fingerprints compared at each window's end."""
    for result in run_distributed(ddp_worker, 2, 11, timeout=600):
        assert result["phase"] == "compress" and result["r_max"] == 8, result["schedule"]
        assert len({rank for _, rank in result["schedule"]}) >= 2, result["schedule"]  # the rank moved
        check(result)


def fsdp_worker(rank, world_size, steps):
    """FSDP2 with a bf16 reduce-scatter: 2 replicas of one shard each."""
    with StreamChecker() as checker:
        with checker.device():
            mesh = hsdp_mesh(1)
            torch.manual_seed(0)
            model = Tiny()
            policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp_shard"], mp_policy=policy)
            fully_shard(model, mesh=mesh["dp_shard"], mp_policy=policy)
            state = EDGCState(mesh.get_group("dp_replicate"), on_accelerator_kernels(**COMPRESS))
            register_fsdp_comm_hook(model, state)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(steps):
            tokens, targets = fsdp_batch(rank, step)
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB).float(), targets.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        phase = state.last_step_metrics["phase"]
    return findings(checker, phase=phase)


def test_fsdp_bf16_reduce_buffer_outlives_its_use():
    """FSDP2 frees its bf16 reduce-scatter output after the hook; the block goes back to the
    reduce-scatter stream, which has not waited for the all-reduce stream the hook ran on (nor for
    the jobs' stream): without ``record_stream`` the next group's reduce-scatter may reuse it while
    Ĝ is still being written into it."""
    for result in run_distributed(fsdp_worker, 2, 8, timeout=600):
        assert result["phase"] == "compress"
        check(result)


def built_ddp(checker, seed=0):
    with checker.device():
        torch.manual_seed(seed)
        model = TinyTransformer(vocab=64, width=64, layers=1, heads=2)
        ddp = DDP(model, bucket_cap_mb=0.1)
        state = EDGCState(None, on_accelerator_kernels(**ADAPTIVE), model=ddp)
        ddp.register_comm_hook(state, edgc_hook)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    return model, ddp, state, optimizer


def ddp_steps(rank, ddp, optimizer, start, stop, vocab=64):
    for step in range(start, stop):
        loss = loss_fn(ddp, *batch(rank, step, vocab=vocab))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def loaded_state_worker(rank, world_size, split, stop):
    """A run resumed from a checkpoint at ``split`` and, in it, a heal from a peer's shared state
    (what torchft's manager calls, `TorchFTEDGCState._heal`) two steps later."""
    with StreamChecker() as checker:
        model, ddp, state, optimizer = built_ddp(checker)
        ddp_steps(rank, ddp, optimizer, 0, split)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "edgc": state.state_dict()}, buffer)
        peer = state.shared_state_dict()
        model, ddp, state, optimizer = built_ddp(checker, seed=1)
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        state.load_state_dict(saved.pop("edgc"))
        del saved  # the checkpoint's tensors live on in the state alone, as in a real resume
        ddp_steps(rank, ddp, optimizer, split, split + 2)
        state.load_shared_state_dict(peer)  # a heal: the device is known, the state moves at once
        ddp_steps(rank, ddp, optimizer, split + 2, stop)
        phase = state.last_step_metrics["phase"]
    return findings(checker, phase=phase)


def test_state_loaded_between_steps_stays_alive_until_the_jobs_stream_is_done_with_it():
    """Q and error feedback loaded from a checkpoint or a peer are read by the jobs' stream and
    replaced there (the arenas): memory the compute stream allocated must be recorded on the jobs'
    stream, or backward may reuse it while the jobs still read it; and the checkpoint's host tensors
    reach the device without a host wait (`edgc.device.timing.to_device`)."""
    for result in run_distributed(loaded_state_worker, 2, 6, 10, timeout=600):
        assert result["phase"] == "compress"
        check(result)


def two_stage_worker(rank, world_size, outer_steps):
    """DiLoCo's two-stage outer sync (4 buckets a sync), Streaming DiLoCo's two fragments, each sync
    started 2 inner steps early; every third outer step rolled back (as torchft's verdict would)."""
    with StreamChecker() as checker:
        with checker.device():
            torch.manual_seed(0)
            model = TinyTransformer(vocab=64, width=32, layers=1, heads=2)
            ends = nn.ModuleDict({"embed": model.embed, "head": model.head})
            ends.register_parameter("position", model.position)
            inner = torch.optim.Adam(model.parameters(), lr=3e-3)
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
            diloco = DiLoCo(
                None, [ends, model.blocks], inner, outer, sync_every=8, fragment_sync_delay=2, sync_method="quant3-2s"
            )
        diloco.state.bucket_values = 4096
        diloco.state.defer_commit = True
        verdicts = iter([True, True, False] * outer_steps)

        def should_commit():
            committed = next(verdicts)
            diloco.state.commit_step() if committed else diloco.state.rollback_step("a test")
            return committed

        diloco._should_commit = should_commit
        committed = []
        with diloco:
            for step in range(outer_steps * 4):
                loss_fn(model, *batch(rank, step, vocab=64)).backward()
                inner.step()
                inner.zero_grad()
                if diloco._local_step == 0:
                    committed.append(diloco.last_outer_step["committed"])
    return findings(checker, committed=committed)


def test_the_two_stage_outer_sync_and_its_rollback_race_nothing():
    """Its buckets' collectives, the owner's reduction and a rollback's read of the kept messages on
    the caller's stream: no race, no host synchronisation."""
    for result in run_distributed(two_stage_worker, 2, 4, timeout=600):
        assert False in result["committed"] and True in result["committed"]
        check(result)
