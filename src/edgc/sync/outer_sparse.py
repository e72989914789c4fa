"""`SparseQuantState`: DiLoCo's outer sync as a chunked top-k with coded indices and 2-bit values,
all-gathered, with error feedback (the form of SparseLoCo, arXiv 2508.15706).

Each tensor's M = Δ + e is cut into chunks of ``chunk`` values (a tensor smaller than a chunk is one
chunk of its own size); each chunk sends its k = ⌈``density`` · chunk⌉ entries of largest magnitude.
An entry is one code: its index within the chunk (⌈log2 chunk⌉ bits, so 12 for 4096) and its sign
(1 bit). Its magnitude is the mean magnitude of its group: the chunk's k entries go in descending
magnitude, and the first half and the second half (``groups`` = 2) each carry one fp32 mean. That
is two bits of value per entry (a sign and one of two magnitudes), the magnitude bit read from the
entry's place in the message instead of sent. Bytes per chunk: ⌈k·(index bits + 1)/8⌉ + 4·groups;
at 64 of 4096 values that is 112 bytes against 16,384 raw (0.0068×), at 128 of 4096 216 (0.013×).

Every rank decodes every rank's message and adds them in rank order (replicas stay bit-identical)
and keeps e ← M − its own decoded message: what a sync did not carry, it carries later. The sum is
divided by the replicas (``aggregate="all"``: SparseLoCo's equation) or, per value, by the replicas
whose message carried it (``aggregate="senders"``: SparseLoCo's code, a scatter-mean that leaves out
the replicas that did not send the index; where replicas choose different indices, most values
come from one replica and the two differ by up to the number of replicas). With ``tile`` > 0 the
chunks are tiles instead of flat runs, as SparseLoCo's code cuts them: a matrix (a tensor of more
dimensions viewed as its first dimension by the rest) in tiles of h × w, h and w the largest divisors
of its two dimensions that are at most ``tile``; a vector in runs of its largest divisor ≤ ``tile``. With
DiLoCo's ``error_feedback_decay`` β < 1 and an outer SGD without momentum this is SparseLoCo's
update (e ← β·e + Δ; the error feedback stands in for the outer momentum); with DiLoCo's Nesterov
outer optimizer it is DiLoCo with a sparse sync. `edgc experiment diloco` compares the two.

`AllocatedSparseState` chooses k per tensor (from `DENSITIES`) where a byte removes the most
measured error, within the bytes of one uniform ``density``: the CQM's error per byte, taken from
rank to density (`edgc.sync.outer_alloc.allocate_by_cost`). The choice is taken on the host: one host read
of the averaged error table per outer step, as `edgc.sync.outer_alloc`'s.
"""

from __future__ import annotations

import math

import torch

from ..device.timing import host_reads_allowed
from .error_feedback import ErrorFeedbackReducer
from .outer_alloc import allocate_by_cost

DENSITIES = (1 / 256, 1 / 128, 1 / 64, 1 / 32, 1 / 16)
AGGREGATIONS = ("all", "senders")  # divide each sent value's sum by every replica, or by those that sent it


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes < 2^bits (any 1 ≤ bits ≤ 32) as ⌈n·bits/8⌉ bytes, bit i of code j at bit j·bits + i."""
    n = codes.numel()
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int64)
    stream = ((codes.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1)
    padded = torch.zeros(math.ceil(n * bits / 8) * 8, dtype=torch.int64, device=codes.device)
    padded[: stream.numel()] = stream
    weights = torch.arange(8, device=codes.device, dtype=torch.int64)
    return (padded.view(-1, 8) << weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of `pack_bits`: the first ``n`` codes, int64."""
    weights = torch.arange(8, device=packed.device, dtype=torch.int64)
    stream = ((packed.to(torch.int64).reshape(-1, 1) >> weights) & 1).reshape(-1)[: n * bits]
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (stream.view(n, bits) << shifts).sum(dim=1)


class _Layout:
    """How one tensor of ``n`` values is cut: chunks of ``size``, ``k`` entries each, index bits."""

    def __init__(self, n: int, chunk: int, density: float):
        self.n = n
        self.size = min(chunk, n)
        self.chunks = math.ceil(n / self.size)
        self.k = max(1, min(self.size, math.ceil(density * self.size)))
        self.index_bits = max(1, math.ceil(math.log2(self.size)))

    def groups(self, groups: int) -> int:
        return min(groups, self.k)

    def code_bytes(self) -> int:
        return math.ceil(self.chunks * self.k * (self.index_bits + 1) / 8)

    def bytes(self, groups: int) -> int:
        return self.code_bytes() + 4 * self.chunks * self.groups(groups)


