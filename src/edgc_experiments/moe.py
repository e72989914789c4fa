"""`edgc experiment moe` — a mixture of experts, EP × DP: EDGC on both groups, and experts' ranks routed by tokens.

`edgc train --moe-experts E --ep P --nproc N` (moe_runner.py): the GPT's every MLP a mixture of E experts
split over P expert-parallel ranks, the dense parameters averaged over all N ranks, each expert over its
N/P expert-data-parallel replicas, on gloo. The arms, each at every seed (same data, same initialisation):

* ``uncompressed``: our uncompressed all-reduce of both groups (the reference of every ratio);
* ``edgc``: EDGC on both groups, each state its own rank decisions over its own group (r_max 8, r_min 2
  given: on loopback the profiled ceiling says compression never pays; the 10 % warm-up, no error test);
* ``one-rank``: PowerSGD at ``--rank`` for every matrix, each expert its own matrix (``rank_split=uniform``);
* ``routed``: the same rank budget shared among each layer's experts by the tokens routed to them in
  the last window (``rank_split=tokens``, `edgc.policies.rank_split`): the same bytes by construction (measured).
  Both PowerSGD arms take EDGC's scaled window (steps/20, at least 10): the split follows the tokens
  about 20 times a run.

Reported: each group's bytes over the whole run against raw (warm-up included), the final validation
loss, and the paired Δ per seed with its mean and 95 % t-interval: EDGC against uncompressed (in % of
the uncompressed loss), routed against one rank (nats), whichever way they fall. ``--arms`` runs a
subset (the paper's open question, routed against one rank at many experts, needs those two alone);
``--aux-weight`` sets the load-balancing loss's weight (0: routing as skewed as the router makes it), and
the summary gives each arm's expert load: the share of a layer's routed tokens its busiest expert got,
and its experts that got none, over the run (the load a routed split has to work with).
"""

from __future__ import annotations

from statistics import mean

from . import common
from .common import fmt_interval, markdown_table, t_interval

NAME = "moe"
HELP = "mixture of experts, EP 2 × DP 2: EDGC on the dense and expert groups, experts' ranks by tokens, paired seeds"
DEFAULT_STEPS = 300
TINY_STEPS = 6
EDGC_FIELDS = {"r_max": 8, "r_min": 2, "warmup_error_test": "false"}
ARMS = ("uncompressed", "edgc", "one-rank", "routed")


def add_arguments(p) -> None:
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds per arm (default 3; at least 3)")
    p.add_argument("--experts", type=int, default=4, metavar="E", help="experts per MoE layer (default 4)")
    p.add_argument("--top-k", type=int, default=2, metavar="K", help="experts per token (default 2)")
    p.add_argument("--ep", type=int, default=2, metavar="P", help="expert-parallel ranks (default 2)")
    p.add_argument("--nproc", type=int, default=4, metavar="N", help="processes, EP × DP (default 4)")
    p.add_argument("--rank", type=int, default=4, metavar="R", help="rank of one-rank and routed (default 4)")
    p.add_argument(
        "--aux-weight", type=float, default=None, metavar="W",
        help="weight of the load-balancing loss (default: edgc train's); 0 leaves the routing skewed",
    )  # fmt: skip
    p.add_argument(
        "--arms", default=",".join(ARMS), metavar="A,B",
        help=f"arms to run, of {', '.join(ARMS)} (default all; the paired intervals need their pairs)",
    )  # fmt: skip
    common.add_shape_arguments(p, common.SMALL_SHAPE)


def validate(args, setting) -> None:
    if args.seeds < (1 if args.tiny else 3):
        raise common.CLIError(f"--seeds: a paired interval needs at least 3 seeds, got {args.seeds}")
    if args.nproc % args.ep or args.nproc < (1 if args.tiny else 2) * args.ep:  # one replica: a smoke run only
        raise common.CLIError(f"--nproc {args.nproc}: must be a multiple of --ep {args.ep}, with 2 replicas or more")
    if args.experts % args.ep or not 1 <= args.top_k <= args.experts:
        raise common.CLIError(f"--experts {args.experts}: must be a multiple of --ep with 1 ≤ --top-k ≤ it")
    if args.rank < 1:
        raise common.CLIError(f"--rank: must be ≥ 1, got {args.rank}")
    arms = args.arms.split(",")
    if not arms or any(arm not in ARMS for arm in arms) or len(set(arms)) < len(arms):
        raise common.CLIError(f"--arms {args.arms}: a comma-separated list of distinct arms of {', '.join(ARMS)}")
    if args.aux_weight is not None and args.aux_weight < 0:
        raise common.CLIError(f"--aux-weight: must be ≥ 0, got {args.aux_weight}")


