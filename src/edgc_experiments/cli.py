"""`edgc experiment NAME`: each of EDGC's claims as one command that leaves plots, a summary and a number.

Every experiment writes ``ROOT/NAME/summary.md`` (the numbers, next to what the paper claims),
``results.json`` (everything measured) and PNG plots, and prints its headline number.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time

from . import common

# experiment name -> module (each exposes NAME, HELP, DEFAULT_STEPS, TINY_STEPS, add_arguments, run, and
# optionally validate(args, setting), which raises CLIError for bad flags before anything is written)
EXPERIMENTS = {
    "entropy-trend": "edgc_experiments.entropy_trend",
    "sampling": "edgc_experiments.sampling",
    "rank-sweep": "edgc_experiments.rank_sweep",
    "window": "edgc_experiments.window",
    "cqm": "edgc_experiments.cqm",
    "pure-dp": "edgc_experiments.pure_dp",
    "pareto": "edgc_experiments.pareto",
    "diloco": "edgc_experiments.diloco",
    "diloco-pairs": "edgc_experiments.diloco_pairs",
    "moe": "edgc_experiments.moe",
}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "experiment",
        help="check one of EDGC's claims on your model: plots, a summary and a headline number",
        description=__doc__.splitlines()[0] + " Results go to ROOT/NAME (default runs/experiments/NAME).",
    )
    sub = p.add_subparsers(dest="experiment", metavar="NAME")
    for name, module_name in EXPERIMENTS.items():
        module = importlib.import_module(module_name)
        sp = sub.add_parser(name, help=module.HELP, description=(module.__doc__ or "").split("\n\n")[0])
        common.add_setting_arguments(sp, module.DEFAULT_STEPS, module.TINY_STEPS)
        module.add_arguments(sp)
        sp.set_defaults(module=module)
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    module = getattr(args, "module", None)
    if module is None:
        args.parser.print_help()
        return 2
    setting = common.setting_from_args(args)
    if hasattr(module, "validate"):
        module.validate(args, setting)  # bad flags fail before any folder is made
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = common.prepare_out(args.out, module.NAME, args.force)
    start = time.perf_counter()
    print(f"edgc experiment {module.NAME}: {setting.describe()} -> {out}/", flush=True)
    result = module.run(args, out, setting, log=lambda m: print(m, flush=True))
    seconds = time.perf_counter() - start
    with open(out / "summary.md", "a") as f:
        command = getattr(args, "command_line", f"edgc experiment {module.NAME}")
        f.write(f"\nCommand: `{command}` ({seconds / 60:.1f} min on this machine).\n")
    print(f"\n{module.NAME}: {result['headline']}")
    print(f"summary: {out / 'summary.md'}  ({seconds / 60:.1f} min)")
    return 0