def encode(x: torch.Tensor, lay: _Layout, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, fp32 magnitudes per chunk and group) of the flat ``x``."""
    blocks = torch.zeros(lay.chunks * lay.size, dtype=torch.float32, device=x.device)
    blocks[: lay.n] = x
    blocks = blocks.view(lay.chunks, lay.size)
    top = blocks.abs().topk(lay.k, dim=1, sorted=True)
    negative = blocks.gather(1, top.indices) < 0
    scales = torch.stack([part.mean(dim=1) for part in top.values.tensor_split(lay.groups(groups), dim=1)], 1)
    codes = top.indices | (negative.to(torch.int64) << lay.index_bits)
    return pack_bits(codes, lay.index_bits + 1), scales


def _group_of_entry(k: int, groups: int, device: torch.device) -> torch.Tensor:
    """The group of each of a chunk's k entries, as ``tensor_split`` (k, groups) cuts them: the first
    k mod groups groups one entry longer. Made on the device (a list copied there makes the host wait)."""
    short, longer = divmod(k, groups)
    entry = torch.arange(k, device=device)
    boundary = longer * (short + 1)
    return torch.where(entry < boundary, entry // (short + 1), longer + (entry - boundary) // short)


def decode(packed: torch.Tensor, scales: torch.Tensor, lay: _Layout, groups: int) -> torch.Tensor:
    """The flat values a message of ``lay`` stands for (zero where nothing was sent)."""
    index, codes = _indices(packed, lay)
    sign = 1 - 2 * (codes >> lay.index_bits).to(torch.float32)
    magnitude = scales.reshape(lay.chunks, -1)[:, _group_of_entry(lay.k, lay.groups(groups), packed.device)]
    dense = torch.zeros(lay.chunks, lay.size, dtype=torch.float32, device=packed.device)
    dense.scatter_(1, index, sign * magnitude)  # one chunk's indices are distinct: no two writes meet
    return dense.view(-1)[: lay.n]


def _indices(packed: torch.Tensor, lay: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(index within its chunk, whole code) of each of a message's entries, (chunks, k) each."""
    codes = unpack_bits(packed, lay.index_bits + 1, lay.chunks * lay.k).view(lay.chunks, lay.k)
    return codes & ((1 << lay.index_bits) - 1), codes


