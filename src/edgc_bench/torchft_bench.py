"""`edgc bench --torchft`: a replica group killed mid-run, on emulated hosts, four ways.

One network of ``--hosts`` hosts at ``--rate`` (see netns.py), the same training (edgc train's
model, data, optimizer, schedule and validation blocks, ``--steps`` optimizer steps), run as:

1. ``ddp-edgc``: EDGC on plain torch DDP, one torchrun across the hosts
   (`edgc_bench.torchft_train --mode ddp`), and ``torchft-nofail``, ``torchft-edgc-nofail``: 2. and
   3. below, all three without a failure, back to back — the step-time comparison, and the
   final-loss reference;
2. ``torchft``: torchft's own DDP, one replica group per host (torchrun per host, a lighthouse
   on host 0); host 1's worker is SIGKILLed at step ``--kill-at``, its torchrun restarts it and it
   heals from a peer;
3. ``torchft-edgc``: the same with `edgc.integrations.torchft`;
4. ``elastic-edgc``: what a user has today — ``edgc train --compressor edgc --auto-resume`` under
   torchrun's elastic restart (c10d rendezvous, ``--max-restarts 1``), checkpointing every
   ``--ckpt-every`` steps; the same worker is killed at the same step, every worker restarts from
   the last checkpoint.

Per run: median step time (the survivor's committed steps with every group in the quorum; rank
0's for the others), total wall
time (launch to exit), steps lost (steps whose work was thrown away: uncommitted steps of the
survivors, or the steps since the last checkpoint plus the one in flight), heal time (kill → the
killed worker's next training step), final validation loss, and for the torchft runs whether the
replicas ended bit-identical and who took part in which step (`edgc_probes.participation`).

The torchft runs' quorum settings are `QuorumSettings.for_groups(hosts, tolerated_failures)`: no
tolerated failure in the failure-free runs, one in those with a kill.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from edgc.integrations.torchft_quorum import QuorumSettings
from edgc_probes.participation import participation

from .netns import Network, _kill_group
from .run import PORT, BenchSettings, launch, train_args

LIGHTHOUSE_PORT, GROUP_PORT = 29510, 29600
WORKER_TIMEOUT_S = 60  # a collective or manager call of a torchft worker (its quorum settings scale with it)
RUNS = ("ddp-edgc", "torchft-nofail", "torchft-edgc-nofail", "torchft", "torchft-edgc", "elastic-edgc")


def worker_args(s: BenchSettings, run_dir: Path) -> list[str]:
    args = [
        "--out",
        str(run_dir),
        *s.model_args(),
        "--replicas",
        str(s.hosts),
        "--edgc",
        json.dumps(edgc_fields(s)),
    ]
    return args


def edgc_fields(s: BenchSettings) -> dict:
    return {**s.edgc, **({"r_max": s.r_max} if s.r_max is not None else {})}


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:  # a line being written
            pass
    return lines


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def run_ddp(net: Network, s: BenchSettings, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True)
    t0 = time.time()
    codes = launch(
        net,
        s,
        ["edgc_bench.torchft_train", "--mode", "ddp", "--compressor", "edgc", *worker_args(s, run_dir)],
        run_dir / "torchrun.log",
        s.run_timeout_s,
    )
    wall = time.time() - t0
    lines = read_lines(run_dir / "group0.jsonl")
    steps = [r for r in lines if r["kind"] == "step"]
    final = next((r for r in lines if r["kind"] == "final"), {})
    return {
        "codes": codes,
        "wall_s": wall,
        "step_s": statistics.median(r["step_s"] for r in steps) if steps else None,
        "steps_lost": 0,
        "heal_s": None,
        "val_loss": final.get("val_loss"),
        "identical": None,
    }


def start_lighthouse(net: Network, s: BenchSettings, tolerated_failures: int, log) -> tuple:
    """torchft's lighthouse on host 0 with `QuorumSettings.for_groups`: (its process, the settings,
    the workers' environment)."""
    lighthouse_bin = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    quorum = QuorumSettings.for_groups(s.hosts, tolerated_failures, timedelta(seconds=WORKER_TIMEOUT_S))
    lighthouse = net.popen(
        0,
        [lighthouse_bin, *quorum.lighthouse_args(), "--bind", f"[::]:{LIGHTHOUSE_PORT}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    time.sleep(0.5)
    env = {
        "OMP_NUM_THREADS": str(s.threads),
        "PYTHONUNBUFFERED": "1",
        "TORCHFT_LIGHTHOUSE": f"http://{net.addr(0)}:{LIGHTHOUSE_PORT}",
    }
    return lighthouse, quorum, env


def start_workers(
    net: Network, s: BenchSettings, env: dict, tolerated_failures: int, log, module: str, *args: str
) -> list:
    """One torchrun per host (one worker, one restart) running ``python -m module``, replica group =
    host, with the group's flags (``--group``, ``--advertise``, ``--timeout``, ``--tolerated-failures``)
    and ``args``; ``env`` from `start_lighthouse`."""
    processes = []
    for host in range(s.hosts):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc_per_node=1",
            "--max-restarts=1",
            f"--master_addr={net.addr(host)}",
            f"--master_port={GROUP_PORT}",
            "-m",
            module,
            "--group",
            str(host),
            "--advertise",
            net.addr(host),
            "--timeout",
            str(WORKER_TIMEOUT_S),
            "--tolerated-failures",
            str(tolerated_failures),
            *args,
        ]
        processes.append(
            net.popen(host, argv, env=env, timeout_s=s.run_timeout_s, stdout=log, stderr=subprocess.STDOUT)
        )
    return processes


def run_torchft(net: Network, s: BenchSettings, compressor: str, run_dir: Path, kill_at: int | None) -> dict:
    run_dir.mkdir(parents=True)
    log = open(run_dir / "torchrun.log", "w")
    # The failure-free passes let no quorum lack a group; those with a kill go on without one dead group.
    tolerated_failures = 0 if kill_at is None else 1
    lighthouse, quorum, env = start_lighthouse(net, s, tolerated_failures, log)
    t0 = time.time()
    processes = start_workers(
        net,
        s,
        env,
        tolerated_failures,
        log,
        "edgc_bench.torchft_train",
        "--mode",
        "torchft",
        "--compressor",
        compressor,
        *worker_args(s, run_dir),
    )
    victim = run_dir / "group1.jsonl"
    kill_t = None
    while kill_at is not None and kill_t is None and any(p.poll() is None for p in processes):
        lines = read_lines(victim)
        if any(r["kind"] == "step" and r["committed"] and r["step"] >= kill_at for r in lines):
            pid = [r for r in lines if r["kind"] == "start"][-1]["pid"]
            os.kill(pid, signal.SIGKILL)
            kill_t = time.time()
        time.sleep(0.05)
    codes = net.wait_all(processes)
    wall = time.time() - t0
    _kill_group(lighthouse)
    log.close()
    measures = measure_torchft(run_dir, s.hosts, s.steps, kill_t)
    (run_dir / "participation.json").write_text(
        json.dumps(
            {**measures["participation"], "identical": measures["identical"], "quorum": quorum.lighthouse_args()},
            indent=1,
        )
    )
    return {"codes": codes, "wall_s": wall, "killed": kill_t is not None, **measures}


def measure_torchft(run_dir: Path, hosts: int, steps: int, kill_t: float | None) -> dict:
    """Step time, steps lost, heal time, final loss and replica identity from the groups' step logs."""
    groups = [read_lines(run_dir / f"group{g}.jsonl") for g in range(hosts)]
    survivor = [r for r in groups[0] if r["kind"] == "step" and r["committed"]]
    full = [r["step_s"] for r in survivor if r["participants"] == hosts]  # alone, a group sends nothing
    finals = [next((r for r in g if r["kind"] == "final"), {}) for g in groups]
    restarted = [r for r in groups[1] if r["kind"] == "step" and r["committed"] and kill_t and r["t"] > kill_t]
    # Steps lost: optimizer steps a group executed beyond the run's length (uncommitted ones, and
    # those redone because nobody held the state any more), for the group that executed the most.
    lost = max(0, max(sum(r["kind"] == "step" for r in g) for g in groups) - steps)
    return {
        "step_s": statistics.median(full) if full else None,
        "steps_lost": lost,
        "heal_s": restarted[0]["t"] - kill_t if restarted else None,
        "val_loss": finals[0].get("val_loss"),
        "identical": len({f.get("checksum") for f in finals}) == 1 and "checksum" in finals[0],
        "participation": participation(groups, steps),
    }


def run_elastic(net: Network, s: BenchSettings, run_dir: Path, kill_at: int, ckpt_every: int) -> dict:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    args = train_args(s, "edgc", run_dir, s.r_max)
    args[args.index("--eval-every") + 1] = str(s.steps)  # one validation, at the end (as the torchft runs)
    args[args.index("--ckpt-every") + 1] = str(ckpt_every)  # this run resumes from its checkpoints
    args += ["--auto-resume"]
    env = {"OMP_NUM_THREADS": str(s.threads), "EDGC_DIST_TIMEOUT": "60", "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    processes = []
    for host in range(s.hosts):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={s.hosts}",
            "--nproc_per_node=1",
            "--max-restarts=1",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={net.addr(0)}:{PORT}",
            "--rdzv_id=bench",
            # A namespace's hostname is the machine's: name the host by its namespace address.
            f"--rdzv_conf=is_host={str(host == 0).lower()}",
            f"--local_addr={net.addr(host)}",
            "-m",
            "edgc_cli.main",
            "train",
            *args,
        ]
        processes.append(
            net.popen(host, argv, env=env, timeout_s=s.run_timeout_s, stdout=log, stderr=subprocess.STDOUT)
        )
        if host == 0:
            time.sleep(0.5)
    metrics = run_dir / "metrics.jsonl"
    kill_t, before, seen_step, back_t = None, set(), 0, None
    while any(p.poll() is None for p in processes) and (kill_t is None or back_t is None):
        texts = metrics.read_text().splitlines() if metrics.exists() else []
        train = [json.loads(t) for t in texts if '"kind": "train"' in t]
        if kill_t is None and train and train[-1]["step"] >= kill_at:
            workers = [
                p
                for p in descendants(processes[1].pid)
                if "edgc_cli.main train" in cmdline(p) and "torch.distributed.run" not in cmdline(p)
            ]
            if workers:
                seen_step, before = train[-1]["step"], set(texts)
                os.kill(workers[-1], signal.SIGKILL)
                kill_t = time.time()
        elif kill_t is not None and any('"kind": "train"' in t and t not in before for t in texts):
            back_t = time.time()
            resumed = min(json.loads(t)["step"] for t in texts if '"kind": "train"' in t and t not in before)
        time.sleep(0.05)
    codes = net.wait_all(processes)
    wall = time.time() - t0
    log.close()
    lines = read_lines(metrics)
    train = [r for r in lines if r["kind"] == "train"]
    evals = [r for r in lines if r["kind"] == "eval"]
    return {
        "codes": codes,
        "wall_s": wall,
        "step_s": statistics.median(r["step_time_s"] for r in train) if train else None,
        "steps_lost": seen_step + 1 - resumed if back_t else None,
        "heal_s": back_t - kill_t if back_t else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "killed": kill_t is not None,
        "identical": None,
    }


def run_torchft_bench(s: BenchSettings, out: Path, command: str, kill_at: int, ckpt_every: int, say=print) -> dict:
    from edgc_train.data import prepare_data

    from .torchft_table import markdown, participation_table, replica_warnings

    out.mkdir(parents=True, exist_ok=True)
    prepare_data(s.data, s.vocab_size, 0.1, s.max_chars, None, log=lambda *a, **k: None)  # once, before the hosts
    started = time.time()
    results: dict[str, dict] = {}
    with Network(s.hosts, s.rate_mbit) as net:
        say(
            f"network: {s.hosts} hosts, {'unlimited' if s.rate_mbit is None else f'{s.rate_mbit:g} Mbit/s'} per host "
            "link"
        )
        for name in RUNS:
            run_dir = out / "runs" / name
            say(f"[{time.time() - started:6.0f} s] {name}")
            if name == "ddp-edgc":
                result = run_ddp(net, s, run_dir)
            elif name == "elastic-edgc":
                result = run_elastic(net, s, run_dir, kill_at, ckpt_every)
            else:
                result = run_torchft(
                    net,
                    s,
                    "edgc" if name.startswith("torchft-edgc") else "none",
                    run_dir,
                    None if name.endswith("nofail") else kill_at,
                )
            result["load"] = os.getloadavg()[0]  # other work on the machine slows a run: shown beside it
            results[name] = result
            say(f"  {json.dumps(result)}")
            if "participation" in result:
                shown = {"settings": {}, "results": {name: result}}
                say("\n".join(["", participation_table(shown), *replica_warnings(shown), ""]))
    summary = {
        "settings": s.__dict__ | {"methods": list(RUNS)},
        "command": command,
        "kill_at": kill_at,
        "ckpt_every": ckpt_every,
        "results": results,
        "elapsed_s": time.time() - started,
        "load": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "bench.md").write_text(markdown(summary))
    return summary
