"""`edgc bench`'s flags, one function per group, in the order `--help` lists them (cli.py parses them)."""

from __future__ import annotations

import argparse
import json

from .diloco_cli import DILOCO_DEFAULTS
from .run import FSDP_METHODS, MOE_METHODS, PIPELINE_METHODS, BenchSettings, all_methods

DEFAULTS = BenchSettings()


def add_setup_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the output folder, the emulated hosts and their link, the methods compared."""
    p.add_argument(
        "--out", default="runs/bench", help="output folder (default %(default)s); runs/ inside it must not exist"
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        help=f"emulated hosts (default {DEFAULTS.hosts}; {DILOCO_DEFAULTS['hosts']} with --diloco)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help=f"processes per host (default {DEFAULTS.nproc}; 2 with --fsdp: the shard degree)",
    )
    p.add_argument(
        "--rate",
        "--rate-mbit",
        dest="rate",
        default=None,
        help=f"link rate per host in Mbit/s, or 'none' for unlimited (default {DEFAULTS.rate_mbit:g}; "
        "--diloco takes --rates)",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated: "
        + ", ".join(all_methods())
        + ", powersgd@N, or 'all' (default: "
        + ",".join(DEFAULTS.methods)
        + "; with --fsdp: "
        + ",".join(FSDP_METHODS)
        + "; with --diloco: of ddp, ddp-edgc, diloco, diloco-edgc, streaming and diloco-edgc@SPEC, DiLoCo + "
        "EDGC with the outer sync SPEC, default the first five)",
    )


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the run each method trains."""
    p.add_argument("--steps", type=int, default=DEFAULTS.steps, help="optimizer steps per method (default %(default)s)")
    p.add_argument(
        "--preset",
        default=None,
        help=f"model preset of edgc train (default {DEFAULTS.preset}; {DILOCO_DEFAULTS['preset']} with --diloco)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=DEFAULTS.micro_batch,
        help="sequences per rank per step (default %(default)s)",
    )
    p.add_argument("--seq-len", type=int, default=DEFAULTS.seq_len, help="tokens per sequence (default %(default)s)")
    p.add_argument("--vocab-size", type=int, default=DEFAULTS.vocab_size, help="BPE vocabulary (default %(default)s)")
    p.add_argument(
        "--eval-every", type=int, default=DEFAULTS.eval_every, help="validation every N steps (default %(default)s)"
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=None,
        help="validation micro-batches per rank (default "
        f"{DEFAULTS.eval_batches}; {DILOCO_DEFAULTS['eval_batches']} with --diloco)",
    )
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of every run (default %(default)s)")
    p.add_argument(
        "--threads", type=int, default=DEFAULTS.threads, help="OMP threads per process (default %(default)s)"
    )


def add_compressor_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the compressors' own settings."""
    p.add_argument("--r-max", type=int, default=None, help="fix EDGC's r_max instead of profiling it on the link")
    p.add_argument(
        "--compress-ratio",
        type=float,
        default=DEFAULTS.compress_ratio,
        help="topk/randomk fraction (default %(default)s)",
    )
    p.add_argument(
        "--edgc",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="EDGCConfig field for edgc (repeatable; adds to / overrides the bench's "
        + " ".join(f"{k}={json.dumps(v)}" for k, v in DEFAULTS.edgc.items())
        + ")",
    )


def add_corpus_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the training text."""
    p.add_argument("--data", default=None, help="training text (default: edgc train's default corpus)")
    p.add_argument("--max-chars", type=int, default=None, help="use only the first N characters of the corpus")


def add_parallelism_flags(p: argparse.ArgumentParser) -> None:
    """The flags of how each host parallelises its model."""
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="HSDP: the processes of a host shard the model with FSDP2, hosts are replicas, and the "
        "methods compress the replica all-reduce (methods: none, edgc, powersgd@…; default none,edgc)",
    )
    p.add_argument(
        "--moe-experts",
        type=int,
        default=0,
        metavar="E",
        help="a mixture of E experts in every MLP (edgc train --moe-experts E), split over the processes of "
        "a host (--ep = --nproc): hosts are the experts' replicas, and both groups cross the link (dense "
        "over every rank, experts over the hosts) (methods: allreduce, edgc, powersgd@…; default "
        + ",".join(MOE_METHODS)
        + ")",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=DEFAULTS.tp,
        help="tensor-parallel degree inside each host (default %(default)s); with --tp/--pp each host "
        "runs one whole TP × PP model (--nproc = tp × pp) and DP crosses the link "
        "(methods: none, edgc, powersgd@…; default " + ",".join(PIPELINE_METHODS) + ")",
    )
    p.add_argument("--pp", type=int, default=DEFAULTS.pp, help="pipeline stages inside each host (default %(default)s)")
    p.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        help="micro-batches per step (default 4 with --pp > 1, else 1; with --pp: ≥ pp)",
    )
    p.add_argument(
        "--interstage",
        default=DEFAULTS.interstage,
        choices=("off", "all", "cooldown"),
        help="with --pp: compress the activation gradients between stages (default %(default)s)",
    )
    p.add_argument(
        "--interstage-rank",
        type=int,
        default=DEFAULTS.interstage_rank,
        help="with --interstage: their rank (edgc: its upper bound) (default %(default)s)",
    )


def add_mode_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the bench's other modes: the link alone, torchft, repeated rounds."""
    p.add_argument(
        "--link-only",
        action="store_true",
        help="only the link calibration (all-reduce sweep 4 KiB–64 MiB, a few seconds): write "
        "--out/calibration.json, train nothing",
    )
    p.add_argument(
        "--torchft",
        action="store_true",
        help="fault tolerance: kill one replica group mid-run and compare torchft DDP, torchft + EDGC, EDGC "
        "on plain DDP (no failure) and EDGC with torchrun's elastic restart (docs/bench.md)",
    )
    p.add_argument(
        "--torchtitan",
        nargs="?",
        const="llama3_debugmodel",
        default=None,
        metavar="CONFIG",
        help="torchtitan's own trainer, its config CONFIG (default llama3_debugmodel), as HSDP, a replica per host "
        "and --nproc shards: native against EDGC, step time and bytes (docs/guides/torchtitan.md)",
    )
    p.add_argument(
        "--torchtitan-ep",
        type=int,
        default=1,
        help="with --torchtitan and a MoE config (deepseek_v3_debugmodel): expert-parallel degree inside each host "
        "(default %(default)s)",
    )
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="with --torchft: the step host 1 is killed at (default "
        "steps/2); with --diloco: the outer step it is killed in (default outer steps/4)",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=10,
        help="with --torchft: checkpoint interval of the elastic-restart run (default %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="run the method list N times, reversed on even rounds, each round in OUT/round-K/; "
        "bench.md gives every round and the mean of its ratios; an even N pairs each round with a reversed one "
        f"(1–9, default {DEFAULTS.rounds}; {DILOCO_DEFAULTS['rounds']} with --diloco)",
    )
