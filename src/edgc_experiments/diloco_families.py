"""The model families of `edgc experiment diloco`: each a next-token model on the KJV Bible, small
enough that two shared cores train it for a few hundred steps in seconds.

* ``gpt2``: `edgc train`'s GPT-2 ``tiny`` preset at 2 layers × 128 wide, on its byte-level BPE tokens;
* ``gru``: a 2-layer character GRU (hidden 256, 0.7 M parameters), on characters;
* ``cnn``: a causal convolutional character model (an MLP over the last 16 characters, written as a
  width-16 convolution and two 1×1 ones), on characters;
* ``llama``: a LLaMA built from a ``transformers`` config with random weights (2 layers × 128, RMSNorm,
  rotary positions, SwiGLU, untied embeddings), on the same BPE tokens as ``gpt2``.

Every family gives the same interface (`Family`): a model built from the seed, this rank's training
batches (its own shard, `edgc_train.sampler.BlockSampler`), ``logits = model(inputs)`` and a validation
loss over a fixed set of validation blocks. The inner optimizers (AdamW, SGD with Nesterov momentum)
have one learning rate per family, cosine-decayed over the run. A `Size` sets the transformers' width,
depth and vocabulary and every family's batches (`STANDARD`: the figures above).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("gpt2", "gru", "cnn", "llama")
INNER = ("adamw", "sgd")
# Inner learning rates per (family, optimizer): AdamW at the usual rate of models this size; SGD
# (Nesterov 0.9) at the largest of 0.1 / 0.3 / 1.0 that did not diverge in a 180-step pilot.
INNER_LR = {
    ("gpt2", "adamw"): 1e-3,
    ("gru", "adamw"): 3e-3,
    ("cnn", "adamw"): 2e-3,
    ("gpt2", "sgd"): 0.3,
    ("gru", "sgd"): 1.0,
    ("cnn", "sgd"): 0.3,
    ("llama", "adamw"): 1e-3,
    ("llama", "sgd"): 0.3,  # GPT-2's rate on the same tokens; not piloted
}
SEQ_LEN, BATCH, VAL_BATCHES = 64, 8, 16
CHARS = 1_000_000  # the first million characters of the corpus: the same text for every family
BPE_VOCAB = 2048
CNN_CONTEXT = 16
BPE_FAMILIES = ("gpt2", "llama")


@dataclass(frozen=True)
class Size:
    """The transformer families' shape and every family's batches."""

    width: int = 128  #: the transformers' hidden size
    layers: int = 2  #: transformer blocks
    heads: int = 4  #: attention heads
    vocab: int = BPE_VOCAB  #: BPE vocabulary of the transformer families (the character ones keep their alphabet)
    seq_len: int = SEQ_LEN  #: tokens per sequence
    batch: int = BATCH  #: sequences per inner step, per replica
    val_batches: int = VAL_BATCHES  #: validation batches of ``batch`` sequences

    def __post_init__(self):
        if min(self.width, self.layers, self.heads, self.vocab, self.seq_len, self.batch, self.val_batches) < 1:
            raise ValueError(f"Size: every field must be ≥ 1, got {self}")
        if self.width % self.heads:
            raise ValueError(f"Size: width {self.width} is not a multiple of heads {self.heads}")


STANDARD = Size()


@dataclass
class Corpus:
    """Token ids of the training and validation text and the vocabulary size."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int


def load_corpus(family: str, cache_dir: str | None = None, vocab: int = BPE_VOCAB) -> Corpus:
    """The family's tokens of the first `CHARS` characters of the KJV: BPE of ``vocab`` tokens (cached by
    `edgc train`'s data preparation) for ``gpt2`` and ``llama``, characters for the others (their own
    alphabet, from the text)."""
    from edgc_train.data import load_corpus as read_text
    from edgc_train.data import prepare_data, source_files, split_corpus

    if family in BPE_FAMILIES:
        data = prepare_data(None, vocab, 0.05, CHARS, cache_dir, log=lambda _: None)
        return Corpus(np.asarray(data.train), np.asarray(data.val), data.vocab_size)
    text = read_text(source_files(None), CHARS)
    train_text, val_text = split_corpus(text, 0.05)
    alphabet = sorted(set(text))
    index = {c: i for i, c in enumerate(alphabet)}
    encode = lambda s: np.fromiter((index[c] for c in s), dtype=np.int32, count=len(s))  # noqa: E731
    return Corpus(encode(train_text), encode(val_text), len(alphabet))


