"""`python -m edgc_bench.gpu --smoke`: every part of the GPU run on the CPU (tiny GPT-2, gloo), so that the
command a lent GPU runs cannot rot where no GPU is at hand; its time limits, its budget and its files."""

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from distributed_harness import run_distributed  # noqa: E402

from edgc.integrations.diloco import DEFAULT_OUTER_SYNC  # noqa: E402
from edgc_bench import gpu  # noqa: E402
from edgc_bench.gpu_parts import BY_NAME, DEFAULT_PARTS, run_in_group  # noqa: E402

MOST_FILES = 8  # what the device tool brings back from one command


def in_the_pool(name, settings, out, timeout, log):
    """The run's part runner, on the suite's process pool instead of a process per part."""
    try:
        run_distributed(run_in_group, 1, name, settings, str(out), backend="gloo", timeout=timeout)
    except Exception as error:  # noqa: BLE001 — the run records a failed part and goes on
        log.write(f"{error}\n")
        return 1
    return 0


def read(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def test_the_default_parts_fit_the_budget_in_the_order_of_their_value(capsys):
    assert DEFAULT_PARTS == ("env", "hook", "sampled", "outer", "tests", "ncu")
    assert sum(BY_NAME[name].limit_s for name in DEFAULT_PARTS) <= gpu.BUDGET_S
    assert gpu.main(["--plan"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[1 : 1 + len(DEFAULT_PARTS)]] == list(DEFAULT_PARTS)


def test_the_smoke_run_measures_every_part_and_the_docs_take_its_files(tmp_path, load_producer):
    # the default parts, then one that fails on a CPU (the device profile needs CUDA): the others keep theirs
    parts = [*DEFAULT_PARTS, "device"]
    assert gpu.main(["--smoke", "--parts", ",".join(parts), "--out", str(tmp_path)], runner=in_the_pool) == 1
    files = {path.name for path in tmp_path.iterdir()} - {"device.json"}
    assert files == {f"{name}.json" for name in DEFAULT_PARTS} | {"summary.json", "log.txt"}
    assert len(files) <= MOST_FILES
    summary = read(tmp_path, "summary")
    assert [name for name, _ in summary["plan"]] == parts
    assert [summary["parts"][name]["status"] for name in parts] == ["ok"] * len(DEFAULT_PARTS) + ["failed"]
    assert all(read(tmp_path, name)["errors"] == [] for name in DEFAULT_PARTS)
    assert "needs a CUDA GPU" in read(tmp_path, "device")["errors"][0]["error"]

    hook = read(tmp_path, "hook")
    graphs = "graphs" if read(tmp_path, "env")["cuda_graphs_option"] else None
    modes = {"plain", "eager"} | ({graphs} if graphs else set())
    assert {(row["bucket_cap_mb"], row["mode"]) for row in hook["steps"]} == {
        (c, m) for c in (100, 0.25) for m in modes
    }
    plain = {row["bucket_cap_mb"]: row for row in hook["steps"] if row["mode"] == "plain"}
    for row in hook["steps"]:
        if row["mode"] != "plain":
            assert row["added_s"] == row["step_s"] - plain[row["bucket_cap_mb"]]["step_s"]
            assert 0 <= row["drain_s"] <= row["step_s"] and row["phase"] == "compress"
    for row in hook["alone"]:
        assert row["dispatches"] > 0 and row["host_s_per_dispatch"] == row["host_s"] / row["dispatches"]
        assert row["host_reads_per_call"] == 1
    if not graphs:  # this build has no CUDA-graphs option: said so, not failed
        assert {row["mode"] for row in hook["unavailable"]} == {"graphs"}

    sampled = {(row["kind"], row["mode"]): row for row in read(tmp_path, "sampled")["alone"]}
    assert sampled["sampled", "eager"]["dispatches"] > sampled["static", "eager"]["dispatches"]
    assert sampled["static", "eager"]["host_reads_per_call"] == 1 <= sampled["sampled", "eager"]["host_reads_per_call"]

    outer = read(tmp_path, "outer")
    (row,) = outer["rows"]
    assert (row["model"], row["method"]) == ("tiny", DEFAULT_OUTER_SYNC)
    assert row["dispatches"] > 0 and len(row["outer_step_s_all"]) == 2
    assert outer["largest_tried"] == [] and "no size beyond XL" in outer["largest_note"]  # no device memory here

    runs = read(tmp_path, "tests")["runs"]
    assert [run["run"] for run in runs] == ["sync_debug", "sanitizer"]
    assert all(run["exit"] == 0 and run["tests"] for run in runs)  # skipped on a CPU, but collected and run

    ncu = read(tmp_path, "ncu")
    if ncu["ncu"] is None:  # no Nsight Compute here: the profiled workload ran alone, twice, and said so
        assert len(ncu["workload_ran"]) == 2 and len(ncu["unavailable"]) == 2 and "rows" not in ncu

    gpu_measured = load_producer("gpu").gpu_measured
    before = gpu_measured.load(
        Path(__file__).resolve().parents[2] / "docs/gpu/h200-2026-11-27",
        Path(__file__).resolve().parents[2] / "docs/gpu/h200-2026-11-27-profiled",
    )
    docs, readme = gpu_measured.build(gpu_measured.load(tmp_path), before)
    text = "\n".join(docs)
    assert "A sampled step against a static one, eager: +" in text and "→" in text
    assert f"| tiny | 0.00 | {DEFAULT_OUTER_SYNC} |" in text
    assert all(f"- {name}: ok" in text for name in DEFAULT_PARTS)
    assert readme[-1].endswith("[docs/gpu.md](docs/gpu.md).")


def test_a_part_past_its_limit_is_killed_and_the_next_runs_in_a_process_of_its_own(tmp_path):
    argv = ["--smoke", "--parts", "sampled,env", "--limit", "sampled=0.01", "--out", str(tmp_path)]
    assert gpu.main(argv) == 1
    parts = read(tmp_path, "summary")["parts"]
    assert parts["sampled"]["status"] == "timed out at 0 s" and parts["env"]["status"] == "ok"
    assert read(tmp_path, "sampled")["stopped"]["status"] == "timed out at 0 s"
    assert read(tmp_path, "env")["torch"] == torch.__version__


def test_a_part_may_use_what_the_parts_before_it_left_and_no_more_than_the_budget(tmp_path):
    given = {}

    def at_once(name, settings, out, timeout, log):  # every part done at once: its time is left over
        given[name] = (timeout, settings["part_limit_s"])
        return 0

    argv = ["--parts", "env,hook,sampled", "--budget", "100", "--limit", "hook=30", "--out", str(tmp_path)]
    assert gpu.run(gpu.parse(argv), at_once)["parts"]["sampled"]["status"] == "ok"
    env_limit = BY_NAME["env"].limit_s
    assert given["env"] == (env_limit, env_limit)
    assert 30 < given["hook"][0] <= 30 + env_limit and given["hook"][0] == given["hook"][1]
    # its own limit and the others' unused time, cut to what is left of the budget
    assert BY_NAME["sampled"].limit_s < given["sampled"][0] <= 100


def test_parts_past_the_budget_are_skipped_and_said_so(tmp_path):
    assert gpu.main(["--smoke", "--parts", "env,hook", "--budget", "1", "--out", str(tmp_path)]) == 1
    parts = read(tmp_path, "summary")["parts"]
    assert {entry["status"] for entry in parts.values()} == {"skipped: the budget was spent"}


def test_the_parts_beside_the_default_still_run(tmp_path):
    assert gpu.main(["--smoke", "--parts", "count,engine,orth", "--out", str(tmp_path)], runner=in_the_pool) == 0
    count, engine, orth = (read(tmp_path, name) for name in ("count", "engine", "orth"))
    assert [(row["bucket_cap_mb"], row["ddp_default"]) for row in count["hook"]] == [(100, False), (0.25, False)]
    assert engine["errors"] == [] and engine["skipped"] == []
    assert {(row["method"], row["bucket_cap_mb"]) for row in engine["steps"]} >= {("edgc", 100), ("powersgd", 100)}
    rows = [row for row in orth["rows"] if row["method"] == "cholesky2-fp64"]
    assert rows and all(row["finite"] and row["orthogonality"] < 1e-6 for row in rows)


def test_the_overlap_part_measures_the_delay_against_plain_steps(tmp_path):
    from edgc_bench.gpu_overlap import overlap

    settings = {"cuda": False, "size": "tiny", "rank": 4, "steps": 2, "micro_batch": 2, "seq_len": 32}

    def runner(fn, world_size, backend, *args, timeout):
        return run_distributed(fn, world_size, *args, backend=backend, timeout=timeout)

    result = overlap(tmp_path, settings, 1.0, runner, timeout=300)  # against a hang, not a timing
    pair, single = result["gloo"], result["nccl"]
    assert pair["world_size"] == 2 and pair["replicas_identical"] and pair["phase"] == "compress"
    for run in (pair, single):
        assert max(run["host_reads_per_step"][run["settle_steps"] :]) <= 1
    assert single["delayed_collectives_per_step"] == single["collectives_last_step"] > 0


def test_the_largest_model_tried_is_the_widest_predicted_to_fit():
    from edgc_bench.gpu_outer import beyond_xl, params_of
    from edgc_probes.gpt2_layout import gpt2_parameters

    assert params_of("medium") == sum(math.prod(shape) for _, shape in gpt2_parameters("medium"))
    assert params_of("xl") == 1_557_611_200  # GPT-2 XL's (docs/gpu/h200-2026-11-27-profiled/outer.json)
    h200 = 143_771 * 2**20
    assert beyond_xl([{"peak_bytes_per_param": 12.0}, {"peak_bytes_per_param": 24.5}], h200) == ["4.2b", "2.7b"]
    assert beyond_xl([{"peak_bytes_per_param": 16.0}], h200) == ["6.7b", "4.2b", "2.7b"]
    assert beyond_xl([{"peak_bytes_per_param": None}], None) == []


def test_ncu_raw_csv_is_read_per_kernel_and_a_kernel_list_becomes_its_filter():
    from edgc_bench.gpu_hbm import kernel_filter, parse

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
    names = ["void at::native::indexFuncLargeIndex<int, long>(int*, long)", "histogram_kernel(float const*)"]
    assert kernel_filter(names) == [
        "--kernel-name-base",
        "function",
        "--kernel-name",
        "regex:^(histogram_kernel|indexFuncLargeIndex)$",
    ]
    assert kernel_filter([]) == []
