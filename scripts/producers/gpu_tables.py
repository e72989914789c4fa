"""The tables and lines of docs/gpu.md's figures, one function each, from the runs gpu_runs.py reads."""

from __future__ import annotations

import json

from edgc_bench import gpu_trace
from producers.gpu_runs import (
    DASH,
    GIB,
    alone_row,
    by_size,
    cell,
    count_row,
    fmt,
    get,
    goal_rank,
    markdown_table,
    ratio,
    step_row,
)


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
