"""The simulator's host model per op class: checked against the H200's hook, its prediction for this engine.

    python scripts/to_docs.py host-model census --out docs/gpu/h200-2026-11-27/op-census.json
    python scripts/to_docs.py host-model                     # the block (counts this engine: minutes)
    python scripts/to_docs.py host-model --engine-census FILE [--graphs-census FILE]

``census`` counts one hook step of this checkout's engine at GPT-2 XL, rank 32, bf16 gradients, DDP's
default, 100 and 200 MB buckets (`edgc_probes.dispatch_count`, fake tensors, views counted beside the
kernel-launching dispatches) and writes the counts; the file in the H200 run's folder holds the
engine that run measured, counted so. Without a subcommand it writes the ``sim-host-model`` block of
docs/gpu.md: the host's cost per op class read from the run's profiler trace (`edgc_sim.host_ops`),
scaled by the per-op cost its device.json measured; the model against each measured hook row of the
profiled run (the measured engine's census); and its prediction for this checkout's engine (counted
now, or read from ``--engine-census``) on the H200 and H100 presets, eager, and with CUDA graphs
where the engine has them (``EDGCConfig.engine.cuda_graphs``; a replay counted as one op by the counter,
or a census from ``--graphs-census``). Nothing is typed: every figure comes from those files and counts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections import Counter
from pathlib import Path
from unittest import mock

from doc_blocks import ROOT, write

RUN = ROOT / "docs" / "gpu" / "h200-2026-11-27"
PROFILED = ROOT / "docs" / "gpu" / "h200-2026-11-27-profiled"
CENSUS = RUN / "op-census.json"
CAPS = {"25 (default)": None, "100": 100, "200": 200}
BLOCK = "sim-host-model"


# ---------------------------------------------------------------------------- counting
@contextlib.contextmanager
def counting_views():
    """While active, the dispatch counter also counts what it leaves out (views, allocation,
    metadata; not the ``prim`` queries a fake tensor makes where a real one answers in C++): the
    host issues those too. Yields the counters made, last one the latest step's."""
    from edgc_probes import dispatch_count

    class ViewCountingCounter(dispatch_count.DispatchCounter):
        def __init__(self, replayed=()):
            super().__init__(replayed)
            self.views_by_op: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            replayed = getattr(self._local, "region", None) is not None  # a replay issues none of its views
            if func.namespace != "prim" and not dispatch_count.launches_kernel(func) and not replayed:
                self.views_by_op[func.overloadpacket.__name__] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    made: list = []

    def counter(replayed=()):
        made.append(ViewCountingCounter(replayed))
        return made[-1]

    with mock.patch.object(dispatch_count, "DispatchCounter", counter):
        yield made


def count_census(graphs: bool = False, settle_steps: int = 1) -> dict | None:
    """Per bucket label, this engine's census at GPT-2 XL (see the docstring); with ``graphs``, its
    config's CUDA graphs on, or None where the engine has none."""
    import torch

    from edgc import EDGCConfig, LowRankConfig
    from edgc_probes.dispatch_count import count_hook_step
    from edgc_probes.gpt2_layout import gpt2_parameters

    config = EDGCConfig.static(32, total_steps=100_000, warmup_fraction=0.0)
    if graphs:
        if "cuda_graphs" not in {f.name for f in dataclasses.fields(LowRankConfig)}:
            return None
        config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, cuda_graphs=True))
    steps = {}
    for label, cap in CAPS.items():
        with counting_views() as made:
            count = count_hook_step(
                gpt2_parameters("xl"),
                bucket_cap_mb=cap,
                config=config,
                settle_steps=settle_steps,
                dtype=torch.bfloat16,
                graphs=graphs,  # the regions the capture checker passes: one launch a call
            )
        steps[label] = {
            "by_op": count.by_op,
            "views_by_op": dict(made[-1].views_by_op),
            "collectives": count.collectives,
            "hook_calls": count.buckets,
            "dispatches": count.dispatches,
        }
        print(f"counted {label} MB: {count.dispatches} dispatches, {sum(made[-1].views_by_op.values())} views")
    return steps


def census_file(steps: dict, graphs: bool) -> dict:
    import torch

    return {
        "model": "xl",
        "rank": 32,
        "dtype": "bfloat16",
        "world_size": 1,
        "cuda_graphs": graphs,
        "torch": torch.__version__,
        "command": "python scripts/to_docs.py host-model census" + (" --graphs" if graphs else ""),
        "steps": steps,
    }


# ---------------------------------------------------------------------------- the block
def measured_rows(profiled: Path) -> dict:
    """The profiled run's hook alone at XL, EDGC, bf16, rank 32, per bucket label: its median seconds
    and its kernels' summed device time."""
    rows = json.loads((profiled / "engine.json").read_text())["hook_alone"]
    out = {}
    for r in rows:
        if (r["model"], r["method"], r["grad_dtype"], r["rank"]) == ("xl", "edgc", "bfloat16", 32):
            label = "25 (default)" if r["ddp_default"] else f"{r['bucket_cap_mb']:g}"
            kernels = (r.get("kernel_profile") or {}).get("device_s")
            out[label] = {"wall_s": r["seconds"], "kernels_s": kernels, "samples_s": r["seconds_all"]}
    return out


