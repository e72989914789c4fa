"""A profiled step of the GPU bench (a Chrome trace from torch.profiler) as streams of device work.

Each kernel, copy and memset is put on its CUDA stream and given a kind from its name: a
collective (NCCL's kernels), the injected delay (``torch.cuda._sleep``'s spin kernel, see
`edgc_bench.gpu_overlap.CollectiveDelay`), a copy or memset, or compute. The stream with the most
compute is backward's; `compute_idle_s` is how long it sat idle between its first and last kernel,
which grows by the injected delay wherever backward waits for a collective.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
COLOURS = {"compute": "tab:blue", "collective": "tab:red", "delay": "0.6", "copy": "tab:orange"}


def kind(name: str, category: str) -> str:
    lowered = name.lower()
    if "nccl" in lowered:
        return "collective"
    if "spin" in lowered or "sleep" in lowered:
        return "delay"
    return "copy" if category != "kernel" else "compute"


def read_trace(path: Path) -> dict:
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as handle:
        return json.load(handle)


def device_spans(trace: dict) -> dict[int, list[tuple[float, float, str]]]:
    """(start µs, end µs, kind) of the device work of a trace, per CUDA stream, in time order."""
    streams: dict[int, list[tuple[float, float, str]]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in DEVICE_CATEGORIES:
            stream = event.get("args", {}).get("stream", event.get("tid"))
            start = float(event["ts"])
            streams.setdefault(stream, []).append(
                (start, start + float(event.get("dur", 0)), kind(event["name"], event["cat"]))
            )
    return {stream: sorted(spans) for stream, spans in streams.items()}


def busy_s(spans: list[tuple[float, float, str]], only: str | None = None) -> float:
    return sum(end - start for start, end, what in spans if only is None or what == only) / 1e6


def lanes(streams: dict[int, list]) -> list[tuple[str, list]]:
    """(label, spans) to draw, backward's stream first: the compute stream, then every stream with
    collectives, delays or compute of its own, then all copy-only streams together (gloo uses many)."""
    if not streams:
        return []
    compute = max(streams, key=lambda s: busy_s(streams[s], "compute"))
    drawn, copies = [(f"stream {compute}: backward (compute stream)", streams[compute])], []
    for stream in sorted(s for s in streams if s != compute):
        kinds = {what for _, _, what in streams[stream]}
        if kinds == {"copy"}:
            copies += streams[stream]
            continue
        role = "collectives" if "collective" in kinds else "injected delay" if "delay" in kinds else "side stream"
        drawn.append((f"stream {stream}: {role}", streams[stream]))
    if copies:
        drawn.append(
            (
                f"{len([s for s in streams if {w for _, _, w in streams[s]} == {'copy'}])} copy-only streams",
                sorted(copies),
            )
        )
    return drawn


def compute_idle_s(streams: dict[int, list], gap_us: float = 5.0) -> float:
    """Seconds the compute stream sat idle (gaps over ``gap_us``) between its first and last span."""
    compute = max(streams, key=lambda s: busy_s(streams[s], "compute"))
    idle, reached = 0.0, None
    for start, end, _ in streams[compute]:
        if reached is not None and start - reached > gap_us:
            idle += start - reached
        reached = end if reached is None else max(reached, end)
    return idle / 1e6


def summary(trace: dict) -> dict:
    streams = device_spans(trace)
    if not streams:
        return {"streams": 0}
    every = [span for spans in streams.values() for span in spans]
    return {
        "streams": len(streams),
        "span_s": (max(e for _, e, _ in every) - min(s for s, _, _ in every)) / 1e6,
        "compute_idle_s": compute_idle_s(streams),
        **{f"{what}_busy_s": sum(busy_s(spans, what) for spans in streams.values()) for what in COLOURS},
    }


def plot(trace: dict, path: Path, title: str) -> None:
    """The device work per stream over the step (matplotlib, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    drawn = lanes(device_spans(trace))
    origin = min(start for _, spans in drawn for start, _, _ in spans)
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.55 * len(drawn)))
    for row, (_, spans) in enumerate(drawn):
        for what, colour in COLOURS.items():
            bars = [((start - origin) / 1e3, max((end - start) / 1e3, 0.002)) for start, end, w in spans if w == what]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=colour)
    ax.set_yticks(range(len(drawn)), [label for label, _ in drawn])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first device activity")
    ax.set_title(title, fontsize=10)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
