"""CQM — the compression quantification model: rank ↔ truncation error ↔ entropy.

Eckart–Young–Mirsky: the best rank-r approximation of A leaves ‖A − A_r‖_F² = Σ_{i>r} λ_i,
the tail of the eigenvalues of AAᵀ. For a Gaussian m×n matrix with unit-variance entries,

    g(r; m, n) = E[ Σ_{i>r} λ_i(AAᵀ) ]

is estimated by Monte Carlo (`error_curve_mc`) and, for large shapes, by the
Marchenko–Pastur law (`error_curve_mp`), which the tests check against each other.

If gradient entries are ~N(0, σ²), the expected error at rank r is σ²·g(r), and the Gaussian
differential entropy is h = ½·ln(2πeσ²). Holding the error fixed while the entropy moves
from H0 to H1 gives g(r1) = e^{c(H0−H1)}·g(r0) (c = 2 for the squared norm), so
r1 = g⁻¹(e^{c(H0−H1)}·g(r0)): falling entropy permits a lower rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

# Above this many matrix elements the Monte-Carlo draw costs seconds; the Marchenko–Pastur
# law is accurate to ~1 % there (it is asymptotic in the matrix size), so it is used instead.
MC_MAX_ELEMENTS = 4_000_000


def error_curve_mc(m: int, n: int, samples: int = 4, seed: int = 0) -> np.ndarray:
    """g(r; m, n) for r = 0..min(m, n) by Monte Carlo over Gaussian matrices.

    Args:
        m: the matrices' rows.
        n: their columns.
        samples: the Gaussian matrices drawn.
        seed: the draws' seed.

    Returns:
        g(r) for r = 0..min(m, n), the mean squared error of the best rank-r approximation.
    """
    p, q = min(m, n), max(m, n)
    rng = np.random.default_rng(seed)
    tails = np.zeros(p + 1)
    for _ in range(samples):
        a = rng.standard_normal((p, q), dtype=np.float32).astype(np.float64)
        eigenvalues = np.linalg.eigvalsh(a @ a.T)[::-1]  # descending
        total = eigenvalues.sum()
        tails += total - np.concatenate([[0.0], np.cumsum(eigenvalues)])
    return np.maximum(tails / samples, 0.0)


def error_curve_mp(m: int, n: int, grid: int = 20_001) -> np.ndarray:
    """g(r; m, n) for r = 0..min(m, n) from the Marchenko–Pastur law.

    With p = min(m, n), q = max(m, n), γ = p/q, the eigenvalues x of AAᵀ/q follow the MP density
    f(x) = √((b−x)(x−a)) / (2πγx) on [a, b], a = (1−√γ)², b = (1+√γ)². The top r of p eigenvalues
    lie above the quantile x_r = F⁻¹(1 − r/p), so g(r) = p·q·∫_a^{x_r} x f(x) dx.
    Integrated in θ with x = a + (b−a)(1−cos θ)/2, which removes the edge singularities.

    Args:
        m: the matrices' rows.
        n: their columns.
        grid: the quadrature's points in θ.

    Returns:
        g(r) for r = 0..min(m, n).
    """
    p, q = min(m, n), max(m, n)
    gamma = p / q
    a, b = (1 - math.sqrt(gamma)) ** 2, (1 + math.sqrt(gamma)) ** 2
    theta = (np.arange(grid) + 0.5) * (math.pi / grid)  # midpoints
    x = a + (b - a) * (1 - np.cos(theta)) / 2
    density_dtheta = ((b - a) / 2) ** 2 * np.sin(theta) ** 2 / (2 * math.pi * gamma * x) * (math.pi / grid)
    cdf = np.cumsum(density_dtheta)
    first_moment = np.cumsum(x * density_dtheta)
    cdf /= cdf[-1]  # the quadrature is accurate to ~1e-9; normalise exactly
    first_moment /= first_moment[-1]  # E[x] = 1 under MP
    ranks = np.arange(p + 1)
    quantiles = np.interp(1 - ranks / p, cdf, x)
    return p * q * np.interp(quantiles, x, first_moment, left=0.0)


class ErrorModel:
    """g summed over a set of matrix shapes, with per-shape curves cached.

    ``total(r)`` is Σ_i g(min(r, k_i); m_i, n_i) over every compressed matrix: the expected
    squared truncation error of the whole gradient at rank r (unit variance). Larger shapes take the
    Marchenko–Pastur curve (`error_curve_mp`).

    Args:
        samples: the Monte Carlo draws per small shape (`error_curve_mc`).
        seed: their seed.
    """

    def __init__(self, samples: int = 4, seed: int = 0):
        self.samples = samples
        self.seed = seed
        self._curves: dict[tuple[int, int], np.ndarray] = {}

    def curve(self, m: int, n: int) -> np.ndarray:
        """g(r; m, n), cached per shape: Monte Carlo up to `MC_MAX_ELEMENTS` elements, else Marchenko–Pastur.

        Args:
            m: the matrix's rows.
            n: its columns.

        Returns:
            g(r) for r = 0..min(m, n).
        """
        key = (min(m, n), max(m, n))
        if key not in self._curves:
            if m * n <= MC_MAX_ELEMENTS:
                self._curves[key] = error_curve_mc(*key, samples=self.samples, seed=self.seed)
            else:
                self._curves[key] = error_curve_mp(*key)
        return self._curves[key]

    def total(self, rank: int, shapes: Iterable[tuple[int, int]]) -> float:
        """Σ_i g(min(r, k_i); m_i, n_i) over the matrices.

        Args:
            rank: the rank r.
            shapes: (m, n) of every compressed matrix.

        Returns:
            The expected squared truncation error of the whole gradient at rank r (unit variance).
        """
        value = 0.0
        for m, n in shapes:
            g = self.curve(m, n)
            value += float(g[min(rank, len(g) - 1)])
        return value

    def inverse(self, target: float, shapes: list[tuple[int, int]], r_low: int, r_high: int) -> int:
        """The smallest rank whose total error is within a target.

        Args:
            target: the total error allowed.
            shapes: (m, n) of every compressed matrix.
            r_low: the lowest rank searched.
            r_high: the highest.

        Returns:
            The smallest rank in [r_low, r_high] whose total error ≤ target (r_high if none).
        """
        for rank in range(r_low, r_high + 1):  # total() is non-increasing in rank
            if self.total(rank, shapes) <= target:
                return rank
        return r_high


def cqm_target_rank(
    model: ErrorModel,
    shapes: list[tuple[int, int]],
    current_rank: int,
    entropy_before: float,
    entropy_now: float,
    exponent: float,
    r_min: int,
    r_max: int,
) -> int:
    """r1 = g⁻¹(e^{c(H0−H1)}·g(r0)) over the given matrix shapes, searched within [r_min, r_max]."""
    if not shapes:
        return current_rank
    allowed_error = math.exp(exponent * (entropy_before - entropy_now)) * model.total(current_rank, shapes)
    return model.inverse(allowed_error, shapes, r_min, r_max)
