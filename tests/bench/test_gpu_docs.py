"""scripts/to_docs.py gpu: the GPU runs' files become the docs' figures. The "before" run is the first
GPU run's committed files (docs/gpu/before); the "after" run is made up here, in the shape
`python -m edgc_bench.gpu` writes."""

import gzip
import json
from pathlib import Path

BEFORE = Path(__file__).resolve().parents[2] / "docs" / "gpu" / "before"
GIB = 2**30


def _step(method, rank, step_s, backward_s=0.1, cap=25, plain_step_s=0.16):
    row = {
        "model": "xl",
        "method": method,
        "rank": rank,
        "bucket_cap_mb": cap,
        "ddp_default": cap == 25,
        "step_s": step_s,
        "backward_s": backward_s,
        "kernels": 5000,
        "peak_bytes": 0,
        "resident_bytes": 0,
    }
    if method != "none":
        hook_s = step_s - plain_step_s
        row.update(hook_s=hook_s, hook_over_backward=hook_s / backward_s, hook_kernels=1500, extra_peak_bytes=GIB)
    return row


def _alone(method, dtype, seconds, cap=25, kernels=None):
    return {
        "model": "xl",
        "method": method,
        "grad_dtype": dtype,
        "rank": 32,
        "bucket_cap_mb": cap,
        "ddp_default": cap == 25,
        "buckets": 73 if cap == 25 else 14,
        "seconds": seconds,
        "kernels": kernels,
        "state_bytes": 2 * GIB,
        "peak_extra_bytes": 3 * GIB,
        "plain_backward_s": 0.1,
    }


