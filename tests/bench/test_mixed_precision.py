"""bf16 training of a tiny GPT-2 (2 layers, width 64) with EDGC (2 gloo processes, 50 steps): the runs of
`python -m edgc_bench.mixed_precision` (its docstring names them), in the suite's process pool. bf16
tracks fp32, its bytes halve, bfloat16 on the wire halves P and Q alone, bf16 error feedback halves
its memory; docs/integrations.md shows the committed run's figures.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from distributed_harness import run_distributed  # noqa: E402

from edgc_bench.mixed_precision import figures, final_loss, measure, pq_elements  # noqa: E402

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "integrations" / "mixed-precision.json"


def in_the_pool(fn, world_size, backend, timeout):
    """`spawn_group`'s signature, on the suite's process pool."""
    return run_distributed(fn, world_size, timeout=timeout, backend=backend)


@pytest.fixture(scope="module")
def runs():
    runs = measure(runner=in_the_pool)
    print({name: round(results[0]["seconds"], 1) for name, results in runs.items()})
    return runs


def test_bf16_training_tracks_fp32_within_2_percent(runs):
    fp32, bf16 = final_loss(runs["fp32"]), final_loss(runs["bf16"])
    print(f"final loss (mean of steps 46-50): fp32 {fp32:.4f}  bf16 {bf16:.4f}  ({bf16 / fp32 - 1:+.2%})")
    assert runs["fp32"][0]["losses"][0] - fp32 > 3, "the run should learn"
    assert abs(bf16 / fp32 - 1) < 0.02
    bf16_rank0 = runs["bf16"][0]
    assert bf16_rank0["grad_dtype"] == "torch.bfloat16"
    assert bf16_rank0["state_dtypes"] == {"torch.float32"}  # factors and error feedback stay fp32
    assert sum(m["phase"] == "compress" for m in bf16_rank0["metrics"]) >= 40


def test_bf16_gradients_halve_every_byte_on_the_wire(runs):
    compared = 0
    for a, b in zip(runs["fp32"][0]["metrics"], runs["bf16"][0]["metrics"]):
        if a["phase"] == b["phase"] == "compress" and a["ranks"] == b["ranks"]:
            assert 2 * b["bytes_raw"] == a["bytes_raw"]
            # Same elements at half the size, except the one-element non-finite flag per DDP
            # bucket: the bf16 model's 2x smaller gradients fill fewer buckets.
            assert abs(b["bytes_sent"] / a["bytes_sent"] - 0.5) < 1e-4
            assert b["bytes_sent"] < b["bytes_raw"] / 2
            compared += 1
            ratio = b["bytes_sent"] / a["bytes_sent"]
    print(f"bytes_sent bf16 / fp32 = {ratio:.6f} on {compared} compressed steps at equal ranks")
    assert compared >= 10


def test_bfloat16_communication_halves_the_p_and_q_bytes(runs):
    fp32, wire = runs["fp32"][0], runs["fp32_bf16_wire"][0]
    compared = 0
    for a, b in zip(fp32["metrics"], wire["metrics"]):
        if a["phase"] != "compress":
            assert a["bytes_sent"] == b["bytes_sent"]  # uncompressed steps: the gradient dtype
            continue
        assert a["ranks"] == b["ranks"]
        pq = pq_elements(a, fp32["shapes"])
        raw_part = a["bytes_sent"] - 4 * pq
        assert b["bytes_sent"] == raw_part + 2 * pq  # P and Q: 4 → 2 bytes; raw tensors unchanged
        compared += 1
        ratio = (b["bytes_sent"] - raw_part) / (a["bytes_sent"] - raw_part)
    print(f"P/Q bytes bfloat16 / float32 = {ratio}; total bytes_sent ratio {b['bytes_sent'] / a['bytes_sent']:.3f}")
    assert compared >= 2


def test_bf16_error_feedback_halves_its_memory_and_tracks_fp32_error_feedback(runs):
    fp32_ef, bf16_ef = runs["bf16"], runs["bf16_ef"]
    assert bf16_ef[0]["error_dtypes"] == {"torch.bfloat16"} and fp32_ef[0]["error_dtypes"] == {"torch.float32"}
    assert bf16_ef[0]["error_bytes"] * 2 == fp32_ef[0]["error_bytes"]
    # What it does to the loss (printed for docs/integrations.md): within 2 % of fp32 error feedback.
    print(
        f"final loss, bf16 gradients: fp32 EF {final_loss(fp32_ef):.4f}, bf16 EF {final_loss(bf16_ef):.4f}, "
        f"fp32 training {final_loss(runs['fp32']):.4f}"
    )
    assert abs(final_loss(bf16_ef) / final_loss(fp32_ef) - 1) < 0.02


def test_the_page_shows_the_committed_run_and_a_fresh_run_renders_alike(runs, load_producer, load_script):
    producer = load_producer("mixed-precision")
    assert load_script("doc_blocks").is_current(producer.BLOCK, producer.block(producer.read(COMMITTED)))
    fresh = figures(runs)
    assert fresh["first_compressed_step"] > 1 and fresh["bf16_over_fp32_bytes_sent"]["steps"] >= 10
    assert "| mean training loss, steps 46–50 |" in producer.block(fresh)
