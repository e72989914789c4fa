"""`edgc experiment pareto` — at the same bytes, does a rank that moves beat the best fixed rank?

Does a moving rank beat static PowerSGD at the same bytes? For each budget b (a mean rank over the compressed steps:
the factor
bytes per step are linear in it) and each seed, one-process runs that share everything but the
rank schedule of their compressed steps (same data order, initialisation and uncompressed
warm-up, `pareto_train`):

* ``static``     static PowerSGD at rank b: the reference every other arm is paired with;
* ``budget-S``   the budget controller (`edgc.budget`, r_max = 2b) with signal S:
                 ``schedule`` (fixed front-loaded, the baseline), ``gradnorm``, ``entropy``, ``error``;
* ``hand-3``     hand-set 2b, b, b/2 for 2/9, 3/9, 4/9 of the compressed steps (the best schedule of a first prototype);
* ``hand-2``     hand-set 2b for 1/3, then b/2;
* ``alt-warm`` / ``alt-truncate`` (``--rank-change-cost``, at the middle budget): the rank
  alternates between b/2 and 3b/2 every window, with the warm-start-preserving rank change or with
  the old truncate-or-random one; ``alt3-warm`` / ``alt3-truncate`` alternate every 3 windows.
  Against static, an alternation pays for the mix of ranks (a low rank loses more than a high one
  gains) and for its changes; fast against slow, paired by seed, leaves the changes alone: their
  difference over the difference in changes is what one change costs, under each rule. The
  alternations also carry never-resized power iterations at both ranks on their own matrices
  (`change_cost`; the ``alt-`` ones start from the run's own Q, so they are the run had it never
  changed rank): what a change costs in compression error. Static rank b carries one independent
  twin: the level two distinct power iterations settle to on the same matrices.
* ``cold``       (``--rank-change-cost``) static PowerSGD at rank b with Q re-drawn every step: no
  warm start at all. A rank change discards at most part of the warm start for the few steps the
  power iteration needs to settle again, so what ``cold`` loses per step bounds what a change can.

Every arm spends b on average, so a paired Δ val loss (arm − static, same seed) says what the
schedule is worth. The summary gives, per budget and arm, the paired Δ per seed, its mean and
95 % t-interval, the bytes against static, and the share of the best hand-set gain it recovers.
It prints its wall time; it is an experiment, not a test.
"""

from __future__ import annotations

import json
import math
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from statistics import mean

from edgc.signals import signal_names

from . import change_cost, common
from .common import fmt, fmt_interval, markdown_table, t_interval
from .pareto_train import compressor_fields, train_run

NAME = "pareto"
HELP = "budget controller vs static PowerSGD at the same bytes: paired Δ val loss over seeds"
DEFAULT_STEPS = 400
TINY_STEPS = 30
BUDGETS = (2, 4, 8)
HAND_SET = ("hand-3", "hand-2")
RANK_CHANGES = ("warm", "truncate")
DERIVED = (
    "warm-vs-truncate",
    "per-change-",
    "per-step-",
    "compression-cost",
)  # entries of the paired stats that are not arms
SLOW_PERIOD = 3  # windows per rank in the slow alternation: 1/3 of the changes at the same bytes


