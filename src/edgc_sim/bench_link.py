"""The bench's emulated link as the calibration sees it: `BenchLink` (latency, rate, tbf burst), fitted
to a bench's ``calibration.json`` sweep (`fit_bench_link`, `bench_link`) or nominal (`nominal_link`)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .tbf import burst_bytes

SMALL_WIRE = 64 * 1024  # bytes on the wire per host up to which an all-reduce is latency alone
LARGE_WIRE = 4 * 2**20  # ... and from which bytes / beta dominates


@dataclass(frozen=True)
class BenchLink:
    """The emulated link as one collective sees it: tc tbf is a token bucket of `burst_bytes`
    refilled at `bytes_per_s`; every collective also pays a fixed latency."""

    alpha_s: float  #: fixed cost of one ring step; an all-reduce over n hosts pays 2(n-1) of them
    bytes_per_s: float  #: beta: the sustained rate per host and direction
    burst_bytes: float  #: what one message gets through at once after an idle gap
    source: str = ""

    def latency_s(self, world: int, all_gather: bool = False) -> float:
        """Fixed cost of one all-reduce (2(n-1) ring steps) or all-gather (n-1) over `world` hosts."""
        return (world - 1) * (1 if all_gather else 2) * self.alpha_s if world > 1 else 0.0

    def bytes_s(self, world: int, nbytes: float, all_gather: bool = False) -> float:
        """Transfer time of one collective of an `nbytes` buffer: what each host sends (2(n-1)/n of
        it for an all-reduce, (n-1) times it for an all-gather) beyond the burst, at beta."""
        if world <= 1:
            return 0.0
        factor = world - 1 if all_gather else 2 * (world - 1) / world
        return max(0.0, factor * nbytes - self.burst_bytes) / self.bytes_per_s

    def collective_s(self, world: int, nbytes: float, all_gather: bool = False) -> float:
        """One all-reduce (or all-gather) of an `nbytes` buffer over `world` hosts."""
        return self.latency_s(world, all_gather) + self.bytes_s(world, nbytes, all_gather)

    def describe(self, world: int = 2) -> str:
        return (
            f"beta {8 * self.bytes_per_s / 1e6:.0f} Mbit/s, {1e6 * self.latency_s(world):.0f} us per "
            f"all-reduce (alpha {1e6 * self.alpha_s:.0f} us per ring step), burst {self.burst_bytes / 1e3:.0f} kB"
        )


def fit_bench_link(
    world: int, sizes_bytes: Sequence[float], seconds: Sequence[float], burst_bytes: float = 0.0
) -> tuple:
    """(alpha_s, bytes_per_s) of an all-reduce sweep, T(S) = 2(n-1) alpha + max(0, f S - B) / beta
    with f = 2(n-1)/n and B the tbf burst the links were given; each number from the sizes where it
    dominates: beta from the least-squares slope over the sizes with f S >= 4 MiB (the burst only
    shifts them), alpha from the mean time of those with f S <= 64 KiB (latency alone), / 2(n-1);
    alpha = 0 without such sizes. (B itself is not fitted: on a loaded machine the sizes near it
    scatter by more than the burst is worth.)"""
    if world < 2:
        raise ValueError("a link fit needs at least 2 hosts")
    factor = 2 * (world - 1) / world
    points = [(factor * float(s), float(t)) for s, t in zip(sizes_bytes, seconds)]
    large = [(w, t) for w, t in points if w >= LARGE_WIRE]
    if len({w for w, _ in large}) < 2:
        raise ValueError("the link fit needs at least two sizes of >= 4 MiB on the wire")
    mean_w = statistics.fmean(w for w, _ in large)
    mean_t = statistics.fmean(t for _, t in large)
    slope = sum((w - mean_w) * (t - mean_t) for w, t in large) / sum((w - mean_w) ** 2 for w, _ in large)
    if slope <= 0:
        raise ValueError("all-reduce time did not grow with size; cannot fit a bandwidth")
    small = [t - max(0.0, w - burst_bytes) * slope for w, t in points if w <= SMALL_WIRE]
    latency = max(0.0, statistics.fmean(small)) if small else 0.0
    return latency / (2 * (world - 1)), 1.0 / slope


def _burst(rows: list, world: int) -> float:
    """The tbf burst of a calibration's links: recorded (newer files), else `edgc_sim.tbf.burst_bytes` of the
    rate implied by a row's bytes / rate bound (ideal_s = f S 8 / R), else 0 (unlimited)."""
    if rows[0].get("burst_bytes") is not None:
        return float(rows[0]["burst_bytes"])
    row = rows[-1]
    if not row.get("ideal_s"):
        return 0.0
    wire = 2 * (world - 1) / world * float(row["mb"]) * 2**20
    return float(burst_bytes(wire * 8 / float(row["ideal_s"]) / 1e6))


def bench_link(calibration_json: str | Path, world: int = 2) -> BenchLink:
    """fit_bench_link of an `edgc bench` calibration.json: rows of {"mb": MiB all-reduced,
    "seconds": median time, "mean_s": mean time and "burst_bytes" (newer files)}; the mean is used
    where present (a step's many collectives add up to their mean, not their median)."""
    rows = json.loads(Path(calibration_json).read_text())
    if not isinstance(rows, list) or not rows or any("mb" not in r or "seconds" not in r for r in rows):
        raise ValueError(f"{calibration_json}: expected a list of {{'mb', 'seconds'}} rows")
    sizes = [float(r["mb"]) * 2**20 for r in rows]
    times = [float(r.get("mean_s", r["seconds"])) for r in rows]
    burst = _burst(rows, world)
    alpha, beta = fit_bench_link(world, sizes, times, burst)
    link = BenchLink(alpha, beta, burst)
    note = (
        ""
        if any(2 * (world - 1) / world * s <= SMALL_WIRE for s in sizes)
        else " (no size <= 64 KiB measured: latency unknown, taken as 0)"
    )
    return replace(link, source=f"fit of {calibration_json}: {link.describe(world)}{note}")


def nominal_link(mbit: float) -> BenchLink:
    """The tbf rate as given (--link-mbit), no latency, no burst: a bound, not a fit."""
    return BenchLink(0.0, mbit * 1e6 / 8, 0.0, f"nominal {mbit:g} Mbit/s, no latency, no burst")


def find_bench_calibration(run_dirs: Sequence[str | Path]) -> Path | None:
    """`<bench>/calibration.json` when every run folder is `<bench>/runs/<method>`."""
    parents = {Path(d).resolve().parent.parent for d in run_dirs}
    if len(parents) == 1:
        path = parents.pop() / "calibration.json"
        if path.is_file():
            return path
    return None
