"""`edgc experiment diloco-pairs` — at the same bytes, should DiLoCo sync often at a low rank or rarely at a high one?

Two replicas (processes on gloo) train `edgc train`'s model with DiLoCo whose outer sync is EDGC's
(`edgc.integrations.diloco`, `diloco_train`). The arms, each at every seed (same data, same
initialisation; a seed's arms run one after the other in the same two processes):

* ``H<h>-r<r>`` for each (H, rank) of ``--pairs``: H inner steps per outer step, the pseudo-gradients
  compressed at a static rank r. Pairs with the same r/H send the same factor bytes over the run
  (the 1-D tensors, sent raw, add a little per outer step: the table gives the measured ratio).
  The first pair is the reference every arm is paired with (Δ = arm − reference, same seed).
* ``H<h>-r<r>-2it`` (at ``--iterations-at``): a second power iteration per outer step, twice the
  factor bytes. Against the same rank with one iteration: what the better factors buy; against
  twice the rank with one (``H<h>-r<2r>``, the same bytes): whether the bytes pay more as rank.
* ``H<h>-full`` (at the ``--iterations-at`` H): uncompressed DiLoCo, what the compression costs.
* ``step-r<r>`` (``--per-step-rank``, 0: none): per-step EDGC at that static rank (every step's
  gradients compressed, as the DDP hook does), the alternative when links allow a sync per step.

The summary gives per arm the mean validation loss, the bytes against the reference, the paired Δ
per seed with its mean and 95 % t-interval, the relative compression error ‖M − Ĝ‖/‖M‖ and the
error feedback's norm against the pseudo-gradient's at the last outer step. It is an experiment,
not a test: it prints its wall time.
"""

from __future__ import annotations

from statistics import mean

from . import common
from .common import fmt, fmt_interval, markdown_table, t_interval
from .diloco_train import OUTER_LR, OUTER_MOMENTUM, train_runs

NAME = "diloco-pairs"
HELP = "DiLoCo with EDGC's outer sync: (H, rank) pairs at the same bytes, 1 vs 2 power iterations, paired seeds"
DEFAULT_STEPS = 128
TINY_STEPS = 64
PAIRS = "8:2,16:4,32:8"
SHAPE = common.SMALL_SHAPE


def add_arguments(p) -> None:
    p.add_argument(
        "--pairs",
        default=PAIRS,
        metavar="H:R,...",
        help=f"(inner steps per outer step, rank) pairs; the first is the reference (default {PAIRS})",
    )
    p.add_argument(
        "--iterations-at",
        default="16:4",
        metavar="H:R",
        help="the pair that also runs 2 power iterations, twice its rank, and uncompressed ('' for none; default 8:2)",
    )
    p.add_argument(
        "--per-step-rank", type=int, default=1, metavar="R", help="per-step EDGC at this rank (0: none; default 1)"
    )
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds per arm (default 3)")
    p.add_argument(
        "--outer-lr", type=float, default=OUTER_LR, help=f"outer Nesterov SGD learning rate (default {OUTER_LR})"
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=OUTER_MOMENTUM,
        help=f"outer Nesterov momentum (default {OUTER_MOMENTUM})",
    )
    common.add_shape_arguments(p, SHAPE)


def parse_pairs(raw: str, flag: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in raw.split(",") if item.strip()]
    except ValueError:
        raise common.CLIError(f"{flag}: expected H:R pairs separated by commas, got {raw!r}") from None
    if not pairs or any(len(pair) != 2 or min(pair) < 1 for pair in pairs):
        raise common.CLIError(f"{flag}: expected H:R pairs of positive integers, got {raw!r}")
    return pairs  # type: ignore[return-value]


def validate(args, setting) -> None:
    pairs = parse_pairs(args.pairs, "--pairs")
    extra = parse_pairs(args.iterations_at, "--iterations-at") if args.iterations_at else []
    if not 2 <= args.seeds <= 10:
        raise common.CLIError(f"--seeds: must be in 2..10 (a paired interval needs two), got {args.seeds}")
    if args.per_step_rank < 0:
        raise common.CLIError(f"--per-step-rank: must be ≥ 0, got {args.per_step_rank}")
    for h, _ in pairs + extra:
        if setting.steps < 2 * h:
            raise common.CLIError(f"--steps: {setting.steps} gives H={h} fewer than 2 outer steps")
    if not 0 <= args.outer_momentum < 1 or args.outer_lr <= 0:
        raise common.CLIError("--outer-lr must be > 0 and --outer-momentum in [0, 1)")


