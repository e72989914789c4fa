"""`edgc bench`: every selected method trained on the same emulated multi-host network, one after another.

For each method the bench starts one ``torchrun`` agent per host inside that host's namespace
(static rendezvous on host 0's address, ``--nnodes H --node_rank i --nproc_per_node N``), each running
``edgc train`` with identical model, data, seed, batch and step count; only ``--compressor`` (and its
rank) differ. Then it reads every run's ``metrics.jsonl`` and writes the comparison (table.py).

Order: ``none`` first (its final validation loss is everyone's target), then ``edgc`` (its profiled
r_max fixes the ranks of ``powersgd@rmax``, ``powersgd@rmin`` and ``torch-powersgd``), then the rest.

Rounds (``rounds`` > 1): the whole method list runs again, in reverse order on even rounds, each
round a complete bench folder ``round-K/``; round 1's r_max fixes the static ranks of every round.
A machine whose speed drifts over minutes (a shared VM) then slows the methods run late in one
round and early in the next: a steady drift cancels in the mean of the rounds' ratios (an ABBA
design; an even N pairs every round with a reversed one), and the rounds' spread shows how much
the machine moved (`edgc_bench.rounds`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgc.sync.sync_methods import sync_method, sync_method_names

from . import link_calibration, table
from .bench_folder import method_dir, read_run
from .netns import Network
from .rounds import rounds_markdown

# The default comparison: what users run (DDP's native all-reduce, PyTorch's PowerSGD hook), the
# compute floor, our uncompressed hook path, the paper's sync-after-backward, static ranks and EDGC.
# The other baselines run with --methods all.
DEFAULT_METHODS = (
    "none",
    "nosync",
    "allreduce",
    "allreduce-blocking",
    "torch-powersgd",
    "powersgd@rmax",
    "powersgd@rmin",
    "edgc",
)
PORT = 29500


@dataclass
class BenchSettings:
    hosts: int = 2
    nproc: int = 1
    rate_mbit: float | None = 1000.0
    methods: tuple[str, ...] = DEFAULT_METHODS
    preset: str = "small"
    steps: int = 60
    micro_batch: int = 2
    seq_len: int = 128
    vocab_size: int = 4096
    eval_every: int = 5
    eval_batches: int = 4
    seed: int = 1337
    threads: int = 1
    r_max: int | None = None  # None: EDGC profiles it on the link
    compress_ratio: float = 0.01
    # EDGC knobs for a short bench run (docs/bench.md): profile ranks 2, 4, 8 on the link, one timed
    # step each (steps 1–3, inside the 6-step warm-up floor; the scaled default would stop at rank 4),
    # and no warm-up error test (it never passed in 20 steps).
    edgc: dict = field(
        default_factory=lambda: {"profile_max_rank": 8, "profile_steps_per_rank": 1, "warmup_error_test": False}
    )
    calibration_mb: tuple[float, ...] = link_calibration.SIZES_MB
    run_timeout_s: int = 900
    data: str | None = None
    max_chars: int | None = None
    fsdp: bool = False  # HSDP: each host's processes shard the model (edgc train --fsdp --fsdp-shard nproc)
    tp: int = 1  # tensor-parallel degree inside each host (edgc train --tp)
    pp: int = 1  # pipeline stages inside each host (edgc train --pp); nproc = tp × pp, DP crosses the link
    grad_accum: int = 1  # micro-batches per step (with --pp: the pipeline's micro-batches, ≥ pp)
    interstage: str = "off"  # activation gradients between stages: off | all | cooldown (edgc train --interstage)
    interstage_rank: int = 8  # their rank (with edgc: the upper bound of the rank that follows the entropy)
    rounds: int = 1  # times the method list runs, reversed on even rounds (see the module docstring); 1–9
    moe_experts: int = 0  # a mixture of experts in every MLP, split over a host's processes (edgc train --ep nproc)

    @property
    def pipeline(self) -> bool:
        """A TP × PP × DP layout: each host runs one whole TP × PP model, its DP groups cross the link."""
        return self.tp > 1 or self.pp > 1

    def model_args(self) -> list[str]:
        """The model, data and seed flags every bench worker takes (`edgc train`, the torchft and
        DiLoCo workers), whatever it syncs with."""
        args = ["--preset", self.preset, "--steps", str(self.steps), "--micro-batch", str(self.micro_batch)]
        args += ["--seq-len", str(self.seq_len), "--vocab-size", str(self.vocab_size)]
        args += ["--eval-batches", str(self.eval_batches), "--seed", str(self.seed)]
        if self.data:
            args += ["--data", self.data]
        if self.max_chars:
            args += ["--max-chars", str(self.max_chars)]
        return args


FSDP_METHODS = ("none", "edgc")  # with --fsdp: native HSDP vs EDGC on the replica all-reduce
# with --tp/--pp: every stage syncs over its DP group with our all-reduce (none), static PowerSGD or EDGC
PIPELINE_METHODS = ("none", "powersgd@rmax", "edgc")
# with --moe-experts: the dense and the experts' groups, each synced by its own state (no DDP: no none)
MOE_METHODS = ("allreduce", "edgc")


def all_methods() -> tuple[str, ...]:
    """Every method token but powersgd@N: the harness's own syncs, static PowerSGD at r_max and
    r_max / 4, the library's registered sync methods (`edgc.sync.sync_methods`), EDGC."""
    return (
        "none",
        "allreduce",
        "allreduce-blocking",
        "nosync",
        "powersgd@rmax",
        "powersgd@rmin",
        "torch-powersgd",
        *sync_method_names(),
        "edgc",
    )


