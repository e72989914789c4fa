"""edgc inside torchtitan 0.3.0's own trainer under torchrun on gloo, run by the CPU-only launcher
`edgc_train.torchtitan_cpu` with a tokenizer and corpus made here. One launch of 4 processes runs, one after
the other in the same processes (one launch, several checks):

* 2 × 2 HSDP, the llama3 debug model: native, EDGC by the one-flag path (``--module
  edgc.integrations.torchtitan --edgc.…``) with a checkpoint after step 4, and EDGC resumed from it;
* 2 × 2 HSDP with expert parallelism 2, deepseek-v3's MoE debug model cut to two layers: native, and EDGC;
* 2 × 1 replicate, the llama3 debug model, on ranks 0 and 1 alone: native, then EDGC as this repository's
  example config sets it up (examples/torchtitan_llama3.py: 2 uncompressed steps, then static rank 4);

and torchtitan's torchft experiment with EDGC's hook across 2 replica groups (a lighthouse here, one
torchrun of one process per group): group 1 dies after step 3 and torchrun starts it again; group 0
goes on alone, then waits for it; the restarted group heals from group 0 and both finish.

Each run records per rank its losses, gradient norms, EDGC's per-step metrics, a digest of its
parameter shards and the mesh FSDP sharded each on.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from edgc.integrations.torchft_quorum import QuorumSettings, launch_local_groups
from edgc_train.torchtitan_assets import asset_args, asset_env, write_assets

from .conftest import run_script

# each fixture is a launch of several minutes on a loaded 2-core machine; the launcher's collectives time out
pytestmark = pytest.mark.timeout(1500)

STEPS, WARMUP, CHECKPOINT_AT = 6, 2, 4
MOE_STEPS, MOE_WARMUP = 2, 1
KILLED_AFTER, REJOINS_AFTER = 3, 4  # torchft: group 1 dies after this step; group 0 waits for it after that one
FT_STEPS = STEPS + 1  # the restarted group may heal in a step late (below): two steps together at the least
MODEL = ["--training.seq_len", "128", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32"]
EDGC = ["--edgc.r_max", "4", "--edgc.r_min", "4", "--edgc.no-adaptive", "--edgc.no-warmup-error-test"]
EDGC += ["--edgc.warmup_fraction", "0"]
LAST = ["activation-checkpoint:none"]  # a subcommand: last on the line
LAYOUTS = {"replicate": (2, 1), "hsdp": (2, 2)}  # name → (replicate degree, shard degree)
LLAMA = ["--module", "llama3", "--config", "llama3_debugmodel"]
MOE = ["--module", "edgc_train.torchtitan_cpu", "--parallelism.expert_parallel_degree", "2"]  # deepseek-v3, 2 layers


def _launch(folder: Path, assets: Path, nproc: int, runs: list[dict]) -> dict[str, dict[int, dict]]:
    """Run ``runs`` in one torchrun launch of ``nproc`` processes; each run's record per rank (of its own
    ``nproc``, where a run has one: the first ranks)."""
    plan = folder / "plan.json"
    plan.write_text(json.dumps(runs))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = run_script([*torchrun, "-m", "edgc_train.torchtitan_cpu", str(plan)], timeout=1500, **asset_env(assets))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = {}
    for run in runs:
        dump = Path(run["args"][run["args"].index("--dump_folder") + 1])
        ranks = range(run.get("nproc", nproc))
        records[run["name"]] = {r: json.loads((dump / "record" / f"rank{r}.json").read_text()) for r in ranks}
    return records


def _run(assets: Path, folder: Path, name: str, layout: str, args: list[str], steps: int) -> dict:
    replicate, shard = LAYOUTS[layout]
    degrees = ["--parallelism.data_parallel_replicate_degree", str(replicate)]
    degrees += ["--parallelism.data_parallel_shard_degree", str(shard)]
    args = [*args, "--training.steps", str(steps), *asset_args(assets), *MODEL, *degrees]
    return {"name": name, "nproc": replicate * shard, "args": [*args, "--dump_folder", str(folder / name), *LAST]}


def _edgc(warmup: int) -> list[str]:
    return [*EDGC, "--edgc.min_warmup_steps", str(warmup)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return write_assets(tmp_path_factory.mktemp("torchtitan_assets"))


@pytest.fixture(scope="module")
def launch(assets, tmp_path_factory) -> dict[str, dict[str, dict[int, dict]]]:
    """Every run of the 4-process launch: layout → name → rank → record."""
    folder = tmp_path_factory.mktemp("torchtitan")
    run = lambda *args: _run(assets, folder, *args)  # noqa: E731
    edgc = ["--module", "edgc.integrations.torchtitan", "--config", "llama3_debugmodel", *_edgc(WARMUP)]
    edgc += ["--checkpoint.enable"]
    saved = [*edgc, "--checkpoint.interval", str(CHECKPOINT_AT), "--checkpoint.no-last-save-model-only"]
    resumed = [*edgc, "--checkpoint.interval", "100", "--checkpoint.no-initial-load-model-only"]
    resumed += ["--checkpoint.initial_load_path", str(folder / "hsdp-edgc" / "checkpoint" / f"step-{CHECKPOINT_AT}")]
    moe = [*MOE, "--config", "deepseek_v3_two_layers_edgc", *_edgc(MOE_WARMUP)]
    example = ["--module", "examples.torchtitan_llama3", "--config", "llama3_debugmodel_edgc"]
    runs = [
        run("hsdp-native", "hsdp", LLAMA, WARMUP + 1),
        run("hsdp-edgc", "hsdp", saved, STEPS),
        run("hsdp-resumed", "hsdp", resumed, STEPS),
        run("moe-native", "hsdp", [*MOE, "--config", "deepseek_v3_two_layers"], MOE_WARMUP + 1),
        run("moe-edgc", "hsdp", moe, MOE_STEPS),
        run("replicate-native", "replicate", LLAMA, WARMUP + 1),  # ranks 0 and 1 alone from here on
        run("replicate-edgc", "replicate", example, STEPS),
    ]
    found: dict[str, dict] = {}
    for name, records in _launch(folder, assets, 4, runs).items():
        layout, method = name.split("-")
        found.setdefault(layout, {})[method] = records
    return found


@pytest.fixture
def hsdp(launch):
    return launch["hsdp"]


@pytest.fixture(scope="module")
def torchft_groups(assets, tmp_path_factory) -> list[dict]:
    """Each group's record: group 0's from its one process, group 1's from its restarted one."""
    folder = tmp_path_factory.mktemp("torchtitan_torchft")
    ready = folder / "group1.restarted"
    ft = ["--module", "edgc.integrations.torchtitan_torchft", "--config", "llama3_torchft_debugmodel", *_edgc(WARMUP)]
    ft += ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.process_group", "gloo"]
    ft += ["--fault_tolerance.process_group_timeout_ms", "60000", "--fault_tolerance.min_replica_size", "1"]
    # torchft needs torchtitan's checkpointer for its heal (never written here); a constant learning rate:
    # torchtitan 0.3.0's torchft optimizer hands a healing group step 0's learning rates (docs/guides/torchtitan.md)
    ft += ["--checkpoint.enable", "--checkpoint.interval", "1000", "--checkpoint.no-enable-ft-dataloader-checkpoints"]
    ft += ["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0", "--profiler.no-enable-profiling"]
    ft += [*asset_args(assets), *MODEL, "--training.steps", str(FT_STEPS)]
    plans, built = [], [str(folder / f"group{group}.built") for group in range(2)]
    for group in range(2):
        run = {"name": f"group{group}", "args": [*ft, "--fault_tolerance.replica_id", str(group)]}
        # both managers heartbeat before either asks: a group slow to start (a loaded machine) is in the
        # first quorum rather than healing into the run, which would leave group 0 without steps 1..2
        run["start_with"] = [built[group], built[1 - group]]
        run["args"] += ["--dump_folder", str(folder / run["name"]), *LAST]
        run |= (
            {"kill_at": KILLED_AFTER, "ready_file": str(ready)}
            if group
            else {"wait_after": [REJOINS_AFTER, str(ready)]}
        )
        plans.append(folder / f"plan{group}.json")
        plans[-1].write_text(json.dumps([run]))
    settings = QuorumSettings.for_groups(2, tolerated_failures=1, timeout=timedelta(seconds=60))
    env = lambda group: {"EDGC_TITAN_PLAN": str(plans[group]), **asset_env(assets)}  # noqa: E731
    code = launch_local_groups("edgc_train.torchtitan_cpu", 2, settings, env, timeout_s=1500, module=True)
    assert code == 0
    return [json.loads((folder / f"group{g}" / "record" / "rank0.json").read_text()) for g in range(2)]


