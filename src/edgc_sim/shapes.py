"""Which gradient tensors one pipeline stage's DP buffer holds (per TP rank, Megatron layout)."""

from __future__ import annotations

from dataclasses import dataclass

from .presets import ModelSpec


@dataclass(frozen=True)
class StageParams:
    """The local (TP-shard) gradient tensors of one stage."""

    matrices: tuple  #: (rows, cols) of every >= 2-D tensor; PowerSGD compresses these
    vector_values: int  #: total values of the 1-D tensors (biases, LayerNorm); always sent raw
    embedding_values: int  #: values of the tied word-embedding shard held here (0 if none)

    @property
    def values(self) -> int:
        """All gradient values of the stage."""
        return sum(m * n for m, n in self.matrices) + self.vector_values


def layer_matrices(hidden: int, tp: int) -> list:
    """One block's weight shards: QKV and FC1 are column-parallel, attention-out and FC2 row-parallel
    (the paper, §3.2 worked example: 1440x1920, 1920x480, 1920x1920, 1920x1920 at h=1920, TP=4)."""
    h = hidden
    return [(3 * h // tp, h), (h, h // tp), (4 * h // tp, h), (h, 4 * h // tp)]


def layer_vector_values(hidden: int, tp: int) -> int:
    """Biases (QKV and FC1 sharded, the row-parallel ones replicated) and two LayerNorms."""
    h = hidden
    return 3 * h // tp + h + 4 * h // tp + h + 2 * 2 * h


def stage_params(model: ModelSpec, tp: int, pp: int, stage: int) -> StageParams:
    """Stage 0 also holds the word- and position-embedding shards, the last stage the final
    LayerNorm and its copy of the tied word embedding (the LM head)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    layers = model.layers // pp
    matrices = layer_matrices(model.hidden, tp) * layers
    vectors = layer_vector_values(model.hidden, tp) * layers
    word = (model.padded_vocab(tp) // tp, model.hidden)
    embedding = 0
    if stage == 0:
        matrices += [word, (model.position_count, model.hidden)]
        embedding = word[0] * word[1]
    if stage == pp - 1:
        vectors += 2 * model.hidden
        if pp > 1:  # with one stage the LM head is the input embedding itself
            matrices.append(word)
            embedding = word[0] * word[1]
    return StageParams(tuple(matrices), vectors, embedding)
