"""Batches of the token arrays that data.py prepares.

``BlockSampler`` cuts the training tokens into non-overlapping blocks of ``seq_len + 1`` tokens,
shuffles them once per epoch with a seeded permutation, and hands every rank its own slice of each
global batch. Its whole position is two integers (epoch, batches done), saved in checkpoints.
``val_batches`` reads the validation tokens in order, the same blocks on every evaluation.
"""

from __future__ import annotations

import numpy as np

from .data import DataError


class BlockSampler:
    """Shuffled non-overlapping blocks of ``seq_len + 1`` tokens, sharded over ranks, resumable.

    Block ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (inputs and next-token targets).
    Every epoch is a fresh permutation drawn from ``seed + epoch``; a global batch takes the next
    ``world_size * micro_batch`` blocks of it and rank ``r`` keeps its ``r``-th slice, so ranks never
    see the same block in an epoch. Leftover blocks at an epoch's end are skipped (not carried over),
    which keeps the position a simple (epoch, batch) pair.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, rank: int, world_size: int, seed: int):
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.n_blocks = (len(tokens) - 1) // seq_len
        self.per_global_batch = world_size * micro_batch
        self.batches_per_epoch = self.n_blocks // self.per_global_batch
        if self.batches_per_epoch < 1:
            raise DataError(
                f"training split has {len(tokens)} tokens: too few for one global batch of "
                f"{self.per_global_batch} x {seq_len + 1} tokens; use more data or smaller "
                "--seq-len/--micro-batch"
            )
        self.epoch, self.batch = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_blocks)

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (inputs, targets), each ``micro_batch x seq_len`` int64."""
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        start = self.batch * self.per_global_batch + self.rank * self.micro_batch
        blocks = self._perm[start : start + self.micro_batch]
        self.batch += 1
        rows = np.stack([self.tokens[b * self.seq_len : b * self.seq_len + self.seq_len + 1] for b in blocks])
        rows = rows.astype(np.int64)
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "seed": self.seed,
            "n_blocks": self.n_blocks,
            "world_size": self.world_size,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, sd: dict) -> None:
        mine = self.state_dict()
        for k in ("seed", "n_blocks", "world_size", "micro_batch", "seq_len"):
            if sd[k] != mine[k]:
                raise ValueError(f"data sampler mismatch: checkpoint has {k}={sd[k]}, this run {mine[k]}")
        self.epoch, self.batch = sd["epoch"], sd["batch"]
        self._perm = self._permutation(self.epoch)


def val_batches(tokens: np.ndarray, seq_len: int, micro_batch: int, n_batches: int, rank: int, world_size: int):
    """Fixed validation batches for this rank: the first blocks of the split, strided over ranks.

    The same blocks every evaluation, so val loss is comparable across steps and runs.
    Yields (inputs, targets); fewer than ``n_batches`` when the split is short.
    """
    n_blocks = (len(tokens) - 1) // seq_len
    total = min(n_batches * world_size * micro_batch, n_blocks)
    mine = list(range(rank, total, world_size))
    for start in range(0, len(mine), micro_batch):
        idx = mine[start : start + micro_batch]
        rows = np.stack([tokens[b * seq_len : b * seq_len + seq_len + 1] for b in idx]).astype(np.int64)
        yield rows[:, :-1], rows[:, 1:]
