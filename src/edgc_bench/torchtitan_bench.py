"""`edgc bench --torchtitan [CONFIG]`: torchtitan's own trainer, one of its configs (its llama3 debug model by default;
a MoE one with ``--torchtitan-ep``) as HSDP (a replica per host, the host's processes sharding it), native against
EDGC (`edgc.integrations.torchtitan`), on emulated hosts.

Each method is one torchtitan run: a ``torchrun`` agent per host inside its namespace, each running the
CPU launcher `edgc_train.torchtitan_cpu` with the same model, data, seed, batch and steps. What is
compared, per method:

* the step time: the median (and range) of the second half of the steps, as rank 0 logged them (the
  first half holds the start-up, and EDGC's warm-up and r_max profiling);
* the wire: what each host's interface sent during the run (``tx_bytes``: the replica all-reduce,
  which is all that crosses hosts but torchtitan's per-step loss and token-count all-reduces), per step;
* EDGC's own counter: what its replica all-reduce sent per rank and step in the second half, against
  this rank's shards in fp32 (what the native all-reduce sends);
* the last step's loss;
* checks: EDGC's warm-up steps give native's losses and gradient norms bit for bit; the replicas end
  with identical parameters (the routed experts across their expert-data-parallel group); with EP,
  the dense and the routed-expert parameters each in a state of their own.

Writes ``runs/<method>/`` (torchtitan's dump folder, the records, ``torchrun.log``), ``results.json``
and ``bench.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from edgc_train.torchtitan_assets import asset_args, asset_env, write_assets

from .diloco_bench import tx_bytes
from .netns import Network
from .run import BenchSettings, launch

METHODS = ("native", "edgc")
MESH_NAMES = {"fsdp": "dense", "efsdp": "experts"}  # EDGC's states by the mesh their parameters are sharded on


@dataclass(frozen=True)
class TitanOptions:
    config: str = "llama3_debugmodel"  # torchtitan's config function
    ep: int = 1  # expert-parallel degree inside each host (a MoE config)


def edgc_flags(edgc: dict, section: str = "edgc") -> list[str]:
    """``--edgc key=value`` items of the bench as torchtitan's ``--edgc.key value`` flags (the engine's table:
    ``--edgc.engine.key value``)."""
    flags = []
    for key, value in edgc.items():
        if isinstance(value, dict):
            flags += edgc_flags(value, f"{section}.{key}")
        elif isinstance(value, bool):
            flags.append(f"--{section}.{'' if value else 'no-'}{key.replace('_', '-')}")
        elif isinstance(value, (list, tuple)):  # a pair, or pairs (rank_schedule): every number its own token
            flat = [v for item in value for v in (item if isinstance(item, (list, tuple)) else [item])]
            flags += [f"--{section}.{key}", *map(str, flat)]
        else:
            flags += [f"--{section}.{key}", str(value)]
    return flags


def native_module(config: str) -> str:
    """The torchtitan module whose config registry holds ``config`` (``--module`` of the native run)."""
    from edgc.integrations.torchtitan_adapter import MODELS, config_function

    function = config_function(config, MODELS)
    if function is None:
        raise ValueError(f"torchtitan has no config {config!r}")
    return function.__module__.removesuffix(".config_registry")


def titan_args(s: BenchSettings, o: TitanOptions, method: str, run_dir: Path, assets: Path) -> list[str]:
    """torchtitan's command line of one method's run."""
    module = native_module(o.config) if method == "native" else "edgc.integrations.torchtitan"
    args = ["--module", module, "--config", o.config, *asset_args(assets)]
    args += ["--training.steps", str(s.steps), "--training.seq_len", str(s.seq_len)]
    args += ["--training.local_batch_size", str(s.micro_batch), "--training.mixed_precision_param", "float32"]
    args += ["--parallelism.data_parallel_replicate_degree", str(s.hosts)]
    args += ["--parallelism.data_parallel_shard_degree", str(s.nproc), "--debug.seed", str(s.seed)]
    args += ["--dump_folder", str(run_dir), "--parallelism.expert_parallel_degree", str(o.ep)]
    if method == "edgc":
        args += edgc_flags({**s.edgc, **({"r_max": s.r_max} if s.r_max is not None else {})})
    return [*args, "activation-checkpoint:none"]  # a subcommand: last


def run_method(net: Network, s: BenchSettings, o: TitanOptions, method: str, run_dir: Path, assets: Path) -> dict:
    run_dir.mkdir(parents=True)
    plan = run_dir / "plan.json"
    plan.write_text(json.dumps([{"name": method, "args": titan_args(s, o, method, run_dir, assets)}]))
    sent_before, started = tx_bytes(net), time.time()
    env = {**asset_env(assets), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    codes = launch(net, s, ["edgc_train.torchtitan_cpu", str(plan)], run_dir / "torchrun.log", s.run_timeout_s, env)
    sent = [after - before for after, before in zip(tx_bytes(net), sent_before)]
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "record").glob("rank*.json"))]
    return {"method": method, "codes": codes, "wall_s": time.time() - started, "tx_bytes": sent, "records": records}


def summary_row(run: dict, steps: int) -> dict:
    """A run's figures (module docstring); None where it failed."""
    records = run["records"]
    if any(run["codes"]) or not records:
        return {"method": run["method"], "failed": run["codes"]}
    late = [s for s in records[0]["steps"] if s["step"] > steps // 2]
    seconds = [s["seconds"] for s in late]
    late_ranks = [[s for s in r["steps"] if s["step"] > steps // 2] for r in records]
    meshes = list(late[0].get("edgc_by_mesh", {})) if late else []
    by_mesh = {m: statistics.fmean(s["edgc_by_mesh"][m]["bytes_sent"] for r in late_ranks for s in r) for m in meshes}
    native = statistics.fmean(r["shard_bytes"] for r in records)  # its all-reduce sends the shards whole
    return {
        "method": run["method"],
        "step_s": statistics.median(seconds),
        "step_s_range": [min(seconds), max(seconds)],
        "wire_per_step": statistics.fmean(run["tx_bytes"]) / steps,
        "payload_per_step": sum(by_mesh.values()) if by_mesh else native,
        "payload_by_mesh": by_mesh,
        "shard_bytes": records[0]["shard_bytes"],
        "final_loss": records[0]["steps"][-1]["loss"],
        "ranks": sorted({s["edgc"].get("rank") for s in late if s["edgc"]} - {None}),
    }


def checks(records: dict[str, list[dict]], nproc: int, ep: int) -> list[list]:
    """[what, holds] of each check of the module docstring, from the runs' records (rank order)."""
    native, edgc = records.get("native", []), records.get("edgc", [])
    if not native or not edgc:
        return []
    warm = sum(1 for s in edgc[0]["steps"] if s["edgc"].get("phase") == "warmup")
    same = all(
        [s["loss"] for s in e["steps"][: warm + 1]] == [s["loss"] for s in n["steps"][: warm + 1]]
        and [s["grad_norm"] for s in e["steps"][:warm]] == [s["grad_norm"] for s in n["steps"][:warm]]
        for e, n in zip(edgc, native)
    )
    replicas = all(record["digest"] == edgc[rank % nproc]["digest"] for rank, record in enumerate(edgc))
    found = [
        [f"EDGC's {warm} warm-up steps give native's losses and gradient norms bit for bit", warm > 0 and same],
        ["the replicas' parameters end identical (routed experts: across their expert-data-parallel group)", replicas],
    ]
    if ep > 1:
        held = edgc[0]["edgc_parameters"]
        experts_apart = bool(held.get("efsdp")) and all("routed_experts" in n for n in held["efsdp"])
        dense_apart = not any("routed_experts" in n for n in held.get("fsdp", []))
        apart = experts_apart and dense_apart
        found.append(["the dense and the routed-expert parameters each in a state of their own", apart])
    return found


def markdown(summary: dict) -> str:
    s = summary["settings"]
    link = "unlimited" if s["rate_mbit"] is None else f"{s['rate_mbit']:g} Mbit/s"
    expert_parallel = f", EP {s['ep']}" if s.get("ep", 1) > 1 else ""
    rows = {row["method"]: row for row in summary["rows"]}
    native = rows.get("native", {})
    lines = [
        f"`{summary['command']}`: torchtitan {summary['torchtitan']} {s['config']}, HSDP {s['hosts']} replicas "
        f"(one per host) × {s['nproc']} shards{expert_parallel}, {s['steps']} steps, "
        f"batch {s['micro_batch']} × {s['seq_len']} per "
        f"rank, fp32, {link} links, CPU, gloo; {summary['date']}, load average {summary['load_start'][0]:.1f} at "
        f"start, {summary['load_end'][0]:.1f} at end",
        "",
        "| method | step time, 2nd half (s) | × native | wire per step, per host (MB) | × native "
        "| replica all-reduce per rank and step (MB) | EDGC rank | last loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for method in METHODS:
        row = rows.get(method)
        if row is None or "failed" in row:
            lines.append(f"| {method} | failed (exit codes {row['failed'] if row else '–'}) | | | | | | |")
            continue
        low, high = row["step_s_range"]
        ratio = lambda key: f"{row[key] / native[key]:.2f}×" if native.get(key) else "–"  # noqa: E731
        lines.append(
            f"| {method} | {row['step_s']:.2f} [{low:.2f}–{high:.2f}] | {ratio('step_s')} "
            f"| {row['wire_per_step'] / 1e6:.2f} | {ratio('wire_per_step')} | {_payload(row)} "
            f"| {', '.join(map(str, row['ranks'])) or '–'} | {row['final_loss']:.4f} |"
        )
    lines += [""] + [f"- {what}: {'holds' if holds else 'fails'}" for what, holds in summary.get("checks", [])]
    return "\n".join(lines) + "\n"


def _payload(row: dict) -> str:
    """MB per rank and step: the total, and each state's where there are several (dense, routed experts)."""
    parts = row.get("payload_by_mesh", {})
    each = " (" + " + ".join(f"{MESH_NAMES.get(m, m)} {b / 1e6:.3f}" for m, b in parts.items()) + ")"
    return f"{row['payload_per_step'] / 1e6:.3f}" + (each if len(parts) > 1 else "")


def run_torchtitan_bench(s: BenchSettings, o: TitanOptions, out: Path, command: str, say=print) -> dict:
    """Native HSDP, then EDGC, on one emulated network; writes results.json and bench.md."""
    import torchtitan

    out.mkdir(parents=True, exist_ok=True)
    assets = write_assets(out / "assets")
    started, load_start = time.time(), os.getloadavg()
    runs = []
    with Network(s.hosts, s.rate_mbit) as net:
        for method in METHODS:
            say(f"[{time.time() - started:6.0f} s] {method}: {o.config}, {s.hosts} × {s.nproc}, {s.steps} steps")
            runs.append(run_method(net, s, o, method, out / "runs" / method, assets))
    summary = {
        "settings": s.__dict__ | {"methods": list(METHODS), "config": o.config, "ep": o.ep},
        "command": command,
        "torchtitan": torchtitan.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "rows": [summary_row(run, s.steps) for run in runs],
        "checks": checks({run["method"]: run["records"] for run in runs}, s.nproc, o.ep),
        "runs": [{k: v for k, v in run.items() if k != "records"} for run in runs],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    # between the markers scripts/to_docs.py bench copies into the manual (docs/results/hsdp.md)
    (out / "bench.md").write_text(f"<!-- bench:start -->\n{markdown(summary)}<!-- bench:end -->\n")
    return summary
