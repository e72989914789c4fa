"""`python -m edgc_bench.gpu --out DIR`: the CUDA path measured on one GPU, in one command (docs/gpu.md).

The parts (`edgc_bench.gpu_parts.PARTS`, ``--plan`` prints them with their limits) run one after
another in the order of their value, each in a process of its own with its own time limit (plus what
the parts before it left of theirs), cut to what is left of ``--budget``: a part that fails or runs
out of time is killed with every process it started, and the next one runs. Each writes
``DIR/<part>.json`` as it measures, so a part killed, or the whole command, keeps what it had;
``DIR/summary.json`` (the plan, and each part's status, seconds and file) is rewritten before and
after each part, and every part's output goes to ``DIR/log.txt`` too. The default parts write 8 files
at most (what the device tool brings back). The exit status is 1 if any part failed, ran out of time
or was skipped. scripts/to_docs.py gpu copies the files into docs/gpu.md and the README.

``--smoke`` runs every part's code on the CPU at a tiny size (GPT-2 "tiny", gloo; tests/bench/
test_gpu_bench.py does); ``--count-only`` writes count.json alone, on any machine (the CPU's count).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .gpu_parts import BY_NAME, DEFAULT_PARTS, command, run_in_group, write_json

BUDGET_S = 500  # one device command of ≤ 9 minutes, the machine's start not included
LEAST_S = 5  # a part is not started with less than this left of the budget
SMOKE_SLACK = 10  # a smoke run's limits and budget, × the device's: a shared CPU is slow, and no figure counts
# A smoke run's first bucket size holds the tiny model in one bucket: on gloo, powerSGD_hook's
# callbacks wait for collectives on gloo's two worker threads, so two buckets in flight deadlock.
SMOKE = {
    "size": "tiny",
    "sizes": "tiny",
    "ranks": "4",
    "goal_rank": 4,
    "bucket_cap_mb": "100,0.25",
    "micro_batch": 2,
    "seq_len": 32,
    "timed_steps": 2,
    "overlap_size": "tiny",
    "overlap_rank": 4,
    "overlap_steps": 2,
    "delay_ms": 1.0,
    "outer_sizes": "tiny",
    "tests": "tests/gpu/test_cuda_graphs.py",
    "sanitized": "",
    "budget": BUDGET_S * SMOKE_SLACK,
}


def settings_of(name: str, args: argparse.Namespace, limit_s: float) -> dict:
    """What part ``name`` is given (JSON): the run's settings, and the part's own where they differ."""
    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC

    settings = {
        "cuda": not args.smoke,
        "out": str(args.out),
        "part_limit_s": limit_s,
        "size": args.size,
        "sizes": args.sizes,
        "rank": args.goal_rank,
        "ranks": args.ranks,
        "bucket_caps": args.bucket_caps,
        "modes": ["eager", "graphs"],
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "timed": args.timed_steps,
        "skip_steps": args.skip_steps,
        "overlap_size": args.overlap_size,
        "overlap_rank": args.overlap_rank,
        "overlap_steps": args.overlap_steps,
        "delay_ms": args.delay_ms,
    }
    if name == "outer":
        methods = [DEFAULT_OUTER_SYNC] + (["bf16"] if args.outer_bf16 else [])
        settings.update(sizes=args.outer_sizes.split(","), methods=methods, micro_batch=1)
        settings.update(seq_len=min(args.seq_len, 512), largest=True)
    if name == "tests":
        settings.update(tests=args.tests.split(), sanitized=["-k", args.sanitized] if args.sanitized else [])
    return settings


# ---------------------------------------------------------------------------- running a part
def _pump(stream, log) -> None:
    for line in stream:
        print(line, end="", flush=True)
        log.write(line)
        log.flush()


def in_a_process(name: str, settings: dict, out: Path, timeout: float, log) -> int | None:
    """Part ``name`` in a process of its own (a new session: it and whatever it starts are killed
    together at ``timeout``); its output to the console and ``log``. Its exit status, None if killed."""
    process = subprocess.Popen(
        command(name, out, settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
    )
    pump = threading.Thread(target=_pump, args=(process.stdout, log), daemon=True)
    pump.start()
    try:
        status = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        status = None
    pump.join(timeout=5)
    return status


def _stopped(out: Path, name: str, note: dict) -> None:
    """Notes in part ``name``'s file why it did not finish (the file keeps what it had measured)."""
    path = out / f"{name}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    write_json(path, {**data, "stopped": note})