def positions(packed: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """1 where a message of ``lay`` carries a value, 0 elsewhere (flat, fp32)."""
    index, _ = _indices(packed, lay)
    dense = torch.zeros(lay.chunks, lay.size, dtype=torch.float32, device=packed.device)
    dense.scatter_(1, index, 1.0)
    return dense.view(-1)[: lay.n]


def tile_side(n: int, tile: int) -> int:
    """The largest divisor of ``n`` that is at most ``tile``."""
    return max(d for d in range(1, min(n, tile) + 1) if n % d == 0)


def tiling(shape: tuple[int, ...], tile: int) -> tuple[int, torch.Tensor | None]:
    """(values per tile, the flat indices that put a tensor of ``shape`` in tile order, tile after
    tile; None where that order is the flat one: a vector, or a matrix whose rows fit in one tile)."""
    n = math.prod(shape)
    if len(shape) < 2:
        return tile_side(max(n, 1), tile), None
    rows = shape[0]
    cols = n // rows
    h, w = tile_side(rows, tile), tile_side(cols, tile)
    if w == cols:
        return h * w, None
    order = torch.arange(n).view(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1)
    return h * w, order


class SparseCodec:
    """The chunked sparse message as a codec of the two-stage all-reduce's contract (a flat run of n values
    to `message_bytes` (n) bytes, a multiple of 4, and back; an all-zero message decodes to zeros): the
    owner of a chunk re-encodes the top of the sum it received, so the wire stays flat in the group size."""

    def __init__(self, density: float = 64 / 4096, chunk: int = 4096, groups: int = 2):
        """``density``, ``chunk`` and ``groups`` as `SparseQuantState`'s."""
        self.density, self.chunk, self.groups = density, chunk, groups

    def _layout(self, n: int) -> _Layout:
        return _Layout(n, self.chunk, self.density)

    def message_bytes(self, n: int) -> int:
        return 4 * math.ceil(self._layout(n).bytes(self.groups) / 4)

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        lay = self._layout(x.numel())
        packed, scales = encode(x, lay, self.groups)
        out.zero_()
        out[: packed.numel()].copy_(packed)
        scale_bytes = scales.reshape(-1).view(torch.uint8)
        out[packed.numel() : packed.numel() + scale_bytes.numel()].copy_(scale_bytes)
        return decode(packed, scales, lay, self.groups).to(x.dtype)

    def decode(self, message: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        lay = self._layout(n)
        code_bytes, scale_count = lay.code_bytes(), lay.chunks * lay.groups(self.groups)
        scales = message[code_bytes : code_bytes + 4 * scale_count].clone().view(torch.float32)
        return decode(message[:code_bytes], scales, lay, self.groups).to(dtype)


class SparseQuantState(ErrorFeedbackReducer):
    """Chunked top-k, coded indices, 2-bit values, all-gathered; error feedback (see the module docstring)."""

    method = "sparse"
    ARGUMENTS = ("density", "chunk", "groups", "aggregate", "tile")  # agreed across the group before the first sync
    ERROR_ROLLBACK = "restore"  # torchft's verdict: the residual from before a discarded step comes back

    def __init__(
        self,
        process_group=None,
        *,
        density: float = 64 / 4096,
        chunk: int = 4096,
        groups: int = 2,
        error_feedback: bool = True,
        model=None,
        aggregate: str = "all",
        tile: int = 0,
    ):
        """``process_group``: the replicas' group (None: the default one); ``density``: the share of each
        chunk's values sent, in (0, 1]; ``chunk``: values per chunk (≥ 8); ``groups``: magnitudes per
        chunk (2: two-bit values); ``error_feedback``: keep what a sync did not carry for the next;
        ``model``: names the tensors (checkpoints are keyed by parameter name); ``aggregate``: what a
        sent value's sum is divided by, ``"all"`` (the replicas) or ``"senders"`` (the replicas that sent
        it); ``tile``: 0 for flat chunks of ``chunk`` values, else the largest side of a tile (≥ 2; the
        chunks are then tiles and ``chunk`` goes unused)."""
        super().__init__(process_group, error_feedback=error_feedback, model=model)
        if aggregate not in AGGREGATIONS:
            raise ValueError(f"aggregate: one of {', '.join(AGGREGATIONS)}, got {aggregate!r}")
        if not (isinstance(tile, int) and (tile == 0 or tile >= 2)):
            raise ValueError(f"tile: 0 (flat chunks) or an integer ≥ 2, got {tile!r}")
        self.aggregate, self.tile = aggregate, tile
        self._tilings: dict[tuple[int, ...], tuple[int, torch.Tensor | None]] = {}  # by shape
        if not (isinstance(density, (int, float)) and 0 < density <= 1):
            raise ValueError(f"density: must be in (0, 1], got {density!r}")
        if not (isinstance(chunk, int) and chunk >= 8):
            raise ValueError(f"chunk: must be an integer ≥ 8, got {chunk!r}")
        if not (isinstance(groups, int) and 1 <= groups <= 8):
            raise ValueError(f"groups: must be an integer in 1..8, got {groups!r}")
        self.density, self.chunk, self.groups = float(density), chunk, groups

    def layout(self, n: int, density: float | None = None) -> _Layout:
        return _Layout(n, self.chunk, self.density if density is None else density)

    def message_bytes(self, sizes: list) -> int:
        """Bytes one rank sends for tensors of ``sizes`` (each a shape, or a number of values: a vector)
        at the state's density."""
        shapes = [(s,) if isinstance(s, int) else tuple(s) for s in sizes]
        return sum(self._layout_of(shape).bytes(self.groups) for shape in shapes)

    def _tiling(self, shape: tuple[int, ...]) -> tuple[int, torch.Tensor | None]:
        if shape not in self._tilings:
            self._tilings[shape] = tiling(shape, self.tile)
        return self._tilings[shape]

    def _layout_of(self, shape: tuple[int, ...]) -> _Layout:
        n = math.prod(shape)
        return _Layout(n, self._tiling(shape)[0], self.density) if self.tile else self.layout(n)

    def _tile_order(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The flat indices that put the concatenated tensors in tile order (None: flat chunks, or
        every tensor's tile order its own)."""
        orders = [self._tiling(tuple(g.shape))[1] for g in grads] if self.tile else []
        if all(order is None for order in orders):
            return None
        parts, offset = [], 0
        for g, order in zip(grads, orders):
            parts.append((torch.arange(g.numel()) if order is None else order) + offset)
            offset += g.numel()
        return torch.cat(parts).to(grads[0].device)

    def encode(self, x: torch.Tensor, lay: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
        return encode(x, lay, self.groups)

    def decode(self, packed: torch.Tensor, scales: torch.Tensor, lay: _Layout) -> torch.Tensor:
        return decode(packed, scales, lay, self.groups)

    def _layouts(self, names: list[str], parts: list[torch.Tensor], shapes: list) -> list[_Layout]:
        """Each tensor's layout, from its shape (``parts``, its values as sent, are for a subclass that
        chooses the layout by them)."""
        return [self._layout_of(tuple(shape)) for shape in shapes]

    def _reduce(self, names, grads, flat) -> None:
        corrected = self._corrected(names, grads)
        order = self._tile_order(grads)
        ordered = corrected if order is None else corrected[order]
        parts = list(ordered.split([g.numel() for g in grads]))
        layouts = self._layouts(names, parts, [g.shape for g in grads])
        messages, sent_local = [], []
        for part, lay in zip(parts, layouts):
            packed, scales = self.encode(part, lay)
            messages += [packed, scales.reshape(-1).view(torch.uint8)]
            sent_local.append(self.decode(packed, scales, lay))
        message = torch.cat(messages)
        average = torch.zeros_like(ordered)
        senders = torch.zeros_like(ordered) if self.aggregate == "senders" else None
        for received in self.comm.all_gather(message):
            pieces = list(self._split_message(received, layouts))
            average.add_(torch.cat([self.decode(*piece) for piece in pieces]).to(average.dtype))
            if senders is not None:
                senders.add_(torch.cat([positions(packed, lay) for packed, _, lay in pieces]).to(senders.dtype))
        average.div_(self.comm.world_size if senders is None else senders.clamp_(min=1))
        sent = torch.cat(sent_local).to(corrected.dtype)
        if order is not None:  # back from tile order
            sent, average = (torch.empty_like(t).index_copy_(0, order, t) for t in (sent, average))
        elements = sum(lay.chunks * lay.k for lay in layouts)
        self._finish(names, grads, flat, corrected, sent, average, elements, message.numel())

    def _split_message(self, message: torch.Tensor, layouts: list[_Layout]):
        """(packed codes, scales, layout) of each tensor in a message."""
        offset = 0
        for lay in layouts:
            code_bytes, scale_bytes = lay.code_bytes(), 4 * lay.chunks * lay.groups(self.groups)
            packed = message[offset : offset + code_bytes]
            scales = message[offset + code_bytes : offset + code_bytes + scale_bytes].clone().view(torch.float32)
            offset += code_bytes + scale_bytes
            yield packed, scales, lay

    def state_dict(self) -> dict:
        settings = {name: getattr(self, name) for name in self.ARGUMENTS}
        return {**super().state_dict(), **settings}


class AllocatedSparseState(SparseQuantState):
    """Chunked sparse sync with k per tensor by measured error per byte (see the module docstring)."""

    method = "sparse-allocated"

    def __init__(
        self,
        process_group=None,
        *,
        density: float = 64 / 4096,
        chunk: int = 4096,
        groups: int = 2,
        error_feedback: bool = True,
        model=None,
    ):
        """``density``: the budget, the bytes of that uniform density (between the lowest and the highest
        of `DENSITIES`); ``process_group``, ``chunk``, ``groups``, ``error_feedback`` and ``model`` as
        `SparseQuantState`'s."""
        super().__init__(
            process_group, density=density, chunk=chunk, groups=groups, error_feedback=error_feedback, model=model
        )
        if not DENSITIES[0] <= density <= DENSITIES[-1]:
            raise ValueError(f"density: the budget must be in [{DENSITIES[0]:g}, {DENSITIES[-1]:g}], got {density!r}")
        self.last_density: dict[str, float] = {}  # the last step's choice, by parameter name

    def _layouts(self, names: list[str], parts: list[torch.Tensor], shapes: list) -> list[_Layout]:
        candidates = [[self.layout(p.numel(), d) for d in DENSITIES] for p in parts]
        errors = torch.stack(
            [
                torch.stack([(part - self.decode(*self.encode(part, lay), lay)).square().sum() for lay in row])
                for part, row in zip(parts, candidates)
            ]
        ).double()
        with host_reads_allowed():  # the module docstring's one read per outer step
            table = self.comm.mean_(errors).tolist()  # identical on every rank: the same choice everywhere
        costs = [[lay.bytes(self.groups) for lay in row] for row in candidates]
        choice = allocate_by_cost(table, costs, self.message_bytes([p.numel() for p in parts]))
        self.last_density = {name: DENSITIES[c] for name, c in zip(names, choice)}
        return [row[c] for row, c in zip(candidates, choice)]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "budget_density": self.density}
