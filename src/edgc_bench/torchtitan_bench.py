"""`edgc bench --torchtitan`: torchtitan's own trainer, its llama3 debug model as HSDP (a replica per host, the
host's processes sharding it), native against EDGC (`edgc.integrations.torchtitan`), on emulated hosts.

Each method is one torchtitan run: a ``torchrun`` agent per host inside its namespace, each running the
CPU launcher `edgc_train.torchtitan_cpu` with the same model, data, seed, batch and steps. What is
compared, per method:

* the step time: the median (and range) of the second half of the steps, as rank 0 logged them (the
  first half holds the start-up, and EDGC's warm-up and r_max profiling);
* the wire: what each host's interface sent during the run (``tx_bytes``: the replica all-reduce,
  which is all that crosses hosts but torchtitan's per-step loss and token-count all-reduces), per step;
* EDGC's own counter: what its replica all-reduce sent per rank and step in the second half, against
  this rank's shards in fp32 (what the native all-reduce sends);
* the last step's loss.

Writes ``runs/<method>/`` (torchtitan's dump folder, the records, ``torchrun.log``), ``results.json``
and ``bench.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from edgc_train.torchtitan_assets import asset_args, asset_env, write_assets

from .diloco_bench import tx_bytes
from .netns import Network
from .run import BenchSettings, launch

METHODS = ("native", "edgc")
MODULES = {"native": "llama3", "edgc": "edgc.integrations.torchtitan"}


def edgc_flags(edgc: dict) -> list[str]:
    """``--edgc key=value`` items of the bench as torchtitan's ``--edgc.key value`` flags."""
    flags = []
    for key, value in edgc.items():
        if isinstance(value, bool):
            flags.append(f"--edgc.{'' if value else 'no-'}{key.replace('_', '-')}")
        elif isinstance(value, (list, tuple)):  # a pair, or pairs (rank_schedule): every number its own token
            flat = [v for item in value for v in (item if isinstance(item, (list, tuple)) else [item])]
            flags += [f"--edgc.{key}", *map(str, flat)]
        else:
            flags += [f"--edgc.{key}", str(value)]
    return flags


def titan_args(s: BenchSettings, method: str, run_dir: Path, assets: Path) -> list[str]:
    """torchtitan's command line of one method's run."""
    args = ["--module", MODULES[method], "--config", "llama3_debugmodel", *asset_args(assets)]
    args += ["--training.steps", str(s.steps), "--training.seq_len", str(s.seq_len)]
    args += ["--training.local_batch_size", str(s.micro_batch), "--training.mixed_precision_param", "float32"]
    args += ["--parallelism.data_parallel_replicate_degree", str(s.hosts)]
    args += ["--parallelism.data_parallel_shard_degree", str(s.nproc), "--debug.seed", str(s.seed)]
    args += ["--dump_folder", str(run_dir)]
    if method == "edgc":
        args += edgc_flags({**s.edgc, **({"r_max": s.r_max} if s.r_max is not None else {})})
    return [*args, "activation-checkpoint:none"]  # a subcommand: last


def run_method(net: Network, s: BenchSettings, method: str, run_dir: Path, assets: Path) -> dict:
    run_dir.mkdir(parents=True)
    plan = run_dir / "plan.json"
    plan.write_text(json.dumps([{"name": method, "args": titan_args(s, method, run_dir, assets)}]))
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
    payload = [s["edgc"]["bytes_sent"] for r in records for s in r["steps"] if s["step"] > steps // 2 and s["edgc"]]
    native = statistics.fmean(r["shard_bytes"] for r in records)  # its all-reduce sends the shards whole
    return {
        "method": run["method"],
        "step_s": statistics.median(seconds),
        "step_s_range": [min(seconds), max(seconds)],
        "wire_per_step": statistics.fmean(run["tx_bytes"]) / steps,
        "payload_per_step": statistics.fmean(payload) if payload else native,
        "shard_bytes": records[0]["shard_bytes"],
        "final_loss": records[0]["steps"][-1]["loss"],
        "ranks": sorted({s["edgc"].get("rank") for s in late if s["edgc"]} - {None}),
    }


def markdown(summary: dict) -> str:
    s = summary["settings"]
    link = "unlimited" if s["rate_mbit"] is None else f"{s['rate_mbit']:g} Mbit/s"
    rows = {row["method"]: row for row in summary["rows"]}
    native = rows.get("native", {})
    lines = [
        f"`{summary['command']}`: torchtitan {summary['torchtitan']} llama3 debug model, HSDP {s['hosts']} replicas "
        f"(one per host) × {s['nproc']} shards, {s['steps']} steps, batch {s['micro_batch']} × {s['seq_len']} per "
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
            f"| {row['wire_per_step'] / 1e6:.2f} | {ratio('wire_per_step')} | {row['payload_per_step'] / 1e6:.3f} "
            f"| {', '.join(map(str, row['ranks'])) or '–'} | {row['final_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def run_torchtitan_bench(s: BenchSettings, out: Path, command: str, say=print) -> dict:
    """Native HSDP, then EDGC, on one emulated network; writes results.json and bench.md."""
    import torchtitan

    out.mkdir(parents=True, exist_ok=True)
    assets = write_assets(out / "assets")
    started, load_start = time.time(), os.getloadavg()
    runs = []
    with Network(s.hosts, s.rate_mbit) as net:
        for method in METHODS:
            say(f"[{time.time() - started:6.0f} s] {method}: torchtitan, {s.hosts} × {s.nproc}, {s.steps} steps")
            runs.append(run_method(net, s, method, out / "runs" / method, assets))
    summary = {
        "settings": s.__dict__ | {"methods": list(METHODS)},
        "command": command,
        "torchtitan": torchtitan.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "rows": [summary_row(run, s.steps) for run in runs],
        "runs": [{k: v for k, v in run.items() if k != "records"} for run in runs],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    # between the markers scripts/bench_to_docs.py copies into the manual (docs/results/hsdp.md)
    (out / "bench.md").write_text(f"<!-- bench:start -->\n{markdown(summary)}<!-- bench:end -->\n")
    return summary
