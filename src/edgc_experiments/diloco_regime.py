"""`edgc experiment diloco --regime frontier`: the sparse outer syncs tested where SparseLoCo claims them.

SparseLoCo's reference configuration runs 8 replicas at H = 15 for ≈ 163 outer steps, warms the inner
learning rate up, and tunes each method (inner lr 1e-3 for SparseLoCo, 8e-4 for DiLoCo; outer lr 1
and 0.6). Short runs cannot tell a bad method from its error feedback's start-up: with decay 0.95 it
remembers ≈ 20 syncs, and at 3 % density a value waits ≈ 30 syncs to be sent. So this regime runs
R = 4 replicas (processes on gloo), H = 15, 1,800 inner steps (120 outer steps), a linear warm-up of
the inner learning rate over the first `WARMUP_SHARE` of the inner steps and then a cosine to 0,
AdamW inner steps, on GPT-2 and the LLaMA-style family at `FRONTIER_SIZE` (sized so that two shared
cores train the whole regime in hours), every method paired with torchft's DiLoCo at three seeds.

Each method is tuned first, on a seed no comparison uses (the first seed + `TUNING_SEED_OFFSET`),
per family: its outer learning rate times each of ``--tune-outer`` (the method's own as the base:
``--outer-lr`` with Nesterov ``--outer-momentum`` for torchft's DiLoCo and the quantised syncs, the
rate its name gives for SparseLoCo's form), then, where the reference tunes it (torchft's DiLoCo and
the sparse syncs), the inner learning rate times each of ``--tune-inner`` at the best outer rate.
The point with the lowest validation loss after the last outer step is the method's setting at the
comparison seeds.

Every run logs, per outer step, the training loss (the mean over the replicas and its H inner steps)
and the sync's relative error, and the validation loss of θ_global every `EVAL_EVERY` outer steps:
the gap against torchft's DiLoCo can be read against the number of syncs (`diloco_regime_summary`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from . import common
from .diloco_families import Size
from .diloco_train import OUTER_MOMENTUM

# 2 layers × 64 wide, 4 × 32 tokens a replica's inner step: ≈ 15 ms of one core per inner step (the
# framework's floor is ≈ 11), so a run of 4 × 1,800 inner steps is ≈ 2 CPU-minutes
FRONTIER_SIZE = Size(width=64, layers=2, heads=4, vocab=512, seq_len=32, batch=4, val_batches=48)
WARMUP_SHARE = 0.1  # of the inner steps (SparseLoCo's reference: 500 of ≈ 2,450)
EVAL_EVERY = 5  # outer steps between two validations of θ_global
CHECKPOINTS = (20, 60)  # outer steps the frontier is drawn at, beside the last
TUNING_SEED_OFFSET = 1000
FRONTIER_METHODS = (
    "torchft,quant3-2s,quant2-2s,sparse128-decay0.95-mom0-lr2,"
    "sparse128-senders-decay0.95-mom0-lr1,sparse128-tiles-decay0.95-mom0-lr1"
)
# Each regime's defaults of `edgc experiment diloco`'s flags (the frontier's outer optimizer: torchft's
# DiLoCo as its examples run it, Nesterov 0.9 at lr 0.7)
REGIMES = {
    "standard": dict(
        models="gpt2,gru,cnn,llama",
        inner="adamw,sgd",
        sync_every="6,30",
        methods="torchft,quant3,rank8,quant3+heal=zero",
        replicas=2,
        outer_momentum=OUTER_MOMENTUM,
        steps=None,  # the experiment's DEFAULT_STEPS
    ),
    "frontier": dict(
        models="gpt2,llama",
        inner="adamw",
        sync_every="15",
        methods=FRONTIER_METHODS,
        replicas=4,
        outer_momentum=0.9,
        steps=1800,
    ),
}


def add_arguments(p) -> None:
    p.add_argument(
        "--regime",
        choices=sorted(REGIMES),
        default="standard",
        help="standard: the cross-model evaluation; frontier: 4 replicas, H = 15, 1,800 inner steps, "
        "a warm-up, each method tuned on a seed of its own (see edgc_experiments.diloco_regime)",
    )
    p.add_argument(
        "--tune-outer",
        default="0.5,1,2",
        metavar="F,...",
        help="frontier: the outer learning rates tried, as multiples of each method's (default 0.5,1,2)",
    )
    p.add_argument(
        "--tune-inner",
        default="0.8,1.25",
        metavar="F,...",
        help="frontier: the inner learning rates tried at the best outer one, as multiples of the family's, "
        "for torchft's DiLoCo and the sparse syncs ('' for none; default 0.8,1.25)",
    )
    p.add_argument(
        "--tune-on",
        metavar="FAMILY,...",
        help="frontier: the families each method is tuned on; the others take the first one's choice "
        "(default: every family of --models)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="frontier: model families trained at once, each in its own replica processes (default 1)",
    )


def resolve(args, setting) -> None:
    """Fill the flags left at None with the regime's defaults (and the inner steps, unless given)."""
    defaults = dict(REGIMES[args.regime])
    steps = defaults.pop("steps")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if steps is not None and args.steps is None and not args.tiny:
        setting.steps = steps


