"""Copy the figures of GPU runs (`python -m edgc_bench.gpu --out DIR`) into docs/gpu.md and the README.

    python scripts/gpu_to_docs.py RUN [--before BEFORE] [--profiled PROFILED]

RUN and BEFORE are folders of a run's files: env.json, engine.json, overlap.json, device.json and,
where the run wrote them, count.json and trace_nccl.json.gz / trace_gloo.json.gz. With --before,
every figure the two runs share is shown as before → after. Writes the block between
``<!-- gpu-figures:start -->`` … ``end`` in docs/gpu.md and the shorter ``gpu`` block in README.md, and
docs/img/gpu_overlap.png from RUN's trace (the NCCL run's, with its injected delay, else gloo's)
when RUN has one. The first run's small files are kept in docs/gpu/before/, so
``python scripts/gpu_to_docs.py docs/gpu/before`` rebuilds the docs from a clean clone (the
picture then stays as it is). Nothing is typed: every figure comes from the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import write  # noqa: E402  (finds the page that holds a block and replaces it)

from edgc_bench import gpu_trace  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FIGURES, SUMMARY = "gpu-figures", "gpu"  # the blocks of docs/gpu.md and of the README
GIB = 2**30
GOAL_RATIO, GOAL_SHARE = 0.5, 0.05  # the GPU goals: EDGC ≤ 0.5× powerSGD_hook, ≤ 5 % of backward
DASH = "–"


# ---------------------------------------------------------------------------- reading
def _json(folder: Path, name: str):
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_run(folder: Path) -> dict:
    """A run's files; engine.json in one shape (the first run wrote a list of training-step rows)."""
    engine = _json(folder, "engine") or {}
    if isinstance(engine, list):
        engine = {"steps": [dict(row, bucket_cap_mb=25, ddp_default=True) for row in engine]}
    engine = {"settings": {}, "steps": [], "hook_alone": [], "skipped": [], "errors": [], **engine}
    traces = [folder / f"trace_{key}.json.gz" for key in ("nccl", "gloo")]
    return {
        "folder": folder,
        "env": _json(folder, "env") or {},
        "engine": engine,
        "overlap": _json(folder, "overlap") or {},
        "device": _json(folder, "device"),
        "count": _json(folder, "count"),
        "trace": next((path for path in traces if path.exists()), None),
    }


def goal_rank(run: dict) -> int:
    return run["engine"]["settings"].get("goal_rank", 32)


SIZES = ("tiny", "small", "medium", "large", "xl")


def by_size(key: tuple) -> tuple:
    """Sort key of rows keyed by (model, …): GPT-2's sizes in order, then the rest of the key."""
    return (SIZES.index(key[0]) if key[0] in SIZES else len(SIZES), *key[1:])


def largest(run: dict) -> str | None:
    models = {(row["model"],) for row in run["engine"]["steps"] + run["engine"]["hook_alone"]}
    return max(models, key=by_size)[0] if models else None


def step_row(run: dict, model: str, method: str, rank: int, cap=25) -> dict | None:
    return next(
        (
            r
            for r in run["engine"]["steps"]
            if (r["model"], r["method"], r.get("rank"), r["bucket_cap_mb"])
            == (model, method, rank if method != "none" else 0, cap)
        ),
        None,
    )


def alone_row(run: dict, model: str, method: str, dtype: str, rank: int, cap=25) -> dict | None:
    return next(
        (
            r
            for r in run["engine"]["hook_alone"]
            if (r["model"], r["method"], r["grad_dtype"], r["rank"], r["bucket_cap_mb"])
            == (model, method, dtype, rank, cap)
        ),
        None,
    )


def count_row(run: dict | None, model: str, cap) -> dict | None:
    if run is None or not run["count"] or "hook" not in run["count"]:
        return None
    return next((r for r in run["count"]["hook"] if (r["model"], r["bucket_cap_mb"]) == (model, cap)), None)


# ---------------------------------------------------------------------------- formatting
def fmt(value, spec: str = ".3g", scale: float = 1.0) -> str:
    return DASH if value is None else format(value * scale if scale != 1 else value, spec)


