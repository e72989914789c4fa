"""`edgc simulate`: project EDGC and its baselines onto a paper-scale cluster, or calibrate the model
against runs measured on this machine."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from edgc.parallel.interstage import MODES

from .calibrate_bench import LATENCY_SOURCES
from .hardware import CLUSTERS, LINKS, cluster_with_inter_link
from .interstage_model import InterStage
from .iteration import IterationModel
from .methods import METHODS, MethodConfig, simulate_methods
from .presets import PRESETS
from .rank_schedule import DeltaMapping, delta_rank_schedule, read_metrics, schedule_from_metrics, synthetic_entropy
from .report import DAY, format_table, plot_breakdown, reductions


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="project EDGC vs baselines onto a paper-scale TP x PP x DP cluster",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_projection_flags(p)
    add_calibration_flags(p)
    add_diloco_flags(p)
    p.set_defaults(func=run)


def add_projection_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the projection: the model, its cluster and run, the methods' settings, the output."""
    p.add_argument("--preset", default="gpt2-12.1b", choices=sorted(PRESETS), help="model + layout + run length")
    p.add_argument(
        "--method",
        action="append",
        choices=METHODS,
        help="method to simulate (repeatable); default: all, with 'none' as the baseline",
    )
    p.add_argument("--cluster", choices=sorted(CLUSTERS), help="hardware (default: the preset's)")
    p.add_argument("--inter-link", choices=sorted(LINKS), help="replace the cluster's inter-node link")
    p.add_argument("--iterations", type=int, help="run length (default: the preset's, 230k)")
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel degree (default: the preset's); the preset's world size is kept, DP = world / (tp x pp)",
    )
    p.add_argument("--pp", type=int, help="pipeline stages (default: the preset's)")
    p.add_argument(
        "--interstage",
        choices=MODES,
        default="off",
        help="activation gradients between stages: raw, all compressed, or only the 1F1B cool-down's",
    )
    p.add_argument("--interstage-rank", type=int, default=8, help="rank of the compressed activation gradients")
    p.add_argument("--rank", type=int, default=32, help="static PowerSGD rank")
    p.add_argument("--optimus-rank", type=int, default=128, help="Optimus-CC DP rank")
    p.add_argument("--optimus-stages", type=int, default=3, help="Optimus-CC compresses the first k stages")
    p.add_argument("--r-max", type=int, help="EDGC rank ceiling (default: profiled from the model)")
    p.add_argument("--window", type=int, default=1000, help="EDGC window w (iterations)")
    p.add_argument("--warmup", type=float, default=0.1, help="uncompressed warm-up, fraction of the run")
    p.add_argument("--metrics", help="replay the rank schedule of an `edgc train` metrics.jsonl")
    p.add_argument(
        "--entropy-tau", type=float, default=10_000, help="synthetic entropy decay time constant (iterations)"
    )
    p.add_argument("--out-dir", default="runs/simulate", help="where the plot (and --json) go")
    p.add_argument("--no-plot", action="store_true", help="skip the breakdown plot")
    p.add_argument("--json", action="store_true", help="also write the results as JSON to --out-dir")


def add_calibration_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the comparison with measured runs and the host's measurement."""
    p.add_argument(
        "--calibrate",
        nargs="+",
        metavar="RUN_DIR",
        help="compare the model with measured `edgc train` runs instead of projecting",
    )
    p.add_argument(
        "--link-calibration",
        metavar="JSON",
        help="with --calibrate: `edgc bench` runs; the link (rate, latency per collective; the tbf "
        "burst it records) is fitted to this calibration.json (default: <bench>/calibration.json "
        "when the runs are <bench>/runs/*; `edgc bench --link-only` measures a fresh one)",
    )
    p.add_argument(
        "--link-mbit",
        type=float,
        help="with --calibrate: `edgc bench` runs on a link of this nominal rate (no fit, no latency, no burst)",
    )
    p.add_argument(
        "--latency",
        choices=LATENCY_SOURCES,
        default="traced",
        help="with --calibrate of bench runs: the fixed cost per collective from the other runs' comm "
        "traces (leave one run out; the sweep's where none teaches it) or from the link sweep",
    )
    p.add_argument(
        "--measure-host",
        action="store_true",
        help="measure this CPU (matmul, memory, dispatch) and the local gloo link, print, exit",
    )
    p.add_argument("--host-profile", help="JSON from --measure-host --save-profile, instead of measuring")
    p.add_argument("--save-profile", help="with --measure-host: write the profile JSON here")
    p.add_argument("--threads", type=int, default=1, help="threads per process for host measurements")
    p.add_argument(
        "--host-processes",
        type=int,
        help="measure the CPU in this many processes at once (default: 1 with --measure-host; with "
        "--calibrate of bench runs, their world size: all ranks share this CPU)",
    )


