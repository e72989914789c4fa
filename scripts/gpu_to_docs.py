"""Copy the figures of a GPU run (`python -m edgc_bench.gpu --out DIR`) into docs/gpu.md and the README.

    python scripts/gpu_to_docs.py DIR

Reads DIR/env.json, engine.json, overlap.json, device.json and trace_gloo.json.gz; writes the block
between ``<!-- gpu:start -->`` and ``<!-- gpu:end -->`` in docs/gpu.md and in README.md (a shorter
one there), and docs/img/gpu_overlap.png: the profiled step's CUDA work per stream, so that the
collectives' copies (gloo's streams) can be seen running beside backward (the compute stream).
Nothing is typed: every figure comes from the files.
"""
from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
START, END = "<!-- gpu:start -->", "<!-- gpu:end -->"
GIB = 2 ** 30


def stream_intervals(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """(start, end) µs of every CUDA kernel and copy of the trace, per stream."""
    lanes: dict[str, list[tuple[float, float]]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            lanes.setdefault(f"stream {event.get('tid')}", []).append((event["ts"], event["ts"] + event.get("dur", 0)))
    return {name: sorted(spans) for name, spans in lanes.items()}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_share(lanes: dict[str, list[tuple[float, float]]]) -> tuple[str, float]:
    """The busiest stream (compute) and the share of the other streams' busy time spent while it was busy."""
    compute = max(lanes, key=lambda name: sum(b - a for a, b in lanes[name]))
    busy = _union(lanes[compute])
    others = _union([span for name, spans in lanes.items() if name != compute for span in spans])
    total = sum(b - a for a, b in others)
    covered = 0.0
    for a, b in others:
        for c, d in busy:
            covered += max(0.0, min(b, d) - max(a, c))
    return compute, covered / total if total else float("nan")


def plot_overlap(lanes: dict, compute: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(a for spans in lanes.values() for a, _ in spans)
    names = [compute] + sorted(name for name in lanes if name != compute)
    fig, ax = plt.subplots(figsize=(10, 1 + 0.5 * len(names)))
    for row, name in enumerate(names):
        spans = [((a - origin) / 1e3, (b - a) / 1e3) for a, b in lanes[name]]
        ax.broken_barh(spans, (row - 0.4, 0.8), color="tab:blue" if name == compute else "tab:orange")
    ax.set_yticks(range(len(names)), [f"{n} (compute)" if n == compute else f"{n} (collective copies)" for n in names])
    ax.set_xlabel("ms since the step's first CUDA activity (rank 0)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def engine_table(rows: list[dict]) -> list[str]:
    lines = ["| model | rank | powerSGD_hook s/step | EDGC s/step | EDGC ÷ powerSGD | EDGC ÷ backward | "
             "EDGC engine alone s | kernels (powerSGD / EDGC) | memory beyond the gradients GiB (powerSGD / EDGC) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    hooks = {(r["model"], r["method"], r["rank"]): r for r in rows}
    for (model, method, rank), ours in hooks.items():
        theirs = hooks.get((model, "powersgd", rank))
        if method != "edgc" or theirs is None:
            continue
        lines.append(f"| {model} | {rank} | {theirs['hook_s']:.4f} | {ours['hook_s']:.4f} | "
                     f"{ours['hook_s'] / theirs['hook_s']:.2f} | {ours['hook_over_backward']:.1%} | "
                     f"{ours.get('engine_alone_s', float('nan')):.4f} | {theirs['hook_kernels']} / {ours['hook_kernels']} | "
                     f"{theirs['extra_peak_bytes'] / GIB:.2f} / {ours['extra_peak_bytes'] / GIB:.2f} |")
    return lines


def device_table(device: dict) -> list[str]:
    measured, preset = device["measured"], device["preset"]
    tera = 1e12
    rows = [("bf16 matmul TFLOP/s", measured["matmul_flops"]["bf16"] / tera,
             preset["matmul_flops"].get("fp16", 0) * preset["mfu"] / tera),
            ("tf32 matmul TFLOP/s", measured["matmul_flops"]["tf32"] / tera,
             preset["matmul_flops"].get("tf32", 0) * preset["mfu"] / tera),
            ("fp32 matmul TFLOP/s", measured["matmul_flops"]["fp32"] / tera,
             preset["matmul_flops"].get("fp32", 0) * preset["mfu"] / tera),
            ("memory GB/s (read + write)", measured["mem_bytes_per_s"] / 1e9, preset["mem_bytes_per_s"] / 1e9),
            ("per-op cost µs (tiny eager op)", measured["launch_s"] * 1e6, preset["launch_s"] * 1e6),
            ("skinny GEMM read GB/s", measured["skinny_read_bytes_per_s"] / 1e9, preset["skinny_read_bytes_per_s"] / 1e9),
            ("skinny GEMM write GB/s", measured["skinny_write_bytes_per_s"] / 1e9, preset["skinny_write_bytes_per_s"] / 1e9)]
    lines = ["| quantity | measured | `edgc simulate` preset `h100` (× mfu) |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {value:.3g} | {value_preset:.3g} |" if value_preset else f"| {name} | {value:.3g} | not modelled |"
              for name, value, value_preset in rows]
    return lines


def build(folder: Path, image: Path) -> tuple[list[str], list[str]]:
    env = json.loads((folder / "env.json").read_text())
    engine = json.loads((folder / "engine.json").read_text())
    runs = json.loads((folder / "overlap.json").read_text())
    device = json.loads((folder / "device.json").read_text())
    with gzip.open(folder / "trace_gloo.json.gz") as handle:
        lanes = stream_intervals(json.load(handle))
    compute, share = overlap_share(lanes)
    plot_overlap(lanes, compute, image)
    head = (f"`python -m edgc_bench.gpu --out {folder.name}` on {env['device']} ({env['nvidia_smi']}), torch "
            f"{env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, {env['date']}.")
    checks = []
    for backend, run in runs.items():
        reads = sorted(set(run["host_reads_per_step"][2:]))
        checks.append(f"- {backend}, {run['world_size']} process(es), GPT-2 {run['model']}: phase {run['phase']} at rank "
                      f"{run['rank']}, replicas identical: {run['replicas_identical']}, host reads per step after "
                      f"the first two: {reads}.")
    overlap_line = (f"- In the profiled gloo step, {share:.0%} of the collectives' CUDA copy time runs while the compute "
                    f"stream is busy (docs/img/gpu_overlap.png).")
    docs = [head, "", *checks, overlap_line, "", "![overlap](img/gpu_overlap.png)", "",
            "Engine time per step (hooked step − plain step, DDP on NCCL with one process, bf16 gradients):", "",
            *engine_table(engine), "", "The simulator's host profile measured on this GPU:", "", *device_table(device)]
    xl = [r for r in engine if r["model"] == "xl" and r["rank"] == 32 and r["method"] in ("edgc", "powersgd")]
    readme = [head, "", *checks, overlap_line]
    if len(xl) == 2:
        ours, theirs = (r for r in sorted(xl, key=lambda r: r["method"] != "edgc"))
        readme.append(f"- GPT-2 XL at rank 32: EDGC {ours['hook_s']:.4f} s per step, {ours['hook_s'] / theirs['hook_s']:.2f}× "
                      f"powerSGD_hook, {ours['hook_over_backward']:.1%} of backward (goals ≤ 0.5× and ≤ 5 %).")
    readme.append("\nEvery figure, the trace and the simulator comparison: [docs/gpu.md](docs/gpu.md).")
    return docs, readme


def replace_block(path: Path, lines: list[str]) -> None:
    text = path.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{path}: markers {START} … {END} not found")
    block = "\n".join([START, *lines, END])
    path.write_text(re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    docs, readme = build(Path(argv[0]), REPO / "docs" / "img" / "gpu_overlap.png")
    replace_block(REPO / "docs" / "gpu.md", docs)
    replace_block(REPO / "README.md", readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