def plan(args) -> dict[str, dict]:
    """{arm name: arm} in the order they run; the first is the reference."""
    outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    arms = {f"H{h}-r{r}": {"sync_every": h, "rank": r, **outer} for h, r in parse_pairs(args.pairs, "--pairs")}
    if args.iterations_at:
        ((h, r),) = parse_pairs(args.iterations_at, "--iterations-at")
        arms.setdefault(f"H{h}-r{r}", {"sync_every": h, "rank": r, **outer})
        arms[f"H{h}-r{r}-2it"] = {"sync_every": h, "rank": r, "power_iterations": 2, **outer}
        arms.setdefault(f"H{h}-r{2 * r}", {"sync_every": h, "rank": 2 * r, **outer})
        arms[f"H{h}-full"] = {"sync_every": h, "rank": None, **outer}
    if args.per_step_rank:
        arms[f"step-r{args.per_step_rank}"] = {"sync_every": 1, "rank": args.per_step_rank, "per_step": True}
    return arms


def run(args, out, setting, log=print) -> dict:
    from .pareto_runs import prepare_data_once

    arms = plan(args)
    seeds = [setting.seed + k for k in range(args.seeds)]
    shape = common.shape_from_args(args)
    log(f"  {len(arms)} arms × {len(seeds)} seeds: {', '.join(arms)}")
    prepare_data_once(setting)  # once, here: the runs then read the same cache
    (out / "runs").mkdir()
    results: dict = {name: {} for name in arms}
    for seed in seeds:
        for name, result in zip(arms, train_runs(setting, list(arms.values()), seed, shape=shape)):
            results[name][str(seed)] = result
            common.write_json(
                out / "runs" / f"{name}-s{seed}.json", {"arm": arms[name], "seed": seed, "result": result}
            )
            log(
                f"  seed {seed} {name}: val {result['val_loss']:.4f}, {result['bytes'] / 1e6:.2f} MB, "
                f"{result['wall_s']:.0f} s"
            )
    return summarise(out, setting, seeds, arms, results, shape)


def last(result: dict, key: str):
    values = [o.get(key) for o in result["outer"] if o.get(key) is not None]
    return values[-1] if values else None


def paired(results: dict, arm: str, reference: str, seeds: list[int]) -> dict:
    """Paired Δ val loss and bytes ratio of ``arm`` against ``reference``."""
    deltas = [results[arm][str(s)]["val_loss"] - results[reference][str(s)]["val_loss"] for s in seeds]
    m, low, high = t_interval(deltas)
    errors = [last(results[arm][str(s)], "relative_error") for s in seeds]
    feedback = [last(results[arm][str(s)], "error_feedback") for s in seeds]
    return {
        "deltas": deltas,
        "mean": m,
        "low": low,
        "high": high,
        "bytes_ratio": mean(results[arm][str(s)]["bytes"] / results[reference][str(s)]["bytes"] for s in seeds),
        "bytes": mean(results[arm][str(s)]["bytes"] for s in seeds),
        "val_loss": mean(results[arm][str(s)]["val_loss"] for s in seeds),
        "relative_error": mean(errors) if None not in errors else None,
        "error_feedback": mean(feedback) if None not in feedback else None,
    }