def add_diloco_flags(p: argparse.ArgumentParser) -> None:
    """The flags of DiLoCo at internet scale."""
    p.add_argument(
        "--diloco",
        action="store_true",
        help="DiLoCo at internet scale (8-1,024 replica groups, 1B-70B, 100 Mbit/s-10 Gbit/s links): "
        "outer step, utilisation, time to 1e12 tokens, crossovers (edgc_sim.diloco)",
    )
    p.add_argument(
        "--diloco-bench",
        metavar="DIR[,DIR...]",
        help="with --diloco: also fit the link to `edgc bench --diloco --scaling` in DIR and compare "
        "(several folders: repeats of one bench command, their medians fitted, their range shown)",
    )


def run(args) -> int:
    from edgc_cli.errors import CLIError

    try:
        if args.measure_host:
            return _measure(args)
        if args.diloco or args.diloco_bench:
            return _diloco(args)
        if args.calibrate:
            return _calibrate(args)
        return _project(args)
    except (ValueError, OSError) as exc:
        raise CLIError(str(exc)) from None


def _project(args) -> int:
    preset = with_layout(PRESETS[args.preset], args.tp, args.pp)
    if args.iterations is not None:
        preset = replace(preset, iterations=args.iterations)
    cluster = CLUSTERS[args.cluster or preset.cluster]
    if args.inter_link:
        cluster = cluster_with_inter_link(cluster, args.inter_link)
    methods = list(dict.fromkeys(["none"] + (args.method or list(METHODS))))  # baseline first
    mapping = DeltaMapping(window=args.window, warmup_frac=args.warmup)
    cfg = MethodConfig(args.rank, args.optimus_rank, args.optimus_stages, mapping, args.r_max)
    interstage = InterStage(args.interstage, args.interstage_rank)
    if interstage.mode != "off" and preset.parallel.pp == 1:
        raise ValueError("--interstage: compresses pipeline traffic and needs pp > 1")
    model = IterationModel(preset, cluster, interstage)
    if args.metrics:
        records = read_metrics(args.metrics)
        schedule = lambda r_max: schedule_from_metrics(records, preset.iterations, r_max, args.window)  # noqa: E731
        source = f"ranks replayed from {args.metrics}"
    else:
        entropy = synthetic_entropy(preset.iterations, mapping.alpha, tau=args.entropy_tau)
        schedule = lambda r_max: delta_rank_schedule(entropy, preset.iterations, r_max, mapping)  # noqa: E731
        source = f"synthetic entropy (tau {args.entropy_tau:g} it)"
    r_max, results = simulate_methods(model, preset.iterations, methods, cfg, schedule)
    par = preset.parallel
    title = (
        f"{preset.name} (TP{par.tp} PP{par.pp} DP{par.dp}, m={par.micro_batches}, {preset.precision}) on "
        f"{cluster.name}: {cluster.nodes}x{cluster.gpus_per_node} {cluster.device.name}, "
        f"intra {cluster.intra.name}, inter {cluster.inter.name}"
    )
    print(title)
    print(
        f"{preset.iterations} iterations; EDGC r_max {r_max} (profiled: largest rank with compressed sync "
        f"<= uncompressed), warm-up {args.warmup:.0%}, {source}\n"
    )
    print(format_table(results, results[0]))
    if par.pp > 1:
        sent, raw = model.interstage_bytes
        print(
            f"\ninter-stage activation gradients ({interstage.mode}, rank {interstage.rank}): "
            f"{sent / 1e6:.2f} MB of {raw / 1e6:.2f} MB raw per iteration and TP rank "
            f"({sent / raw:.3f}x); compress + decompress {1e3 * model.interstage_compress_s:.2f} ms per sending "
            f"stage; pipeline flush {1e3 * max(model.timeline.flush_end):.1f} ms"
        )
    if not args.no_plot:
        path = plot_breakdown(results, title, Path(args.out_dir) / f"simulate_{preset.name}.png")
        print(f"\nbreakdown plot: {path}")
    if args.json:
        path = Path(args.out_dir) / f"simulate_{preset.name}.json"
        path.write_text(json.dumps(_as_json(preset.name, cluster.name, r_max, results), indent=2))
        print(f"results: {path}")
    return 0


def _diloco(args) -> int:
    from .diloco import Site
    from .diloco_report import join_repeats, markdown

    bench = None
    if args.diloco_bench:
        summaries = []
        for folder in args.diloco_bench.split(","):
            path = Path(folder) / "results.json"
            if not path.is_file():
                raise ValueError(f"--diloco-bench: {path} not found (written by edgc bench --diloco --scaling)")
            summaries.append(json.loads(path.read_text()))
        bench = join_repeats(summaries)
    print(markdown(Site(), bench))
    return 0