def cell(run: dict, before: dict | None, find, key: str, spec: str = ".3g", scale: float = 1.0) -> str:
    """``find(run)[key]``, as ``before → after`` where there is a before run."""
    after = fmt(get(find(run), key), spec, scale)
    return after if before is None else f"{fmt(get(find(before), key), spec, scale)} → {after}"


def get(row: dict | None, key: str, default=None):
    return default if row is None else row.get(key, default)


def ratio(a, b):
    return None if a is None or not b else a / b


def verdict(value, goal: float, unit: str, spec: str) -> str:
    if value is None:
        return "not measured"
    if value <= goal:
        return f"met: {format(value, spec)}{unit} (goal ≤ {format(goal, spec)}{unit})"
    return f"missed: {format(value, spec)}{unit}, {value / goal:.1f}× the goal of ≤ {format(goal, spec)}{unit}"


# ---------------------------------------------------------------------------- sections
def shown(folder: Path) -> str:
    """A run folder as the docs name it: relative to the repository when inside it."""
    try:
        return str(folder.resolve().relative_to(REPO))
    except ValueError:
        return str(folder)


def describe(run: dict, role: str) -> str:
    env = run["env"]
    return (
        f"- {role}: `{shown(run['folder'])}`: {env.get('device', '?')} ({env.get('nvidia_smi', 'no nvidia-smi')}), "
        "torch "
        f"{env.get('torch', '?')}, CUDA {env.get('cuda', DASH)}, NCCL {env.get('nccl', DASH)}, {env.get('date', '?')}."
    )


def goals(run: dict) -> list[str]:
    """The GPU goals at the goal rank on the largest model, met or missed by how much."""
    model, rank = largest(run), goal_rank(run)
    if model is None:
        return ["- Goals: no engine figures in this run."]
    lines = []
    for dtype in ("bfloat16", "float32"):
        ours, theirs = alone_row(run, model, "edgc", dtype, rank), alone_row(run, model, "powersgd", dtype, rank)
        if ours and theirs:
            lines.append(
                f"- EDGC ÷ powerSGD_hook, each hook alone on {dtype} gradients, GPT-2 {model} rank {rank}: "
                + verdict(ratio(ours["seconds"], theirs["seconds"]), GOAL_RATIO, "×", ".2f")
                + "."
            )
    ours, theirs = step_row(run, model, "edgc", rank), step_row(run, model, "powersgd", rank)
    if ours and theirs:
        lines.append(
            f"- EDGC ÷ powerSGD_hook, the hook's share of a bf16 training step, GPT-2 {model} rank {rank}: "
            + verdict(ratio(ours["hook_s"], theirs["hook_s"]), GOAL_RATIO, "×", ".2f")
            + "."
        )
    if ours:
        lines.append(
            f"- EDGC's added step time ÷ backward, GPT-2 {model} rank {rank}: "
            + verdict(ours["hook_over_backward"] * 100, GOAL_SHARE * 100, " %", ".3g")
            + "."
        )
    alone = alone_row(run, model, "edgc", "bfloat16", rank)
    if alone and alone.get("plain_backward_s"):
        lines.append(
            f"- EDGC's hook alone ÷ backward (all of its work, none hidden), GPT-2 {model} rank {rank}: "
            + verdict(alone["seconds"] / alone["plain_backward_s"] * 100, GOAL_SHARE * 100, " %", ".3g")
            + "."
        )
    return lines


def markdown_table(titles: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """A table's lines; ``align`` has one letter per column: l(eft) or r(ight)."""
    rule = "|" + "".join(" --- |" if side == "l" else " ---: |" for side in align)
    return ["| " + " | ".join(titles) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows)]


