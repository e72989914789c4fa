"""GPT-2 models for the harness: HF ``GPT2LMHeadModel`` from a ``GPT2Config`` preset, random init.

Nothing is downloaded: the model is built from a config (``HF_HUB_OFFLINE=1`` is set before
transformers is imported), so every run starts from the seeded random initialisation.

Presets (parameter counts with tied input/output embeddings, at the vocabulary size shown):

==========  =======  =======  =======  ===========  ==========================================
preset      n_layer  n_embd   n_head   n_positions  parameters
==========  =======  =======  =======  ===========  ==========================================
``tiny``    4        256      4        256          3.4M at vocab 512, 4.3M at vocab 4096
``small``   8        512      8        512          27.6M at vocab 4096, 29.7M at vocab 8192
``gpt2``    12       768      12       1024         124.4M at vocab 50257 (the GPT-2 small shape)
==========  =======  =======  =======  ===========  ==========================================

Any of n_layer / n_embd / n_head / n_positions / dropout can be overridden. Dropout defaults to 0
(as in nanoGPT pretraining): it adds nothing for short runs and would be one more RNG stream.
"""

from __future__ import annotations

import os

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_embd=256, n_head=4, n_positions=256),
    "small": dict(n_layer=8, n_embd=512, n_head=8, n_positions=512),
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024),
}


def model_shape(
    preset: str,
    vocab_size: int,
    seq_len: int,
    n_layer: int | None = None,
    n_embd: int | None = None,
    n_head: int | None = None,
    n_positions: int | None = None,
) -> dict:
    """The resolved shape: preset values, then overrides; n_positions grows to fit ``seq_len``."""
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r}, choose from {', '.join(PRESETS)}")
    shape = dict(PRESETS[preset])
    for name, value in (("n_layer", n_layer), ("n_embd", n_embd), ("n_head", n_head), ("n_positions", n_positions)):
        if value is not None:
            shape[name] = value
    if n_positions is None:
        shape["n_positions"] = max(shape["n_positions"], seq_len)
    if shape["n_positions"] < seq_len:
        raise ValueError(f"n_positions: {shape['n_positions']} is below seq_len {seq_len}")
    if shape["n_embd"] % shape["n_head"]:
        raise ValueError(f"n_head: n_embd {shape['n_embd']} is not divisible by n_head {shape['n_head']}")
    shape["vocab_size"] = vocab_size
    return shape


def build_model(shape: dict, dropout: float = 0.0):
    """A randomly initialised ``GPT2LMHeadModel`` (uses the current torch RNG: seed first)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # silence "using default loss" style chatter on every rank
    config = GPT2Config(
        **shape,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        # The trained tokenizer puts <|endoftext|> at id 0; GPT-2's 50256 would be out of range.
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def count_parameters(model) -> int:
    """Unique parameters (the tied input/output embedding counted once)."""
    return sum(p.numel() for p in model.parameters())