def with_layout(preset, tp: int | None, pp: int | None):
    """`preset` with TP and/or PP replaced, its world size kept (DP = world / (tp x pp))."""
    if tp is None and pp is None:
        return preset
    par = preset.parallel
    tp, pp = tp or par.tp, pp or par.pp
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp/--pp: must be >= 1, got tp {tp}, pp {pp}")
    world = par.world_size
    if world % (tp * pp):
        raise ValueError(f"--tp/--pp: the preset's world size {world} is not a multiple of tp x pp = {tp * pp}")
    dp = world // (tp * pp)
    if preset.model.hidden % tp or preset.model.heads % tp:
        raise ValueError(f"--tp: must divide the model's {preset.model.heads} heads and width {preset.model.hidden}")
    return replace(preset, parallel=replace(par, tp=tp, pp=pp, dp=dp))


def _as_json(preset: str, cluster: str, r_max: int, results) -> dict:
    out = {"preset": preset, "cluster": cluster, "r_max": r_max, "methods": {}}
    for r in results:
        d_comm, d_time = reductions(r, results[0])
        out["methods"][r.method] = {
            "ranks": r.ranks,
            "dp_comm_s": r.dp_sync_s,
            "iteration_s": r.iteration_s,
            "run_days": r.total_s / DAY,
            "comm_reduction": d_comm,
            "time_reduction": d_time,
            "breakdown_s": r.breakdown,
        }
    return out


def _host_profile(args):
    from .host import load_profile, measure_host, measure_link

    if args.host_profile:
        device, link = load_profile(args.host_profile)
        if link is not None:
            return device, link, None
    else:
        device = measure_host(args.threads, processes=args.host_processes or 1)
    link, sizes, seconds = measure_link()
    return device, link, (sizes, seconds)


def _measure(args) -> int:
    from .host import save_profile

    device, link, sweep = _host_profile(args)
    print(
        f"matmul {device.matmul_flops['fp32'] / 1e9:.1f} GFLOP/s, memory {device.mem_bytes_per_s / 1e9:.1f} GB/s, "
        f"dispatch {device.launch_s * 1e6:.1f} us/op ({args.threads} thread(s))"
    )
    if sweep:
        for n, t in zip(*sweep):
            print(f"  gloo all-reduce {n / 2**20:8.3f} MiB: {t * 1e3:8.3f} ms")
    print(f"link fit: alpha {link.latency_s * 1e6:.1f} us, beta {link.bytes_per_s / 1e9:.2f} GB/s")
    if args.save_profile:
        save_profile(args.save_profile, device, link)
        print(f"profile: {args.save_profile}")
    return 0


def expand_bench_dirs(paths) -> list:
    """`--calibrate BENCHDIR`: an `edgc bench` folder (one with runs/<method>/config.json) stands for
    its run folders; run folders are kept as given."""
    from pathlib import Path

    out = []
    for path in map(Path, paths):
        runs = (
            sorted(d for d in (path / "runs").glob("*") if (d / "config.json").is_file())
            if not (path / "config.json").is_file()
            else []
        )
        out += [str(d) for d in runs] or [str(path)]
    return out


def _calibrate(args) -> int:
    from .bench_link import bench_link, find_bench_calibration, nominal_link
    from .calibrate import calibrate, load_run
    from .calibrate_bench import calibrate_bench
    from .calibration_tables import format_bench_calibration, format_calibration
    from .host import load_profile, measure_host

    dirs = expand_bench_dirs(args.calibrate)
    runs = [load_run(d) for d in dirs]
    from .calibrate_pipeline import calibrate_pipeline, format_pipeline_calibration, is_pipeline_run

    if any(is_pipeline_run(r) for r in runs):
        # TP x PP bench: the inter-stage model on the local link (the p2p stays inside a host)
        if args.host_profile is None:
            args.host_processes = args.host_processes or int(runs[0].config["world_size"])
        device, link, _ = _host_profile(args)
        print(format_pipeline_calibration(calibrate_pipeline(runs, device, link), link, device))
        return 0
    link_json = args.link_calibration or (None if args.link_mbit else find_bench_calibration(dirs))
    if args.link_mbit or link_json:
        # bench runs: hosts over the emulated link; only the CPU is taken from the profile / measured
        link = (
            nominal_link(args.link_mbit) if args.link_mbit else bench_link(link_json, int(runs[0].config["world_size"]))
        )
        processes = args.host_processes or int(runs[0].config["world_size"])
        device = (
            load_profile(args.host_profile)[0] if args.host_profile else measure_host(args.threads, processes=processes)
        )
        print(format_bench_calibration(calibrate_bench(runs, device, link, args.latency), link, device))
        return 0
    device, link, _ = _host_profile(args)
    print(format_calibration(calibrate(runs, device, link)))
    return 0