def _after_run(folder: Path) -> None:
    env = {
        "device": "GPU-X",
        "nvidia_smi": "GPU-X, 1.0, 80 GiB",
        "driver": "1.0",
        "torch": "9.9",
        "cuda": "13.0",
        "nccl": "2.0",
        "date": "today",
    }
    engine = {
        "settings": {"goal_rank": 32},
        "skipped": [{"model": "medium"}],
        "errors": [{"model": "large", "method": "edgc", "error": "Traceback …\nRuntimeError: out of memory\n"}],
        "steps": [
            _step("none", 0, 0.16),
            _step("edgc", 32, 0.164),
            _step("powersgd", 32, 1.76),
            _step("none", 0, 0.16, cap=200),
            _step("edgc", 32, 0.162, cap=200),
        ],
        "hook_alone": [
            _alone("edgc", "bfloat16", 0.004, kernels=900),
            _alone("powersgd", "bfloat16", 1.6, kernels=74000),
            _alone("edgc", "float32", 0.005),
            _alone("powersgd", "float32", 0.02),
            _alone("edgc", "bfloat16", 0.003, cap=200, kernels=400),
        ],
    }
    count = {
        "rank": 32,
        "dtype": "bfloat16",
        "torch": "9.9",
        "world_size": 1,
        "rule": "the rule",
        "hook": [
            {
                "model": "xl",
                "bucket_cap_mb": 25,
                "ddp_default": True,
                "dispatches": 1900,
                "linalg": 2,
                "matrices": 194,
                "compressed": 194,
                "buckets": 73,
                "collectives": 219,
                "host_reads": 1,
                "top_ops": {"mm": 500, "copy_": 300},
            },
            {
                "model": "xl",
                "bucket_cap_mb": 200,
                "ddp_default": False,
                "dispatches": 800,
                "linalg": 2,
                "matrices": 194,
                "compressed": 194,
                "buckets": 14,
                "collectives": 42,
                "host_reads": 1,
                "top_ops": {"mm": 500},
            },
        ],
        "engine_same_shape": [{"shape": [1600, 6400], "matrices": k, "dispatches": 40 + k} for k in (1, 2, 8)],
    }
    single = {
        "backend": "nccl",
        "world_size": 1,
        "model": "small",
        "rank": 16,
        "phase": "compress",
        "settle_steps": 4,
        "host_reads_per_step": [1] * 9,
        "collectives_last_step": 21,
        "replicas_identical": True,
        "delay_ms": 2.0,
        "plain": {"gradients_ready_s": 0.030, "step_s": 0.040},
        "delayed": {"gradients_ready_s": 0.051, "step_s": 0.090},
        "delayed_collectives_per_step": 21.0,
        "injected_s_per_step": 0.042,
        "backward_wait_s": 0.021,
    }
    pair = dict(single, backend="gloo", world_size=2, delay_ms=0.0)
    for key in ("delayed", "delayed_collectives_per_step", "injected_s_per_step", "backward_wait_s"):
        del pair[key]
    device = json.loads((BEFORE / "device.json").read_text())
    device["measured"]["launch_s"] = 8e-6
    for name, value in (
        ("env", env),
        ("engine", engine),
        ("count", count),
        ("overlap", {"gloo": pair, "nccl": single}),
        ("device", device),
    ):
        (folder / f"{name}.json").write_text(json.dumps(value))
    # backward's stream 7: kernels 0–40 µs and 60–100 µs (a 20 µs wait); NCCL on 20; the delay's spin kernel on 30
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "tid": 7, "ts": 1000 + t, "dur": 10, "args": {"stream": 7}}
        for t in (0, 10, 20, 30, 60, 70, 80, 90)
    ]
    events += [
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllReduce",
            "tid": 20,
            "ts": 1045,
            "dur": 5,
            "args": {"stream": 20},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "spin_kernel(long)",
            "tid": 30,
            "ts": 1020,
            "dur": 25,
            "args": {"stream": 30},
        },
    ]
    with gzip.open(folder / "trace_nccl.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)


def test_an_after_run_is_shown_beside_the_first_one(tmp_path, load_producer):
    script = load_producer("gpu")
    _after_run(tmp_path)
    docs, readme = script.build(script.load_run(tmp_path), script.load_run(BEFORE), tmp_path / "overlap.png")
    text = "\n".join(docs)
    assert (tmp_path / "overlap.png").stat().st_size > 0
    assert "- Before: `docs/gpu/before`: NVIDIA H100 80GB HBM3" in text and "GPU-X" in text
    # before → after, from the first run's engine.json and this one's
    assert (
        "| xl | edgc | 32 | 0.164 → 0.16 | 0.579 → 0.164 | 0.415 → 0.004 | 408% → 4% | 13451 → 1500 | 5.82 → 1.00 |"
        in text
    )
    assert "met: 0.00× (goal ≤ 0.50×)" in text  # hooks alone on bf16: 0.004 s ÷ 1.6 s
    assert "EDGC ÷ powerSGD_hook, each hook alone on float32 gradients, GPT-2 xl rank 32: met: 0.25×" in text
    assert "EDGC's added step time ÷ backward, GPT-2 xl rank 32: met: 4 %" in text
    assert "missed: 408 %, 81.7× the goal of ≤ 5 %" in text  # the first run's, under "Before:"
    assert (
        "| xl | 32 | 0.0040 | 1.6000 | 0.00 | 0.0050 | 0.0200 | 0.25 | 4% | 900 / 74000 | 1900 | 2.00 / 2.00 |" in text
    )
    assert "| xl | 200 | 14 | 0.0030 | – | 400 | 800 | 0.0020 |" in text
    assert "| xl | 25 (default) | 1900 | 2 | 194 of 194 | 73 | 219 | 1 | mm 500, copy_ 300 |" in text
    assert "(matrices → dispatches): 1 → 41, 2 → 42, 8 → 48" in text
    assert "every gradient was computed 21 ms later than without (50% of the injected delay)" in text
    assert "idle 0.02 ms between its first and last kernel; collectives 0.005 ms, injected delay 0.025 ms" in text
    assert "| per-op cost µs (tiny eager op) | 10.2 → 8 | 5 | 1.60 |" in text
    assert "RuntimeError: out of memory" in text and "1 measurements skipped" in text
    assert any(
        "Dispatches of one compressed step of GPT-2 xl (CPU count): 1900 at 25 MB buckets, 800 at 200 MB" in line
        for line in readme
    )
    assert any(line.startswith("- Overlap, the nccl run: with 2 ms injected per all-reduce") for line in readme)
    assert "| medium |" not in text  # rows of the first run that this one did not measure again are left out


def test_the_first_run_alone_renders_from_its_committed_files(tmp_path, load_producer):
    script = load_producer("gpu")
    docs, readme = script.build(script.load_run(BEFORE), None, tmp_path / "overlap.png")
    text = "\n".join(docs)
    assert not (tmp_path / "overlap.png").exists()  # no trace committed: the picture stays as it is
    assert "`docs/gpu/before` has no trace of device work" in text
    assert "| xl | powersgd | 32 | 0.164 | 1.75 | 1.59 | 1561% | 74040 | 2.99 |" in text
    assert "EDGC ÷ powerSGD_hook, the hook's share of a bf16 training step, GPT-2 xl rank 32: met: 0.26×" in text
    assert any("missed: 408 %" in line for line in readme)


H200 = BEFORE.parent / "h200-2026-11-27"
PROFILED = BEFORE.parent / "h200-2026-11-27-profiled"


def test_the_committed_h200_runs_render_as_the_docs_show_them(tmp_path, load_producer):
    """docs/gpu.md and the README hold what the script makes of the committed H200 runs, line by line."""
    script = load_producer("gpu")
    sections = script.gpu_profiled.sections
    image, current_count = tmp_path / "gpu_overlap.png", script.read_json(BEFORE.parent / "count", "count")
    docs, readme = script.build(script.load_run(H200), script.load_run(BEFORE), image, current_count)
    more_docs, more_readme = sections(PROFILED)
    page = (BEFORE.parents[1] / "gpu.md").read_text()
    front = (BEFORE.parents[2] / "README.md").read_text()
    picture_line = next(line for line in docs if line.startswith("Device work per CUDA stream"))
    assert image.exists() and picture_line in page  # drawn from the committed trace
    assert all(line in page for line in docs + more_docs if line)
    assert all(line in front for line in readme[:-1] + more_readme if line)


def test_the_profiled_sections_copy_the_files_figures(load_producer):
    profiled = load_producer("gpu").gpu_profiled
    run = profiled.load(PROFILED)
    docs, readme = profiled.sections(PROFILED)
    hbm = run["hbm"]["rows"][0]
    assert any(f"{hbm['bytes_per_compressed_element']:.1f} B per compressed element" in line for line in readme)
    assert run["hbm"]["errors"] and any("not measured" in line for line in docs)  # the sampled step's timeout
    for row in run["outer"]["rows"]:
        assert any(f"| {row['peak_beyond_held_bytes_per_param']:.1f} |" in line for line in docs)
    profiled = [row for row in run["engine"]["hook_alone"] if row.get("kernel_profile")]
    assert len([line for line in docs if line.startswith("| xl |")]) >= len(profiled)