def spread_line(*runs: dict) -> str:
    """The hook's timed samples of both runs per bucket label: the spread the check sits in."""
    parts = []
    for label in runs[0]:
        samples = [t for run in runs for t in run.get(label, {}).get("samples_s", [])]
        parts.append(f"{label} MB {1e3 * min(samples):.1f}–{1e3 * max(samples):.1f} ms")
    return (
        f"The hook's {sum(len(run[label]['samples_s']) for run in runs for label in run) // len(runs[0])} timed calls "
        "a row in the two runs span " + ", ".join(parts) + ": they fall in a faster and a slower group, and the "
        "model (read from a profiled trace) sits with the slower."
    )


def censuses(steps: dict) -> dict:
    from edgc_sim.host_ops import OpCensus

    return {label: OpCensus.from_dict(step) for label, step in steps.items()}


def block(run: Path, profiled: Path, measured_census: dict, engine: dict, graphs: dict | None) -> str:
    from edgc_sim.host_ops import costs_from_trace, read_trace
    from edgc_sim.host_report import check_rows, check_table, costs_table, prediction_table, share_line

    launch_s = json.loads((run / "device.json").read_text())["measured"]["launch_s"]
    traced = json.loads((run / "overlap.json").read_text())["nccl"]
    trace = run / "trace_nccl.json.gz"
    costs = costs_from_trace(read_trace(trace), launch_s, f"{trace.relative_to(ROOT)}")
    measured = measured_rows(profiled)
    rows = check_rows(costs, censuses(measured_census["steps"]), measured, measured_rows(run))
    steps = {("eager", label): census for label, census in censuses(engine["steps"]).items()}
    for label in CAPS:
        steps[("CUDA graphs", label)] = None if graphs is None else censuses(graphs["steps"])[label]
    return "\n".join(
        [
            f"Host cost per op class, read from `{costs.source}` (GPT-2 {traced['model']}, EDGC rank "
            f"{traced['rank']} on NCCL, profiled; {sum(costs.samples.values()):,} ops in {costs.calls} hook calls) "
            "by `edgc_sim.host_ops`: an "
            "op's own span plus the Python gap before it; the `h100` preset's scaled by its per-op cost "
            f"({1e6 * launch_s:.1f} µs on the H200's host):",
            "",
            costs_table(costs),
            "",
            f"**The check** (GPT-2 XL, rank 32, bf16 gradients, the hook alone, `{profiled.relative_to(ROOT)}`'s "
            f"median, the rows the model is held to; beside it `{run.relative_to(ROOT)}`'s, the same engine in the "
            f"other run; the measured engine's ops counted by `{measured_census['command']}`, torch "
            f"{measured_census['torch']}): host = the census at the classes' costs; device = the simulator's "
            "engine model on the `h200` preset; predicted = the larger:",
            "",
            check_table(rows),
            "",
            spread_line(measured, measured_rows(run)),
            "",
            f"Where the host's time goes (25 MB buckets): {share_line(rows[0])}.",
            "",
            f"**The prediction for this checkout's engine** (counted by `{engine['command']}`"
            + ("" if graphs is None else f" and `{graphs['command']}`")
            + f", torch {engine['torch']}; with CUDA graphs a replay costs one element-wise op's host time, the "
            "ops inside it none):",
            "",
            prediction_table(costs, steps),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="to_docs.py host-model", description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", choices=["census"], help="census: count this engine and write --out")
    p.add_argument("--out", type=Path, help="with census: the JSON to write")
    p.add_argument("--graphs", action="store_true", help="with census: count with the engine's CUDA graphs on")
    p.add_argument("--settle-steps", type=int, default=1, help="compressed steps before the counted one")
    p.add_argument("--run", type=Path, default=RUN, help="the GPU run's folder (trace, device.json)")
    p.add_argument("--profiled", type=Path, default=PROFILED, help="the profiled run's folder (engine.json)")
    p.add_argument("--census", type=Path, default=CENSUS, help="the measured engine's census")
    p.add_argument("--engine-census", type=Path, help="this engine's census (default: count it now)")
    p.add_argument("--graphs-census", type=Path, help="this engine's census with CUDA graphs (default: count it now)")
    args = p.parse_args(argv)
    if args.what == "census":
        if args.out is None:
            p.error("census needs --out")
        steps = count_census(args.graphs, args.settle_steps)
        if steps is None:
            p.error("--graphs: this checkout's LowRankConfig has no cuda_graphs")
        args.out.write_text(json.dumps(census_file(steps, args.graphs), indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    read = lambda path: json.loads(path.read_text())  # noqa: E731
    engine = (
        read(args.engine_census) if args.engine_census else census_file(count_census(False, args.settle_steps), False)
    )
    if args.graphs_census:
        graphs = read(args.graphs_census)
    else:
        counted = count_census(True, args.settle_steps)
        graphs = None if counted is None else census_file(counted, True)
    print(write(BLOCK, block(args.run, args.profiled, read(args.census), engine, graphs)))
    return 0