def plan(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(part, limit in seconds) in the order they run; ``--limit NAME=S`` replaces a part's limit."""
    slack = SMOKE_SLACK if args.smoke else 1
    limits = {name: BY_NAME[name].limit_s * slack for name in args.parts}
    for given in args.limit:
        name, _, seconds = given.partition("=")
        if name not in BY_NAME:
            raise SystemExit(f"--limit {given}: no part {name!r} (parts: {', '.join(BY_NAME)})")
        limits[name] = float(seconds)
    return [(name, limits[name]) for name in args.parts]


def print_plan(args: argparse.Namespace) -> None:
    total = 0.0
    print(f"{'part':8} {'limit s':>7} {'by then':>7}  what")
    for name, limit in plan(args):
        total += limit
        print(f"{name:8} {limit:7.0f} {total:7.0f}  {BY_NAME[name].what}")
    print(
        f"budget {args.budget:.0f} s: a part may also use what the parts before it left of their limits, and "
        f"no more than is left of the budget; a part is not started with less than {LEAST_S} s left"
    )


def run(args: argparse.Namespace, runner=None) -> dict:
    """Every part of the plan; the summary. ``runner(name, settings, out, timeout, log)`` runs one and
    returns its exit status, None if it ran out of time (default: `in_a_process`)."""
    runner = runner or in_a_process
    started = time.perf_counter()
    summary = {"budget_s": args.budget, "plan": plan(args), "parts": {}}
    path = args.out / "summary.json"
    with open(args.out / "log.txt", "a") as log:
        planned = 0.0  # when the part would start if every part before it took its whole limit
        for name, limit in summary["plan"]:
            elapsed = time.perf_counter() - started
            left, saved = args.budget - elapsed, max(planned - elapsed, 0.0)
            planned += limit
            entry = summary["parts"][name] = {"limit_s": limit, "file": f"{name}.json"}
            if left < LEAST_S:
                entry["status"] = "skipped: the budget was spent"
                _stopped(args.out, name, {"status": entry["status"]})
                continue
            timeout, part_started = min(limit + saved, left), time.perf_counter()
            entry.update(status="running", timeout_s=timeout)
            write_json(path, summary)
            print(f"== part {name}: {timeout:.0f} s at most", flush=True)
            log.write(f"== part {name}: {timeout:.0f} s at most\n")
            status = runner(name, settings_of(name, args, timeout), args.out, timeout, log)
            seconds = time.perf_counter() - part_started
            entry.update(seconds=round(seconds, 1), exit=status)
            entry["status"] = "ok" if status == 0 else f"timed out at {timeout:.0f} s" if status is None else "failed"
            if status != 0:
                _stopped(args.out, name, {"status": entry["status"], "seconds": seconds})
            print(f"== part {name}: {entry['status']}, {seconds:.0f} s", flush=True)
        summary["seconds"] = round(time.perf_counter() - started, 1)
        write_json(path, summary)
        from .gpu_summary import summary_lines

        lines = summary_lines(args.out, summary)
        print("\n".join(lines), flush=True)
        log.write("\n".join(lines) + "\n")
    return summary


# ---------------------------------------------------------------------------- the command
def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m edgc_bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the JSON files and the log")
    parser.add_argument("--plan", action="store_true", help="print the parts, their limits and the budget; run none")
    parser.add_argument("--smoke", action="store_true", help="on the CPU: tiny GPT-2, gloo, a few steps")
    parser.add_argument("--count-only", action="store_true", help="count.json only (CPU)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"of {', '.join(BY_NAME)}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the parts together")
    parser.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="a part's own limit")
    parser.add_argument("--size", default="xl", help="GPT-2 size of parts hook, sampled and ncu")
    parser.add_argument("--sizes", default="medium,large,xl", help="GPT-2 sizes of parts count and engine")
    parser.add_argument("--ranks", default="4,8,16,32,64", help="ranks of part engine")
    parser.add_argument("--goal-rank", type=int, default=32, help="the rank of the goals")
    parser.add_argument(
        "--bucket-cap-mb", default="default,100,200", help="DDP bucket sizes; 'default': DDP's own (25 MB)"
    )
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--outer-sizes", default="xl", help="GPT-2 sizes of part outer (then the largest that fits)")
    parser.add_argument("--outer-bf16", action="store_true", help="part outer: a bf16 cast sync beside the default")
    parser.add_argument("--tests", default="tests/gpu", help="part tests: pytest's arguments")
    parser.add_argument(
        "--sanitized", default="engine or nccl or resume or diloco", help="part tests: -k under the sanitizer"
    )
    parser.add_argument("--overlap-size", default="small", help="part overlap: GPT-2 size")
    parser.add_argument("--overlap-rank", type=int, default=16)
    parser.add_argument("--overlap-steps", type=int, default=4, help="timed steps without and with the delay")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="injected delay per all-reduce (part overlap)")
    parser.add_argument("--skip-steps", action="store_true", help="part engine: the hooks alone only")
    smoke = "--smoke" in (argv if argv is not None else sys.argv[1:])
    if smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args(argv)
    args.parts = ["count"] if args.count_only else args.parts.split(",")
    unknown = [name for name in args.parts if name not in BY_NAME]
    if unknown:
        parser.error(f"no part {', '.join(unknown)} (parts: {', '.join(BY_NAME)})")
    if args.out is None and not args.plan:
        parser.error("--out is required")
    from edgc_probes.gpt2_layout import GPT2_SIZES

    args.sizes = sorted(args.sizes.split(","), key=lambda size: -GPT2_SIZES[size][1])
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.bucket_caps = [None if cap == "default" else float(cap) for cap in args.bucket_cap_mb.split(",")]
    return args


def main(argv: list[str] | None = None, runner=None) -> int:
    """The command; ``runner``: how a part runs (`run`'s; the suite runs them in its process pool)."""
    args = parse(argv)
    if args.plan:
        print_plan(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.count_only:  # on the CPU, in this process
        run_in_group(0, 1, "count", settings_of("count", args, BY_NAME["count"].limit_s), str(args.out))
        return 0
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("python -m edgc_bench.gpu: needs a CUDA GPU (or --smoke, or --count-only)", file=sys.stderr)
            return 2
    summary = run(args, runner)
    return 0 if all(entry["status"] == "ok" for entry in summary["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