class CharGRU(nn.Module):
    def __init__(self, vocab: int, embed: int = 64, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = nn.GRU(embed, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


class CharCNN(nn.Module):
    """Logits of the next character from the last `CNN_CONTEXT` ones (left-padded: causal)."""

    def __init__(self, vocab: int, embed: int = 32, hidden: int = 384, context: int = CNN_CONTEXT):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, embed)
        self.window = nn.Conv1d(embed, hidden, context)
        self.mix = nn.Conv1d(hidden, hidden, 1)
        self.head = nn.Conv1d(hidden, vocab, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.pad(self.embed(tokens).transpose(1, 2), (self.context - 1, 0))
        x = F.gelu(self.mix(F.gelu(self.window(x))))
        return self.head(x).transpose(1, 2)


class GPT2Logits(nn.Module):
    """`edgc train`'s GPT-2 returning the logits alone."""

    def __init__(self, vocab: int, size: Size = STANDARD):
        super().__init__()
        from edgc_train.model import build_model, model_shape

        shape = model_shape("tiny", vocab, size.seq_len, n_layer=size.layers, n_embd=size.width, n_head=size.heads)
        self.gpt = build_model(shape)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=tokens).logits


class LlamaLogits(nn.Module):
    """A small LLaMA (``transformers.LlamaForCausalLM``, random weights) returning the logits alone."""

    def __init__(self, vocab: int, size: Size = STANDARD):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=size.width,
            intermediate_size=size.width * 11 // 4,  # SwiGLU's 8/3 × width, rounded as LLaMA rounds it
            num_hidden_layers=size.layers,
            num_attention_heads=size.heads,
            num_key_value_heads=size.heads,
            max_position_embeddings=size.seq_len,
            tie_word_embeddings=False,
        )
        self.llama = LlamaForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=tokens).logits


BUILDERS: dict[str, Callable[[int, Size], nn.Module]] = {  # (vocabulary, size) -> model
    "gpt2": GPT2Logits,
    "gru": lambda vocab, size: CharGRU(vocab),
    "cnn": lambda vocab, size: CharCNN(vocab),
    "llama": LlamaLogits,
}


@dataclass
class Family:
    """One family's model, data and inner optimizer for one replica (see the module docstring)."""

    name: str
    corpus: Corpus
    size: Size = STANDARD

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return BUILDERS[self.name](self.corpus.vocab_size, self.size)

    def sampler(self, rank: int, world: int, seed: int):
        from edgc_train.sampler import BlockSampler

        return BlockSampler(self.corpus.train, self.size.seq_len, self.size.batch, rank, world, seed)

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = (torch.from_numpy(np.ascontiguousarray(a)) for a in batch)
        return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    def inner_optimizer(self, model: nn.Module, kind: str, lr_scale: float = 1.0) -> torch.optim.Optimizer:
        """The family's inner optimizer of ``kind`` at its learning rate × ``lr_scale``."""
        lr = INNER_LR[(self.name, kind)] * lr_scale
        if kind == "adamw":
            decay = [p for p in model.parameters() if p.dim() >= 2]
            rest = [p for p in model.parameters() if p.dim() < 2]
            return torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                lr=lr,
                betas=(0.9, 0.95),
            )
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)

    def validation_loss(self, model: nn.Module) -> float:
        total, count = self.validation_sums(model)
        return total / count

    @torch.no_grad()
    def validation_sums(self, model: nn.Module, rank: int = 0, world: int = 1) -> tuple[float, int]:
        """(summed loss, tokens) over this rank's share of the validation batches (every ``world``-th
        from the ``rank``-th: the shares of all ranks make the whole set)."""
        from edgc_train.sampler import val_batches

        size = self.size
        batches = list(val_batches(self.corpus.val, size.seq_len, size.batch, size.val_batches, 0, 1))
        model.eval()
        total, count = 0.0, 0
        for x, y in batches[rank::world]:
            logits = model(torch.from_numpy(x))
            total += float(
                F.cross_entropy(logits.flatten(0, 1).float(), torch.from_numpy(y).flatten(), reduction="sum")
            )
            count += y.size
        model.train()
        return total, count


def family(name: str, cache_dir: str | None = None, size: Size = STANDARD) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r}: choose from {', '.join(FAMILIES)}")
    return Family(name, load_corpus(name, cache_dir, size.vocab), size)
