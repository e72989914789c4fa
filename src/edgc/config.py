"""`EDGCConfig`: every knob of EDGC in one validated dataclass.

Defaults follow the paper's released code (``docs``, README table): α = 0.1, β = 0.25, 1000 histogram bins,
window w = 1000 steps, rank step s = 4, r_min = r_max / 4, warm-up floor 10 % of the planned steps, seed 714.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .checks import FieldCheck
from .policies.rank_rules import rank_mapping, rank_mapping_names
from .policies.rank_split import rank_split_names
from .policies.signals import get_signal, signal_names

ENTROPY_ESTIMATORS = ("auto", "histogram", "gaussian")
COMM_DTYPES = (None, "bfloat16", "float16", "float32")
ERROR_FEEDBACK_DTYPES = ("float32", "gradient")
ORTHONORMALIZATION_CHOICES = ("auto", "householder", "cholesky2-fp64", "cholesky4-fp32")
RANK_CHANGES = ("warm", "truncate")
POWER_ITERATIONS = (1, 2)


@dataclass(frozen=True, kw_only=True)
class LowRankConfig:
    """The PowerSGD engine's own settings (`edgc.engine.lowrank.LowRankCompressor`), nested in `EDGCConfig.engine`."""

    min_compression_rate: float = 2.0
    """A matrix m×n is compressed only if (m+n)·r·rate < m·n; others go raw. ≥ 0 (0 = compress all)."""

    error_feedback: bool = True
    """Keep each matrix's compression residual and add it to its next gradient."""

    error_feedback_dtype: str = "float32"
    """dtype of error feedback for bf16/fp16 gradients: 'float32' (exact) or 'gradient' (half the memory)."""

    communication_dtype: str | None = None
    """dtype of P/Q on the wire: None = the gradient dtype, or 'bfloat16', 'float16', 'float32'."""

    orthogonalization_epsilon: float = 1e-12
    """Shift of each Gram matrix in orthonormalising P and Q, relative to its mean diagonal (finite factors). ≥ 0."""

    orthonormalization: str = "auto"
    """How P and Q are orthonormalised: 'auto' (by device: Householder on CPU, float64 CholeskyQR2 on GPUs with fast
    float64, float32 four-pass CholeskyQR elsewhere), or one of 'householder', 'cholesky2-fp64', 'cholesky4-fp32'."""

    seed: int = 714
    """Seed of the initial Q factors and of restarted Q rows (identical on every rank). ≥ 0."""

    rank_change: str = "warm"
    """How Q follows a rank change: 'warm' (keep the highest-energy directions, add the residual's) or 'truncate' (first
    columns, random new ones)."""

    cuda_graphs: bool = False
    """On CUDA, replay each stretch of a compressed job from a CUDA graph once it has run twice at a rank (captured
    again after a rank change or a new layout, each capture said on the edgc logger); eager off CUDA."""

    # Set by whoever builds the engine (DiLoCo's outer sync, a dispatch count), not by a run's
    # EDGCConfig: not in its to_dict, so config.json and checkpoints read as before.
    power_iterations: int = 1
    """Power iterations a compressed call runs: 1, or 2 for a second on the compressed matrices (twice their bytes)."""

    force_accelerator_kernels: bool = False
    """A CPU runs a fast-float64 GPU's kernels (orthonormalisation, error feedback's path): dispatch counts, tests."""

    def __post_init__(self) -> None:
        check = FieldCheck(self)
        check.number("min_compression_rate", allow_zero=True)
        check.number("orthogonalization_epsilon", allow_zero=True)
        check.choice("orthonormalization", ORTHONORMALIZATION_CHOICES)
        check.boolean("error_feedback")
        check.choice("error_feedback_dtype", ERROR_FEEDBACK_DTYPES)
        check.choice("communication_dtype", COMM_DTYPES)
        check.integer("seed", 0)
        check.choice("rank_change", RANK_CHANGES)
        check.choice("power_iterations", POWER_ITERATIONS)
        check.boolean("force_accelerator_kernels")
        check.boolean("cuda_graphs")


