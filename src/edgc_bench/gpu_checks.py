"""Parts "tests" and "ncu" of the GPU run: the CUDA tests, plain and under PyTorch's CUDA sanitizer,
and the HBM bytes Nsight Compute reads.

"tests": ``pytest tests/gpu`` (its tests run every step after the first under
``torch.cuda.set_sync_debug_mode("error")`` themselves), then the engine, NCCL, resume and DiLoCo tests
again with ``TORCH_CUDA_SANITIZER=1`` (gloo's worker threads copy CUDA tensors on streams of their
own, so the gloo tests stay out of it); each a process of its own with its share of the part's
limit, its outcome per test read from pytest's JUnit XML. Both run without tests/conftest.py
(``--noconftest``): it stops any run on a machine without every extra the CI suite tests (torchft and
sphinx among them, which the device's image lacks), and tests/gpu needs none of them nor its fixtures.

"ncu": `edgc_bench.gpu_hbm` under Nsight Compute, first the kernels only a sampled step runs (the
histogram's: their names are read from part "sampled"'s file, so only they are profiled), then a
whole static step. Without ncu (a CPU), the profiled workload runs alone, so that its code is checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SANITIZED = "engine or nccl or resume or diloco"
FIRST_SHARE = 0.6  # of a part's time: the first of its two runs


def run_bounded(command: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """``command`` (in the repository's root) and its exit status and output; killed with every
    process it started once ``timeout`` seconds have passed (status None)."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=max(timeout, 1))
        return process.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, output


def read_junit(path: Path) -> list[dict]:
    """Per test case of a JUnit XML file: its name, outcome, seconds and message."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = {"failure": "failed"}.get(child.tag, child.tag), child.get("message", "")
        cases.append(
            {
                "test": f"{case.get('classname', '')}::{case.get('name', '')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message[:1500],
            }
        )
    return cases


def pytest_run(arguments: list[str], timeout: float, env: dict | None = None) -> dict:
    """``python -m pytest ARGUMENTS`` bounded by ``timeout``: exit status, outcomes per test, output's end."""
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-rA"]
        command.append(f"--junitxml={junit}")
        started = time.perf_counter()
        status, output = run_bounded(command + arguments, timeout, env)
        tests = read_junit(junit) if junit.exists() else []
    outcomes: dict[str, int] = {}
    for case in tests:
        outcomes[case["outcome"]] = outcomes.get(case["outcome"], 0) + 1
    return {
        "arguments": arguments,
        "env": env or {},
        "exit": status,
        "timed_out": status is None,
        "seconds": time.perf_counter() - started,
        "outcomes": outcomes,
        "tests": tests,
        "output_tail": output[-4000:],
    }


def tests_part(record, settings: dict) -> None:
    """Part "tests" (the module docstring)."""
    started, limit = time.perf_counter(), settings["part_limit_s"]
    runs = [
        ("sync_debug", settings["tests"], {"HF_HUB_OFFLINE": "1"}, FIRST_SHARE),
        (
            "sanitizer",
            settings["tests"] + settings["sanitized"],
            {"HF_HUB_OFFLINE": "1", "TORCH_CUDA_SANITIZER": "1"},
            1.0,
        ),
    ]
    for name, arguments, env, share in runs:
        left = limit - (time.perf_counter() - started) - 2
        timeout = left * share
        record.attempt("runs", {"run": name}, lambda: pytest_run(arguments, timeout, env))


def histogram_kernels(out: Path) -> list[str]:
    """The kernels only a sampled step ran (eager), from part "sampled"'s file; none if it has none."""
    path = out / "sampled.json"
    if not path.exists():
        return []
    entries = json.loads(path.read_text()).get("sampled_only_kernels", [])
    return [name for entry in entries if entry["mode"] == "eager" for name, _, _ in entry["kernels"]]


def ncu_part(record, settings: dict) -> None:
    """Part "ncu" (the module docstring)."""
    from .gpu_hbm import measure, ncu_path, workload

    out, model, rank = Path(settings["out"]), settings["size"], settings["rank"]
    started, limit = time.perf_counter(), settings["part_limit_s"]
    histogram = histogram_kernels(out)
    jobs = [("edgc-sampled", histogram, "the sampled step's own kernels"), ("edgc", [], "a static step")]
    if not histogram:
        jobs[0] = ("edgc-sampled", [], "a sampled step (no kernel list from part sampled: every kernel)")
    path = ncu_path()
    record.set("ncu", path)
    for k, (method, kernels, what) in enumerate(jobs):
        label = {"model": model, "rank": rank, "method": method, "what": what}
        if path is None:  # the workload alone: its code checked, no bytes read
            record.unavailable("rows", label, "Nsight Compute (ncu) is not installed here")
            record.attempt("workload_ran", label, lambda: workload(model, rank, method) or {"ran": True})
            continue
        left = limit - (time.perf_counter() - started) - 2
        timeout = left * (FIRST_SHARE if k == 0 else 1.0)
        record.attempt("rows", label, lambda: measure(model, rank, method, timeout, kernels))
