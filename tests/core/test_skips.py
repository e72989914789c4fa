"""A test is skipped only for what the machine lacks, never for a missing extra: every extra the suite
needs is checked when it starts (`tests/conftest.py`), and the files that may skip are listed here."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# Every file that may skip, and what of the machine it needs. Nothing else may skip.
MACHINE_SKIPS = {
    "gpu/test_cuda.py": "a CUDA device (EDGC_TEST_DEVICE=cuda), NCCL",
    "gpu/test_cuda_graphs.py": "a CUDA device (graph capture)",
    "bench/test_gpu_bench.py": "no CUDA device (the CPU fallback's message)",
    "bench/test_netns.py": "Linux network namespaces and tc (root)",
    "bench/test_link_only.py": "Linux network namespaces and tc (root)",
    "core/test_exit.py": "Linux scheduling policies (SCHED_IDLE)",
}
SKIPPING = {"skip", "skipif", "importorskip"}


def skips_in(path: Path) -> list[str]:
    """Each use of pytest's skip, skipif or importorskip in the file (``pytest.skip``,
    ``pytest.mark.skipif``, ``from pytest import skip``), as ``name:line``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in SKIPPING:
            found.append(f"{node.attr}:{node.lineno}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pytest"):
            found += [f"{a.name}:{node.lineno}" for a in node.names if a.name in SKIPPING]
    return found


def test_no_test_imports_or_skips():
    uses = {str(p.relative_to(TESTS)): skips_in(p) for p in sorted(TESTS.rglob("*.py"))}
    importorskips = {path: found for path, found in uses.items() if any(u.startswith("importorskip") for u in found)}
    assert importorskips == {}, "import the extra plainly: tests/conftest.py checks that it is installed"
    unlisted = {path: found for path, found in uses.items() if found and path not in MACHINE_SKIPS}
    assert unlisted == {}, "a skip only for what the machine lacks, listed in MACHINE_SKIPS"
    assert all(uses.get(path) for path in MACHINE_SKIPS), "a listed file that no longer skips leaves the list"


def test_a_missing_extra_stops_the_suite_by_name():
    spec = importlib.util.spec_from_file_location("suite_conftest", TESTS / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    assert conftest.missing_extras() == []
    absent = conftest.REQUIRED_EXTRAS["torchft"]
    real = importlib.util.find_spec
    assert conftest.missing_extras(lambda name: None if name == absent else real(name)) == ["torchft"]