def step_table(run: dict, before: dict | None) -> list[str]:
    """The hooks' share of a training step (DDP, bf16, DDP's default buckets) as RUN measured it,
    before → after where BEFORE measured the same."""
    keys = sorted(
        {
            (r["model"], r["method"], r["rank"])
            for r in run["engine"]["steps"]
            if r["method"] != "none" and r["bucket_cap_mb"] == 25
        },
        key=by_size,
    )
    rows = []
    for model, method, rank in keys:
        hooked, plain = (lambda r: step_row(r, model, method, rank)), (lambda r: step_row(r, model, "none", 0))
        rows.append(
            [
                model,
                method,
                str(rank),
                cell(run, before, plain, "step_s"),
                cell(run, before, hooked, "step_s"),
                cell(run, before, hooked, "hook_s"),
                cell(run, before, hooked, "hook_over_backward", ".0%"),
                cell(run, before, hooked, "hook_kernels", "d"),
                cell(run, before, hooked, "extra_peak_bytes", ".2f", 1 / GIB),
            ]
        )
    return markdown_table(
        [
            "model",
            "hook",
            "rank",
            "plain step s",
            "hooked step s",
            "hook s",
            "hook ÷ backward",
            "hook kernels",
            "memory beyond the gradients GiB",
        ],
        "llrrrrrrr",
        rows,
    )


def alone_table(run: dict) -> list[str]:
    """Each hook alone at DDP's default buckets: EDGC against powerSGD_hook on bf16 and fp32 gradients."""
    keys = sorted(
        {(r["model"], r["rank"]) for r in run["engine"]["hook_alone"] if r["bucket_cap_mb"] == 25}, key=by_size
    )
    rows = []
    for model, rank in keys:
        found = {
            (m, d): alone_row(run, model, m, d, rank) for m in ("edgc", "powersgd") for d in ("bfloat16", "float32")
        }
        seconds = {key: get(row, "seconds") for key, row in found.items()}
        ours, theirs = found["edgc", "bfloat16"], found["powersgd", "bfloat16"]
        predicted = get(count_row(run, model, 25), "dispatches") if rank == goal_rank(run) else None
        rows.append(
            [
                model,
                str(rank),
                *(
                    value
                    for dtype in ("bfloat16", "float32")
                    for value in (
                        fmt(seconds["edgc", dtype], ".4f"),
                        fmt(seconds["powersgd", dtype], ".4f"),
                        fmt(ratio(seconds["edgc", dtype], seconds["powersgd", dtype]), ".2f"),
                    )
                ),
                fmt(ratio(get(ours, "seconds"), get(ours, "plain_backward_s")), ".0%"),
                f"{fmt(get(ours, 'kernels'), 'd')} / {fmt(get(theirs, 'kernels'), 'd')}",
                fmt(predicted, "d"),
                f"{fmt(get(ours, 'state_bytes'), '.2f', 1 / GIB)} / {fmt(get(theirs, 'state_bytes'), '.2f', 1 / GIB)}",
            ]
        )
    return markdown_table(
        [
            "model",
            "rank",
            "EDGC bf16 s",
            "powerSGD bf16 s",
            "ratio",
            "EDGC fp32 s",
            "powerSGD fp32 s",
            "ratio",
            "EDGC bf16 ÷ backward",
            "kernels EDGC / powerSGD (bf16)",
            "dispatches predicted",
            "state GiB EDGC / powerSGD (bf16)",
        ],
        "l" + "r" * 11,
        rows,
    )


def bucket_table(run: dict) -> list[str]:
    """EDGC at the goal rank per DDP bucket size: the hook alone, its kernels, the predicted dispatches."""
    rank = goal_rank(run)
    keys = sorted(
        {
            (r["model"], r["bucket_cap_mb"])
            for r in run["engine"]["hook_alone"]
            if r["method"] == "edgc" and r["rank"] == rank
        },
        key=by_size,
    )
    rows = []
    for model, cap in keys:
        bf16, fp32 = (
            alone_row(run, model, "edgc", "bfloat16", rank, cap),
            alone_row(run, model, "edgc", "float32", rank, cap),
        )
        rows.append(
            [
                model,
                f"{fmt(cap, 'g')}{' (default)' if cap == 25 else ''}",
                fmt(get(bf16, "buckets"), "d"),
                fmt(get(bf16, "seconds"), ".4f"),
                fmt(get(fp32, "seconds"), ".4f"),
                fmt(get(bf16, "kernels"), "d"),
                fmt(get(count_row(run, model, cap), "dispatches"), "d"),
                fmt(get(step_row(run, model, "edgc", rank, cap), "hook_s"), ".4f"),
            ]
        )
    return markdown_table(
        [
            "model",
            "bucket MB",
            "buckets",
            "EDGC alone bf16 s",
            "fp32 s",
            "kernels (bf16)",
            "dispatches predicted",
            "hook's share of a step s",
        ],
        "lrrrrrrr",
        rows,
    )


