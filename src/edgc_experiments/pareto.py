"""`edgc experiment pareto` — at the same bytes, does a rank that moves beat the best fixed rank?

Does a moving rank beat static PowerSGD at the same bytes? For each budget b (a mean rank over the compressed steps:
the factor
bytes per step are linear in it) and each seed, one-process runs that share everything but the
rank schedule of their compressed steps (same data order, initialisation and uncompressed
warm-up, `pareto_train`):

* ``static``     static PowerSGD at rank b: the reference every other arm is paired with;
* ``budget-S``   the budget controller (`edgc.control.budget`, r_max = 2b) with signal S:
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
Its parts: pareto_arms.py (the arms), pareto_runs.py (the runs, reused by key), pareto_summary.py
(the paired differences and the summary), pareto_train.py (one run).
"""

from __future__ import annotations

from edgc.policies.signals import signal_names

from . import common
from .common import fmt
from .pareto_arms import BUDGETS, HAND_SET, RANK_CHANGES, arms
from .pareto_runs import executor, prepare_data_once, resolved_config, reusable_runs, run_key, run_one
from .pareto_summary import summarise

NAME = "pareto"
HELP = "budget controller vs static PowerSGD at the same bytes: paired Δ val loss over seeds"
DEFAULT_STEPS = 400
TINY_STEPS = 30


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
    prepare_data_once(setting)  # once, here: the runs then read the same cache
    results: dict = {str(b): {name: {} for name in plan[b]} for b in budgets}
    (out / "runs").mkdir()
    reusable = reusable_runs(args.reuse, log)
    todo = []
    keys = {(b, name, seed): run_key(vars(setting), resolved_config(plan[b][name]), seed) for b, name, seed in jobs}
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
    with executor(args.jobs) as pool:
        futures = {pool.submit(run_one, (setting, plan[b][name], seed)): (b, name, seed) for b, name, seed in todo}
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