def check_methods(methods: list[str], fsdp: bool = False, pipeline: bool = False, moe: bool = False) -> list[str]:
    """Validated method tokens; raises ValueError with one line."""
    out = []
    for m in methods:
        base, _, rank = m.partition("@")
        if moe and base not in ("allreduce", "powersgd", "edgc"):
            raise ValueError(
                f"method {m!r} is not available with --moe-experts; choose from allreduce, edgc, powersgd@…"
            )
        if fsdp and base not in (*FSDP_METHODS, "allreduce", "powersgd"):
            raise ValueError(
                f"method {m!r} is not available with --fsdp; choose from none, allreduce, edgc, powersgd@…"
            )
        if pipeline and base not in ("none", "powersgd", "edgc"):
            raise ValueError(
                f"method {m!r} is not available with --tp/--pp (a pipeline stage's sync); "
                "choose from none, edgc, powersgd@…"
            )
        ok = m in all_methods() or (
            base == "powersgd" and (rank in ("rmax", "rmin") or rank.isdigit() and int(rank) > 0)
        )
        if not ok:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(all_methods())} or powersgd@N")
        if m not in out:
            out.append(m)
    return out


def execution_order(methods: list[str]) -> list[str]:
    first = [m for m in ("none", "edgc") if m in methods]
    return first + [m for m in methods if m not in first]


def train_args(s: BenchSettings, method: str, out: Path, r_max: int | None) -> list[str]:
    args = [
        "--out",
        str(out),
        *s.model_args(),
        "--eval-every",
        str(s.eval_every),
        "--no-progress",
        "--no-tensorboard",
        "--comm-trace",
        "--device",
        "cpu",
        "--ckpt-every",
        "-1",
    ]  # no checkpoints: GBs per bench, never read
    if s.fsdp:
        args += ["--fsdp", "--fsdp-shard", str(s.nproc)]
    if s.moe_experts:
        args += ["--moe-experts", str(s.moe_experts), "--ep", str(s.nproc)]
    if s.pipeline:
        args += ["--tp", str(s.tp), "--pp", str(s.pp), "--grad-accum", str(s.grad_accum)]
        if s.pp > 1:
            args += ["--interstage", s.interstage, "--interstage-rank", str(s.interstage_rank)]
    base, _, rank = method.partition("@")
    args += ["--compressor", base]
    if base == "powersgd" or base == "torch-powersgd":
        r = r_max if rank in ("rmax", "") else max(1, r_max // 4) if rank == "rmin" else int(rank)
        args += ["--powersgd-rank", str(r)]
    if (method := sync_method(base)) is not None and method.takes("ratio"):
        args += ["--compress-ratio", str(s.compress_ratio)]
    if base == "edgc":
        edgc = dict(s.edgc)
        if s.r_max is not None:
            edgc.setdefault("r_max", s.r_max)
        for key, value in edgc.items():
            args += ["--edgc", f"{key}={json.dumps(value)}"]
    return args


def launch(
    net: Network, s: BenchSettings, module_argv: list[str], log_path: Path, timeout_s: int, env: dict | None = None
) -> list[int]:
    """Start one torchrun agent per host running ``python -m <module_argv>`` (with ``env`` besides the
    bench's own); wait for all."""
    env = {"OMP_NUM_THREADS": str(s.threads), "EDGC_DIST_TIMEOUT": "300", "PYTHONUNBUFFERED": "1", **(env or {})}
    processes = []
    with open(log_path, "w") as log:
        for host in range(s.hosts):
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={s.hosts}",
                f"--node_rank={host}",
                f"--nproc_per_node={s.nproc}",
                f"--master_addr={net.addr(0)}",
                f"--master_port={PORT}",
                "-m",
                *module_argv,
            ]
            processes.append(net.popen(host, argv, env=env, timeout_s=timeout_s, stdout=log, stderr=subprocess.STDOUT))
            if host == 0:
                time.sleep(0.5)  # host 0 opens the store first
        return net.wait_all(processes)