@dataclass(kw_only=True)
class EDGCConfig:
    """Configuration of the EDGC compressor (one instance per data-parallel group)."""

    r_max: int | None = None
    """Largest PowerSGD rank (rank ceiling); None = profile it at start (ranks 2, 4, 8, …). ≥ 1."""

    r_min: int | None = None
    """Smallest rank the controller may choose; None = max(1, r_max // 4). 1 ≤ r_min ≤ r_max."""

    rank_step: int = 4
    """Largest rank change per window (s), in ranks. ≥ 1."""

    rank_granularity: int = 2
    """Chosen ranks are rounded down to a multiple of this (the paper uses even ranks). ≥ 1."""

    window: int = 1000
    """Window length w in optimizer steps; the rank is re-decided once per window. ≥ 1."""

    adaptive: bool = True
    """False = static PowerSGD at r_max after warm-up (no entropy sampling, no rank changes)."""

    rank_mapping: str = "delta"
    """Rank mapping, one registered in edgc.policies.rank_rules: 'delta' (authors' linear map of the entropy
    change), 'cqm', or 'error-band' (keeps ‖M−Ĝ‖²/‖M‖² in error_band)."""

    cqm_exponent: float = 2.0
    """c in g(r1) = e^{c(H0−H1)} g(r0): 2 for squared Frobenius error, 1 for the plain norm. > 0."""

    cqm_mc_samples: int = 4
    """Monte-Carlo draws per matrix shape when estimating g(r; m, n) for the 'cqm' mapping. ≥ 1."""

    iteration_sample_ratio: float = 0.1
    """α (ISR): entropy is estimated every round(1/α) optimizer steps (once per window when no decision reads it). In
    (0, 1]."""

    gradient_sample_ratio: float = 0.25
    """β (GSR): fraction of gradient elements used (every round(1/β)-th element of each tensor). In (0, 1]."""

    entropy_sample_cap: int | None = 1 << 22
    """About the most gradient elements one sampled step's estimate reads: beyond it the β stride is
    thinned (elements, one more per tensor at most; ≥ entropy_bins; None = every β-th element)."""

    entropy_bins: int = 1000
    """Histogram bins over the sample's [min, max] for the entropy estimate. ≥ 2."""

    entropy_estimator: str = "auto"
    """'histogram' (plug-in Shannon entropy, nats), 'gaussian' (½·ln(2πeσ²)) or 'auto' (gaussian for cqm, else
    histogram)."""

    total_steps: int | None = None
    """Planned optimizer steps T of the run, for the warm-up floor; None = no fraction-based floor. ≥ 1."""

    warmup_fraction: float = 0.1
    """f_w: no compression before ⌊f_w·T⌋ steps (needs total_steps). In [0, 1]."""

    warmup_error_test: bool = True
    """Also wait until the rank-r_min error of today's gradients ≤ the rank-r_max error at warm-up start."""

    min_warmup_steps: int = 2
    """Absolute floor of uncompressed steps (lets DDP rebuild its buckets first). ≥ 0."""

    profile_max_rank: int = 128
    """Highest rank profiled for r_max: tried first, then halved down to 2 until one pays (pipeline stages: up from 2).
    ≥ 2."""

    profile_steps_per_rank: int = 2
    """Timed steps per candidate rank when profiling, after a one-step quick test that may settle it (the first
    candidate's also time the plain sync, blocking). ≥ 1."""

    # --- noise-robust rank decisions: the noise gate on the entropy trend ---
    entropy_significance: float = 3.0
    """k of the noise gate: the rank moves only if the entropy shift exceeds k standard errors of the window means; 0 =
    no gate (the paper's rule, every window). ≥ 0."""

    max_warmup_fraction: float = 0.3
    """The warm-up ends by ⌊this·T⌋ steps even if the error test has not passed (needs total_steps). In [0, 1]."""

    error_band: tuple[float, float] = (0.05, 0.15)
    """'error-band' mapping: keep the window mean of ‖M−Ĝ‖²/‖M‖² (relative, unitless) in [low, high]; 0 ≤ low < high ≤
    1."""

    # --- the byte budget: a mean rank, spent early ---
    rank_budget: float | None = None
    """Byte budget as the mean rank over the compressed steps, spent early by the budget controller (needs total_steps);
    None = the paper's rank rules (rank_mapping). r_min ≤ budget ≤ r_max."""

    budget_signal: str = "schedule"
    """What tells the budget controller the early regime lasts, a signal registered in edgc.policies.signals:
    'schedule' (fixed front-loaded), or the noise-gated trend of 'gradnorm', 'entropy' or 'error'."""

    front_load: float = 2.0
    """Budget controller: rank = even spending rate × (1 + (front_load − 1)·need), need ∈ [0, 1] from the signal. ≥ 1 (1
    = spend evenly)."""

    rank_schedule: tuple[tuple[int, int], ...] | None = None
    """Hand-set ranks: ((step, rank), …), the rank in force from each optimizer step on once compressing; overrides
    every controller. 1 ≤ rank ≤ r_max."""

    rank_split: str = "uniform"
    """How the rank is shared among each stacked experts parameter's experts (edgc.policies.rank_split):
    'uniform' (all at the rank) or 'tokens' (in proportion to the tokens routed to each in the last window,
    at the same bytes). The default is the one `edgc experiment moe`'s paired interval sets (docs/guides/moe.md)."""

    fusion_mb: float | None = None
    """Gradient MB of consecutive DDP buckets gathered into one compression job (fewer, larger kernel batches); None =
    256 on accelerators, 0 (each bucket its own job) on CPU. ≥ 0."""

    engine: LowRankConfig = field(default_factory=LowRankConfig)
    """The PowerSGD engine's settings, a `LowRankConfig` (the table's last rows, ``engine.NAME``):
    EDGCConfig(engine=LowRankConfig(error_feedback=False)), --edgc engine.error_feedback=false, config.engine.seed."""

    def __post_init__(self) -> None:
        check = FieldCheck(self)
        if not isinstance(self.engine, LowRankConfig):
            check.fail("engine", "must be a LowRankConfig: EDGCConfig(engine=LowRankConfig(seed=1))")
        for name in ("r_max", "r_min", "total_steps"):
            if getattr(self, name) is not None:
                check.integer(name, 1)
        for name in ("rank_step", "rank_granularity", "window", "cqm_mc_samples", "profile_steps_per_rank"):
            check.integer(name, 1)
        check.integer("entropy_bins", 2)
        if self.entropy_sample_cap is not None:
            check.integer("entropy_sample_cap", self.entropy_bins)
        check.integer("profile_max_rank", 2)
        check.integer("min_warmup_steps", 0)
        check.ratio("iteration_sample_ratio", low_open=True)
        check.ratio("gradient_sample_ratio", low_open=True)
        check.ratio("warmup_fraction", low_open=False)
        check.ratio("max_warmup_fraction", low_open=False)
        check.number("entropy_significance", allow_zero=True)
        band = self.error_band
        if (
            not isinstance(band, (tuple, list))
            or len(band) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in band)
            or not 0 <= band[0] < band[1] <= 1
        ):
            check.fail("error_band", "must be (low, high) with 0 ≤ low < high ≤ 1")
        self.error_band = (float(band[0]), float(band[1]))
        check.number("cqm_exponent", allow_zero=False)
        if self.fusion_mb is not None:
            check.number("fusion_mb", allow_zero=True)
        for name in ("adaptive", "warmup_error_test"):
            check.boolean(name)
        check.choice("rank_mapping", rank_mapping_names())
        check.choice("entropy_estimator", ENTROPY_ESTIMATORS)
        check.choice("budget_signal", signal_names())
        check.choice("rank_split", rank_split_names())
        check.number("front_load", allow_zero=False)
        if self.front_load < 1:
            check.fail("front_load", "must be ≥ 1 (1 = spend the budget evenly)")
        if self.rank_budget is not None:
            check.number("rank_budget", allow_zero=False)
            if self.total_steps is None:
                check.fail("rank_budget", "needs total_steps (the budget is a mean over the run's compressed steps)")
            if self.rank_budget < 1 or (self.r_max is not None and self.rank_budget > self.r_max):
                check.fail("rank_budget", f"must be in [max(1, r_min), r_max = {self.r_max}]")
            if self.r_min is not None and self.rank_budget < self.r_min:
                check.fail("rank_budget", f"must be ≥ r_min = {self.r_min}")
        if self.rank_schedule is not None:
            entries = self.rank_schedule
            ok = (
                isinstance(entries, (tuple, list))
                and len(entries) > 0
                and all(
                    isinstance(e, (tuple, list))
                    and len(e) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
                    for e in entries
                )
            )
            ok = ok and all(step >= 0 and rank >= 1 for step, rank in entries)
            ok = ok and all(a[0] < b[0] for a, b in zip(entries, entries[1:]))
            if not ok:
                check.fail("rank_schedule", "must be ((step, rank), …) with increasing steps ≥ 0 and ranks ≥ 1")
            self.rank_schedule = tuple((int(a), int(b)) for a, b in entries)
            if self.r_max is not None and max(r for _, r in self.rank_schedule) > self.r_max:
                check.fail("rank_schedule", f"ranks must be ≤ r_max = {self.r_max}")
        if self.r_min is not None:
            if self.r_max is None:
                check.fail("r_min", "needs r_max to be set (with a profiled r_max, r_min = r_max // 4)")
            if self.r_min > self.r_max:
                check.fail("r_min", f"must be ≤ r_max = {self.r_max}")

    # ------------------------------------------------------------------ helpers
    @classmethod
    def static(cls, rank: int, **overrides: Any) -> EDGCConfig:
        """Static PowerSGD after the warm-up: the non-adaptive baseline.

        Args:
            rank: the rank of every compressed step (r_max = r_min).
            **overrides: any other field.

        Returns:
            The config.

        Raises:
            ValueError: ``overrides`` set ``r_max``, ``r_min`` or ``adaptive``.
        """
        fixed = sorted({"r_max", "r_min", "adaptive"} & set(overrides))
        if fixed:
            raise ValueError(f"EDGCConfig.static: {fixed} are set by the rank argument; pass rank= only")
        overrides.setdefault("warmup_error_test", False)
        return cls(r_max=rank, r_min=rank, adaptive=False, **overrides)

    @property
    def sample_every(self) -> int:
        """Entropy is sampled on steps where step % sample_every == 0 (1/α rounded)."""
        return max(1, round(1.0 / self.iteration_sample_ratio))

    @property
    def decisions_read_samples(self) -> bool:
        """Whether rank decisions read the sampled series (entropy, gradient norm, compression error).

        Not with a hand-set ``rank_schedule`` nor with a budget signal that reads none (the fixed ``schedule``)."""
        if not self.adaptive or self.rank_schedule is not None:
            return False
        return self.rank_budget is None or get_signal(self.budget_signal).reads_samples

    @property
    def sample_period(self) -> int:
        """Steps between the GDS samples actually taken: every round(1/α) steps when decisions read
        them; otherwise once per window, enough for the report's curves and nothing on the hot path."""
        return self.sample_every if self.decisions_read_samples else max(self.sample_every, self.window)

    @property
    def element_stride(self) -> int:
        """Every element_stride-th gradient element enters the entropy sample (1/β rounded)."""
        return max(1, round(1.0 / self.gradient_sample_ratio))

    def warmup_floor(self) -> int:
        """Steps that are always uncompressed.

        Returns:
            max(⌊f_w·T⌋, min_warmup_steps).
        """
        from_fraction = math.floor(self.warmup_fraction * self.total_steps) if self.total_steps else 0
        return max(from_fraction, self.min_warmup_steps)

    def warmup_ceiling(self) -> int:
        """The steps the warm-up never lasts beyond.

        Returns:
            max(⌊max_warmup_fraction·T⌋, warmup_floor()), or infinity without T.
        """
        if not self.total_steps:
            return math.inf  # type: ignore[return-value]
        return max(math.floor(self.max_warmup_fraction * self.total_steps), self.warmup_floor())

    @property
    def resolved_entropy_estimator(self) -> str:
        """The estimator in use: 'auto' is the rank mapping's (`edgc.policies.rank_rules.RankMapping.entropy_estimator`:
        'gaussian' for cqm, whose error model reads entropy differences as log-scale changes, paper §2.5)."""
        if self.entropy_estimator != "auto":
            return self.entropy_estimator
        return rank_mapping(self.rank_mapping).entropy_estimator

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values, so a dict survives config.json unchanged.

        Returns:
            The fields (tuples as lists), the engine's in an ``engine`` table, as `from_dict` reads them.
        """

        def plain(value: Any) -> Any:
            return [plain(v) for v in value] if isinstance(value, (tuple, list)) else value

        values = {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "engine"}
        return {**values, "engine": {name: plain(getattr(self.engine, name)) for name in ENGINE_FIELDS}}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EDGCConfig:
        """The config of a `to_dict`: a JSON or TOML table, ``--edgc`` flags.

        Args:
            values: the fields, the engine's in an ``engine`` table (a dict saved flat: `nested_config_dict` first).

        Returns:
            The config.

        Raises:
            ValueError: an unknown field, or an engine field given beside the others (the line names its table).
        """
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        flat = [name for name in unknown if name in ENGINE_FIELDS]
        if flat:
            nested = f"EDGCConfig(engine=LowRankConfig({flat[0]}=...)), in a dict {{'engine': {{{flat[0]!r}: ...}}}}"
            raise ValueError(f"EDGCConfig has no field {flat[0]!r}: it is an engine field, {nested}")
        engine = values.get("engine", {})
        if isinstance(engine, dict):
            unknown += [f"engine.{name}" for name in sorted(set(engine) - set(ENGINE_FIELDS))]
        if unknown:
            raise ValueError(f"EDGCConfig: unknown field(s) {unknown}")
        if isinstance(engine, dict):
            values = {**values, "engine": LowRankConfig(**engine)}
        return cls(**values)


ENGINE_OWNER_FIELDS = ("power_iterations", "force_accelerator_kernels")  # the engine's owner's (`LowRankConfig`)
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(LowRankConfig) if f.name not in ENGINE_OWNER_FIELDS)


def nested_config_dict(values: dict[str, Any]) -> dict[str, Any]:
    """An `EDGCConfig.to_dict` as one written now, for readers of saved ones (config.json, a checkpoint's
    ``config``): one written before the engine's fields were nested (beside the others) has them moved in.

    Args:
        values: the saved dict, flat or nested.

    Returns:
        The dict with every engine field in ``engine`` (a nested one unchanged).
    """
    flat = {name: values[name] for name in ENGINE_FIELDS if name in values}
    if not flat:
        return values
    rest = {name: value for name, value in values.items() if name not in flat and name != "engine"}
    return {**rest, "engine": {**flat, **(values.get("engine") or {})}}


def dotted_fields(values: dict[str, Any]) -> dict[str, Any]:
    """An `EDGCConfig.to_dict` (or a saved one) by dotted name, the engine's ``engine.NAME`` as torchtitan names them.

    Args:
        values: the dict.

    Returns:
        Dotted name → value.
    """
    values = nested_config_dict(values)
    engine = values.get("engine") or {}
    return {**{k: v for k, v in values.items() if k != "engine"}, **{f"engine.{k}": v for k, v in engine.items()}}


def field_docs(config_class: type = None) -> list[tuple[str, Any, str]]:
    """The one-line doc of every field of a config dataclass, read from the source docstrings.

    Args:
        config_class: the dataclass (default `EDGCConfig`).

    Returns:
        (name, default, one-line doc) per field, in the fields' order ("" where a field has none).
    """
    import ast
    import inspect

    config_class = config_class or EDGCConfig
    tree = ast.parse(inspect.getsource(config_class))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]  # one line

    def default(f: dataclasses.Field) -> Any:
        if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default

    return [(f.name, default(f), docs.get(f.name, "")) for f in dataclasses.fields(config_class)]


__all__ = [
    "EDGCConfig",
    "LowRankConfig",
    "field_docs",
    "config_table_markdown",
    "ENTROPY_ESTIMATORS",
    "RANK_CHANGES",
    "ENGINE_FIELDS",
    "ENGINE_OWNER_FIELDS",
    "nested_config_dict",
    "dotted_fields",
]


def config_table_markdown() -> str:
    """The manual's table of every EDGCConfig field, generated from the dataclasses themselves: the
    engine's fields last, as ``engine.NAME`` (`LowRankConfig`'s, in ``EDGCConfig.engine``)."""
    rows = ["| field | default | meaning, unit, valid range |", "| --- | --- | --- |"]
    engine = [(f"engine.{name}", *rest) for name, *rest in field_docs(LowRankConfig) if name in ENGINE_FIELDS]
    for name, default, doc in field_docs(EDGCConfig) + engine:
        shown = "LowRankConfig()" if name == "engine" else repr(default)
        rows.append(f"| `{name}` | `{shown}` | {doc.replace('|', '∣')} |")
    return "\n".join(rows)
