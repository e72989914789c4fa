"""`edgc bench --diloco`: DDP, DDP + EDGC, DiLoCo, DiLoCo + EDGC and Streaming DiLoCo on emulated hosts.

One network per link rate (``--rates``, e.g. 100 and 10 Mbit/s per host), ``--hosts`` hosts, one
torchft replica group per host (a torchrun per host, a lighthouse on host 0, the quorum settings of
`QuorumSettings.for_groups`: no tolerated failure in the failure-free runs, one in the kill pass).
At each link the methods run ``--rounds`` times, in reverse order on even rounds (a steady drift of
the shared machine's speed then cancels in the rounds' mean), each with the same training
(edgc train's model, data, AdamW and schedule, ``--steps`` inner steps; diloco_train.py):

1. ``ddp``: torchft's DDP, uncompressed, a sync every step;
2. ``ddp-edgc``: torchft + EDGC, a sync every step;
3. ``diloco``: torchft's own DiLoCo, ``sync_every`` H, its uncompressed all-reduce (``should_quantize=False``);
4. ``diloco-edgc``: `edgc.integrations.torchft.DiLoCo`, the same H;
5. ``streaming-…``: Streaming DiLoCo (``--fragments`` fragments, one syncing every H / fragments
   inner steps) of whichever of 3 and 4 reached the other's final loss sooner in round 1 at this link;

or those of ``--methods``, where ``diloco-edgc@SPEC`` is DiLoCo + EDGC with the outer sync SPEC
instead of ``--outer-sync``'s (two outer syncs side by side at one link, against the same torchft run).

A run that passes ``--time-budget`` seconds of training is stopped at the next sync (a method
that cannot finish in time at a slow link reports the steps it took). After the rounds, the kill
pass at the last link: DiLoCo + EDGC again, host 1's worker SIGKILLed while its outer step
``--kill-at`` is in flight; torchrun restarts it and it heals from a peer.

Per run (diloco_table.py reads the logs): group 0's validation loss on its training clock every
few inner steps, bytes per sync (what one replica put into the all-reduce, and what left its
network interface), participation per sync, the digest of every group's shared model at the end.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .netns import Network, _kill_group
from .run import BenchSettings
from .torchft_bench import read_lines, start_lighthouse, start_workers

METHODS = ("ddp", "ddp-edgc", "diloco", "diloco-edgc", "streaming")
# DiLoCo + EDGC: rank 16 (1/12 of the pseudo-gradient's bytes on the tiny preset) at every outer
# step: the byte budget's mean rank is its ceiling. Six outer steps leave the budget controller no
# room: spent early (ranks 16 → 2, mean 8; or 32 → 2, mean 16) the last outer steps at rank 2 cost
# 1.7 % (1.1 %) of validation loss against uncompressed DiLoCo, a constant 16 cost 0.7 % (pilots at the
# default two sequences per step). No warm-up: an uncompressed outer step is a whole model.
EDGC_DILOCO = {
    "r_max": 16,
    "rank_budget": 16,
    "window": 2,
    "warmup_fraction": 0.0,
    "min_warmup_steps": 0,
    "warmup_error_test": False,
}
# DDP + EDGC: the same ranks; the 2 uncompressed steps DDP needs to rebuild its buckets and no
# fraction-based warm-up (10 % of a short run would be 6 more uncompressed steps).
EDGC_DDP = {"r_max": 16, "rank_budget": 16, "window": 6, "warmup_fraction": 0.0, "warmup_error_test": False}


@dataclass(frozen=True)
class DilocoOptions:
    rates: tuple[float, ...] = (100.0, 20.0)
    sync_every: int = 10
    fragments: int = 2
    eval_every: int = 5
    kill_at: int | None = None  # the outer step killed in flight; None: no kill pass
    time_budget_s: float = 150.0
    edgc: tuple = ()  # extra EDGCConfig fields for both EDGC methods, as (key, value) pairs
    outer_sync: str = "quant3-2s"  # the DiLoCo methods' outer sync: a registered sync method, or "edgc" (PowerSGD)
    methods: tuple[str, ...] = METHODS  # those run at each link; "diloco-edgc@SPEC": DiLoCo + EDGC with SPEC
    scaling: tuple[int, ...] = ()  # host counts of the scaling pass (diloco_scaling.py) instead of the rounds
    scaling_syncs: tuple[str, ...] = ()  # … and the outer syncs it runs beside torchft's DiLoCo
    delays_ms: tuple[float, ...] = (0.0,)  # … once per one-way delay added between hosts (edgc_bench.delay_line)

    def unit(self, method: str) -> int:
        """Inner steps between two syncs of ``method`` (a stop falls on one, and on an eval step)."""
        sync = (
            1
            if method.startswith("ddp")
            else self.sync_every // (self.fragments if method.startswith("streaming") else 1)
        )
        return math.lcm(sync, self.eval_every)


def worker_args(s: BenchSettings, o: DilocoOptions, method: str, run_dir: Path) -> list[str]:
    base, _, outer_sync = method.removeprefix("streaming-").partition("@")
    edgc = {**(EDGC_DDP if base == "ddp-edgc" else EDGC_DILOCO), **dict(o.edgc)}
    args = [
        "--out",
        str(run_dir),
        "--method",
        base,
        "--sync-every",
        str(o.sync_every),
        "--fragments",
        str(o.fragments if method.startswith("streaming") else 1),
        "--eval-every",
        str(o.eval_every),
        *s.model_args(),
        "--replicas",
        str(s.hosts),
        "--edgc",
        json.dumps(edgc),
        "--outer-sync",
        outer_sync or o.outer_sync,
    ]
    return args


def tx_bytes(net: Network) -> list[int]:
    """Bytes each host's interface has sent so far."""
    counts = []
    for host in range(net.hosts):
        done = subprocess.run(
            ["ip", "netns", "exec", net.ns(host), "cat", f"/sys/class/net/{net.ifname}/statistics/tx_bytes"],
            capture_output=True,
            text=True,
            check=False,
        )
        counts.append(int(done.stdout.strip() or 0))
    return counts


