"""`edgc bench` flags -> BenchSettings -> run_bench (see run.py and docs/bench.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from edgc_cli.errors import CLIError

from .diloco_cli import DILOCO_DEFAULTS, add_diloco_flags, diloco_options, edgc_items
from .flags import (
    DEFAULTS,
    add_compressor_flags,
    add_corpus_flags,
    add_mode_flags,
    add_parallelism_flags,
    add_setup_flags,
    add_training_flags,
)
from .netns import NetnsError, check_prerequisites
from .run import FSDP_METHODS, MOE_METHODS, PIPELINE_METHODS, BenchSettings, all_methods, check_methods


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="compare every compressor on emulated hosts with rate-limited links (needs root)",
        description="Create one network namespace per host (veth links through a bridge, tc tbf on both ends), "
        "train the same model with every selected method one after the other, and write a markdown "
        "table (bench.md), results.json and plots into --out. See docs/bench.md.",
    )
    add_setup_flags(p)
    add_training_flags(p)
    add_compressor_flags(p)
    add_corpus_flags(p)
    add_parallelism_flags(p)
    add_mode_flags(p)
    add_diloco_flags(p)
    p.add_argument(
        "--run-timeout", type=int, default=DEFAULTS.run_timeout_s, help="seconds per method run (default %(default)s)"
    )
    p.set_defaults(func=run)


def positive(name: str, value: int) -> int:
    if value < 1:
        raise CLIError(f"--{name}: must be ≥ 1, got {value}")
    return value


def rate_from(text: str | None) -> float | None:
    """--rate in Mbit/s; None for an unlimited link."""
    rate_text = text if text is not None else f"{DEFAULTS.rate_mbit:g}"
    if str(rate_text).lower() in ("none", "unlimited"):
        return None
    try:
        rate = float(rate_text)
    except ValueError:
        raise CLIError(f"--rate: expected Mbit/s or 'none', got {rate_text!r}") from None
    if rate <= 0:
        raise CLIError(f"--rate: must be > 0, got {rate_text}")
    return rate


def methods_from(args: argparse.Namespace, pipeline: bool) -> list[str]:
    """--methods, checked against what the chosen parallelism can run."""
    try:
        moe = bool(getattr(args, "moe_experts", 0))
        default = (
            FSDP_METHODS if args.fsdp else PIPELINE_METHODS if pipeline else MOE_METHODS if moe else DEFAULTS.methods
        )
        diloco_methods = getattr(args, "diloco", False)  # --diloco's own methods: diloco_cli checks them
        chosen = args.methods if args.methods is not None and not diloco_methods else ",".join(default)
        names = ",".join(all_methods()) if chosen.strip() == "all" else chosen
        names = [m.strip() for m in names.split(",") if m.strip()]
        methods = check_methods(names, fsdp=args.fsdp, pipeline=pipeline, moe=moe)
    except ValueError as exc:
        raise CLIError(f"--methods: {exc}") from None
    if not methods:
        raise CLIError("--methods: empty")
    return methods


def settings_from(args: argparse.Namespace) -> BenchSettings:
    defaults = DILOCO_DEFAULTS if getattr(args, "diloco", False) else {}
    for name in ("hosts", "preset", "eval_batches", "rounds"):
        if getattr(args, name) is None:
            setattr(args, name, defaults.get(name, getattr(DEFAULTS, name)))
    rate = rate_from(args.rate)
    tp, pp = positive("tp", args.tp), positive("pp", args.pp)
    pipeline = tp > 1 or pp > 1
    if pipeline and args.fsdp:
        raise CLIError("--tp/--pp: cannot be combined with --fsdp (HSDP shards the model another way)")
    if args.interstage != "off" and pp == 1:
        raise CLIError("--interstage: compresses pipeline traffic and needs --pp > 1")
    nproc = args.nproc if args.nproc is not None else tp * pp if pipeline else 2 if args.fsdp else DEFAULTS.nproc
    nproc = moe_nproc(args, nproc, pipeline)
    if pipeline and nproc != tp * pp:
        raise CLIError(
            f"--nproc: with --tp/--pp each host runs one whole model, so it must be tp × pp = {tp * pp}, got {nproc}"
        )
    grad_accum = positive("grad-accum", args.grad_accum if args.grad_accum is not None else 4 if pp > 1 else 1)
    if pp > 1 and grad_accum < pp:
        raise CLIError(
            f"--grad-accum: is the number of pipeline micro-batches and must be ≥ pp = {pp}, got {grad_accum}"
        )
    eval_batches = positive("eval-batches", args.eval_batches)
    if pipeline and eval_batches % grad_accum:
        raise CLIError(
            f"--eval-batches: must be a multiple of --grad-accum = {grad_accum} with --tp/--pp "
            f"(whole pipeline steps), got {eval_batches}"
        )
    methods = methods_from(args, pipeline)
    from edgc_train.config import merge_edgc

    edgc = merge_edgc(DEFAULTS.edgc, edgc_items(args.edgc))
    if not 1 <= args.rounds <= 9:
        raise CLIError(f"--rounds: must be in [1, 9], got {args.rounds}")
    if args.rounds > 1 and (args.torchft or args.link_only) and not getattr(args, "diloco", False):
        raise CLIError("--rounds: repeats the method comparison; drop it with --torchft or --link-only")
    if not 0 < args.compress_ratio <= 1:
        raise CLIError(f"--compress-ratio: must be in (0, 1], got {args.compress_ratio}")
    return BenchSettings(
        hosts=positive("hosts", args.hosts),
        rate_mbit=rate,
        nproc=positive("nproc", nproc),
        methods=tuple(methods),
        preset=args.preset,
        steps=positive("steps", args.steps),
        micro_batch=positive("micro-batch", args.micro_batch),
        seq_len=positive("seq-len", args.seq_len),
        vocab_size=args.vocab_size,
        eval_every=positive("eval-every", args.eval_every),
        eval_batches=eval_batches,
        seed=args.seed,
        threads=positive("threads", args.threads),
        r_max=args.r_max,
        compress_ratio=args.compress_ratio,
        edgc=edgc,
        run_timeout_s=positive("run-timeout", args.run_timeout),
        data=args.data,
        max_chars=args.max_chars,
        fsdp=args.fsdp,
        tp=tp,
        pp=pp,
        grad_accum=grad_accum,
        interstage=args.interstage,
        interstage_rank=positive("interstage-rank", args.interstage_rank),
        rounds=args.rounds,
        moe_experts=args.moe_experts,
    )


def moe_nproc(args: argparse.Namespace, nproc: int, pipeline: bool) -> int:
    """--moe-experts checked against the layout: the processes of a host are its expert-parallel ranks (2 by
    default), which must split the experts; not with --fsdp, --tp/--pp or --torchft."""
    experts = args.moe_experts
    if not experts:
        return nproc
    if experts < 0 or args.fsdp or pipeline or args.torchft or getattr(args, "diloco", False):
        raise CLIError("--moe-experts: a positive count, without --fsdp, --tp/--pp, --torchft or --diloco")
    nproc = args.nproc if args.nproc is not None else 2
    if experts % nproc:
        raise CLIError(f"--moe-experts {experts}: must be a multiple of --nproc {nproc} (the expert-parallel ranks)")
    return nproc


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if settings.hosts > 250:
        raise CLIError("--hosts: at most 250")
    check_training(settings)
    try:
        check_prerequisites()
    except NetnsError as exc:
        raise CLIError(str(exc)) from None
    out = Path(args.out)
    if args.diloco:
        return diloco(settings, args, out)
    if args.torchft:
        return torchft(settings, args, out)
    if args.torchtitan:
        return torchtitan(settings, args, out)
    if args.link_only:
        if (out / "calibration.json").exists():
            raise CLIError(f"--out: {out}/calibration.json already exists; choose a new folder")
        return link_only(settings, out)
    if (out / "runs").exists() or (out / "round-1").exists():
        raise CLIError(f"--out: {out} already holds a bench; choose a new folder")
    from .run import run_bench

    command = "edgc bench" + (
        "".join(" " + shlex.quote(a) for a in sys.argv[sys.argv.index("bench") + 1 :]) if "bench" in sys.argv else ""
    )
    summary = run_bench(settings, out, command)
    print((out / "bench.md").read_text())
    return 1 if summary["notes"] and any("failed" in n for n in summary["notes"]) else 0


def torchft(settings: BenchSettings, args: argparse.Namespace, out: Path) -> int:
    """`edgc bench --torchft` (torchft_bench.py): four runs, one kill each of the last three."""
    if settings.pipeline or settings.fsdp:
        raise CLIError("--torchft: runs plain data parallelism (one replica group per host); drop --tp/--pp/--fsdp")
    if settings.hosts < 2:
        raise CLIError("--torchft: needs ≥ 2 hosts (one is killed)")
    kill_at = args.kill_at if args.kill_at is not None else settings.steps // 2
    if not 0 < kill_at < settings.steps - 1:
        raise CLIError(f"--kill-at: must be in [1, steps - 2] = [1, {settings.steps - 2}], got {kill_at}")
    if not 0 < args.ckpt_every < settings.steps:
        raise CLIError(f"--ckpt-every: must be in [1, steps - 1], got {args.ckpt_every}")
    if (out / "runs").exists():
        raise CLIError(f"--out: {out}/runs already exists; choose a new folder")
    require_torchft("--torchft")
    from .torchft_bench import run_torchft_bench

    run_torchft_bench(settings, out, command_line("--torchft"), kill_at, args.ckpt_every)
    print((out / "bench.md").read_text())
    return 0


def torchtitan(settings: BenchSettings, args: argparse.Namespace, out: Path) -> int:
    """`edgc bench --torchtitan` (torchtitan_bench.py): native HSDP, then EDGC, in torchtitan's trainer."""
    if settings.pipeline or settings.fsdp:
        raise CLIError("--torchtitan: torchtitan's HSDP is a replica per host, --nproc shards; drop --tp/--pp/--fsdp")
    if settings.hosts < 2:
        raise CLIError("--torchtitan: needs ≥ 2 hosts (one replica each)")
    if (out / "runs").exists():
        raise CLIError(f"--out: {out}/runs already exists; choose a new folder")
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        raise CLIError("--torchtitan: torchtitan is not installed (pip install 'edgc[torchtitan]')") from None
    if args.torchtitan_ep < 1 or settings.nproc % args.torchtitan_ep:
        raise CLIError(f"--torchtitan-ep: must divide --nproc {settings.nproc}, got {args.torchtitan_ep}")
    from .torchtitan_bench import TitanOptions, run_torchtitan_bench

    options = TitanOptions(config=args.torchtitan, ep=args.torchtitan_ep)
    run_torchtitan_bench(settings, options, out, command_line("--torchtitan"))
    print((out / "bench.md").read_text())
    return 0


