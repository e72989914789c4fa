"""The manual's generated blocks go through one mechanism (scripts/doc_blocks.py): every producer is
registered by the kind of figure it copies, runs through `scripts/to_docs.py KIND`, and leaves the
splitting of a page at its markers to doc_blocks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# The parts of the mechanism and of one producer, which write no block of their own.
NOT_PRODUCERS = {"doc_blocks", "to_docs", "gpu_runs", "gpu_tables", "gpu_profiled", "gpu_measured"}


def test_every_script_that_writes_a_block_is_a_registered_producer(load_script):
    doc_blocks = load_script("doc_blocks")
    scripts = {p.stem for p in SCRIPTS.glob("*.py")} - NOT_PRODUCERS
    assert set(doc_blocks.PRODUCERS.values()) == scripts
    for script in scripts:  # read, not imported: some import the harness, the simulator, matplotlib
        tree = ast.parse((SCRIPTS / f"{script}.py").read_text())
        assert any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body), script


def test_no_script_finds_a_marker_itself():
    """A marker is written only by doc_blocks.markers; a docstring may name one."""
    found = []
    for path in sorted(SCRIPTS.glob("*.py")):
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
    assert "gpu                      scripts/gpu_to_docs.py" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no figure kind 'nope'"):
        to_docs.main(["nope"])
