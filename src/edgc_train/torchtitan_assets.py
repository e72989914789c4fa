"""A tokenizer and a text corpus made on the spot for torchtitan's trainer (its wheel ships neither, and
the tests and the bench download nothing): `write_assets` writes them, `asset_args` points torchtitan at them.

The corpus is a toy language that a model can learn: each word is followed by a fixed permutation of
itself, or by a random word one time in five (an entropy floor of about 1.3 nats), so that a loss
falls over a few steps of torchtitan's debug model. The tokenizer is a word-level one over exactly
those words, with ``<s>``/``</s>`` as its begin/end tokens; its vocabulary fits the debug models' 2048.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

WORDS, NOISE = 400, 0.2
SPECIALS = ("<unk>", "<s>", "</s>")


def _word(index: int) -> str:
    return f"w{index:03d}"


def _document(rng: random.Random, permutation: list[int], length: int) -> str:
    token = rng.randrange(WORDS)
    words = [token]
    for _ in range(length - 1):
        token = rng.randrange(WORDS) if rng.random() < NOISE else permutation[token]
        words.append(token)
    return " ".join(_word(w) for w in words)


def write_assets(folder: Path, documents: int = 1500, seed: int = 0) -> Path:
    """Write ``folder/tokenizer`` and ``folder/data/train.jsonl`` (once: an existing folder is kept) and
    load the corpus once into ``folder/hf_cache`` (processes given `asset_env` then only read it)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    folder = Path(folder)
    tokenizer_dir, data_dir = folder / "tokenizer", folder / "data"
    if (data_dir / "train.jsonl").exists():
        return folder
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate([*SPECIALS, *(_word(i) for i in range(WORDS))])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    rng = random.Random(seed)
    permutation = list(range(WORDS))
    rng.shuffle(permutation)
    lines = [json.dumps({"text": _document(rng, permutation, rng.randrange(40, 160))}) for _ in range(documents)]
    (data_dir / "train.jsonl").write_text("\n".join(lines) + "\n")
    _warm_cache(folder)
    return folder


def asset_env(folder: Path) -> dict[str, str]:
    """The environment the launched processes need: the datasets cache `write_assets` filled, offline."""
    return {"HF_DATASETS_CACHE": str(Path(folder) / "hf_cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def asset_args(folder: Path) -> list[str]:
    """torchtitan's flags that read the tokenizer and the corpus of `write_assets` (its ``c4_test``
    loader: a local folder of JSON lines)."""
    folder = Path(folder)
    return ["--hf_assets_path", str(folder / "tokenizer"), "--dataloader.dataset_path", str(folder / "data")]


def _warm_cache(folder: Path) -> None:
    from datasets import load_dataset

    saved = {key: os.environ.get(key) for key in asset_env(folder)}
    os.environ.update(asset_env(folder))
    try:
        load_dataset(str(folder / "data"), split="train", cache_dir=asset_env(folder)["HF_DATASETS_CACHE"])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
