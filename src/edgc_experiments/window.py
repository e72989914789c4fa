"""`edgc experiment window` — how long should the rank window w be (paper §2.6, w = 1000)?

One single-process GPT-2 run records, every step, the full histogram entropy of the whole gradient
(all elements) and, on every round(1/α)-th step, the GDS-sampled one (every round(1/β)-th element;
α = 0.1, β = 0.25) and its Gaussian entropy. For each window length w (default: steps/40, /20, /10, /5):

- CC(w): Pearson correlation between the windowed (mean per window) sampled entropy series and the
  windowed full series — does a window hold enough samples to follow the true trend? (The paper
  reports w = 1000 "optimal" with CC ≥ 0.94; w = 1000 at α = 0.1 is 100 samples per window.)
- the rank schedule the library's own controller (``edgc.control.rank_control.WindowController``, r_max = 32,
  r_min = 8, s = 4, 10 % warm-up) produces from the sampled series, with the default ``delta``
  mapping (histogram entropy) and the ``cqm`` mapping (Gaussian entropy), and how often it agrees
  with the schedule the full series would have produced.
"""

from __future__ import annotations

import math

import numpy as np

from edgc.config import EDGCConfig
from edgc.control.entropy import gaussian_entropy, histogram_entropy, strided_sample
from edgc.control.rank_control import WindowController
from edgc.policies.plans import COMPRESS, DecisionInputs

from . import common
from .common import fmt, markdown_table

NAME = "window"
HELP = "window sizes: CC of windowed sampled vs full entropy, and the rank schedules each window gives"
DEFAULT_STEPS = 600
TINY_STEPS = 24
R_MAX, R_MIN = 32, 8


def add_arguments(p) -> None:
    p.add_argument(
        "--windows", metavar="W,W,...", help="window lengths in steps (default: steps/40, steps/20, steps/10, steps/5)"
    )
    p.add_argument("--alpha", type=float, default=0.1, help="GDS iteration sample ratio α (default 0.1)")
    p.add_argument("--beta", type=float, default=0.25, help="GDS gradient sample ratio β (default 0.25)")


