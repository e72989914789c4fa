"""`edgc experiment diloco` — does compressed DiLoCo hold against torchft's DiLoCo across models?

Replicas (processes on gloo) train each model family of `diloco_families` (GPT-2 ``tiny`` on BPE
tokens, a 2-layer character GRU, a causal character CNN) with each inner optimizer (AdamW, SGD with
Nesterov momentum) at each H (inner steps per outer step), for the same inner steps. Per cell
(family, optimizer, H) every method of ``--methods`` runs at every seed, paired with torchft's own
DiLoCo (``torchft.local_sgd.DiLoCo``, uncompressed) at the same seed: same initialisation, same data.

Methods (`METHODS`; ``+heal=P`` after a name: replica 1 healed after the middle outer step with
error-feedback policy P, paired with the same method without the heal):

* ``torchft``: torchft's DiLoCo, the reference; ``raw``: edgc's DiLoCo sending everything raw;
* ``rank<r>``: EDGC's PowerSGD at a static rank r (``-noef``: without error feedback,
  ``-decay<f>``: the error feedback multiplied by f before every sync);
* ``quant8`` … ``quant2``, ``alloc3``, ``topk5``: the registered sync methods of those names (`edgc.sync.outer_sync`),
  with error feedback (``-noef`` / ``-decay<f>`` as above); ``quant<b>-2s``: the same codes through the
  two-stage all-reduce (`edgc.sync.two_stage`), reported against torchft and, where the cell has it,
  against ``quant<b>`` too (a second row, paired at the same seeds).

Reported per cell: bytes against torchft's, the validation loss, the paired Δ % against torchft
per seed with its mean and 95 % t-interval (at equal outer steps); at equal bytes, each method at
the smallest H against torchft at the largest (whose bytes are H_max/H_min times fewer per inner
step); and the spectrum: the share of a pseudo-gradient's energy in its top r singular values beside
the share of one step's gradient (rank 0, the first outer step of torchft's run at the first seed).

``--regime frontier`` runs instead where SparseLoCo claims its frontier (`diloco_regime`): 4 replicas,
H = 15, 1,800 inner steps with a warm-up, GPT-2 and the LLaMA, each method tuned on a seed of its own,
the gap read at 20, 60 and 120 outer steps (`diloco_regime_summary`).
"""

from __future__ import annotations

from statistics import mean

from . import common, diloco_regime, diloco_regime_summary
from .common import fmt, fmt_interval, markdown_table, t_interval
from .diloco_families import FAMILIES, INNER
from .diloco_frontier import BOUND, frontier_table, plot_frontier
from .diloco_regime import REGIMES
from .diloco_runs import method_arm, train_runs
from .diloco_train import OUTER_LR

NAME = "diloco"
HELP = "compressed DiLoCo against torchft's DiLoCo across model families, inner optimizers and H, paired seeds"
DEFAULT_STEPS = 120
TINY_STEPS = 12
SPECTRUM_RANKS = (1, 4, 16)
TOLERANCE = 3.0  # % of torchft's validation loss the acceptance allows


def add_arguments(p) -> None:
    def default(name: str) -> str:  # each regime's default, for the help
        return f"default {REGIMES['standard'][name]}; frontier: {REGIMES['frontier'][name]}"

    p.add_argument("--models", help=f"model families of {','.join(FAMILIES)} ({default('models')})")
    p.add_argument("--inner", help=f"inner optimizers of {','.join(INNER)} ({default('inner')})")
    p.add_argument("--sync-every", metavar="H,...", help=f"inner steps per outer step ({default('sync_every')})")
    p.add_argument("--methods", help=f"methods, torchft's first (see the module docstring; {default('methods')})")
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds per method (default 3)")
    p.add_argument("--replicas", type=int, metavar="N", help=f"DiLoCo replicas (a process each; {default('replicas')})")
    p.add_argument(
        "--outer-lr", type=float, default=OUTER_LR, help=f"outer Nesterov SGD learning rate (default {OUTER_LR})"
    )
    p.add_argument("--outer-momentum", type=float, help=f"outer Nesterov momentum ({default('outer_momentum')})")
    diloco_regime.add_arguments(p)
    p.add_argument(
        "--reuse",
        default="",
        metavar="DIR,...",
        help="take a method's runs of a cell from DIR/runs/ of an earlier run of this experiment that "
        "has it at every seed and the same outer steps (the other methods are trained)",
    )
    p.add_argument(
        "--no-train",
        action="store_true",
        help="with --reuse: train nothing; a cell some method of which is missing is left out (the summary says which)",
    )