@pytest.fixture(params=list(LAYOUTS))
def layout(request, launch) -> tuple[str, dict]:
    return request.param, launch[request.param]


def _replicas(name: str) -> list[tuple[int, int]]:
    """Pairs of ranks that hold the same shard in different replicas (replicas are the outer mesh dimension)."""
    replicate, shard = LAYOUTS[name]
    return [(s, s + r * shard) for s in range(shard) for r in range(1, replicate)]


def test_native_is_hsdp_and_edgc_shards_on_the_shard_dimension(layout):
    """torchtitan 0.3.0 has no replicate() path: at every shard degree, 1 included, native is FSDP on the
    2-D (dp_replicate, fsdp) mesh; with EDGC, FSDP shards on fsdp alone and EDGC reduces over the replicas."""
    _, runs = layout
    for rank in runs["native"]:
        assert runs["native"][rank]["fsdp_mesh"] == ["dp_replicate", "fsdp"]
        assert runs["edgc"][rank]["fsdp_mesh"] == ["fsdp"]


def test_warmup_is_native_bit_for_bit(layout):
    """EDGC's uncompressed warm-up (fp32, replicate degree 2) sums exactly as native HSDP: the same losses and
    gradient norms, and the first compressed step's loss, computed with the weights the warm-up made."""
    _, runs = layout
    for rank, native in runs["native"].items():
        edgc = runs["edgc"][rank]["steps"]
        assert [s["edgc"]["phase"] for s in edgc[:WARMUP]] == ["warmup"] * WARMUP
        assert [s["loss"] for s in edgc[: WARMUP + 1]] == [s["loss"] for s in native["steps"]]
        assert [s["grad_norm"] for s in edgc[:WARMUP]] == [s["grad_norm"] for s in native["steps"][:WARMUP]]