def windows_for(args, steps: int) -> list[int]:
    if args.windows:
        try:
            values = sorted({int(v) for v in args.windows.split(",") if v.strip()})
        except ValueError:
            raise common.CLIError(f"--windows: expected integers separated by commas, got {args.windows!r}") from None
        if not values or values[0] < 1:
            raise common.CLIError("--windows: window lengths must be ≥ 1")
        return values
    return sorted({max(2, steps // d) for d in (40, 20, 10, 5)})


def validate(args, setting) -> None:
    if not (0 < args.alpha <= 1 and 0 < args.beta <= 1):
        raise common.CLIError("--alpha and --beta must be in (0, 1]")
    windows_for(args, setting.steps)


def rank_schedule(
    values: list[float], steps: int, window: int, alpha: float, mapping: str, shapes: list[tuple[int, int]]
) -> list[int]:
    """Rank per step (0 = uncompressed warm-up) chosen by the library controller from a sampled series.

    ``values[i]`` is the entropy sampled at library step i·round(1/α) (steps count from 0), fed to the
    controller only once that step has happened, as in training.
    """
    config = EDGCConfig(
        r_max=R_MAX,
        r_min=R_MIN,
        window=window,
        iteration_sample_ratio=alpha,
        total_steps=steps,
        warmup_fraction=0.1,
        warmup_error_test=False,
        rank_mapping=mapping,
    )
    controller = WindowController(config)
    every = config.sample_every
    ranks = []
    for step in range(steps):
        plan = controller.plan(step)
        ranks.append(plan.rank or 0)
        if plan.decision:
            seen = values[: step // every + 1]
            inputs = DecisionInputs(
                plan, entropies=seen, sample_steps=[i * every for i in range(len(seen))], shapes=shapes
            )
            controller.apply(inputs, controller.propose(inputs))
        assert controller.phase in (COMPRESS, "warmup")
    return ranks


def summary_lines(T, args, every, headline, plots, rows, setting, stride):
    """The experiment's summary.md, line by line: the headline, the setting, its tables and what the paper says."""
    return [
        f"# Experiment `{NAME}`: window length w",
        "",
        f"**Headline:** {headline}.",
        "",
        f"Setting: {setting.describe()}; one process. Sampled entropy: GDS with α = {args.alpha:g} "
        f"(every {every} steps), β = {args.beta:g} (every {stride}th element); full entropy: every element, "
        f"every step. Rank schedules: the library's `WindowController` with r_max = {R_MAX}, r_min = {R_MIN}, "
        f"rank step 4, warm-up 10% of {T} steps (no error test), fed the sampled series as training would.",
        "",
        markdown_table(
            [
                "w (steps)",
                "samples / window",
                "windows",
                "CC sampled vs full",
                "delta: mean rank",
                "delta: changes",
                "delta: final",
                "delta: same rank as from full entropy",
                "cqm: mean rank",
                "cqm: changes",
                "cqm: final",
                "cqm: same as full",
            ],
            rows,
        ),
        "",
        "Plots: " + ", ".join(f"`{p.name}`" for p in plots),
        "",
        "Paper (§2.6): w = 1000 steps (at α = 0.1: 100 entropy samples per window) was found best, with a "
        "correlation ≥ 0.94 between entropy trajectories. Short windows give more rank decisions from fewer, "
        "noisier samples; long ones react late. The `delta` mapping normalises the latest window-to-window "
        "change by the first one, so the schedule depends strongly on how noisy the first windows are.",
    ]


def window_results(T, args, every, full, full_gauss, full_steps, gauss, sampled, sampled_steps, shapes):
    """Per window length: the correlation of the windowed sampled entropy with the full one, and the
    rank schedules the delta and CQM mappings give from each, beside those from the full entropy."""
    results = {}
    for w in windows_for(args, T):
        full_w = common.window_series(full_steps, full, w, T)
        samp_w = common.window_series(sampled_steps, sampled, w, T)
        pairs = [(a, b) for a, b in zip(full_w, samp_w) if math.isfinite(a) and math.isfinite(b)]
        res = {
            "window": w,
            "samples_per_window": w / every,
            "windows": len(pairs),
            "cc": common.pearson([a for a, _ in pairs], [b for _, b in pairs]),
            "full_windowed": full_w,
            "sampled_windowed": samp_w,
        }
        full_sampled_series = [full[s - 1] for s in sampled_steps]  # the full entropy on the same steps
        full_gauss_series = [full_gauss[s - 1] for s in sampled_steps]
        for mapping, series, reference in (("delta", sampled, full_sampled_series), ("cqm", gauss, full_gauss_series)):
            ranks = rank_schedule(series, T, w, args.alpha, mapping, shapes)
            ref = rank_schedule(reference, T, w, args.alpha, mapping, shapes)
            compressed = [r for r in ranks if r]
            changes = sum(1 for a, b in zip(ranks, ranks[1:]) if a and b and a != b)
            res[mapping] = {
                "ranks": ranks,
                "mean_rank": float(np.mean(compressed)) if compressed else float("nan"),
                "changes": changes,
                "final_rank": ranks[-1],
                "agreement_with_full": float(np.mean([a == b for a, b in zip(ranks, ref)])),
                "ranks_from_full": ref,
            }
        results[str(w)] = res

    return results


def run(args, out, setting, log=print) -> dict:
    every, stride = max(1, round(1 / args.alpha)), max(1, round(1 / args.beta))
    full_steps, full, sampled, gauss, full_gauss = [], [], [], [], []
    shapes: list[tuple[int, int]] = []

    def on_grads(step, named):
        import torch

        grads = [g for _, g in named if g is not None]
        if not shapes:
            from edgc.engine.factors import matrix_shape
            from edgc.engine.lowrank import LowRankCompressor

            engine = LowRankCompressor(EDGCConfig(r_max=R_MAX))
            for g in grads:  # the matrices the engine would compress at r_max (the cqm mapping's shapes)
                shape = matrix_shape(g)
                if shape is not None and engine.compressed_rank(shape, R_MAX):
                    shapes.append(shape)
        flat = torch.cat([g.reshape(-1) for g in grads]).float()
        full_steps.append(step)
        full.append(histogram_entropy(flat))
        full_gauss.append(gaussian_entropy(flat))
        if (step - 1) % every == 0:  # library step = step - 1
            sample, _ = strided_sample(grads, stride)
            sampled.append(histogram_entropy(sample))
            gauss.append(gaussian_entropy(sample))

    curve = common.train_and_capture(setting, on_grads, every=1, log=log)
    T = setting.steps
    sampled_steps = [1 + i * every for i in range(len(sampled))]
    results = window_results(T, args, every, full, full_gauss, full_steps, gauss, sampled, sampled_steps, shapes)
    headline = (
        "CC(windowed sampled vs full entropy) "
        + ", ".join(f"w={r['window']}: {fmt(r['cc'])}" for r in results.values())
        + (
            "; delta-mapping mean rank "
            + ", ".join(f"w={r['window']}: {fmt(r['delta']['mean_rank'], '.1f')}" for r in results.values())
        )
    )
    plots = _plot(out, results, full_steps, full, sampled_steps, sampled, T)
    rows = []
    for r in results.values():
        rows.append(
            [
                r["window"],
                f"{r['samples_per_window']:.1f}",
                r["windows"],
                fmt(r["cc"]),
                fmt(r["delta"]["mean_rank"], ".1f"),
                r["delta"]["changes"],
                r["delta"]["final_rank"],
                f"{100 * r['delta']['agreement_with_full']:.0f}%",
                fmt(r["cqm"]["mean_rank"], ".1f"),
                r["cqm"]["changes"],
                r["cqm"]["final_rank"],
                f"{100 * r['cqm']['agreement_with_full']:.0f}%",
            ]
        )
    summary = summary_lines(T, args, every, headline, plots, rows, setting, stride)
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    common.write_json(
        out / "results.json",
        {
            "setting": vars(setting),
            "alpha": args.alpha,
            "beta": args.beta,
            "full": {"steps": full_steps, "entropy": full},
            "sampled": {"steps": sampled_steps, "entropy": sampled, "gaussian": gauss},
            "results": results,
            "loss": curve,
        },
    )
    return {"headline": headline, "results": results}


def _plot(out, results, full_steps, full, sampled_steps, sampled, T):
    plt = common.pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    axes[0].plot(full_steps, full, color="lightgrey", lw=0.8, label="full, every step")
    axes[0].plot(sampled_steps, sampled, ".", color="grey", ms=3, label="GDS sample")
    for r in results.values():
        w = r["window"]
        x = [(k + 0.5) * w for k in range(len(r["sampled_windowed"]))]
        axes[0].step(x, r["sampled_windowed"], where="mid", lw=1.2, label=f"w={w} (CC {fmt(r['cc'])})")
    axes[0].set_ylabel("histogram entropy (nats)")
    axes[0].set_title("Gradient entropy and its window means (sampled series) per window length", fontsize=9)
    axes[0].legend(fontsize=7, ncol=3)
    for ax, mapping in ((axes[1], "delta"), (axes[2], "cqm")):
        for r in results.values():
            ax.plot(
                range(1, T + 1),
                r[mapping]["ranks"],
                lw=1.2,
                label=f"w={r['window']} (mean {fmt(r[mapping]['mean_rank'], '.1f')})",
            )
        ax.set_ylabel("PowerSGD rank (0 = warm-up)")
        ax.set_title(
            f"Rank schedule from the sampled entropy, `{mapping}` mapping "
            f"({'histogram' if mapping == 'delta' else 'Gaussian'} entropy), r ∈ [{R_MIN}, {R_MAX}]",
            fontsize=9,
        )
        ax.legend(fontsize=7, ncol=4)
    axes[2].set_xlabel("optimizer step")
    return [common.save(fig, out / "window.png")]