def add_arguments(p) -> None:
    p.add_argument(
        "--budgets",
        default=",".join(map(str, BUDGETS)),
        metavar="B,B,...",
        help="mean ranks to compare at (default 2,4,8)",
    )
    p.add_argument("--seeds", type=int, default=5, metavar="N", help="seeds per arm (default 5)")
    p.add_argument(
        "--signals",
        default=",".join(signal_names()),
        metavar="S,S,...",
        help=f"budget controller signals to run (default {','.join(signal_names())})",
    )
    p.add_argument(
        "--hand-set",
        default=",".join(HAND_SET),
        metavar="H,H,...",
        help=f"hand-set schedules to run, '' for none (default {','.join(HAND_SET)})",
    )
    p.add_argument(
        "--rank-change-cost",
        action="store_true",
        help="also alternate the rank every window (warm vs truncate) at the middle budget",
    )
    p.add_argument(
        "--rank-change",
        choices=RANK_CHANGES,
        default=None,
        help="rank-change rule of every arm but the alternations, which set their own (default: EDGCConfig's)",
    )
    p.add_argument("--jobs", type=int, default=2, metavar="N", help="runs in parallel, one thread each (default 2)")
    p.add_argument(
        "--reuse",
        metavar="DIR",
        action="append",
        default=[],
        help="reuse finished runs of an earlier pareto folder (its runs/*.json) whose setting, seed "
        "and config are identical; repeatable",
    )
    p.add_argument(
        "--no-train",
        action="store_true",
        help="train nothing: summarise the --reuse runs; arms without every seed are listed as not run",
    )


def parse_list(raw: str, flag: str, cast, allowed=None) -> list:
    try:
        values = [cast(v.strip()) for v in raw.split(",") if v.strip()]
    except ValueError:
        raise common.CLIError(f"{flag}: expected a comma-separated list, got {raw!r}") from None
    if not values or (allowed is not None and any(v not in allowed for v in values)):
        raise common.CLIError(f"{flag}: expected some of {', '.join(map(str, allowed or ()))}, got {raw!r}")
    return values


def validate(args, setting) -> None:
    budgets = parse_list(args.budgets, "--budgets", int)
    if any(b < 2 for b in budgets):
        raise common.CLIError(
            f"--budgets: each must be ≥ 2 (the hand-set schedules go down to b/2), got {args.budgets}"
        )
    parse_list(args.signals, "--signals", str, signal_names())
    if args.hand_set:
        parse_list(args.hand_set, "--hand-set", str, HAND_SET)
    if not 2 <= args.seeds <= 10:
        raise common.CLIError(f"--seeds: must be in 2..10 (a paired interval needs two), got {args.seeds}")
    if args.jobs < 1:
        raise common.CLIError(f"--jobs: must be ≥ 1, got {args.jobs}")
    if setting.steps < 10:
        raise common.CLIError(f"--steps: must be ≥ 10 (a warm-up step and a window to compress), got {setting.steps}")


def compressed_steps(steps: int) -> int:
    """Steps after the shared 10 % warm-up (`base_fields`)."""
    return steps - math.floor(0.1 * steps)


def base_fields(steps: int) -> dict:
    """What every arm shares: the 10 % warm-up (no error test, so only the rank differs) and `edgc train`'s window."""
    from edgc_train.config import scaled_edgc_defaults

    scaled = scaled_edgc_defaults(steps)
    return {
        "total_steps": steps,
        "warmup_fraction": 0.1,
        "warmup_error_test": False,
        "window": scaled["window"],
        "iteration_sample_ratio": scaled["iteration_sample_ratio"],
    }


