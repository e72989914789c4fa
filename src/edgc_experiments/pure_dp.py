"""`edgc experiment pure-dp` — EDGC without any pipeline part, on pure data parallelism.

The paper's end-to-end numbers come from 3D parallelism, where DAC (stage alignment) also plays a
part. This runs EDGC as a plain DDP comm hook — no pipeline, no DAC, one DP group — against the
uncompressed all-reduce and static PowerSGD at EDGC's r_max, with `edgc train --nproc 2` (identical
runs except for the compressor), and reports bytes, communication time, validation loss and the
rank schedule, plus `edgc report`'s plots of the three runs.

EDGC's settings: r_max = 16, r_min = 4 (given: on loopback, profiling finds that compression never
pays and switches it off), the ``cqm`` mapping on the Gaussian entropy (as in `edgc demo`), and the
run-length-scaled window, sampling and 10 % warm-up of `edgc train`. On loopback communication is
nearly free, so the bytes are the number to watch; `edgc bench` measures time on a limited link.
"""

from __future__ import annotations

from edgc_train.report_runs import format_schedule, load_run

from . import common
from .common import markdown_table
from .rank_sweep import compressed_stats, dp_setting

NAME = "pure-dp"
HELP = "EDGC as a plain DDP hook (no pipeline, no DAC) vs uncompressed and static PowerSGD, 2 processes"
DEFAULT_STEPS = 200
TINY_STEPS = 6
EDGC_FIELDS = {"r_max": 16, "r_min": 4, "rank_mapping": "cqm", "entropy_estimator": "gaussian"}


def add_arguments(p) -> None:
    p.add_argument(
        "--nproc",
        type=int,
        default=2,
        metavar="N",
        help="data-parallel processes per run (default 2; 1 = in this process, for quick checks)",
    )
    p.add_argument(
        "--link-mbit",
        type=float,
        metavar="RATE",
        help="also run the same three methods with `edgc bench` on 2 emulated hosts joined by a "
        "RATE Mbit/s link (needs root, ip and tc), and add its table (doubles the run time)",
    )


def validate(args, setting) -> None:
    if args.nproc < 1:
        raise common.CLIError(f"--nproc: must be ≥ 1, got {args.nproc}")
    if args.link_mbit is not None and not args.link_mbit > 0:
        raise common.CLIError(f"--link-mbit: must be > 0 Mbit/s, got {args.link_mbit:g}")