def run_method(
    net: Network, s: BenchSettings, o: DilocoOptions, method: str, run_dir: Path, kill_at: int | None = None
) -> dict:
    """One run of ``method`` on the network; with ``kill_at``, host 1's worker dies in that outer step."""
    run_dir.mkdir(parents=True)
    log = open(run_dir / "torchrun.log", "w")
    tolerated = 0 if kill_at is None else 1
    lighthouse, _, env = start_lighthouse(net, s, tolerated, log)
    sent_before, t0 = tx_bytes(net), time.time()
    processes = start_workers(
        net, s, env, tolerated, log, "edgc_bench.diloco_train", *worker_args(s, o, method, run_dir)
    )
    events = watch(processes, run_dir, s, o, method, kill_at)
    codes = net.wait_all(processes)
    wall = time.time() - t0
    sent = [after - before for after, before in zip(tx_bytes(net), sent_before)]
    _kill_group(lighthouse)
    log.close()
    return {"method": method, "codes": codes, "wall_s": wall, "tx_bytes": sent, **events}


def watch(processes, run_dir: Path, s: BenchSettings, o: DilocoOptions, method: str, kill_at: int | None) -> dict:
    """While the run goes: stop it at the time budget (stop.json), kill host 1 in outer step ``kill_at``."""
    stop_at, kill_t = None, None
    while any(p.poll() is None for p in processes):
        first = read_lines(run_dir / "group0.jsonl")
        steps = [r for r in first if r["kind"] == "step"]
        if stop_at is None and steps and steps[-1]["t"] - steps[0]["t"] + steps[0]["step_s"] > o.time_budget_s:
            unit = o.unit(method)
            latest = max(
                r["step"]
                for g in range(s.hosts)
                for r in read_lines(run_dir / f"group{g}.jsonl")
                if r["kind"] == "step"
            )
            # a step no group has begun yet (groups are at most one sync apart), on a sync and an eval step
            stop_at = -(-(latest + 4) // unit) * unit
            if stop_at < s.steps:
                (run_dir / "stop.tmp").write_text(json.dumps({"steps": stop_at}))
                os.replace(run_dir / "stop.tmp", run_dir / "stop.json")
            else:
                stop_at = s.steps
        if kill_at is not None and kill_t is None:
            victim = read_lines(run_dir / "group1.jsonl")
            if any(r["kind"] == "sync_start" and r["outer"] >= kill_at for r in victim):
                time.sleep(0.5)  # into the outer step's quorum and all-reduce
                os.kill([r for r in victim if r["kind"] == "start"][-1]["pid"], signal.SIGKILL)
                kill_t = time.time()
        time.sleep(0.1)
    return {"stopped_at": stop_at if stop_at is not None and stop_at < s.steps else None, "kill_t": kill_t}


def better_of(results: list[dict]) -> str:
    """Of ``diloco`` and ``diloco-edgc`` (round 1 at this link): the one that reached the higher of
    their final losses sooner on its training clock; the streaming run is of that one."""
    from .diloco_table import final_loss, time_to

    runs = {r["method"]: r for r in results if r["method"] in ("diloco", "diloco-edgc")}
    if len(runs) < 2:
        return "diloco-edgc"
    target = max(final_loss(r) for r in runs.values())
    times = {name: time_to(r, target) for name, r in runs.items()}
    return min(times, key=lambda name: (times[name] is None, times[name] or 0.0))


def run_link(net: Network, s: BenchSettings, o: DilocoOptions, out: Path, say) -> list[dict]:
    """Every round of the methods at one link; each result carries its round and measures."""
    from .diloco_table import measure

    results: list[dict] = []
    streaming = None
    for round_index in range(1, s.rounds + 1):
        order = list(o.methods) if round_index % 2 else list(reversed(o.methods))
        for method in order:
            if method == "streaming":
                streaming = streaming or "streaming-" + better_of(results)
                method = streaming
            run_dir = out / f"round-{round_index}" / method
            say(f"  round {round_index}: {method}")
            result = run_method(net, s, o, method, run_dir)
            result.update(round=round_index, **measure(run_dir, s.hosts, s.steps, None))
            result["load"] = os.getloadavg()[0]
            say("    " + summary_line(result))
            results.append(result)
    return results


def summary_line(r: dict) -> str:
    loss = r.get("final_loss")
    return (
        f"exit {r['codes']}, wall {r['wall_s']:.0f} s, clock {r.get('clock_s') or 0:.0f} s, steps "
        f"{r.get('steps_done')}, "
        f"final val loss {'–' if loss is None else f'{loss:.4f}'}, identical {r.get('identical')}"
    )


def run_diloco_bench(s: BenchSettings, o: DilocoOptions, out: Path, command: str, say=print) -> dict:
    from edgc_train.data import prepare_data

    from .diloco_table import markdown, measure

    out.mkdir(parents=True, exist_ok=True)
    prepare_data(s.data, s.vocab_size, 0.1, s.max_chars, None, log=lambda *a, **k: None)  # once, before the hosts
    started, links = time.time(), []
    for rate in o.rates:
        say(f"[{time.time() - started:6.0f} s] {s.hosts} hosts at {rate:g} Mbit/s per host link")
        link_dir = out / f"{rate:g}mbit"
        with Network(s.hosts, rate) as net:
            results = run_link(net, s, o, link_dir, say)
            kill = None
            if o.kill_at is not None and rate == o.rates[-1]:
                say(f"[{time.time() - started:6.0f} s] kill pass: diloco-edgc, host 1 killed in outer step {o.kill_at}")
                run_dir = link_dir / "kill" / "diloco-edgc"
                kill = run_method(net, s, o, "diloco-edgc", run_dir, kill_at=o.kill_at)
                kill.update(measure(run_dir, s.hosts, s.steps, kill["kill_t"]), load=os.getloadavg()[0])
                say("    " + summary_line(kill))
        links.append({"rate_mbit": rate, "results": results, "kill": kill})
    summary = {
        "settings": s.__dict__ | {"methods": list(METHODS)},
        "options": o.__dict__,
        "command": command,
        "links": links,
        "elapsed_s": time.time() - started,
        "load": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "bench.md").write_text(markdown(summary))
    return summary