def count_table(count: dict) -> list[str]:
    """The CPU's dispatch count of one compressed step through the DDP hook (count.json)."""
    rows = [
        [
            row["model"],
            f"{fmt(row['bucket_cap_mb'], 'g')}{' (default)' if row['ddp_default'] else ''}",
            str(row["dispatches"]),
            str(row["linalg"]),
            f"{row['compressed']} of {row['matrices']}",
            str(row["buckets"]),
            str(row["collectives"]),
            str(row["host_reads"]),
            ", ".join(f"{name} {n}" for name, n in list(row["top_ops"].items())[:5]),
        ]
        for row in count["hook"]
    ]
    same = ", ".join(f"{row['matrices']} → {row['dispatches']}" for row in count["engine_same_shape"])
    shape = "×".join(map(str, count["engine_same_shape"][0]["shape"])) if count["engine_same_shape"] else DASH
    return markdown_table(
        [
            "model",
            "bucket MB",
            "dispatches",
            "linalg",
            "matrices compressed",
            "buckets",
            "collectives",
            "host reads",
            "most dispatched",
        ],
        "lrrrrrrrl",
        rows,
    ) + [
        "",
        f"One engine call on one bucket of same-shape {shape} matrices (matrices → dispatches): {same}. "
        f"Rank {count['rank']}, {count['dtype']} gradients, torch {count['torch']}; counted: {count['rule']}.",
    ]


def overlap_lines(run: dict, before: dict | None) -> list[str]:
    lines = []
    for key, result in run["overlap"].items():
        if "error" in result:
            lines.append(f"- {key}: failed: `{result['error'].strip().splitlines()[-1]}`")
            continue
        reads = sorted(set(result["host_reads_per_step"][result.get("settle_steps", 2) :]))
        prior = get((before or {}).get("overlap", {}).get(key), "replicas_identical")
        replicas = (
            ""
            if result["world_size"] == 1
            else (
                " replicas identical: "
                f"{result['replicas_identical']}{f' (before: {prior})' if before and prior is not None else ''};"
            )
        )
        lines.append(
            f"- {result['backend']}, {result['world_size']} process(es), GPT-2 {result['model']}, EDGC rank "
            f"{result['rank']}:{replicas} host reads per step after the first {result.get('settle_steps', 2)}: "
            f"{reads}; {result['collectives_last_step']} collectives per step."
        )
        if "backward_wait_s" in result:
            injected, waited = result["injected_s_per_step"], result["backward_wait_s"]
            lines.append(
                f"  - With {result['delay_ms']:g} ms injected per all-reduce ({injected * 1e3:.3g} ms per step), "
                f"every gradient was computed {waited * 1e3:.3g} ms later than without "
                f"({fmt(ratio(waited, injected), '.0%')} of the injected delay): step "
                f"{result['plain']['step_s'] * 1e3:.4g} → {result['delayed']['step_s'] * 1e3:.4g} ms."
            )
    return lines


def trace_lines(run: dict) -> list[str]:
    if run["trace"] is None:
        return []
    found = gpu_trace.summary(gpu_trace.read_trace(run["trace"]))
    if not found["streams"]:
        return [f"- `{run['trace'].name}` holds no device activity."]
    return [
        f"- In the profiled step (`{run['trace'].name}`), device work spans {found['span_s'] * 1e3:.4g} ms on "
        f"{found['streams']} streams; backward's stream is busy {found['compute_busy_s'] * 1e3:.4g} ms and idle "
        f"{found['compute_idle_s'] * 1e3:.4g} ms between its first and last kernel; collectives "
        f"{found['collective_busy_s'] * 1e3:.3g} ms, injected delay {found['delay_busy_s'] * 1e3:.3g} ms, copies "
        f"{found['copy_busy_s'] * 1e3:.3g} ms."
    ]


