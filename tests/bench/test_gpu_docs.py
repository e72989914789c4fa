"""scripts/gpu_to_docs.py: the GPU run's files become the docs' figures (on stand-in files; the real
ones come from `python -m edgc_bench.gpu` on a GPU)."""
import gzip
import json


def _engine_row(model, method, rank, hook_s, backward_s=0.5):
    return {"model": model, "method": method, "rank": rank, "hook_s": hook_s, "hook_over_backward": hook_s / backward_s,
            "hook_kernels": 100 if method == "powersgd" else 40, "extra_peak_bytes": 2 ** 30, "engine_alone_s": hook_s}


def test_the_block_is_built_from_the_files(tmp_path, load_script):
    script = load_script("gpu_to_docs")
    (tmp_path / "env.json").write_text(json.dumps({"device": "GPU-X", "nvidia_smi": "GPU-X, 1.0", "torch": "9.9",
                                                  "cuda": "13.0", "nccl": "2.0", "date": "today"}))
    (tmp_path / "engine.json").write_text(json.dumps([_engine_row("xl", "powersgd", 32, 0.040),
                                                      _engine_row("xl", "edgc", 32, 0.010)]))
    run = {"world_size": 2, "model": "small", "phase": "compress", "rank": 16, "replicas_identical": True,
           "host_reads_per_step": [1, 1, 1, 1]}
    (tmp_path / "overlap.json").write_text(json.dumps({"gloo": run}))
    tera = 1e12
    (tmp_path / "device.json").write_text(json.dumps({
        "measured": {"matmul_flops": {"bf16": 700 * tera, "tf32": 300 * tera, "fp32": 50 * tera}, "mem_bytes_per_s": 3e12,
                     "launch_s": 8e-6, "skinny_read_bytes_per_s": 2e12, "skinny_write_bytes_per_s": 2.5e12},
        "preset": {"matmul_flops": {"fp16": 989 * tera, "tf32": 494.7 * tera, "fp32": 67 * tera}, "mfu": 0.4,
                   "mem_bytes_per_s": 3.35e12, "launch_s": 5e-6, "skinny_read_bytes_per_s": 0,
                   "skinny_write_bytes_per_s": 0}}))
    # compute stream 7 busy 0–100 µs; a copy stream busy 50–150 µs: half of its time overlaps
    events = [{"ph": "X", "cat": "kernel", "tid": 7, "ts": 1000 + t, "dur": 10} for t in range(0, 100, 10)]
    events += [{"ph": "X", "cat": "gpu_memcpy", "tid": 20, "ts": 1050, "dur": 100}]
    with gzip.open(tmp_path / "trace_gloo.json.gz", "wt") as handle:
        json.dump({"traceEvents": events}, handle)
    docs, readme = script.build(tmp_path, tmp_path / "overlap.png")
    text = "\n".join(docs)
    assert (tmp_path / "overlap.png").stat().st_size > 0
    assert "50% of the collectives' CUDA copy time" in text
    assert "| xl | 32 | 0.0400 | 0.0100 | 0.25 | 2.0% |" in text
    assert "GPU-X" in text and "host reads per step after the first two: [1]" in text
    assert "| per-op cost µs (tiny eager op) | 8 | 5 |" in text
    assert any("GPT-2 XL at rank 32: EDGC 0.0100 s per step, 0.25× powerSGD_hook, 2.0% of backward" in line for line in readme)