def test_compressing_sends_a_fifth_of_native_learns_and_keeps_replicas_identical(layout):
    name, runs = layout
    for record in runs["edgc"].values():
        steps = record["steps"]
        # EDGC's own counter: a warm-up step sends this rank's shards whole, as the native all-reduce does
        assert all(s["edgc"]["bytes_sent"] == record["shard_bytes"] for s in steps[:WARMUP])
        compressed = steps[WARMUP:]
        assert [s["edgc"]["phase"] for s in compressed] == ["compress"] * (STEPS - WARMUP)
        assert all(s["edgc"]["rank"] == 4 for s in compressed)
        assert all(s["edgc"]["bytes_sent"] <= 0.2 * record["shard_bytes"] for s in compressed)
        assert compressed[-1]["loss"] < compressed[0]["loss"]
    for a, b in _replicas(name):
        assert runs["edgc"][a]["digest"] == runs["edgc"][b]["digest"]


def test_resume_from_torchtitans_checkpoint_continues_bit_exactly(hsdp):
    """Each rank's EDGC state (error feedback, Q, step, controller) goes into torchtitan's checkpoint under
    its own key and back: the resumed run's later steps and final weights are the uninterrupted run's."""
    for rank, resumed in hsdp["resumed"].items():
        full = hsdp["edgc"][rank]
        assert [s["step"] for s in resumed["steps"]] == list(range(CHECKPOINT_AT + 1, STEPS + 1))
        assert [(s["loss"], s["grad_norm"]) for s in resumed["steps"]] == [
            (s["loss"], s["grad_norm"]) for s in full["steps"][CHECKPOINT_AT:]
        ]
        assert resumed["digest"] == full["digest"]
        assert resumed["edgc_totals"] == full["edgc_totals"]