def device_table(run: dict, before: dict | None) -> list[str]:
    """`edgc_sim`'s host profile measured on the GPU against the simulator's h100 preset."""
    measured, preset = run["device"]["measured"], run["device"]["preset"]
    prior = (before or {}).get("device") or {}
    tera = 1e12
    rows = [
        (
            f"{name} matmul TFLOP/s",
            lambda m, n=name: m["matmul_flops"][n] / tera,
            preset["matmul_flops"].get(key, 0) * preset["mfu"] / tera,
        )
        for name, key in (("bf16", "fp16"), ("tf32", "tf32"), ("fp32", "fp32"))
    ]
    rows += [
        ("memory GB/s (read + write)", lambda m: m["mem_bytes_per_s"] / 1e9, preset["mem_bytes_per_s"] / 1e9),
        ("per-op cost µs (tiny eager op)", lambda m: m["launch_s"] * 1e6, preset["launch_s"] * 1e6),
        (
            "skinny GEMM read GB/s",
            lambda m: m["skinny_read_bytes_per_s"] / 1e9,
            preset["skinny_read_bytes_per_s"] / 1e9,
        ),
        (
            "skinny GEMM write GB/s",
            lambda m: m["skinny_write_bytes_per_s"] / 1e9,
            preset["skinny_write_bytes_per_s"] / 1e9,
        ),
    ]
    # what the engine orthonormalised by when the run measured it: torch.linalg.qr before the engine
    # was batched, then its Cholesky QR of one P block (edgc_sim.host.measure_cuda)
    if "qr_s" in measured:
        rows.append(("QR (1 × 6400 × 32) ms", lambda m: m["qr_s"] * 1e3, 0))
    if "orth_s" in measured:
        block = " × ".join(map(str, measured["orth_block"]))
        rows.append((f"orthonormalisation ({block}) ms", lambda m: m["orth_s"] * 1e3, 0))
    table = []
    for name, value, expected in rows:
        now = value(measured)
        try:
            shown_value = f"{value(prior['measured']):.3g} → {now:.3g}" if prior else f"{now:.3g}"
        except KeyError:  # the run before did not measure this
            shown_value = f"{now:.3g}"
        table.append(
            [name, shown_value, f"{expected:.3g}" if expected else "not modelled", fmt(ratio(now, expected), ".2f")]
        )
    return markdown_table(
        ["quantity", "measured", "`edgc simulate` preset `h100` (× mfu)", "measured ÷ preset"], "lrrr", table
    )


def problems(run: dict) -> list[str]:
    """Parts that failed and measurements skipped or failed in RUN (every one, so none is hidden)."""
    lines = [
        f"- part {name} failed: `{result['error'].strip().splitlines()[-1]}`"
        for name in ("env", "engine", "overlap", "device", "count")
        if isinstance(result := run.get(name), dict) and "error" in result
    ]
    engine = run["engine"]
    lines += [
        f"- engine {json.dumps({k: v for k, v in e.items() if k != 'error'})} failed: "
        f"`{e['error'].strip().splitlines()[-1]}`"
        for e in engine["errors"]
    ]
    if engine["skipped"]:
        lines.append(
            f"- engine: {len(engine['skipped'])} measurements skipped when its time budget ran out: "
            + "; ".join(json.dumps(e) for e in engine["skipped"][:6])
            + ("; …" if len(engine["skipped"]) > 6 else "")
        )
    return lines


# ---------------------------------------------------------------------------- the blocks
def picture(run: dict, image: Path) -> list[str]:
    """Draws ``image`` from RUN's trace; the line that shows it (and says where it came from)."""
    if run["trace"] is None or not gpu_trace.device_spans(trace := gpu_trace.read_trace(run["trace"])):
        return [
            f"![device work per stream](img/{image.name})",
            "",
            f"(`{shown(run['folder'])}` has no trace of device work: the picture above is kept from an earlier run.)",
        ]
    overlap = run["overlap"].get(run["trace"].name.removeprefix("trace_").removesuffix(".json.gz"), {})
    title = (
        f"{run['env'].get('device', '?')}: one compressed step, {overlap.get('backend', '?')}, "
        f"{overlap.get('world_size', '?')} process(es), GPT-2 {overlap.get('model', '?')}, "
        f"{overlap.get('delay_ms', 0):g} ms injected per all-reduce"
    )
    gpu_trace.plot(trace, image, title)
    return [
        f"![device work per stream](img/{image.name})",
        "",
        f"Device work per CUDA stream in the profiled step of `{shown(run['trace'])}`.",
    ]