def bench(args, setting, out, log) -> str:
    """The same comparison on a rate-limited link via `edgc bench`; returns its bench.md text."""
    try:
        from edgc_bench.netns import NetnsError, check_prerequisites
        from edgc_bench.run import BenchSettings, run_bench
    except ImportError:
        raise common.CLIError("--link-mbit needs edgc bench (src/edgc_bench), which is not installed") from None
    try:
        check_prerequisites()
    except NetnsError as exc:
        raise common.CLIError(f"--link-mbit: {exc}") from None
    edgc = {k: v for k, v in EDGC_FIELDS.items() if k != "r_max"}
    settings = BenchSettings(
        hosts=2,
        nproc=1,
        rate_mbit=args.link_mbit,
        preset=setting.preset,
        methods=("none", f"powersgd@{EDGC_FIELDS['r_max']}", "edgc"),
        steps=setting.steps,
        micro_batch=setting.micro_batch,
        seq_len=setting.seq_len,
        vocab_size=setting.vocab_size,
        eval_every=max(1, setting.steps // 4),
        seed=setting.seed,
        r_max=EDGC_FIELDS["r_max"],
        edgc={**edgc, "warmup_error_test": not args.tiny},
        data=setting.data,
        max_chars=setting.max_chars,
    )
    try:
        run_bench(settings, out / "bench", f"edgc experiment {NAME} --link-mbit {args.link_mbit:g}", say=log)
    except NetnsError as exc:
        raise common.CLIError(f"--link-mbit: {exc}") from None
    return (out / "bench" / "bench.md").read_text()


def summary_lines(args, dp, e, headline, log, nproc, out, report_plots, rows):
    """The experiment's summary.md, line by line: the headline, the setting, its tables and what the paper says."""
    summary = [
        f"# Experiment `{NAME}`: EDGC on pure data parallelism (no pipeline, no DAC)",
        "",
        f"**Headline:** {headline}.",
        "",
        f"Setting: {dp.describe(nproc)}; {nproc} process(es) (`edgc train --nproc {nproc}`, gloo on loopback), same "
        f"seed and data order for all runs. EDGC: {', '.join(f'{k}={v}' for k, v in EDGC_FIELDS.items())}, other "
        "knobs scaled to the run by `edgc train` (10% warm-up, window steps/20). Per-step times are medians over "
        "compressed steps (all steps for `none`).",
        "",
        markdown_table(
            [
                "run",
                "MB sent / step (whole run)",
                "bytes vs none",
                "comm ms / step",
                "total comm vs none",
                "compress ms / step",
                "step ms",
                "val loss",
                "Δ val loss",
            ],
            rows,
        ),
        "",
        f"EDGC rank schedule (steps: rank): {e['schedule']}",
        "",
        "Paper: the 46.45% communication-latency and 16.13% training-time reductions are for GPT2-2.5B/12.1B "
        "with 3D parallelism on V100/H100 clusters, with DAC aligning pipeline stages. Here EDGC runs with no "
        "pipeline at all: the byte reduction comes from the entropy-driven PowerSGD alone. Whether the bytes turn "
        "into time depends on the link: on loopback they barely do (see the comm columns); `edgc bench` "
        "measures it on a bandwidth-limited link.",
        "",
        "Plots: " + ", ".join(f"`{p_.relative_to(out)}`" for p_ in report_plots),
    ]
    if args.link_mbit is not None:
        summary += [
            "",
            f"## The same on a {args.link_mbit:g} Mbit/s link (`edgc bench`, 2 emulated hosts × 1 process)",
            "",
            bench(args, dp, out, log).replace("\n# ", "\n### "),
        ]
    return summary


def run(args, out, setting, log=print) -> dict:
    nproc = 1 if args.tiny else max(1, args.nproc)
    dp = dp_setting(setting, nproc)
    flags = ["--eval-every", str(max(1, setting.steps // 4)), "--eval-batches", "8"]
    fields = {**EDGC_FIELDS, **({"warmup_error_test": "false"} if args.tiny else {})}  # tiny: compress at once
    edgc_flags = [x for k, v in fields.items() for x in ("--edgc", f"{k}={v}")]
    # "none" here is our measured uncompressed all-reduce (DDP's native one has no separable comm time).
    jobs = {
        "none": ["--compressor", "allreduce"],
        f"powersgd{EDGC_FIELDS['r_max']}": ["--compressor", "powersgd", "--powersgd-rank", str(EDGC_FIELDS["r_max"])],
        "edgc": ["--compressor", "edgc", *edgc_flags],
    }
    for name, extra in jobs.items():
        common.edgc_train(dp, out / name, nproc, [*flags, *extra], log)
    folders = [out / name for name in jobs]
    loaded = [load_run(f) for f in folders]
    stats = {name: compressed_stats(run) for name, run in zip(jobs, loaded)}
    base = stats["none"]
    rows, results = [], {}
    for name, run in zip(jobs, loaded):
        s = stats[name]
        res = {
            "val_loss": s["val_loss"],
            "delta_val_loss": s["val_loss"] - base["val_loss"],
            "bytes_per_step_run": s["bytes_per_step"],
            "bytes_ratio_run": s["bytes_per_step"] / base["bytes_per_step"],
            "comm_s": s["comp_comm_s"],
            "compress_s": s["comp_compress_s"],
            "step_s": s["comp_step_s"],
            "comm_total_s": sum(r["comm_time_s"] for r in run.train),
            "schedule": format_schedule(run),
        }
        res["comm_total_ratio"] = res["comm_total_s"] / max(1e-12, sum(r["comm_time_s"] for r in loaded[0].train))
        results[name] = res
        rows.append(
            [
                name,
                f"{res['bytes_per_step_run'] / 1e6:.3f}",
                f"{res['bytes_ratio_run']:.3f}",
                f"{1000 * res['comm_s']:.2f}",
                f"{res['comm_total_ratio']:.2f}",
                f"{1000 * res['compress_s']:.1f}",
                f"{1000 * res['step_s']:.0f}",
                f"{res['val_loss']:.4f}",
                f"{res['delta_val_loss']:+.4f}",
            ]
        )
    e, p = results["edgc"], results[f"powersgd{EDGC_FIELDS['r_max']}"]
    headline = (
        f"pure DP, no DAC: EDGC sends {e['bytes_ratio_run']:.3f}× the bytes of the uncompressed run over the "
        f"whole run (static PowerSGD r={EDGC_FIELDS['r_max']}: {p['bytes_ratio_run']:.3f}×), total comm time "
        f"{e['comm_total_ratio']:.2f}× on loopback, Δ val loss {e['delta_val_loss']:+.4f} nats"
    )
    report_plots = common.report_plots(folders, out / "report")
    summary = summary_lines(args, dp, e, headline, log, nproc, out, report_plots, rows)
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    common.write_json(
        out / "results.json", {"setting": vars(dp), "nproc": nproc, "edgc": EDGC_FIELDS, "results": results}
    )
    return {"headline": headline, "results": results}
