"""`python -m edgc_bench.gpu --smoke`: every part of the GPU bench run on the CPU (tiny GPT-2, gloo),
so that the bench the GPU run depends on cannot rot where no GPU is at hand."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from distributed_harness import run_distributed  # noqa: E402

from edgc.integrations.diloco import DEFAULT_OUTER_SYNC  # noqa: E402
from edgc_bench import gpu  # noqa: E402


def in_the_pool(fn, world_size, backend, *args, timeout):
    """The bench's runner, on the suite's process pool instead of new processes."""
    return run_distributed(fn, world_size, *args, backend=backend, timeout=timeout)


def test_the_smoke_run_writes_every_part(tmp_path):
    assert gpu.main(["--smoke", "--out", str(tmp_path)], runner=in_the_pool) == 0
    files = {path.name for path in tmp_path.iterdir()}
    assert files == {
        "env.json",
        "count.json",
        "overlap.json",
        "engine.json",
        "orth.json",
        "outer.json",
        "trace_gloo.json.gz",
        "trace_nccl.json.gz",
    }
    read = {
        name: json.loads((tmp_path / f"{name}.json").read_text())
        for name in ("count", "overlap", "engine", "orth", "outer")
    }
    engine_rows = [row for row in read["orth"]["rows"] if row["method"] == "cholesky2-fp64"]
    assert engine_rows and all(row["finite"] and row["orthogonality"] < 1e-6 for row in engine_rows)

    assert [(row["bucket_cap_mb"], row["ddp_default"]) for row in read["count"]["hook"]] == [
        (100, False),
        (0.25, False),
    ]
    assert [row["matrices"] for row in read["count"]["engine_same_shape"]] == [1, 2, 8]

    pair, single = read["overlap"]["gloo"], read["overlap"]["nccl"]
    assert pair["world_size"] == 2 and pair["replicas_identical"] and pair["phase"] == "compress"
    for run in (pair, single):
        assert max(run["host_reads_per_step"][run["settle_steps"] :]) <= 1
    # Every all-reduce of a step went through the delay, which the run measured against plain steps.
    assert single["delayed_collectives_per_step"] == single["collectives_last_step"] > 0
    assert {"plain", "delayed", "backward_wait_s"} <= set(single)

    engine = read["engine"]
    assert engine["errors"] == [] and engine["skipped"] == []
    steps = {(row["method"], row["bucket_cap_mb"]) for row in engine["steps"]}
    assert steps == {
        ("none", 100),
        ("edgc", 100),
        ("powersgd", 100),
        ("edgc-bf16-ef", 100),
        ("none", 0.25),
        ("edgc", 0.25),
    }
    assert all(
        row["hook_s"]
        == row["step_s"]
        - next(
            plain["step_s"]
            for plain in engine["steps"]
            if plain["method"] == "none" and plain["bucket_cap_mb"] == row["bucket_cap_mb"]
        )
        for row in engine["steps"]
        if row["method"] != "none"
    )
    alone = {(row["method"], row["grad_dtype"], row["bucket_cap_mb"]) for row in engine["hook_alone"]}
    assert {
        ("edgc", "bfloat16", 100),
        ("powersgd", "bfloat16", 100),
        ("edgc", "float32", 100),
        ("powersgd", "float32", 100),
        ("edgc", "bfloat16", 0.25),
        ("edgc-sampled", "bfloat16", 100),
    } <= alone
    assert all(row["seconds"] > 0 and row["plain_backward_s"] > 0 for row in engine["hook_alone"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the device profile would succeed")
def test_a_failing_part_keeps_the_others(tmp_path):
    assert gpu.main(["--smoke", "--parts", "env,device", "--out", str(tmp_path)]) == 1
    assert json.loads((tmp_path / "env.json").read_text())["torch"] == torch.__version__
    assert "needs a CUDA GPU" in json.loads((tmp_path / "device.json").read_text())["error"]


def test_the_outer_step_is_measured_for_the_default_and_the_cast(tmp_path):
    assert gpu.main(["--smoke", "--parts", "outer", "--out", str(tmp_path)], runner=in_the_pool) == 0
    outer = json.loads((tmp_path / "outer.json").read_text())
    assert outer["errors"] == []
    assert [(row["model"], row["method"]) for row in outer["rows"]] == [("tiny", DEFAULT_OUTER_SYNC), ("tiny", "bf16")]
    assert all(len(row["outer_step_s_all"]) == 2 and row["inner_step_s"] > 0 for row in outer["rows"])


def test_ncu_raw_csv_is_read_per_kernel():
    from edgc_bench.gpu_hbm import parse

    text = "\n".join(
        [
            "==PROF== Connected to process 7",
            '"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum"',
            '"","","byte","byte"',
            '"0","void gemm<bf16>(int)","1,048,576","2048"',
            '"1","elementwise_kernel","4096","n/a"',
            '"2","reduce_kernel","10","20"',
        ]
    )
    kernels = parse(text)
    assert [k["name"] for k in kernels] == ["void gemm<bf16>(int)", "reduce_kernel"]
    assert kernels[0]["dram__bytes_read.sum"] == 1048576 and kernels[1]["dram__bytes_write.sum"] == 20