def arm_flags(args, arm: str, steps: int) -> list[str]:
    """``edgc train`` flags of ``arm`` in a run of ``steps`` steps."""
    from edgc_train.config import scaled_edgc_defaults

    moe = ["--moe-experts", str(args.experts), "--moe-top-k", str(args.top_k), "--ep", str(args.ep)]
    if getattr(args, "aux_weight", None) is not None:
        moe += ["--moe-aux-weight", str(args.aux_weight)]
    if arm == "uncompressed":
        return [*moe, "--compressor", "allreduce"]
    if arm == "edgc":
        fields = {**EDGC_FIELDS, **({"min_warmup_steps": 1} if args.tiny else {})}
        return [*moe, "--compressor", "edgc", *[x for k, v in fields.items() for x in ("--edgc", f"{k}={v}")]]
    # powersgd's window (1000 unless given) is the split's: EDGC's scaled one, so each run re-splits ~20 times
    window = 2 if args.tiny else scaled_edgc_defaults(steps)["window"]
    split = "tokens" if arm == "routed" else "uniform"
    edgc = ["--edgc", f"rank_split={split}", "--edgc", f"window={window}"]
    return [*moe, "--compressor", "powersgd", "--powersgd-rank", str(args.rank), *edgc]


def measure(run_dir) -> dict:
    """Bytes of each group over the whole run (sent, raw) and the final validation loss."""
    lines = common.read_metrics(run_dir)
    train = [r for r in lines if r["kind"] == "train"]
    evals = [r for r in lines if r["kind"] == "eval"]
    out = {"val_loss": evals[-1]["val_loss"]}
    for key in ("expert_max_share", "experts_idle"):  # the experts' load over the run
        values = [r[key] for r in train if r.get(key) is not None]
        out[key] = sum(values) / len(values) if values else float("nan")
    for group in ("dense", "expert"):
        sent, raw = (sum(r[f"{group}_bytes_{kind}"] for r in train) for kind in ("sent", "raw"))
        out[group] = sent / raw if raw else float("nan")
    sent, raw = (
        sum(r[f"{group}_bytes_{kind}"] for r in train for group in ("dense", "expert")) for kind in ("sent", "raw")
    )
    out["both"] = sent / raw
    out["bytes_sent"] = sent
    return out


def paired(values: list[float]) -> dict:
    m, low, high = t_interval(values)
    return {"mean": m, "low": low, "high": high, "per_seed": values}


