"""The orthonormalisation comparison: what the docs state is what the engine does."""

import json
from pathlib import Path

import torch

from edgc_bench.orthonormalization import METHODS, compare

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "engine" / "orthonormalization.json"


def test_the_engine_is_as_orthonormal_as_float64_householder_where_one_pass_is_not():
    rows = compare(torch.device("cpu"), shapes=((3, 6, 80),), conditions=(1e1, 1e5), repeats=1)
    quality = {(row["method"], row["input"]): row for row in rows}
    for case in ("kappa=10", "kappa=100000", "rank-deficient"):
        ours, householder = quality["cholesky2-fp64", case], quality["householder-fp64", case]
        assert ours["finite"] and ours["orthogonality"] < max(10 * householder["orthogonality"], 1e-7), case
    assert quality["cholesky-fp64", "kappa=100000"]["orthogonality"] > 1e-2  # why the engine makes two passes
    # Why in float64: float32 CholeskyQR2 squares κ = 1e5 past float32's precision, and whether that
    # ends in a NaN or in a finite but skewed basis depends on the CPU's BLAS; the engine's passes
    # are finite and as orthonormal as Householder on that input on any CPU (the loop above).
    assert {row["method"] for row in rows} == set(METHODS)


def test_the_engine_page_shows_the_committed_comparison(load_producer):
    script = load_producer("orthonormalization")
    assert script.block(json.loads(COMMITTED.read_text())) in (ROOT / "docs" / "concepts" / "engine.md").read_text()


def test_the_float32_method_is_as_orthonormal_as_float32_householder():
    """Where float64 is slow the engine runs four shifted float32 Cholesky passes: finite on every
    input, rank-deficient ones included, and as orthonormal as Householder in the same precision."""
    rows = compare(torch.device("cpu"), shapes=((3, 6, 80),), conditions=(1e1, 1e5, 1e7), repeats=1)
    quality = {(row["method"], row["input"]): row for row in rows}
    for case in ("kappa=10", "kappa=100000", "kappa=1e+07", "rank-deficient"):
        ours, householder = quality["cholesky4-fp32", case], quality["householder-fp32", case]
        assert ours["finite"] and ours["orthogonality"] < max(10 * householder["orthogonality"], 1e-5), case
        assert ours["residual"] < max(10 * householder["residual"], 1e-5), case