def test_moe_experts_reduced_over_their_expert_data_parallel_group_scaled_as_native(launch):
    """deepseek-v3's MoE debug model with EP 2 on 2 × 2 HSDP: the routed experts are sharded on their own
    mesh (efsdp) and held by a state of their own, the dense parameters on fsdp; the warm-up's gradient
    (dense and experts, with EP's gradient scale) is native's bit for bit; both states compress; each
    parameter, the routed experts included, ends identical across the replicas that hold it (their
    expert-data-parallel group)."""
    runs = launch["moe"]
    for rank, record in runs["edgc"].items():
        native, steps = runs["native"][rank]["steps"], record["steps"]
        assert [s["grad_norm"] for s in steps[:MOE_WARMUP]] == [s["grad_norm"] for s in native[:MOE_WARMUP]]
        assert [s["loss"] for s in steps[: MOE_WARMUP + 1]] == [s["loss"] for s in native]
        held, meshes = record["edgc_parameters"], record["parameter_meshes"]
        assert held["efsdp"] and all("routed_experts" in name for name in held["efsdp"])
        assert held["fsdp"] and not any("routed_experts" in name for name in held["fsdp"])
        for state in ("fsdp", "efsdp"):  # the experts' mesh also has ep; neither has dp_replicate (EDGC's)
            assert all(state in meshes[name.split("[")[0]] for name in held[state])
        assert not any("dp_replicate" in mesh for mesh in meshes.values())
        for s in steps[MOE_WARMUP:]:
            for metrics in s["edgc_by_mesh"].values():
                assert metrics["phase"] == "compress" and metrics["bytes_sent"] <= 0.2 * metrics["bytes_raw"]
    for a, b in _replicas("hsdp"):
        assert runs["edgc"][a]["digest"] == runs["edgc"][b]["digest"]


def test_torchft_group_killed_heals_and_the_replicas_end_identical(torchft_groups):
    """EDGC's hook across torchft replica groups in torchtitan's torchft experiment: group 1 dies, group 0
    trains alone, group 1 restarts and heals (model, optimizer, step, and EDGC's shared state) from it;
    from then on both commit the same compressed steps and end with the same weights."""
    survivor, restarted = torchft_groups
    assert [s["step"] for s in survivor["steps"]] == list(range(1, FT_STEPS + 1))
    # The restarted group heals in at the first quorum that holds it: the step after group 0 waited for
    # it, or the next when group 0's request made a quorum of one first (the lighthouse's fast quorum
    # issues once every member of the last quorum has asked: a few ms decide it on a loaded machine).
    joined = [s["step"] for s in restarted["steps"]]
    assert REJOINS_AFTER < joined[0] <= REJOINS_AFTER + 2 and joined == list(range(joined[0], FT_STEPS + 1))
    assert restarted["edgc_faults"]["heals"] == 1 and survivor["edgc_faults"]["heals"] == 0
    for record in torchft_groups:
        late = [s for s in record["steps"] if s["step"] > REJOINS_AFTER]
        assert all(s["edgc"]["phase"] == "compress" and s["edgc"]["committed"] for s in late)
        assert all(s["edgc"]["bytes_sent"] <= 0.2 * record["shard_bytes"] for s in late)
    together = [s["grad_norm"] for s in survivor["steps"] if s["step"] >= joined[0]]
    assert [s["grad_norm"] for s in restarted["steps"]] == together
    assert restarted["digest"] == survivor["digest"]