def multiples(raw: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in raw.split(",") if v.strip()]
    except ValueError:
        raise common.CLIError(f"{flag}: expected numbers separated by commas, got {raw!r}") from None
    if any(v <= 0 for v in values):
        raise common.CLIError(f"{flag}: every multiple must be > 0, got {raw!r}")
    return values


def validate(args, setting) -> None:
    """The frontier's own checks (`diloco.validate` has made the shared ones)."""
    if not multiples(args.tune_outer, "--tune-outer"):
        raise common.CLIError("--tune-outer: at least one multiple (1: the method's own rate)")
    multiples(args.tune_inner, "--tune-inner")
    if args.no_train and not args.reuse:
        raise common.CLIError("--no-train needs --reuse")
    if not 1 <= args.jobs <= 4:
        raise common.CLIError(f"--jobs: must be in 1..4, got {args.jobs}")
    if not tune_on(args) or not set(tune_on(args)) <= set(args.models.split(",")):
        raise common.CLIError(f"--tune-on: families of --models {args.models!r}, got {args.tune_on!r}")
    if len(args.sync_every.split(",")) != 1:
        raise common.CLIError("--sync-every: the frontier regime runs one H")


def tunes_inner(arm: dict) -> bool:
    """Whether the reference tunes the method's inner learning rate: torchft's DiLoCo and the sparse syncs."""
    return arm["method"] == "torchft" or str(arm.get("sync", "")).startswith("sparse")


def evals(outer_steps: int) -> list[int]:
    """The outer steps after which θ_global is validated: every `EVAL_EVERY`, the checkpoints, the last."""
    points = set(range(EVAL_EVERY, outer_steps + 1, EVAL_EVERY)) | set(checkpoints(outer_steps))
    return sorted(points)


def checkpoints(outer_steps: int) -> list[int]:
    return [c for c in CHECKPOINTS if c < outer_steps] + [outer_steps]


