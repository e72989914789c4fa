"""Model shapes, parallel layouts and the paper's training presets (the paper, §3.2)."""

from __future__ import annotations

from dataclasses import dataclass

GPT2_VOCAB = 50257  # GPT-2 BPE vocabulary (gpt2-vocab.json)
# The paper's runs compress with Optimus-CC's reducer (cost_model.optimus_powersgd_time); `edgc train`
# runs with this library's engine (edgc_sim.engine_model), priced with the device's engine rates.
REDUCERS = ("paper", "edgc")


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-2 decoder (Megatron layout: tied input/output embedding, learned positions)."""

    layers: int  #: transformer blocks (>= 1)
    hidden: int  #: model width h (>= 1, divisible by heads)
    heads: int  #: attention heads (>= 1)
    seq_len: int = 1024  #: tokens per sequence, also the number of position embeddings (>= 1)
    vocab: int = GPT2_VOCAB  #: vocabulary size before padding (>= 1)
    vocab_pad: int = 128  #: vocab is padded to a multiple of vocab_pad * TP (Megatron 128; 1 = none)
    positions: int = 0  #: learned position embeddings (>= seq_len); 0 = seq_len (Megatron max-position)

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "vocab_pad"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.positions and self.positions < self.seq_len:
            raise ValueError(f"positions ({self.positions}) must be 0 or >= seq_len ({self.seq_len})")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    def padded_vocab(self, tp: int) -> int:
        """Megatron pads the vocabulary to a multiple of 128 * TP so each shard is aligned."""
        step = self.vocab_pad * tp
        return -(-self.vocab // step) * step

    def params(self) -> int:
        """Parameters (unpadded vocab): 12 L h^2 + 13 L h + embeddings + final LayerNorm."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (self.vocab + self.position_count) * h + 2 * h

    @property
    def position_count(self) -> int:
        return self.positions or self.seq_len


@dataclass(frozen=True)
class ParallelSpec:
    """3D layout and batch shape of one iteration."""

    tp: int  #: tensor-parallel degree (>= 1)
    pp: int  #: pipeline stages (>= 1)
    dp: int  #: data-parallel replicas (>= 1)
    micro_batch: int  #: sequences per micro-batch (>= 1)
    global_batch: int  #: sequences per iteration over all replicas (multiple of micro_batch * dp)

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.global_batch % (self.micro_batch * self.dp):
            raise ValueError(
                f"global_batch ({self.global_batch}) must be a multiple of micro_batch*dp "
                f"({self.micro_batch * self.dp})"
            )

    @property
    def micro_batches(self) -> int:
        """Micro-batches per iteration per pipeline (m)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Preset:
    """A training setup: model, layout, run length, precision and the cluster it ran on."""

    name: str  #: preset key
    model: ModelSpec  #: network shape
    parallel: ParallelSpec  #: 3D layout and batch
    iterations: int  #: training iterations of a whole run (>= 1)
    cluster: str  #: default key into hardware.CLUSTERS
    precision: str = "fp32"  #: matmul precision key into DeviceSpec.matmul_flops
    bytes_per_value: int = 4  #: bytes of an activation / gradient / P,Q value (4 = fp32)
    source: str = ""  #: where the numbers come from
    reducer: str = "paper"  #: whose PowerSGD the DP sync runs: "paper" (Optimus-CC's reducer) or "edgc" (our engine)

    def __post_init__(self):
        if self.reducer not in REDUCERS:
            raise ValueError(f"reducer must be one of {REDUCERS}, got {self.reducer!r}")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations!r}")
        if self.bytes_per_value not in (2, 4):
            raise ValueError(f"bytes_per_value must be 2 or 4, got {self.bytes_per_value!r}")
        if self.model.layers % self.parallel.pp:
            raise ValueError(f"layers ({self.model.layers}) must be divisible by pp ({self.parallel.pp})")


# The released launch scripts pass no --fp16/--bf16 (the paper, §3.3), so the runs were fp32 Megatron;
# the NGC 24.05 container they name turns fp32 matmuls into TF32 on tensor cores where the GPU has
# them (H100, not V100). Gradients, P/Q and activations are then fp32 (4 bytes).
PRESETS = {
    p.name: p
    for p in (
        Preset(
            "gpt2-345m",
            ModelSpec(24, 1024, 16),
            ParallelSpec(2, 4, 2, 4, 64),
            230_000,
            "v100x16",
            "fp32",
            4,
            "the paper, §3.2, EDGC 345M_GPT2_230K.sh",
        ),
        Preset(
            "gpt2-2.5b",
            ModelSpec(52, 1920, 24),
            ParallelSpec(4, 4, 2, 4, 64),
            230_000,
            "v100x32",
            "fp32",
            4,
            "the paper, §3.2, EDGC 2.5B_GPT2_230k.sh",
        ),
        Preset(
            "gpt2-12.1b",
            ModelSpec(76, 3584, 28),
            ParallelSpec(4, 4, 4, 4, 128),
            230_000,
            "h100x64",
            "tf32",
            4,
            "the paper, §3.2, EDGC 12.1B_GPT2_230k.sh",
        ),
    )
}