def diloco(settings: BenchSettings, args: argparse.Namespace, out: Path) -> int:
    """`edgc bench --diloco` (diloco_bench.py): every link's rounds and the kill pass."""
    if args.torchft or args.link_only or settings.fsdp or settings.pipeline:
        raise CLIError(
            "--diloco: runs plain data parallelism, one replica group per host; drop "
            "--torchft/--link-only/--fsdp/--tp/--pp"
        )
    if args.rate is not None:
        raise CLIError("--rate: --diloco runs at every rate of --rates instead")
    if settings.hosts < 3:
        raise CLIError(f"--hosts: --diloco needs ≥ 3 (the kill pass leaves a quorum of two), got {settings.hosts}")
    opts = diloco_options(settings, args)
    if (out / "results.json").exists():
        raise CLIError(f"--out: {out} already holds a bench; choose a new folder")
    require_torchft("--diloco")
    from .diloco_bench import run_diloco_bench
    from .diloco_scaling import run_scaling

    (run_scaling if opts.scaling else run_diloco_bench)(settings, opts, out, command_line("--diloco"))
    print((out / ("scaling.md" if opts.scaling else "bench.md")).read_text())
    return 0


def require_torchft(flag: str) -> None:
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise CLIError(f"{flag}: torchft is not installed (pip install 'edgc[torchft]')") from None