def run_calibration(net: Network, s: BenchSettings, out: Path) -> list[dict]:
    env = {"OMP_NUM_THREADS": "1", "WORLD_SIZE": str(s.hosts), "MASTER_ADDR": net.addr(0), "MASTER_PORT": str(PORT)}
    sizes = [str(mb) for mb in s.calibration_mb]
    processes = []
    for host in range(s.hosts):
        processes.append(
            net.popen(
                host,
                [sys.executable, "-m", "edgc_bench.link_calibration", *sizes],
                env={**env, "RANK": str(host)},
                timeout_s=300,
                stdout=subprocess.PIPE if host == 0 else subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    codes = net.wait_all(processes)
    text = processes[0].stdout.read().decode()  # type: ignore[union-attr]
    if any(codes):
        raise RuntimeError(f"calibration failed (exit codes {codes})")
    results = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    rows = link_calibration.rows(results, s.hosts, s.rate_mbit)
    (out / "calibration.json").write_text(json.dumps(rows, indent=1))
    return rows


def edgc_r_max(run: dict) -> int | None:
    """EDGC compresses first at r_max (then only moves within [r_min, r_max]): its largest rank used."""
    ranks = [r["rank"] for r in run["train"] if r.get("rank")]
    return max(ranks) if ranks else None


def round_order(methods: list[str], round_: int) -> list[str]:
    """Round 1 (and every odd round) in the bench's order; even rounds reversed, so that each method
    runs as far from its place in the previous round as the list allows."""
    order = execution_order(methods)
    return order if round_ % 2 else order[::-1]


def run_bench(s: BenchSettings, out: Path, command: str, say=print) -> dict:
    """Every method (every round of them) on one emulated network; writes bench.md and results.json."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_start = os.getloadavg()
    from edgc_train.data import prepare_data

    prepare_data(s.data, s.vocab_size, 0.1, s.max_chars, None, log=lambda *a, **k: None)  # once, before the hosts
    with Network(s.hosts, s.rate_mbit) as net:
        layout = f" (TP{s.tp} × PP{s.pp} per host, DP{s.hosts} across)" if s.pipeline else ""
        say(
            f"network: {s.hosts} hosts × {s.nproc} processes{layout}, "
            f"{'unlimited' if s.rate_mbit is None else f'{s.rate_mbit:g} Mbit/s'} per host link (tbf both ends)"
        )
        calibration = run_calibration(net, s, out)
        say(link_calibration.table(calibration, s.rate_mbit))
        if s.rounds == 1:
            return run_round(
                net, s, out, execution_order(list(s.methods)), s.r_max, calibration, command, say, started, load_start
            )
        rounds, r_max = [], s.r_max
        for k in range(1, s.rounds + 1):
            order = round_order(list(s.methods), k)
            say(f"round {k} of {s.rounds}: {', '.join(order)}")
            summary = run_round(net, s, out / f"round-{k}", order, r_max, calibration, command, say, started)
            r_max = summary["r_max"]  # round 1's profiled r_max: every round's static ranks are the same
            rounds.append(summary)
    summary = {
        "settings": s.__dict__ | {"methods": list(s.methods)},
        "command": command,
        "r_max": r_max,
        "rounds": [f"round-{k}" for k in range(1, s.rounds + 1)],
        "notes": [f"round {k}: {note}" for k, r in enumerate(rounds, 1) for note in r["notes"]],
        "elapsed_s": time.time() - started,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "bench.md").write_text(rounds_markdown(out, summary))
    return summary


def run_round(
    net: Network,
    s: BenchSettings,
    out: Path,
    order: list[str],
    r_max: int | None,
    calibration: list[dict],
    command: str,
    say,
    bench_started: float,
    load_start: tuple[float, float, float] | None = None,
) -> dict:
    """Train every method of ``order`` once into ``out/runs``; write out's results.json, bench.md, plots."""
    (out / "runs").mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_start = load_start or os.getloadavg()
    results: dict[str, dict] = {}
    notes: list[str] = []
    for method in order:
        if method != "edgc" and ("@r" in method or method == "torch-powersgd") and r_max is None:
            r_max = 8
            notes.append("r_max was not profiled (EDGC not run or never compressed): static ranks use r_max = 8")
        run_dir = method_dir(out, method)
        argv = ["edgc_cli.main", "train", *train_args(s, method, run_dir, r_max)]
        say(f"[{time.time() - bench_started:6.0f} s] {method}: edgc train {shlex.join(argv[2:])}")
        t0 = time.time()
        codes = launch(net, s, argv, run_dir.parent / f"{run_dir.name}.log", s.run_timeout_s)
        if any(codes) or not (run_dir / "metrics.jsonl").exists():
            notes.append(f"{method}: failed (exit codes {codes}); see runs/{method.replace('@', '-')}.log")
            say(f"  {method} failed: exit codes {codes}")
            continue
        run = read_run(run_dir)
        run["wall_total_s"] = time.time() - t0
        run["powersgd_rank"] = run["config"].get("powersgd_rank")
        results[method] = run
        if method == "edgc" and r_max is None:
            r_max = edgc_r_max(run)
            if r_max is None:
                notes.append("EDGC never compressed (profiling found no rank faster than uncompressed)")
        say(f"  done in {time.time() - t0:.0f} s: val_loss {run['eval'][-1]['val_loss']:.4f}")
    summary = {
        "settings": s.__dict__ | {"methods": list(s.methods)},
        "command": command,
        "calibration": calibration,
        "r_max": r_max,
        "notes": notes,
        "elapsed_s": time.time() - started,
        "order": order,
        "round": out.name if s.rounds > 1 else None,
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }
    summary["rows"] = table.rows(results, r_max, s.pipeline)
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "bench.md").write_text(table.markdown(summary, results))
    table.plots(results, out)
    return summary