def summary_lines(arms, comparisons, header, headline, reference, seeds, setting, shape, table):
    """The experiment's summary.md up to its plot: the headline, the setting, the paired table and
    what it answers."""
    return [
        f"# Experiment `{NAME}`: at the same bytes, sync often at a low rank or rarely at a high one?",
        "",
        f"**Headline:** {'; '.join(headline)}.",
        "",
        f"Setting: {setting.describe(1)}, on each of 2 replicas (its own shard of the data); model {shape}; seeds "
        f"{seeds}; DiLoCo's outer "
        f"Nesterov SGD at lr {arms[reference]['outer_lr']:g}, momentum {arms[reference]['outer_momentum']:g}; "
        "a static rank from the first outer step; validation loss over the whole validation split. "
        f"Δ = arm − {reference} at the same seed (negative: better).",
        "",
        markdown_table(header, table),
        "",
        *(
            [
                markdown_table(
                    ["power iterations", "Δ per seed", "Δ mean [95 % CI]", "bytes ratio"],
                    [
                        [n, " ".join(f"{d:+.4f}" for d in p["deltas"]), fmt_interval(p), f"{p['bytes_ratio']:.2f}"]
                        for n, p in comparisons.items()
                    ],
                ),
                "",
            ]
            if comparisons
            else []
        ),
    ]


def summarise(out, setting, seeds, arms, results, shape) -> dict:
    names = list(arms)
    reference = names[0]
    stats = {name: paired(results, name, reference, seeds) for name in names}
    comparisons = {}
    iterated = [n for n in names if n.endswith("-2it")]
    for name in iterated:  # 2 iterations against 1 at the same rank, and against twice the rank (same bytes)
        base = name[: -len("-2it")]
        h, r = base[1:].split("-r")
        for other in (base, f"H{h}-r{2 * int(r)}"):
            comparisons[f"{name} − {other}"] = paired(results, name, other, seeds)
    table = [
        [
            name,
            f"{p['bytes'] / 1e6:.2f}",
            f"{p['bytes_ratio']:.2f}",
            f"{p['val_loss']:.4f}",
            "–" if name == reference else " ".join(f"{d:+.4f}" for d in p["deltas"]),
            "–" if name == reference else fmt_interval(p),
            fmt(p["relative_error"], ".3f"),
            fmt(p["error_feedback"], ".2f"),
        ]
        for name, p in stats.items()
    ]
    header = [
        "arm",
        "MB sent (one replica)",
        "bytes vs ref",
        "val loss (mean)",
        "Δ per seed",
        "Δ mean [95 % CI]",
        "‖M−Ĝ‖/‖M‖ (last)",
        "‖e‖/‖Δ‖ (last)",
    ]
    same_bytes = [
        n
        for n in names
        if n in arms
        and not n.endswith(("-2it", "-full"))
        and not n.startswith("step")
        and abs(stats[n]["bytes_ratio"] - 1) < 0.25
    ]
    best = min(same_bytes, key=lambda n: stats[n]["val_loss"])
    headline = [
        f"at the same bytes the best pair is {best} ({stats[best]['val_loss']:.4f}; "
        + ", ".join(f"{n} {fmt_interval(stats[n])}" for n in same_bytes if n != reference)
        + f" vs {reference})"
    ]
    headline += [f"{name}: {fmt_interval(p)}" for name, p in comparisons.items()]
    summary = summary_lines(arms, comparisons, header, headline, reference, seeds, setting, shape, table)
    plot = _plot(out, reference, stats)
    summary.append(f"Plot: `{plot.relative_to(out)}`")
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    common.write_json(
        out / "results.json",
        {
            "setting": vars(setting),
            "shape": shape,
            "seeds": seeds,
            "arms": arms,
            "runs": results,
            "paired": stats,
            "comparisons": comparisons,
        },
    )
    return {"headline": "; ".join(headline), "paired": stats, "comparisons": comparisons}


def _plot(out, reference: str, stats: dict):
    """Δ val loss against the reference with its 95 % interval, one row per arm, by bytes sent."""
    plt = common.pyplot()
    names = [n for n in stats if n != reference]
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(names) + 1.4))
    for y, name in enumerate(names):
        p = stats[name]
        ax.errorbar(
            [p["mean"]],
            [y],
            xerr=[[p["mean"] - p["low"]], [p["high"] - p["mean"]]],
            fmt="o",
            color="tab:red" if abs(p["bytes_ratio"] - 1) < 0.25 else "tab:grey",
        )
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(list(range(len(names))), [f"{n} ({stats[n]['bytes_ratio']:.2f}× bytes)" for n in names], fontsize=7)
    ax.set_xlabel(f"Δ val loss vs {reference} (95 % CI; red: the same bytes)", fontsize=8)
    return common.save(fig, out / "diloco.png")