def run(args, out, setting, log=print) -> dict:
    from dataclasses import replace

    from .pareto_runs import prepare_data_once

    dp = replace(setting, micro_batch=max(1, setting.micro_batch // args.nproc))  # every rank reads its own
    shape = common.shape_from_args(args)
    flags = ["--eval-every", str(setting.steps), "--eval-batches", "16"]  # the final validation loss
    flags += [x for field, v in shape.items() for x in ("--" + field.replace("_", "-"), str(v))]
    prepare_data_once(setting)  # once, here: the runs then read the same cache
    seeds = [setting.seed + i for i in range(args.seeds)]
    arms = [arm for arm in ARMS if arm in args.arms.split(",")]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in seeds:
        for arm in arms:
            run_dir = out / f"seed{seed}" / arm
            common.edgc_train(
                replace(dp, seed=seed), run_dir, args.nproc, [*flags, *arm_flags(args, arm, setting.steps)], log
            )
            results[arm].append(measure(run_dir))
    payload: dict = {"seeds": seeds, "shape": shape, "results": results, "aux_weight": args.aux_weight}
    if {"edgc", "uncompressed"} <= set(arms):
        pairs = zip(results["edgc"], results["uncompressed"])
        payload["edgc_pct"] = paired([100 * (e["val_loss"] / u["val_loss"] - 1) for e, u in pairs])
    if {"routed", "one-rank"} <= set(arms):
        pairs = list(zip(results["routed"], results["one-rank"]))
        payload["routed"] = paired([r["val_loss"] - o["val_loss"] for r, o in pairs])
        payload["same_bytes"] = [r["bytes_sent"] / o["bytes_sent"] for r, o in pairs]
    headline = summarise(out, args, dp, payload)
    common.write_json(out / "results.json", payload)
    return {"headline": headline, **payload}


def default_split(routed: dict) -> str:
    """The rank split the paired interval of routed − one rank (val loss) sets as the default: tokens only
    where its whole interval is below zero."""
    return "tokens" if routed["high"] < 0 else "uniform"


def _findings(args, payload) -> tuple[list[str], list[str]]:
    """The headline's clauses and the paired Δ's sentences, for the pairs of arms that ran."""
    results, headline, paired_lines = payload["results"], [], []
    if "edgc_pct" in payload:
        edgc, pct = results["edgc"], payload["edgc_pct"]
        headline.append(
            f"EDGC sends {max(r['both'] for r in edgc):.3f}× the raw bytes of both groups at most (dense "
            f"{max(r['dense'] for r in edgc):.3f}×, experts {max(r['expert'] for r in edgc):.3f}×), val loss "
            f"{fmt_interval(pct, '+.2f')} % against uncompressed"
        )
        per_seed = ", ".join(f"{v:+.2f}" for v in pct["per_seed"])
        paired_lines.append(
            f"EDGC − uncompressed {fmt_interval(pct, '+.2f')} % of the uncompressed loss (per seed {per_seed})"
        )
    if "routed" in payload:
        routed, same_bytes = payload["routed"], payload["same_bytes"]
        headline.append(
            f"routed − one rank {fmt_interval(routed, '+.4f')} nats at {min(same_bytes):.4f}–{max(same_bytes):.4f}× "
            f"its bytes ({args.seeds} seeds): the default rank_split is {default_split(routed)}"
        )
        per_seed = ", ".join(f"{v:+.4f}" for v in routed["per_seed"])
        paired_lines.append(
            f"routed − one rank {fmt_interval(routed, '+.4f')} nats (per seed {per_seed}), at "
            f"{', '.join(f'{v:.4f}' for v in same_bytes)}× one rank's bytes"
        )
    return headline, paired_lines


def summarise(out, args, setting, payload) -> str:
    """Write summary.md; return its headline."""
    results = payload["results"]
    rows = [
        [arm, *(f"{mean(r[k] for r in runs):.3f}" for k in ("dense", "expert", "both"))]
        + [f"{mean(r.get(k, float('nan')) for r in runs):.2f}" for k in ("expert_max_share", "experts_idle")]
        + [f"{mean(r['val_loss'] for r in runs):.4f}", " ".join(f"{r['val_loss']:.4f}" for r in runs)]
        for arm, runs in results.items()
    ]
    clauses, paired_lines = _findings(args, payload)
    headline = "; ".join(clauses)
    seeds, shape = ", ".join(map(str, payload["seeds"])), payload["shape"]
    aux = "the harness's default" if args.aux_weight is None else f"{args.aux_weight:g}"
    columns = ["arm", "dense bytes", "expert bytes", "both", "busiest expert", "idle experts", "val loss (mean)"]
    summary = [
        f"# Experiment `{NAME}`: a mixture of experts, EP {args.ep} × DP {args.nproc // args.ep}",
        "",
        f"**Headline:** {headline}.",
        "",
        f"Setting: {setting.describe(args.nproc)}, {shape['n_layer']} layers of width {shape['n_embd']} "
        f"({shape['n_head']} heads); {args.experts} experts per layer (top-{args.top_k}, load-balancing weight "
        f"{aux}) over {args.ep} expert-parallel ranks, `edgc train --nproc {args.nproc}` on gloo, seeds "
        f"{seeds}. EDGC: {', '.join(f'{k}={v}' for k, v in EDGC_FIELDS.items())}; one-rank and routed: PowerSGD at "
        f"rank {args.rank}, 10 % warm-up. Bytes: each group's over the whole run against its raw bytes. Load: "
        "the busiest expert's share of a layer's routed tokens and a layer's experts that got none, per step "
        "(rank 0's tokens), averaged over the run.",
        "",
        markdown_table([*columns, "val loss per seed"], rows),
        "",
        f"Paired Δ (same seed): {'; '.join(paired_lines)}. Mean [95 % t-interval].",
    ]
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    return headline
