"""Do pipeline stages finish their gradient sync closer together with DAC than with one rank for all?

    python -m edgc_bench.stages [--rate-mbit 100] [--rank 8] [--steps 30] [--out runs/stages]
                                [--tp T] [--interstage off|all|cooldown]

Two emulated hosts (`edgc_bench.netns`), each running one whole 2-stage pipeline
(`edgc train --pp 2`, 2 processes per host; ``--tp T``: `--tp T --pp 2`, 2·T processes per host,
TP and PP inside the host), so each stage's data-parallel group crosses the rate-limited link.
``--interstage`` compresses the activation gradients between the stages in both runs (intra-host;
their bytes per step are reported). Two runs on the same data and seed:

* ``dac``     — EDGC: every stage profiles its sync-time table and r_max on the link; stage 0's
  rank comes from its entropy, stage 1's from the DAC alignment;
* ``uniform`` — static PowerSGD on both stages at the rank stage 0 used most in the ``dac`` run
  (`--compressor powersgd`), so only the later stage's rank differs between the runs.

Per step, the spread is the time between the first and the last stage finishing its sync
(`sync_finish_s` in metrics.jsonl); the table reports its median over the compressed steps and
the ratio dac / uniform measured in this one invocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .netns import Network, check_prerequisites
from .run import BenchSettings, launch


def spread(record: dict) -> float:
    finishes = [s["sync_finish_s"] for s in record["stages"]]
    return max(finishes) - min(finishes)


def summarise(run_dir: Path) -> dict:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    compressed = [r for r in lines if r["kind"] == "train" and r["phase"] == "compress"][2:]  # skip transitions
    if not compressed:
        raise RuntimeError(f"{run_dir}: no compressed steps to measure")
    return {
        "spread_s": statistics.median(spread(r) for r in compressed),
        "step_s": statistics.median(r["step_time_s"] for r in compressed),
        "stage_ranks": [
            sorted({str(r["stages"][s]["rank"]) for r in compressed}) for s in range(len(compressed[0]["stages"]))
        ],
        "stage_sync_s": [
            statistics.median(r["stages"][s]["sync_time_s"] for r in compressed)
            for s in range(len(compressed[0]["stages"]))
        ],
        "stage0_ranks": [r["stages"][0]["rank"] for r in compressed],
        "steps": len(compressed),
        "dp_mb": statistics.median(r["bytes_sent"] for r in compressed) / 1e6,
        "interstage_mb": statistics.median(r.get("interstage_bytes_sent", 0) for r in compressed) / 1e6,
        "interstage_raw_mb": statistics.median(r.get("interstage_bytes_raw", 0) for r in compressed) / 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.stages", description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="per-host link rate (Mbit/s)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", default="runs/stages")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside each host")
    parser.add_argument("--interstage", default="off", choices=("off", "all", "cooldown"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"{out} exists; choose another --out", file=sys.stderr)
        return 2
    check_prerequisites()
    out.mkdir(parents=True)
    settings = BenchSettings(hosts=2, nproc=2 * args.tp, rate_mbit=args.rate_mbit)
    common = [
        "--pp",
        "2",
        "--tp",
        str(args.tp),
        "--interstage",
        args.interstage,
        "--grad-accum",
        "4",
        "--preset",
        args.preset,
        "--steps",
        str(args.steps),
        "--micro-batch",
        "4",
        "--seq-len",
        "128",
        "--eval-every",
        "0",
        "--eval-batches",
        "4",
        "--no-progress",
        "--no-tensorboard",
    ]
    edgc = {"window": 5, "profile_max_rank": 64, "profile_steps_per_rank": 1, "warmup_error_test": False}
    results = {}
    with Network(2, args.rate_mbit) as net:

        def train(name: str, extra: list[str]) -> dict:
            codes = launch(
                net,
                settings,
                ["edgc_cli.main", "train", "--out", str(out / name), *common, *extra],
                out / f"{name}.log",
                timeout_s=1200,
            )
            if any(codes):
                raise RuntimeError(f"{name}: edgc train failed (exit codes {codes}); see {out / (name + '.log')}")
            return summarise(out / name)

        results["dac"] = train(
            "dac", ["--compressor", "edgc", *[a for k, v in edgc.items() for a in ("--edgc", f"{k}={json.dumps(v)}")]]
        )
        stage0_rank = statistics.mode(results["dac"]["stage0_ranks"])
        results["uniform"] = train("uniform", ["--compressor", "powersgd", "--powersgd-rank", str(stage0_rank)])
    ratio = results["dac"]["spread_s"] / results["uniform"]["spread_s"]
    table = [
        "| run | stage ranks | median sync time per stage (ms) | median finish spread (ms) | median step (s) "
        "| DP MB/step | inter-stage MB/step (raw) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("uniform", "dac"):
        r = results[name]
        table.append(
            f"| {name} | {' / '.join(','.join(ranks) for ranks in r['stage_ranks'])} | "
            f"{' / '.join(f'{t * 1000:.0f}' for t in r['stage_sync_s'])} | {r['spread_s'] * 1000:.1f} | "
            f"{r['step_s']:.2f} | {r['dp_mb']:.2f} | {r['interstage_mb']:.3f} ({r['interstage_raw_mb']:.3f}) |"
        )
    text = "\n".join(table) + f"\n\nspread dac / uniform: {ratio:.2f}× ({args.rate_mbit:g} Mbit/s per host, "
    text += f"{'TP' + str(args.tp) + ' × ' if args.tp > 1 else ''}PP2 × DP2, inter-stage {args.interstage})\n"
    (out / "stages.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