def arms(
    budget: int, steps: int, signals: list[str], hand_set: list[str], change_cost: bool, rank_change: str | None = None
) -> dict[str, dict]:
    """{arm name: EDGCConfig fields} at this budget; ``rank_change``: the rule of every arm that
    does not set its own (None: EDGCConfig's default)."""
    base = base_fields(steps)
    if rank_change is not None:
        base["rank_change"] = rank_change
    n = compressed_steps(steps)
    start = steps - n

    def schedule(*parts: tuple[float, int]) -> tuple:
        """Ranks for fractions of the compressed steps, as absolute (step, rank) entries."""
        entries, at = [], start
        for fraction, rank in parts:
            entries.append((at, rank))
            at += round(fraction * n)
        return tuple(entries)

    result = {"static": {**base, "r_max": budget, "r_min": budget, "adaptive": False}}
    for signal in signals:
        result[f"budget-{signal}"] = {
            **base,
            "r_max": 2 * budget,
            "rank_budget": float(budget),
            "budget_signal": signal,
        }
    half = max(1, budget // 2)
    if "hand-3" in hand_set:
        result["hand-3"] = {
            **base,
            "r_max": 2 * budget,
            "adaptive": False,
            "rank_schedule": schedule((2 / 9, 2 * budget), (3 / 9, budget), (4 / 9, half)),
        }
    if "hand-2" in hand_set:
        result["hand-2"] = {
            **base,
            "r_max": 2 * budget,
            "adaptive": False,
            "rank_schedule": schedule((1 / 3, 2 * budget), (2 / 3, half)),
        }
    if change_cost:
        low, high = budget // 2, budget + budget // 2
        for prefix, period in (("alt", 1), (f"alt{SLOW_PERIOD}", SLOW_PERIOD)):
            # the same ranks in the same share of the same windows; only the number of changes differs
            windows = range(start, steps, base["window"])
            entries = tuple(
                (s, high if (k // period) % 2 == 0 else low) for k, s in enumerate(windows) if k % period == 0
            )
            for mode in RANK_CHANGES:
                result[f"{prefix}-{mode}"] = {
                    **base,
                    "r_max": high,
                    "adaptive": False,
                    "rank_schedule": entries,
                    "rank_change": mode,
                    "shadow_ranks": (low, high),
                }
                if period == 1:  # the compression cost is read off these: twins that are the never-changed run
                    result[f"{prefix}-{mode}"]["shadow_twin"] = "run"
        result["cold"] = {**result["static"], "cold_start": True}  # an instrument field (`pareto_train`)
        # static's excess over an independent twin at its own rank: the level any two distinct iterations settle to
        result["static"] = {**result["static"], "shadow_ranks": (budget,)}
    return result


def _prepare_data(setting) -> None:
    from edgc_train.data import DataError, prepare_data

    cfg = setting.train_config()
    try:
        prepare_data(cfg.data, cfg.vocab_size, cfg.val_fraction, cfg.max_chars, cfg.cache_dir, log=lambda _: None)
    except DataError as exc:
        raise common.CLIError(str(exc)) from None


def resolved_config(fields: dict) -> dict:
    """An arm's whole compressor config: its fields over `EDGCConfig`'s defaults (and the
    instrument's own ``cold_start``). Run keys hold this, so a changed default is a different run."""
    from edgc import EDGCConfig

    config = EDGCConfig(**compressor_fields(fields)).to_dict()
    if fields.get("cold_start"):
        config["cold_start"] = True
    if fields.get("shadow_ranks"):
        config["shadow_ranks"] = list(fields["shadow_ranks"])
    if fields.get("shadow_twin"):
        config["shadow_twin"] = fields["shadow_twin"]
    return config


def _run_key(setting: dict, config: dict, seed: int) -> str:
    """What makes two runs the same run: the training setting, the seed and the resolved config."""
    return json.dumps({"setting": setting, "seed": seed, "config": config}, sort_keys=True, default=list)


def _reusable_runs(folders: list[str], log=print) -> dict[str, dict]:
    """{run key: record} of the finished runs in earlier pareto folders (runs/*.json, or a results.json).

    Records whose key holds only an arm's explicit fields (written before keys held the resolved
    config) are not reused: under which defaults they ran is not recorded."""
    found, older = {}, 0
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise common.CLIError(f"--reuse: {folder} is not a folder")
        for path in sorted(folder.glob("runs/*.json")):
            record = json.loads(path.read_text())
            if "config" not in json.loads(record["key"]):
                older += 1
                continue
            found[record["key"]] = record
        summary = folder / "results.json"
        if summary.is_file():  # a finished experiment: the keys follow from its setting, configs and seeds
            data = json.loads(summary.read_text())
            if "configs" not in data:
                older += sum(len(by_seed) for runs_b in data["runs"].values() for by_seed in runs_b.values())
                continue
            for b, configs_b in data["configs"].items():
                for name, config in configs_b.items():
                    for seed, result in data["runs"][b][name].items():
                        key = _run_key(data["setting"], config, int(seed))
                        found.setdefault(key, {"key": key, "result": result})
    if older:
        log(f"  --reuse: {older} records from before run keys held the whole config are not reused")
    return found


class _InProcess:
    """``--jobs 1``: the runs one after the other in this process (no worker start-up)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def submit(fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future


def _executor(jobs: int):
    if jobs == 1:
        return _InProcess()
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def _run_one(job):
    setting, fields, seed = job
    return train_run(setting, fields, seed)


def run(args, out, setting, log=print) -> dict:
    budgets = parse_list(args.budgets, "--budgets", int)
    signals = parse_list(args.signals, "--signals", str, signal_names())
    seeds = [setting.seed + k for k in range(args.seeds)]
    middle = budgets[len(budgets) // 2]
    hand_set = parse_list(args.hand_set, "--hand-set", str, HAND_SET) if args.hand_set else []
    plan = {
        b: arms(b, setting.steps, signals, hand_set, args.rank_change_cost and b == middle, args.rank_change)
        for b in budgets
    }
    jobs = [(b, name, seed) for b in budgets for name in plan[b] for seed in seeds]
    log(
        f"  {len(jobs)} runs ({args.jobs} at a time): budgets {budgets}, arms per budget "
        f"{[len(plan[b]) for b in budgets]}, seeds {seeds}"
    )
    _prepare_data(setting)  # once, here: the runs then read the same cache
    results: dict = {str(b): {name: {} for name in plan[b]} for b in budgets}
    (out / "runs").mkdir()
    reusable = _reusable_runs(args.reuse, log)
    todo = []
    keys = {(b, name, seed): _run_key(vars(setting), resolved_config(plan[b][name]), seed) for b, name, seed in jobs}
    for b, name, seed in jobs:
        key = keys[b, name, seed]
        if key in reusable:
            results[str(b)][name][str(seed)] = reusable[key]["result"]
            common.write_json(out / "runs" / f"b{b}-{name}-s{seed}.json", reusable[key])
        else:
            todo.append((b, name, seed))
    log(f"  {len(jobs) - len(todo)} reused from {', '.join(args.reuse) or '-'}; {len(todo)} to train")
    skipped = sorted({(b, name) for b, name, _ in todo}) if args.no_train else []
    if args.no_train:
        for b, name, _ in todo:  # an arm is compared over all seeds or not at all
            plan[b].pop(name, None)
            results[str(b)].pop(name, None)
        todo = []
        if any("static" not in plan[b] for b in budgets):
            raise common.CLIError(
                "--no-train: the reused runs lack static at some budget (every arm is paired with it)"
            )
    with _executor(args.jobs) as pool:
        futures = {pool.submit(_run_one, (setting, plan[b][name], seed)): (b, name, seed) for b, name, seed in todo}
        for done, future in enumerate(futures, 1):
            b, name, seed = futures[future]
            run_result = future.result()
            results[str(b)][name][str(seed)] = run_result
            record = {"key": keys[b, name, seed], "result": run_result}
            common.write_json(out / "runs" / f"b{b}-{name}-s{seed}.json", record)  # kept even if a later run fails
            log(
                f"  [{done}/{len(todo)}] b={b} {name} seed {seed}: val {run_result['val_loss']:.4f}, "
                f"mean rank {fmt(run_result['mean_rank'], '.2f')}, {run_result['wall_s']:.0f} s"
            )
    return summarise(out, setting, budgets, seeds, plan, results, skipped)


def paired(results: dict, arm: str, seeds: list[int]) -> dict:
    """Paired Δ val loss and bytes ratio of ``arm`` against static at one budget."""
    deltas = [results[arm][str(s)]["val_loss"] - results["static"][str(s)]["val_loss"] for s in seeds]
    ratio = mean(results[arm][str(s)]["bytes"] / results["static"][str(s)]["bytes"] for s in seeds)
    m, low, high = t_interval(deltas)
    return {
        "deltas": deltas,
        "mean": m,
        "low": low,
        "high": high,
        "bytes_ratio": ratio,
        "mean_rank": mean(results[arm][str(s)]["mean_rank"] or 0.0 for s in seeds),
        "rank_changes": mean(results[arm][str(s)]["rank_changes"] for s in seeds),
        "val_loss": mean(results[arm][str(s)]["val_loss"] for s in seeds),
    }


def summarise(out, setting, budgets, seeds, plan, results, skipped=()) -> dict:
    table, headline = [], []
    stats: dict = {}
    for b in budgets:
        arms_b = {name: paired(results[str(b)], name, seeds) for name in plan[b]}
        hand = [arms_b[n]["mean"] for n in ("hand-3", "hand-2") if n in arms_b]
        best_hand = min(hand) if hand else None
        for name, p in arms_b.items():
            p["recovered"] = (
                p["mean"] / best_hand
                if best_hand is not None and best_hand < 0 and name.startswith("budget-")
                else None
            )
            p["beats_static"] = name != "static" and p["high"] < 0
        stats[str(b)] = arms_b
        for name, p in arms_b.items():
            table.append(
                [
                    b,
                    name,
                    f"{p['mean_rank']:.2f}",
                    f"{p['bytes_ratio']:.3f}",
                    f"{p['val_loss']:.4f}",
                    "–" if name == "static" else " ".join(f"{d:+.4f}" for d in p["deltas"]),
                    "–" if name == "static" else f"{p['mean']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]",
                    fmt(p["recovered"], ".0%") if p["recovered"] is not None else "–",
                    f"{p['rank_changes']:.1f}",
                ]
            )
        default = arms_b.get("budget-schedule")
        if default is not None:
            headline.append(
                f"b={b}: budget controller {default['mean']:+.4f} "
                f"[{default['low']:+.4f}, {default['high']:+.4f}] vs static"
                + (
                    f" ({default['recovered']:.0%} of the best hand-set gain)"
                    if default["recovered"] is not None
                    else ""
                )
            )
    change_cost = []
    for b in budgets:
        if {"alt-warm", "alt-truncate"} <= set(plan[b]):
            change_cost.append(_change_cost(b, results[str(b)], stats[str(b)], seeds, compressed_steps(setting.steps)))
    header = [
        "budget",
        "arm",
        "mean rank",
        "bytes vs static",
        "val loss (mean)",
        "Δ per seed",
        "Δ mean [95 % CI]",
        "of best hand-set gain",
        "rank changes",
    ]
    plot = _plot(out, budgets, stats)
    summary = [
        f"# Experiment `{NAME}`: does a moving rank beat static PowerSGD at the same bytes?",
        "",
        f"**Headline:** {'; '.join(headline) or 'no budget-controller arm ran'}.",
        "",
        f"Setting: {setting.describe(1)}; seeds {seeds}; every arm shares data order, initialisation and the "
        "10 % uncompressed warm-up; validation loss over the whole validation split; bytes counted after the warm-up. "
        "Δ = arm − static at the same seed (negative: the arm learns more from the same bytes).",
        "",
        markdown_table(header, table),
        "",
        *(line for text in change_cost for line in (text, "")),
        *(
            [f"Not run (no finished runs for every seed): {', '.join(f'{n} at b={b}' for b, n in skipped)}.", ""]
            if skipped
            else []
        ),
        f"Plot: `{plot.relative_to(out)}`",
    ]
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    common.write_json(
        out / "results.json",
        {
            "setting": vars(setting),
            "seeds": seeds,
            "budgets": budgets,
            "arms": {str(b): plan[b] for b in budgets},
            "configs": {str(b): {name: resolved_config(fields) for name, fields in plan[b].items()} for b in budgets},
            "runs": results,
            "paired": stats,
        },
    )
    return {"headline": "; ".join(headline), "paired": stats}


def _change_cost(b: int, runs_b: dict, stats_b: dict, seeds: list[int], compressed_steps: int) -> str:
    """The alternation arms' paragraph; adds 'warm-vs-truncate', 'per-change-<rule>' and
    'per-step-cold' to ``stats_b``."""
    fast = {mode: stats_b[f"alt-{mode}"] for mode in RANK_CHANGES}
    text = (
        f"**Cost of changing the rank** (b={b}: the rank alternates {b // 2} ↔ {b + b // 2} every window, "
        f"{fast['warm']['rank_changes']:.0f} changes, against static {b}): warm start kept "
        f"{fmt_interval(fast['warm'])}, truncate-or-random {fmt_interval(fast['truncate'])}"
    )
    # warm − truncate, paired by seed: what keeping the warm start saves per run
    diff = stats_b["warm-vs-truncate"] = paired(
        {"static": runs_b["alt-truncate"], "arm": runs_b["alt-warm"]}, "arm", seeds
    )
    text += f"; warm − truncate {fmt_interval(diff)} (bytes {diff['bytes_ratio']:.3f}×: the residual all-reduce)."
    if "cold" in stats_b:
        cold = stats_b["cold"]
        per = stats_b["per-step-cold"] = {k: cold[k] / compressed_steps for k in ("mean", "low", "high")}
        text += (
            f" **What a warm start is worth:** re-drawing Q every step (static {b}, no warm start) costs "
            f"{fmt_interval(cold)} against static, {fmt_interval(per, '+.5f')} per compressed step; a change "
            "discards at most part of the warm start for the few steps the power iteration needs to settle, "
            "so this bounds what one change can cost."
        )
    text += change_cost.paragraph(
        b, {mode: runs_b[f"alt-{mode}"] for mode in RANK_CHANGES}, runs_b["static"], stats_b, seeds
    )
    slow = f"alt{SLOW_PERIOD}"
    if not all(f"{slow}-{mode}" in runs_b for mode in RANK_CHANGES):
        return text
    parts = []
    for mode in RANK_CHANGES:  # fast − slow at the same ranks and bytes, per extra change
        d = paired({"static": runs_b[f"{slow}-{mode}"], "arm": runs_b[f"alt-{mode}"]}, "arm", seeds)
        extra = fast[mode]["rank_changes"] - stats_b[f"{slow}-{mode}"]["rank_changes"]
        per = {k: d[k] / extra for k in ("mean", "low", "high")}
        stats_b[f"per-change-{mode}"] = {**per, "fast_minus_slow": d, "extra_changes": extra}
        parts.append(f"{mode} {fmt_interval(per, '+.5f')}")
    text += (
        f" Per change (every window against every {SLOW_PERIOD} windows at the same ranks and bytes, "
        f"paired by seed, over the {stats_b['per-change-warm']['extra_changes']:.0f} extra changes): "
        + ", ".join(parts)
        + "."
    )
    return text


def _plot(out, budgets, stats):
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.6), squeeze=False)
    for ax, b in zip(axes[0], budgets):
        names = [n for n in stats[str(b)] if n != "static" and not n.startswith(DERIVED)]  # arms, each against static
        ys = range(len(names))
        for y, name in zip(ys, names):
            p = stats[str(b)][name]
            color = (
                "tab:red"
                if name.startswith("budget")
                else ("tab:grey" if name.startswith(("alt", "cold")) else "tab:blue")
            )
            ax.errorbar([p["mean"]], [y], xerr=[[p["mean"] - p["low"]], [p["high"] - p["mean"]]], fmt="o", color=color)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(list(ys), names, fontsize=7)
        ax.set_xlabel("Δ val loss vs static (95 % CI)", fontsize=8)
        ax.set_title(f"budget: mean rank {b}", fontsize=9)
    return common.save(fig, out / "pareto.png")