def _split(raw: str) -> list[str]:
    return [v.strip() for v in raw.split(",") if v.strip()]


def validate(args, setting) -> None:
    diloco_regime.resolve(args, setting)
    for flag, values, allowed in (("--models", args.models, FAMILIES), ("--inner", args.inner, INNER)):
        bad = [v for v in _split(values) if v not in allowed]
        if bad or not _split(values):
            raise common.CLIError(f"{flag}: choose from {', '.join(allowed)}, got {values!r}")
    try:
        hs = [int(v) for v in _split(args.sync_every)]
        methods = [method_arm(m) for m in _split(args.methods)]
    except ValueError as exc:
        raise common.CLIError(f"--sync-every / --methods: {exc}") from None
    if not hs or min(hs) < 1 or any(setting.steps < 2 * h for h in hs):
        raise common.CLIError(f"--sync-every: every H must give ≥ 2 outer steps of --steps {setting.steps}")
    if not methods or methods[0]["method"] != "torchft":
        raise common.CLIError("--methods: the first must be torchft (the reference every method is paired with)")
    if not 2 <= args.seeds <= 10 or not 2 <= args.replicas <= 8:
        raise common.CLIError("--seeds must be in 2..10 and --replicas in 2..8")
    if args.regime == "frontier":
        diloco_regime.validate(args, setting)


