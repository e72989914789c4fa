"""The generated blocks of the manual: where each lives, how one is read, replaced and checked, and
which script produces each kind of figure (`scripts/to_docs.py KIND …` runs one).

A block is the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``. Each name occurs in
exactly one page under docs/ (or in README.md), so a producer names the block it fills and this
module finds the page; moving a block to another page needs no change to the producer. Every
producer reads and writes its blocks through this module; none splits a page at its markers itself.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent

# Each kind of figure, by name, and the script whose `main(argv)` produces its blocks from a run's
# output (its docstring says which run and which blocks). The script's own name runs it too.
PRODUCERS = {
    "bench": "bench_to_docs",
    "bench-ab": "bench_ab_to_docs",
    "bench-repeats": "bench_repeats_to_docs",
    "calibration": "calibration_to_docs",
    "demo": "demo_to_docs",
    "diloco-scale": "diloco_scale_to_docs",
    "diloco-wire": "diloco_wire_to_docs",
    "dispatch-count": "dispatch_count_to_docs",
    "engine-cost": "engine_cost_to_docs",
    "engine-model": "engine_model_to_docs",
    "experiment": "experiment_to_docs",
    "fsdp-memory": "fsdp_memory",
    "gpu": "gpu_to_docs",
    "host-model": "host_model_to_docs",
    "interstage-calibration": "interstage_calibration_to_docs",
    "orthonormalization": "orthonormalization_to_docs",
    "parallel": "parallel_to_docs",
    "results-summary": "results_summary",
    "simulate": "simulate_to_docs",
    "stages": "stages_to_docs",
    "step-kinds": "step_kinds_to_docs",
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def name_of(marker: str) -> str:
    """The block's name in one of its markers (``<!-- NAME:start -->``)."""
    return marker.split()[1].rsplit(":", 1)[0]


def page_of(name: str, root: Path = ROOT) -> Path:
    """The one page (docs/**/*.md or README.md) that holds block ``name``."""
    start, _ = markers(name)
    pages = [
        p
        for p in sorted((root / "docs").rglob("*.md")) + [root / "README.md"]
        if p.is_file() and start in p.read_text()
    ]
    if len(pages) != 1:
        raise SystemExit(f"block {name!r}: expected in exactly one page, found in {[str(p) for p in pages] or 'none'}")
    return pages[0]


def read(text: str, name: str) -> str:
    """Block ``name``'s content in ``text``, as it stands between its markers."""
    start, end = markers(name)
    if start not in text or end not in text:
        raise SystemExit(f"no {start} … {end} block")
    return text.split(start, 1)[1].split(end, 1)[0]


def replace(text: str, name: str, body: str, add_missing: bool = False) -> str:
    """``text`` with block ``name``'s content replaced by ``body``. The markers must be there, unless
    ``add_missing``: then an empty block is added at the end of the text first."""
    start, end = markers(name)
    if add_missing and (start not in text or end not in text):
        text = text.rstrip() + f"\n\n{start}\n{end}\n"
    read(text, name)  # refuses a text without the block
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{body.rstrip()}\n{end}{rest.split(end, 1)[1]}"


def write(name: str, body: str, page: Path | None = None, add_missing: bool = False) -> Path:
    """Replace block ``name`` in ``page`` (default: the page that holds it); returns the page."""
    page = page or page_of(name)
    page.write_text(replace(page.read_text(), name, body, add_missing))
    return page


def is_current(name: str, body: str, page: Path | None = None) -> bool:
    """Whether block ``name`` already holds ``body`` (what `write` would leave there)."""
    text = (page or page_of(name)).read_text()
    return replace(text, name, body) == text


def producer(kind: str):
    """The module of the script that produces figure kind ``kind``."""
    if kind not in PRODUCERS:
        raise SystemExit(f"no figure kind {kind!r}; one of: {', '.join(sorted(PRODUCERS))}")
    script = PRODUCERS[kind]
    sys.path.insert(0, str(SCRIPTS))  # the scripts import each other and this module by name
    spec = importlib.util.spec_from_file_location(script, SCRIPTS / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