def base_arm(args, name: str, steps: int) -> dict:
    """The method's arm before tuning (`diloco.method_arm` for its name, the regime's schedule)."""
    from .diloco_runs import method_arm

    h = int(args.sync_every)
    outer = {"outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum}
    arm = {"sync_every": h, "inner": args.inner, **outer, **method_arm(name)}
    return {**arm, "warmup": round(WARMUP_SHARE * steps), "evals": evals(steps // h)}


def tuned(arm: dict, point: tuple[float, float]) -> dict:
    """``arm`` at a grid point (outer multiple, inner multiple)."""
    return {**arm, "outer_lr": arm["outer_lr"] * point[0], "inner_lr": point[1]}


def label(point: tuple[float, float]) -> str:
    return f"outer×{point[0]:g} inner×{point[1]:g}"


def best(runs: dict) -> str | None:
    """The label of the finished run with the lowest final validation loss (None: every run diverged)."""
    finished = {key: run["val_loss"] for key, run in runs.items() if run.get("val_loss") is not None}
    return min(finished, key=finished.get) if finished else None


class FamilyRuns:
    """One family's runs at `FRONTIER_SIZE` (``tuning``: {method: {label: run}}; ``compare``: {method:
    {seed: run}}), written to ``runs/<family>.json`` after every batch of runs, found again in ``--reuse``
    folders of the same size."""

    def __init__(self, out: Path, family: str, reuse: list[str]):
        self.path = out / "runs" / f"{family}.json"
        self.data: dict = {"size": asdict(FRONTIER_SIZE), "tuning": {}, "compare": {}}
        paths = [Path(f) / "runs" / f"{family}.json" for f in reuse]
        self.earlier = [json.loads(p.read_text()) for p in paths if p.is_file()]
        self.earlier = [e for e in self.earlier if e.get("size") == self.data["size"]]

    def get(self, kind: str, method: str, key: str, arm: dict) -> dict | None:
        """The run of ``arm`` under (kind, method, key), here or in an earlier folder (the same arm only)."""
        for source in [self.data, *self.earlier]:
            run = source.get(kind, {}).get(method, {}).get(key)
            if run is not None and run.get("arm") == arm:
                return run
        return None

    def put(self, kind: str, method: str, key: str, run: dict) -> None:
        self.data[kind].setdefault(method, {})[key] = run

    def save(self) -> None:
        """Written whole or not at all (a copy renamed into place): a run stopped mid-write keeps the last."""
        partial = self.path.with_suffix(".json.partial")
        common.write_json(partial, self.data)
        partial.replace(self.path)


def run(args, out, setting, log=print) -> tuple[list[int], list[str], dict, dict]:
    """Tune every method on the ``--tune-on`` families, then compare them on every family at the chosen
    points (a family not tuned takes the first tuned family's): (seeds, methods, {family: its runs},
    {family: {method: the chosen grid point's label}}), for `diloco_regime_summary.summarise`."""
    families = [f for f in args.models.split(",") if f]
    methods = [m for m in args.methods.split(",") if m]
    seeds = [setting.seed + k for k in range(args.seeds)]
    (out / "runs").mkdir()
    reuse = [f for f in args.reuse.split(",") if f]
    stores = {f: FamilyRuns(out, f, reuse) for f in families}
    tuned_families = [f for f in families if f in tune_on(args)]
    with ThreadPoolExecutor(args.jobs) as pool:
        points = dict(
            zip(tuned_families, pool.map(lambda f: _tune(args, setting, f, methods, stores[f], log), tuned_families))
        )
        for family in families:
            points.setdefault(family, points[tuned_families[0]])
        list(pool.map(lambda f: _compare(args, setting, f, points[f], seeds, stores[f], log), families))
    chosen = {f: {name: None if p is None else label(p) for name, p in points[f].items()} for f in families}
    return seeds, methods, {f: s.data for f, s in stores.items()}, chosen


def tune_on(args) -> list[str]:
    """The families the methods are tuned on (``--tune-on``; every one of ``--models`` by default)."""
    return [f for f in (args.tune_on or args.models).split(",") if f]


def _tune(args, setting, family: str, methods: list[str], store: FamilyRuns, log) -> dict:
    """Each method's grid on the tuning seed: {method: the best point (None: every point diverged)}."""
    arms = {name: base_arm(args, name, setting.steps) for name in methods}
    outer_points = [(m, 1.0) for m in multiples(args.tune_outer, "--tune-outer")]
    tuning_seed = setting.seed + TUNING_SEED_OFFSET
    tried = {name: list(outer_points) for name in methods}
    for p in outer_points:  # the outer rates, in --tune-outer's order, every method at each before the next
        grid = {(name, label(p)): tuned(arms[name], p) for name in methods}
        _train(args, setting, family, store, "tuning", tuning_seed, grid, log)
    second = {}
    for name in methods:  # the inner rates at the best outer one
        if tunes_inner(arms[name]):
            top = _point(store.data["tuning"].get(name, {}), outer_points)
            for n in multiples(args.tune_inner, "--tune-inner"):
                second[name, label((top[0], n))] = tuned(arms[name], (top[0], n))
                tried[name].append((top[0], n))
    _train(args, setting, family, store, "tuning", tuning_seed, second, log)
    return {name: _point(store.data["tuning"].get(name, {}), tried[name], none=True) for name in methods}


def _compare(args, setting, family: str, points: dict, seeds: list[int], store: FamilyRuns, log) -> None:
    """Every method at its chosen point, at every seed (one batch of runs per seed)."""
    arms = {name: tuned(base_arm(args, name, setting.steps), p) for name, p in points.items() if p is not None}
    for seed in seeds:
        _train(args, setting, family, store, "compare", seed, {(n, str(seed)): arm for n, arm in arms.items()}, log)


def _point(runs: dict, points: list[tuple[float, float]], none: bool = False) -> tuple[float, float] | None:
    """The best of ``points`` by their runs (where every one diverged: None if ``none``, else the first)."""
    top = best({key: run for key, run in runs.items() if key in {label(p) for p in points}})
    return next((p for p in points if label(p) == top), None if none else points[0])


def _train(args, setting, family: str, store: FamilyRuns, kind: str, seed: int, arms: dict, log) -> None:
    """Train the arms ``{(method, key): arm}`` at ``seed`` (those found in the store or an earlier folder
    are taken from there), each in a set of replica processes of its own and written to the store as
    soon as it ends: a regime stopped on the way keeps every run it finished, and ``--reuse`` resumes it."""
    from .diloco_runs import train_runs

    todo = {}
    for (name, key), arm in arms.items():
        found = store.get(kind, name, key, arm)
        if found is not None:
            store.put(kind, name, key, found)
        else:
            todo[name, key] = arm
    store.save()
    if todo and args.no_train:
        log(f"  {family} {kind} at seed {seed}: not in the --reuse folders, left out: {', '.join(map(str, todo))}")
        return
    for (name, key), arm in todo.items():
        (result,) = train_runs(
            family,
            [arm],
            seed,
            setting.steps,
            args.replicas,
            timeout_s=24 * 3600,
            cache_dir=setting.cache_dir,
            size=FRONTIER_SIZE,
        )
        store.put(kind, name, key, {**result, "arm": arm, "seed": seed})
        store.save()
        val = result["val_loss"]
        log(
            f"  {family} {kind} {name} {key} (seed {seed}): "
            f"{'diverged at outer step ' + str(result['diverged_at']) if val is None else f'val {val:.4f}'}, "
            f"{result['wall_s'] / 60:.1f} min"
        )
