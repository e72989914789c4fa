"""The manual's generated blocks go through one mechanism (scripts/doc_blocks.py): every producer is
registered by the kind of figure it copies, runs through `scripts/to_docs.py KIND`, and leaves the
splitting of a page at its markers to doc_blocks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PRODUCERS = SCRIPTS / "producers"
# The registry, and the parts of one producer: none writes a block of its own.
PARTS = {"__init__", "gpu_runs", "gpu_tables", "gpu_profiled", "gpu_measured"}


def test_every_producer_is_a_module_registered_by_kind_and_no_script_runs_one_alone(load_script):
    producers = load_script("to_docs").PRODUCERS
    modules = {p.stem for p in PRODUCERS.glob("*.py")} - PARTS
    assert set(producers.values()) == modules
    assert {p.name for p in SCRIPTS.glob("*.py")} == {"doc_blocks.py", "to_docs.py"}
    for module in modules | PARTS:  # read, not imported: some import the harness, the simulator, matplotlib
        tree = ast.parse((PRODUCERS / f"{module}.py").read_text())
        defines_main = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
        assert defines_main == (module not in PARTS), module
        runs_alone = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert runs_alone == [], module


def test_no_script_finds_a_marker_itself():
    """A marker is written only by doc_blocks.markers; a docstring may name one."""
    found = []
    for path in sorted(SCRIPTS.rglob("*.py")):
        tree = ast.parse(path.read_text())
        documented = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, documented) and ast.get_docstring(node, clean=False) is not None
        }
        found += [
            f"{path.name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and ":start -->" in node.value
            and id(node) not in docstrings
            and path.stem != "doc_blocks"
        ]
    assert found == []


def test_a_block_is_read_replaced_added_and_checked(load_script, tmp_path):
    blocks = load_script("doc_blocks")
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- x:start -->\nold\n<!-- x:end -->\ntail\n")
    assert blocks.read(page.read_text(), "x") == "\nold\n"
    assert not blocks.is_current("x", "new", page)
    blocks.write("x", "new\n\n", page)
    assert page.read_text() == "intro\n<!-- x:start -->\nnew\n<!-- x:end -->\ntail\n"
    assert blocks.is_current("x", "new", page)
    with pytest.raises(SystemExit, match="no <!-- y:start -->"):
        blocks.write("y", "body", page)
    blocks.write("y", "body", page, add_missing=True)
    assert page.read_text().endswith("tail\n\n<!-- y:start -->\nbody\n<!-- y:end -->\n")


def test_to_docs_lists_the_kinds_and_refuses_an_unknown_one(load_script, capsys):
    to_docs = load_script("to_docs")
    assert to_docs.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(to_docs.PRODUCERS)
    assert "gpu                      scripts/producers/gpu.py  Copy the figures of GPU runs" in listed[12]
    with pytest.raises(SystemExit, match="no figure kind 'nope'"):
        to_docs.main(["nope"])