def command_line(mode: str) -> str:
    """This invocation as `edgc bench …` (for the tables), or the mode alone when not run from the CLI."""
    if "bench" not in sys.argv:
        return f"edgc bench {mode}"
    return "edgc bench" + "".join(" " + shlex.quote(a) for a in sys.argv[sys.argv.index("bench") + 1 :])


def check_training(settings: BenchSettings) -> None:
    """The training config, checked once (bad preset, batch, layout) before any namespace exists."""
    from edgc_train.config import TrainConfig

    try:
        TrainConfig(
            preset=settings.preset,
            seq_len=settings.seq_len,
            micro_batch=settings.micro_batch,
            steps=settings.steps,
            vocab_size=settings.vocab_size,
            compressor="none",
            tp=settings.tp,
            pp=settings.pp,
            grad_accum=settings.grad_accum,
            eval_batches=settings.eval_batches,
            interstage=settings.interstage,
            interstage_rank=settings.interstage_rank,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def link_only(settings: BenchSettings, out: Path) -> int:
    """The bench's link calibration alone, on a fresh network of the same hosts and rate."""
    from . import link_calibration
    from .netns import Network
    from .run import run_calibration

    out.mkdir(parents=True, exist_ok=True)
    with Network(settings.hosts, settings.rate_mbit) as net:
        rows = run_calibration(net, settings, out)
    print(link_calibration.table(rows, settings.rate_mbit))
    print(f"written: {out / 'calibration.json'}")
    return 0
