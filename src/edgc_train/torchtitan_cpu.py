"""torchtitan 0.3.0's own trainer on a CPU, under torchrun with gloo: a CPU-only launcher for the tests and
the bench (never the library, which runs on any device unchanged).

    torchrun --nproc_per_node 2 -m edgc_train.torchtitan_cpu PLAN.json

PLAN (or the file ``$EDGC_TITAN_PLAN`` names) is a JSON list of runs, each ``{"name": ..., "args": [...]}``
and optionally ``"kill_at": S`` (the process dies at the end of step S, as a crashed host would; not
once torchrun has restarted it), ``"wait_after": [S, FILE]`` (after step S it waits until FILE
exists), ``"ready_file": FILE`` (written once the trainer is built, by a restarted process), ``"start_with":
[FILE, ...]`` (its first process writes the first FILE once the trainer is built, then waits for every other
before the first step: replica groups whose torchft managers all heartbeat before any asks for a quorum,
so that the first quorum holds them all, however slowly each started) and ``"nproc": N``
(the run is trained by ranks 0..N-1 alone, in a process group of their own: see `shrink_world`). Each run is one
torchtitan ``Trainer`` (or the subclass its config names), built by torchtitan's ``ConfigManager``
from ``args`` (torchtitan's command line: ``--module``, ``--config``, ``--parallelism.…``) and trained
by its ``train()``. The process group is started once, here, and every run of the launch uses it
(torchtitan then skips its own start): one launch, several runs, of as many layouts as fit the world
(runs of a smaller world come last). Each run writes
``<dump_folder>/record/rank<R>.json``: per step the loss, the gradient norm and EDGC's metrics, the
wall time of each step, a digest of this rank's parameter shards, their bytes in fp32 (what an
uncompressed all-reduce of them sends), the mesh FSDP sharded each on, and EDGC's counters.

What a CPU needs that torchtitan 0.3.0 does not do, patched here, in this process only:

* the device: ``torchtitan.tools.utils`` picks "cuda" without a GPU; it gets "cpu" and a stand-in for
  the device module (memory counters read 0) before any other torchtitan module is imported;
* attention: FlexAttention has no backward on a CPU; its call computes plain
  ``scaled_dot_product_attention`` over the dense mask of the block mask's own ``mask_mod`` (the same
  causal, per-document mask), and the block mask is built eagerly (no compiler);
* gloo has no PREMUL_SUM: FSDP's reduce-scatter is forced to a SUM (``set_force_sum_reduction_for_comms``),
  the same result with torchtitan's divide factor of 1;
* torch 2.13 has no ``torch.distributed.set_timeout``: torchtitan's shorter timeouts after the first
  step are skipped; every collective keeps this launcher's timeout (``TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=int(os.environ.get("EDGC_DIST_TIMEOUT", "120")))
# torchtitan's flags every test and bench run of this launcher takes: the local tokenizer and data
# (`write_assets`), the DTensor backend that fully_shard accepts on torch 2.13, no compile, no
# validation, no CUDA graphs, a fixed seed (the same initial weights in every run).
CPU_ARGS = [
    "--parallelism.spmd_backend",
    "partial_dtensor",
    "--debug.seed",
    "0",
    "--validator.no-enable",
    "--compile.no-enable",
    "--training.disable-cuda-graphs",  # a CPU has none; torchtitan refuses expert parallelism's dispatch with them
]


class _CPUDevice(types.SimpleNamespace):
    """What torchtitan calls on its device module (``torch.cuda`` on a GPU), for the CPU."""

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}


def _cpu_device_module() -> _CPUDevice:
    props = types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), name="cpu")
    nothing = staticmethod(lambda *args, **kwargs: None)
    return _CPUDevice(
        set_device=nothing,
        synchronize=nothing,
        empty_cache=nothing,
        reset_peak_memory_stats=nothing,
        current_device=lambda: 0,
        device_count=lambda: 1,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: props,
    )


def _sdpa_over_mask(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention's call as plain attention: the dense mask of the block mask's ``mask_mod``."""
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("the CPU launcher's attention takes no score_mod and returns no lse")
    batch, _, length, _ = q.shape
    mask = create_mask(block_mask.mask_mod, batch, None, length, k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, types.SimpleNamespace(lse=None)


def patch_torchtitan_for_cpu() -> None:
    """The patches of the module docstring; call before importing torchtitan (but its tools.utils)."""
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", _cpu_device_module()
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.distributed import fsdp as titan_fsdp
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention, decoder

    attention.FlexAttention.compiled_flex_attn = staticmethod(_sdpa_over_mask)
    decoder.create_attention_mask = create_block_mask  # eager: no compiler on the test machine's path
    dividing_off = titan_fsdp.disable_fsdp_gradient_division

    def dividing_off_summing(model):
        dividing_off(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = dividing_off_summing
    if not hasattr(dist, "set_timeout"):
        dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def parameter_digest(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of this rank's shard of every parameter (a DTensor's local tensor), by name."""
    digests = {}
    for name, param in model.named_parameters():
        local = _local(param)
        digests[name] = hashlib.sha256(local.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return digests


def _restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def _wait_for(path: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {path}")
        time.sleep(0.2)


def _metrics(state) -> dict:
    if state is None:
        return {}
    metrics = state.last_step_metrics
    keep = ("step", "phase", "rank", "bytes_sent", "bytes_raw", "committed")
    return {key: metrics[key] for key in keep if key in metrics}


def _states(trainer) -> dict:
    """EDGC's states by shard mesh (`EDGCTrainer.edgc_states`), or its one state under the name "fsdp"."""
    states = getattr(trainer, "edgc_states", None)
    if states is None:
        state = getattr(trainer, "edgc_state", None)
        states = {} if state is None else {"fsdp": state}
    return states


def run_one(run: dict, record_dir: Path | None = None) -> dict:
    """Build and train one run of the plan; returns (and writes) this rank's record of it."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args([*CPU_ARGS, *run["args"]])  # a subcommand (activation-checkpoint:none) last
    trainer = config.build()
    if run.get("ready_file") and _restarted():
        Path(run["ready_file"]).write_text("up")
    if run.get("start_with") and not _restarted():
        own, *others = run["start_with"]
        Path(own).write_text("built")
        for other in others:
            _wait_for(other)
    steps: list[dict] = []
    log = trainer.metrics_processor.log
    started = [time.perf_counter()]

    def recording_log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        now = time.perf_counter()
        steps.append(
            {"step": step, "loss": global_avg_loss, "grad_norm": grad_norm, "seconds": now - started[0]}
            | {"edgc": _metrics(getattr(trainer, "edgc_state", None))}
            | {"edgc_by_mesh": {name: _metrics(state) for name, state in _states(trainer).items()}}
        )
        started[0] = now
        if run.get("kill_at") == step and not _restarted():
            os._exit(17)  # a crashed host: no clean-up, no goodbye to the peers
        if run.get("wait_after") and run["wait_after"][0] == step:
            _wait_for(run["wait_after"][1])
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    trainer.metrics_processor.log = recording_log
    try:
        trainer.train()
        model = trainer.model_parts[0]
        state = getattr(trainer, "edgc_state", None)
        record = {
            "name": run["name"],
            "rank": dist.get_rank(),
            "steps": steps,
            "digest": parameter_digest(model),
            "shard_bytes": 4 * sum(_local(p).numel() for p in model.parameters() if p.requires_grad),
            "fsdp_mesh": list(next(model.parameters()).device_mesh.mesh_dim_names),
            "parameter_meshes": {name: list(p.device_mesh.mesh_dim_names) for name, p in model.named_parameters()},
            "edgc_totals": dict(state.totals) if state is not None else None,
            # under torchft: steps the manager did not commit, heals from a peer
            "edgc_faults": {key: getattr(state, key) for key in ("steps_discarded", "heals") if hasattr(state, key)},
            # each state's parameters (by shard mesh: the dense ones, the routed experts) and counters
            "edgc_parameters": {name: sorted(part.parameter_shapes) for name, part in _states(trainer).items()},
            "edgc_totals_by_mesh": {name: dict(part.totals) for name, part in _states(trainer).items()},
        }
    finally:
        trainer.close()
    folder = record_dir or Path(config.dump_folder) / "record"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    return record


def deepseek_v3_two_layers():
    """torchtitan's deepseek-v3 debug model cut to its first two layers, a dense one and a MoE one (routed and
    shared experts, router, expert-parallel dispatch): the tests' MoE model, a third of the six layers' CPU
    time. A config function: ``--module edgc_train.torchtitan_cpu --config deepseek_v3_two_layers``."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    return config


def deepseek_v3_two_layers_edgc():
    """`deepseek_v3_two_layers` trained by EDGCTrainer (``--edgc.FIELD`` flags set EDGC)."""
    from edgc.integrations.torchtitan import with_edgc

    return with_edgc(deepseek_v3_two_layers())


def shrink_world(size: int, store_file: Path) -> bool:
    """Ranks 0..size-1 leave the launch's process group for one of their own, of ``size`` ranks (a file store
    at ``store_file``, new), which torchtitan then takes for its world; False on the other ranks, which are done."""
    if size > dist.get_world_size():
        raise ValueError(f"a run of {size} processes in a launch of {dist.get_world_size()}")
    rank = dist.get_rank()
    if rank == 0:
        store_file.unlink(missing_ok=True)  # a file store left by an earlier launch would hold its keys
    dist.barrier()
    dist.destroy_process_group()
    if rank >= size:
        return False
    os.environ["WORLD_SIZE"] = str(size)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=size, timeout=TIMEOUT)
    return True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    plan_file = Path(argv[0] if argv else os.environ["EDGC_TITAN_PLAN"])
    plan = json.loads(plan_file.read_text())
    patch_torchtitan_for_cpu()
    from torchtitan.tools.logging import init_logger

    init_logger()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    try:
        for run in plan:
            size = run.get("nproc", dist.get_world_size())
            if size != dist.get_world_size() and not shrink_world(size, plan_file.with_suffix(f".world{size}")):
                break  # this rank takes no part in the runs of the smaller world
            run_one(run)
            dist.barrier()
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
