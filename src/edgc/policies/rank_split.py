"""How a state's rank is shared among its experts' matrices: a rank split, registered by name.

The rank control (`edgc.control.rank_control`) chooses one rank r per step for a state. A mixture of experts
stores a layer's experts as one stacked parameter (`edgc.distributed.experts`), each expert its own matrix; a
*rank split* may give those matrices different ranks at the bytes r gives them all: within each
stacked parameter the ranks sum to what r sends (its experts share one shape, so the same factor
bytes), each at least 1 and at most the largest rank at which the matrix is still compressed.
Other matrices keep r. ``EDGCConfig.rank_split`` names the split:

* ``uniform``: every expert at r (no split);
* ``tokens``: each expert's share in proportion to the tokens routed to it in the last window (its
  gradient is the sum of theirs), counted by the model and summed over the group at each window's
  end, per step (`edgc.distributed.expert_tokens`); uniform until a window has been counted. An
  expert's rank is also capped at its tokens per step (at least 1): a gradient from n tokens has rank
  at most n, so an expert that got few (or none: a dead expert, rank 1) leaves its share to the others;
  where the caps leave less than the budget, fewer bytes are sent.

A split is pure logic on agreed values (token counts are exact sums, identical on every rank), so
every rank computes the same ranks without a broadcast. A new split is one class and one
`register_rank_split`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..registry import Registry

Groups = Mapping[str, Sequence[tuple[str, tuple[int, ...]]]]  # stacked parameter → (matrix name, shape)
Compressed = Callable[[tuple[int, int], int], int]  # (m, n), rank → the rank it is sent at (0: raw)


def largest_rank(shape: tuple[int, int], compressed: Compressed) -> int:
    """The largest rank at which a matrix of ``shape`` is still compressed (0: never), by bisection:
    a matrix compressed at rank r is compressed at every lower rank."""
    low, high = 0, min(shape)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if compressed(shape, middle) == middle else (low, middle - 1)
    return low


def share_ranks(total: int, weights: Sequence[float], cap: int | Sequence[int]) -> list[int]:
    """Integer ranks in [1, cap], summing to ``total`` (clipped to what [1, cap] allows), as close to
    ``total``·w/Σw as the bounds allow: entries past their cap fixed at it, then entries below 1 at 1,
    the rest re-shared each time (an even share where their weights are all 0), then rounded by largest
    remainder (ties to the earlier entry). ``cap``: one for all, or one per entry (each at least 1)."""
    count = len(weights)
    caps = [max(1, int(c)) for c in cap] if isinstance(cap, Sequence) else [cap] * count
    total = min(max(total, count), sum(caps))
    fixed: dict[int, float] = {}
    ideal: dict[int, float] = {}
    while len(fixed) < count:
        free = [i for i in range(count) if i not in fixed]
        left, mass = total - sum(fixed.values()), sum(weights[i] for i in free)
        ideal = {i: left * weights[i] / mass if mass > 0 else left / len(free) for i in free}
        over = [i for i, x in ideal.items() if x > caps[i]]
        under = [i for i, x in ideal.items() if x < 1]
        if not over and not under:
            break
        fixed.update({i: float(caps[i]) for i in over} if over else {i: 1.0 for i in under})
    values = {**ideal, **fixed}
    ranks = [min(caps[i], max(1, math.floor(values[i]))) for i in range(count)]
    order = sorted(range(count), key=lambda i: (-(values[i] - math.floor(values[i])), i))
    spare = total - sum(ranks)
    while spare > 0:  # largest remainders first, then round again: total ≤ Σ caps, so it ends
        for i in order:
            if spare > 0 and ranks[i] < caps[i]:
                ranks[i] += 1
                spare -= 1
    return ranks


class RankSplit:
    """One rank split (see the module docstring): ``reads_tokens`` says whether the state counts tokens
    for it; `ranks` maps the step's rank to per-matrix ranks (an empty map: every matrix at r)."""

    name: str = ""
    reads_tokens: bool = False

    def ranks(self, rank: int, groups: Groups, weights: Mapping[str, float], compressed: Compressed) -> dict[str, int]:
        """Matrix name → its rank where it differs from ``rank``; ``groups`` the experts of each stacked
        parameter, ``weights`` the agreed measurement of each matrix (e.g. its tokens), ``compressed`` the
        engine's rule (`edgc.engine.lowrank.LowRankCompressor.compressed_rank`)."""
        return {}


class UniformSplit(RankSplit):
    """Every expert at the state's rank."""

    name = "uniform"


class TokenSplit(RankSplit):
    """Each expert's share of its stacked parameter's rank budget in proportion to its tokens."""

    name = "tokens"
    reads_tokens = True

    def ranks(self, rank, groups, weights, compressed) -> dict[str, int]:
        out = {}
        for matrices in groups.values():
            counted = [weights.get(name) for name, _ in matrices]
            if not matrices or any(w is None for w in counted):
                continue  # uniform until every expert of the parameter was counted
            shape = matrices[0][1]
            shape = (shape[0], math.prod(shape[1:]))
            each = compressed(shape, rank)
            if not each:
                continue  # sent raw at this rank: nothing to share
            ceiling = largest_rank(shape, compressed)
            caps = [min(ceiling, max(1, math.ceil(tokens))) for tokens in counted]  # rank ≤ tokens per step
            shares = share_ranks(each * len(matrices), counted, caps)
            out.update({name: r for (name, _), r in zip(matrices, shares) if r != each})
        return out


@dataclass
class ExpertSplit:
    """A controller's rank split (``EDGCConfig.rank_split``) with the agreed weights it shares the rank
    by: each matrix's measurement of the last window (its tokens), by name; empty until one is counted."""

    split: RankSplit
    weights: dict[str, float] = field(default_factory=dict)

    @property
    def reads_tokens(self) -> bool:
        """Whether the state counts tokens for it."""
        return self.split.reads_tokens

    def ranks(self, rank: int, groups: Groups, compressed: Compressed) -> dict[str, int]:
        """Matrix name → its own rank where the split gives it one (the experts of ``groups``;
        ``compressed``: the engine's rank rule)."""
        return self.split.ranks(rank, groups, self.weights, compressed)


RANK_SPLITS: Registry[RankSplit] = Registry("rank split")


def register_rank_split(split: RankSplit) -> RankSplit:
    """Make ``split`` available as ``EDGCConfig.rank_split = split.name``."""
    if not isinstance(split, RankSplit):
        raise ValueError(f"a rank split is a RankSplit, got {split!r}")
    return RANK_SPLITS.add(split.name, split)


def rank_split_names() -> tuple[str, ...]:
    """The registered splits' names, in registration order."""
    return RANK_SPLITS.names()


def rank_split(name: str) -> RankSplit:
    return RANK_SPLITS.find(name)


for _split in (UniformSplit(), TokenSplit()):
    register_rank_split(_split)