def build(
    run: dict, before: dict | None, image: Path, current_count: dict | None = None
) -> tuple[list[str], list[str]]:
    """docs/gpu.md's block and the README's. ``current_count``: this checkout's dispatch count
    (docs/gpu/count), which the README states instead of the run's when given."""
    heads = [describe(run, "This run" if before else "The run")] + ([describe(before, "Before")] if before else [])
    model, rank = largest(run), goal_rank(run)
    docs = [*heads, "", f"**Goals** (GPT-2 {model}, rank {rank}):", "", *goals(run)]
    if before:
        docs += ["", "Before:", "", *goals(before)]
    docs += [
        "",
        "**The hooks in a training step** (DDP on NCCL, one process, bf16, DDP's default buckets; the hook's share "
        "is the hooked step minus the plain one):",
        "",
        *step_table(run, before),
    ]
    if run["engine"]["hook_alone"]:
        docs += [
            "",
            "**Each hook alone** (one backward's gradients in DDP's default buckets, restored before every call; "
            "ratio = EDGC ÷ powerSGD_hook; kernels from the profiler, dispatches from the CPU count):",
            "",
            *alone_table(run),
            "",
            f"**DDP's bucket size** (EDGC at rank {rank}):",
            "",
            *bucket_table(run),
        ]
    if run["count"] and "hook" in run["count"]:
        docs += [
            "",
            "**Dispatches of one compressed step, counted on the CPU** (`python -m edgc_bench.gpu --count-only`):",
            "",
            *count_table(run["count"]),
        ]
    docs += [
        "",
        "**Overlap and host reads:**",
        "",
        *overlap_lines(run, before),
        *trace_lines(run),
        "",
        *picture(run, image),
    ]
    if run["device"] and "measured" in run["device"]:
        docs += ["", "**The simulator's host profile on this GPU:**", "", *device_table(run, before)]
    if trouble := problems(run):
        docs += ["", "**What failed or was skipped in this run:**", "", *trouble]
    readme = [*heads, *goals(run)]
    if current_count:
        count, whose = current_count, "CPU count, this checkout's engine"
    else:
        count, whose = run["count"] or {}, "CPU count"
    xl = [row for row in count.get("hook", []) if row["model"] == model]
    if xl:
        readme.append(
            f"- Dispatches of one compressed step of GPT-2 {model} ({whose}): "
            + ", ".join(f"{row['dispatches']} at {row['bucket_cap_mb']:g} MB buckets" for row in xl)
            + "; [the recommended bucket size](docs/gpu.md#this-checkouts-engine)."
        )
    for key, result in run["overlap"].items():
        for line in overlap_lines({"overlap": {key: result}}, None):
            if "injected" in line:
                readme.append(f"- Overlap, the {key} run: w{line.removeprefix('  - W')}")
    readme.append("\nEvery figure, the trace's picture and the simulator comparison: [docs/gpu.md](docs/gpu.md).")
    return docs, readme


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("run", type=Path, help="the run's folder")
    parser.add_argument("--before", type=Path, help="an earlier run's folder, shown beside it")
    parser.add_argument("--profiled", type=Path, help="a profiled run's folder (scripts/gpu_profiled.py)")
    args = parser.parse_args(argv)
    run, before = load_run(args.run), load_run(args.before) if args.before else None
    docs, readme = build(
        run, before, REPO / "docs" / "img" / "gpu_overlap.png", _json(REPO / "docs" / "gpu" / "count", "count")
    )
    if args.profiled:
        from gpu_profiled import sections

        more_docs, more_readme = sections(args.profiled)
        docs += more_docs
        readme[-1:-1] = more_readme  # before the closing line that points to the page
    for block, lines in ((FIGURES, docs), (SUMMARY, readme)):
        write(block, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
