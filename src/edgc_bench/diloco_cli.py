"""The flags of `edgc bench --diloco` and their checks (cli.py calls, diloco_bench.py runs it)."""

from __future__ import annotations

import argparse

from edgc_cli.errors import CLIError

# --diloco's own defaults for flags the other modes share: three groups (a kill leaves two), the tiny
# preset (60 steps of three groups are about a minute of compute on two cores, so five methods at
# two links, twice, fit in about 45 minutes), two rounds. One sequence per step would halve the
# compute, but DiLoCo + EDGC then ended 1.0–1.4 % above uncompressed DiLoCo (0.7 % at two).
DILOCO_DEFAULTS = {"hosts": 3, "preset": "tiny", "eval_batches": 2, "rounds": 2}


def add_diloco_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--diloco",
        action="store_true",
        help="DDP, DDP + EDGC, DiLoCo (torchft's), DiLoCo + EDGC and Streaming DiLoCo at each of --rates, "
        "one torchft replica group per host, then a kill pass (docs/bench.md)",
    )
    p.add_argument(
        "--rates",
        default="100,20",
        help="with --diloco: comma-separated link rates in Mbit/s, one network each, the slow one last "
        "(default %(default)s)",
    )
    p.add_argument(
        "--sync-every",
        type=int,
        default=10,
        help="with --diloco: DiLoCo's inner steps per outer step H (default %(default)s)",
    )
    p.add_argument(
        "--fragments",
        type=int,
        default=2,
        help="with --diloco: Streaming DiLoCo's model fragments (default %(default)s)",
    )
    p.add_argument(
        "--outer-sync",
        default="quant3-2s",
        help="with --diloco: the outer sync of the DiLoCo + EDGC methods, a registered sync method's name "
        "or edgc (PowerSGD at the bench's ranks; default %(default)s, DiLoCo's default)",
    )
    p.add_argument(
        "--scaling",
        default=None,
        metavar="HOSTS,...",
        help="with --diloco: instead of the rounds, the wire per process per outer step and the outer step's "
        "time at each of these host counts (one replica group each), for torchft's DiLoCo and each of "
        "--scaling-syncs, at the slowest of --rates (docs/bench.md)",
    )
    p.add_argument(
        "--scaling-syncs",
        default="quant3,quant3-2s",
        help="with --scaling: the outer syncs beside torchft's DiLoCo (default %(default)s)",
    )
    p.add_argument(
        "--delay-ms",
        default="0",
        metavar="MS,...",
        help="with --scaling: one-way delays added on every path between two hosts, one network each "
        "(a round trip is twice it; edgc_bench.delay_line; default %(default)s)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=150.0,
        help="with --diloco: seconds of training per run; a run still going then stops at its next sync "
        "(default %(default)s)",
    )


def edgc_items(items: list[str]) -> dict:
    """``--edgc KEY=VALUE`` items as an EDGCConfig table, as `edgc train` reads them (`edgc_train.cli`)."""
    from edgc_train.cli import parse_edgc_flags

    return parse_edgc_flags(items)


def diloco_options(settings, args: argparse.Namespace):
    """DilocoOptions from the flags, each bad value one line."""
    from .diloco_bench import DilocoOptions

    try:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise CLIError(f"--rates: expected Mbit/s values separated by commas, got {args.rates!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise CLIError(f"--rates: every rate must be > 0, got {args.rates!r}")
    h, f = args.sync_every, args.fragments
    if h < 2 or settings.steps % h:
        raise CLIError(f"--sync-every: must be ≥ 2 and divide --steps = {settings.steps}, got {h}")
    if f < 2 or h % f:
        raise CLIError(f"--fragments: must be ≥ 2 and divide --sync-every = {h}, got {f}")
    outer = settings.steps // h
    # early: the killed group's restart and heal take several outer steps of a run this short
    kill_at = args.kill_at if args.kill_at is not None else max(1, outer // 4)
    if kill_at == 0:  # no kill pass
        kill_at = None
    elif not 1 <= kill_at <= outer - 2:
        raise CLIError(
            f"--kill-at: with --diloco an outer step in [1, outer steps - 2] = [1, {outer - 2}] "
            f"(0: no kill pass), got {kill_at}"
        )
    if args.time_budget <= 0:
        raise CLIError(f"--time-budget: must be > 0, got {args.time_budget:g}")
    from .diloco_bench import METHODS

    methods = tuple(m.strip() for m in (args.methods or "").split(",") if m.strip()) or METHODS
    syncs = [v.strip() for v in args.scaling_syncs.split(",") if v.strip()]
    checked = [("--outer-sync", args.outer_sync)] + [("--methods", m.partition("@")[2]) for m in methods]
    for flag, spec in checked + [("--scaling-syncs", v) for v in syncs]:
        _check_outer_sync(flag, spec)
    bad = [m for m in methods if m.partition("@")[0] not in METHODS or ("@" in m and not m.startswith("diloco-edgc@"))]
    if bad:
        raise CLIError(f"--methods: each of {', '.join(METHODS)} or diloco-edgc@SPEC, got {', '.join(bad)}")
    scaling = _host_counts(args.scaling)
    try:
        delays = tuple(float(v) for v in args.delay_ms.split(",") if v.strip())
    except ValueError:
        raise CLIError(f"--delay-ms: expected milliseconds separated by commas, got {args.delay_ms!r}") from None
    if not delays or any(d < 0 for d in delays):
        raise CLIError(f"--delay-ms: every delay must be ≥ 0, got {args.delay_ms!r}")
    return DilocoOptions(
        rates=rates,
        sync_every=h,
        fragments=f,
        eval_every=settings.eval_every,
        kill_at=kill_at,
        time_budget_s=args.time_budget,
        edgc=tuple(edgc_items(args.edgc).items()),
        outer_sync=args.outer_sync,
        methods=methods,
        scaling=scaling,
        scaling_syncs=tuple(syncs),
        delays_ms=delays,
    )


def _host_counts(raw: str | None) -> tuple[int, ...]:
    if raw is None:
        return ()
    try:
        counts = tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise CLIError(f"--scaling: expected host counts separated by commas, got {raw!r}") from None
    if not counts or any(not 2 <= c <= 64 for c in counts):
        raise CLIError(f"--scaling: every host count must be in 2..64, got {raw!r}")
    return counts


def _check_outer_sync(flag: str, spec: str) -> None:
    from edgc.sync.sync_methods import outer_sync_spec

    if spec and spec != "edgc":
        try:
            outer_sync_spec(spec)
        except ValueError as exc:
            raise CLIError(f"{flag}: edgc or a registered sync method with DiLoCo's modifiers: {exc}") from None