def plan(args, steps: int) -> list[tuple[str, str, int, dict]]:
    """(family, inner, H, {method: arm}) per cell, in the order they run."""
    outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    cells = []
    for family in _split(args.models):
        for inner in _split(args.inner):
            for h in (int(v) for v in _split(args.sync_every)):
                arms = {}
                for name in _split(args.methods):
                    arm = {"sync_every": h, "inner": inner, **outer, **method_arm(name)}
                    policy = arm.pop("heal_policy", None)
                    if policy:
                        arm["heal"] = (max(1, steps // h // 2), policy)
                    arms[name] = arm
                cells.append((family, inner, h, arms))
    return cells


def run(args, out, setting, log=print) -> dict:
    if args.regime == "frontier":
        return diloco_regime_summary.summarise(out, setting, args, *diloco_regime.run(args, out, setting, log))
    seeds = [setting.seed + k for k in range(args.seeds)]
    cells = plan(args, setting.steps)
    (out / "runs").mkdir()
    results: dict = {}
    missing = []
    for family, inner, h, arms in list(cells):
        key = f"{family}/{inner}/H{h}"
        found = reused(_split(args.reuse), key, arms, seeds, setting.steps // h)
        todo = {str(s): [n for n in arms if str(s) not in found.get(n, {})] for s in seeds}
        if any(todo.values()) and args.no_train:
            log(f"  {key}: left out (no runs of {', '.join(sorted({n for v in todo.values() for n in v}))})")
            missing.append(key)
            cells.remove((family, inner, h, arms))
            continue
        results[key] = {name: dict(found.get(name, {})) for name in arms}
        log(f"  {key}: reused {sum(len(v) for v in found.values())} runs; training {sum(map(len, todo.values()))}")
        for seed in seeds:
            _train_seed(args, setting, key, family, {n: arms[n] for n in todo[str(seed)]}, seed, seeds, results, log)
            common.write_json(out / "runs" / f"{key.replace('/', '-')}.json", results[key])  # partial: resumable
    if not cells:
        raise common.CLIError("--no-train: no cell has runs of every method in the --reuse folders")
    return summarise(out, setting, args, seeds, cells, results, missing)


def _train_seed(args, setting, key, family, todo: dict, seed: int, seeds, results: dict, log) -> None:
    """Train the arms ``todo`` of cell ``key`` at ``seed`` into ``results[key]``."""
    if not todo:
        return
    if seed == seeds[0] and "torchft" in todo:
        todo["torchft"] = {**todo["torchft"], "spectrum": list(SPECTRUM_RANKS)}
    runs = train_runs(family, list(todo.values()), seed, setting.steps, args.replicas, cache_dir=setting.cache_dir)
    for name, result in zip(todo, runs):
        results[key][name][str(seed)] = result
        log(
            f"  {key} seed {seed} {name}: val {result['val_loss']:.4f}, "
            f"{result['bytes'] / result['bytes_raw']:.4f}× payload, {result['wall_s']:.0f} s"
        )


def reused(folders: list[str], key: str, arms: dict, seeds: list[int], outer_steps: int) -> dict:
    """{method: {seed: run}} of cell ``key``: each method of ``arms`` at each seed that one of ``folders``
    holds at ``outer_steps`` (the first such folder's; the runs are deterministic, so any is as good).
    A folder of an interrupted run holds the seeds it finished: passing it resumes that run."""
    import json
    from pathlib import Path

    found: dict = {}
    for folder in folders:
        path = Path(folder) / "runs" / f"{key.replace('/', '-')}.json"
        cell = json.loads(path.read_text()) if path.is_file() else {}
        for name in arms:
            for s in seeds:
                run = cell.get(name, {}).get(str(s))
                if run is not None and run["outer_steps"] == outer_steps:
                    found.setdefault(name, {}).setdefault(str(s), run)
    return found


def paired_percent(cell: dict, arm: str, reference: str, seeds: list[int]) -> dict:
    """Paired Δ % of ``arm``'s validation loss against ``reference``'s, with its bytes ratio."""
    deltas = [100 * (cell[arm][str(s)]["val_loss"] / cell[reference][str(s)]["val_loss"] - 1) for s in seeds]
    m, low, high = t_interval(deltas)
    errors = [
        o["relative_error"] for s in seeds for o in cell[arm][str(s)]["outer"] if o.get("relative_error") is not None
    ]
    return {
        "deltas": deltas,
        "mean": m,
        "low": low,
        "high": high,
        "relative_error": mean(errors) if errors else None,
        "val_loss": mean(cell[arm][str(s)]["val_loss"] for s in seeds),
        "bytes_ratio": mean(cell[arm][str(s)]["bytes"] / cell[reference][str(s)]["bytes"] for s in seeds),
    }


def paired_cells(cells, results, seeds):
    """Per cell (family, inner steps, H, arms): the arms' paired differences over the seeds, their
    table rows, and the spectra of the runs that recorded one."""
    rows, stats, spectra = [], {}, []
    for family, inner, h, arms in cells:
        key = f"{family}/{inner}/H{h}"
        cell = results[key]
        for name, reference in _pairs(arms, cell):
            p = stats[
                (key, name) if reference == "torchft" or "+heal=" in name else (key, f"{name} vs {reference}")
            ] = paired_percent(cell, name, reference, seeds)
            versus = "" if reference == "torchft" else f" (vs {reference})"
            rows.append(
                [
                    family,
                    inner,
                    h,
                    name + versus,
                    f"{p['bytes_ratio']:.3f}",
                    fmt(p["relative_error"], ".2f"),
                    f"{p['val_loss']:.4f}",
                    "–" if name == "torchft" else " ".join(f"{d:+.2f}" for d in p["deltas"]),
                    "–" if name == "torchft" else fmt_interval(p, "+.2f"),
                ]
            )
        spectrum = cell["torchft"][str(seeds[0])].get("spectrum")
        if spectrum:
            spectra.append(
                [family, inner, h]
                + [
                    f"{spectrum['pseudo_gradient'][str(r)]:.2f} / {spectrum['gradient'][str(r)]:.2f}"
                    for r in SPECTRUM_RANKS
                ]
            )
    return rows, spectra, stats


def summarise(out, setting, args, seeds, cells, results, missing=()) -> dict:
    rows, spectra, stats = paired_cells(cells, results, seeds)
    equal_bytes = _equal_bytes(cells, results, seeds, sorted({h for _, _, h, _ in cells}))
    headline = _headline(stats, cells)
    summary = [
        f"# Experiment `{NAME}`: compressed DiLoCo against torchft's DiLoCo across models",
        "",
        f"**Headline:** {headline}",
        "",
        f"Setting: {setting.steps} inner steps of {args.replicas} replicas (one process each, its own shard of the "
        f"data), 8 × 64 tokens per inner step, the first 1 M characters of the KJV Bible; inner learning rate "
        f"cosine to 0, gradients clipped at 1; DiLoCo's outer Nesterov SGD at lr {args.outer_lr:g}, momentum "
        f"{args.outer_momentum:g}; seeds {seeds}; validation loss over 16 × 8 validation blocks after the last "
        "outer step. Δ % = 100·(method / torchft − 1) at the same seed (negative: better); payload: what one "
        "replica's messages hold against torchft's DiLoCo (its fp32 pseudo-gradients), not the wire (the "
        "bench counts that from the sockets); ‖M−Ĝ‖/‖M‖: the "
        "sync's relative error (M = Δ + e, Ĝ what it sent), mean over outer steps and seeds.",
        "",
        *([f"Not run (left out with --no-train): {', '.join(missing)}.", ""] if missing else []),
        "At equal outer steps:",
        "",
        markdown_table(
            [
                "model",
                "inner",
                "H",
                "method",
                "payload vs torchft",
                "‖M−Ĝ‖/‖M‖ (mean)",
                "val loss (mean)",
                "Δ % per seed",
                "Δ % mean [95 % CI]",
            ],
            rows,
        ),
        "",
    ]
    summary += [
        f"Frontier (a method holds in a cell where its paired 95 % interval lies inside ±{BOUND:g} % of torchft's "
        "loss; plot: each cell's validation loss against the payload per outer step):",
        "",
        frontier_table(stats, cells),
        "",
    ]
    if equal_bytes:
        summary += [
            "At an equal or smaller payload (the same inner steps; the method held against syncing less often):",
            "",
            markdown_table(
                ["model", "inner", "method", "against", "payload ratio", "Δ % per seed", "Δ % mean [95 % CI]"],
                equal_bytes,
            ),
            "",
        ]
    if spectra:
        summary += [
            "Spectrum: share of the energy in the top r singular values, pseudo-gradient / gradient "
            "(energy-weighted over the matrices):",
            "",
            markdown_table(["model", "inner", "H"] + [f"r = {r}" for r in SPECTRUM_RANKS], spectra),
            "",
        ]
    summary.append(f"Plot: `{plot_frontier(out, stats, cells).name}`")
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    common.write_json(
        out / "results.json",
        {
            "setting": vars(setting),
            "seeds": seeds,
            "runs": results,
            "paired": {f"{k} {n}": p for (k, n), p in stats.items()},
        },
    )
    return {"headline": headline, "paired": stats}


def _pairs(arms: dict, cell: dict) -> list[tuple[str, str]]:
    """(method, the method it is paired with) per row: torchft, the same method without its heal, and a
    two-stage method also against its one-stage twin."""
    pairs = []
    for name in arms:
        reference = name.partition("+heal=")[0] if "+heal=" in name else "torchft"
        pairs.append((name, reference if reference in cell else "torchft"))
        twin = name.replace("-2s", "")
        if "+heal=" not in name and twin != name and twin in cell:
            pairs.append((name, twin))
    return pairs


def _equal_bytes(cells, results: dict, seeds: list[int], hs: list[int]) -> list[list]:
    """Rows of each method at the smallest H against torchft's DiLoCo and today's default at the largest H,
    over the same inner steps, where the method sent at most the bytes of the one it is held against."""
    from edgc.integrations.diloco import DEFAULT_OUTER_SYNC

    rows: list[list] = []
    if len(hs) < 2:
        return rows
    low, high = hs[0], hs[-1]
    for family, inner, h, arms in cells:
        if h != low or f"{family}/{inner}/H{high}" not in results:
            continue
        fast, slow = results[f"{family}/{inner}/H{low}"], results[f"{family}/{inner}/H{high}"]
        for name in arms:
            for against in ("torchft", DEFAULT_OUTER_SYNC):
                if name in ("torchft", against) or "+heal=" in name or against not in slow:
                    continue
                p = paired_percent({"arm": fast[name], "against": slow[against]}, "arm", "against", seeds)
                if p["bytes_ratio"] <= 1.0:
                    rows.append(
                        [
                            family,
                            inner,
                            f"{name} H{low}",
                            f"{against} H{high}",
                            f"{p['bytes_ratio']:.3f}",
                            " ".join(f"{d:+.2f}" for d in p["deltas"]),
                            fmt_interval(p, "+.2f"),
                        ]
                    )
    return rows


def _headline(stats: dict, cells) -> str:
    """Per method: the cells whose interval's upper end is within TOLERANCE % of torchft's loss."""
    names = [n for n in cells[0][3] if n != "torchft" and "+heal=" not in n]
    parts = []
    for name in names:
        mine = [(key, p) for (key, n), p in stats.items() if n == name]
        held = sum(p["high"] <= TOLERANCE for _, p in mine)
        worst_key, worst = max(mine, key=lambda kp: kp[1]["high"])
        ratio = max(p["bytes_ratio"] for _, p in mine)
        parts.append(
            f"{name} (≤ {ratio:.3f}× payload) within {TOLERANCE:g} % of torchft in {held}/{len(mine)} cells, "
            f"worst {worst_key} {fmt_interval(worst, '+.2f')} %"
        )
    return "; ".join(parts) + "."
