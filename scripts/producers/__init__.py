"""The producers of the manual's figures, one module per kind of figure, registered by kind in
`PRODUCERS`. Each module's `main(argv)` copies a run's output into its generated blocks (its
docstring says which run and which blocks); `python scripts/to_docs.py KIND ARGS…` is the one way to
run one. The modules that are no kind are parts of one: `gpu_runs` (a GPU run's files and cells),
`gpu_tables` (its tables), `gpu_profiled` (the profiled run's sections) and `gpu_measured` (a run in
parts beside the earlier one), all the ``gpu`` kind's.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Each kind of figure, by name, and the module here that produces it.
PRODUCERS = {
    "bench": "bench",
    "bench-ab": "bench_ab",
    "bench-repeats": "bench_repeats",
    "calibration": "calibration",
    "demo": "demo",
    "diloco-scale": "diloco_scale",
    "diloco-wire": "diloco_wire",
    "dispatch-count": "dispatch_count",
    "engine-cost": "engine_cost",
    "engine-model": "engine_model",
    "experiment": "experiment",
    "fsdp-memory": "fsdp_memory",
    "gpu": "gpu",
    "host-model": "host_model",
    "interstage-calibration": "interstage_calibration",
    "mixed-precision": "mixed_precision",
    "orthonormalization": "orthonormalization",
    "parallel": "parallel",
    "results-summary": "results_summary",
    "simulate": "simulate",
    "stages": "stages",
    "step-kinds": "step_kinds",
}


def path_of(kind: str) -> Path:
    """The file of the module that produces figure kind ``kind``."""
    if kind not in PRODUCERS:
        raise SystemExit(f"no figure kind {kind!r}; one of: {', '.join(sorted(PRODUCERS))}")
    return HERE / f"{PRODUCERS[kind]}.py"


def summary(kind: str) -> str:
    """The first line of kind ``kind``'s docstring, read without importing the module (some import
    the harness, the simulator or matplotlib)."""
    docstring = ast.get_docstring(ast.parse(path_of(kind).read_text())) or ""
    return docstring.splitlines()[0] if docstring else ""


def producer(kind: str):
    """The module that produces figure kind ``kind``: its `main(argv)` writes the kind's blocks."""
    path_of(kind)  # refuses an unknown kind
    return importlib.import_module(f"{__name__}.{PRODUCERS[kind]}")
