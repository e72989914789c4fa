"""Codecs of the two-stage compressed all-reduce (`edgc.sync.two_stage`): rows of values to rows of bytes
whose size depends only on how many values a row carries, and back.

The reducer hands a codec all the chunks of a bucket at once, as an ``[N, C]`` tensor (``encode_rows``,
``decode_rows``), so that a bucket costs the same launches whatever the number of chunks N. A codec
that only knows one flat run at a time (``encode``, ``decode``) is called row by row
(`encode_rows`, `decode_rows` below).

`QuantCodec`: ``bits`` bits a value (2 ≤ bits ≤ 8) with one fp32 scale (max |x| / L) per block of
``block`` values, rounded to the nearest of the 2L + 1 levels −L…L (L = 2^(bits−1) − 1), as
`edgc.sync.outer_sync.QuantizedState` rounds. A row's message is its scales, then its codes as ``bits``
bit planes (plane k holds bit k of every code, eight codes a byte): the codes stay one byte each
while they are made and read, never a wider integer. Bytes for a row of n values: 4·⌈n/block⌉ +
⌈n/8⌉·bits, rounded up to a multiple of 4 (so that a message placed at any multiple of its size keeps
its scales aligned). A row of C values costs about 5 + bits bytes a value while it is encoded (the
scaled values, their codes and their bit planes), whatever the number of rows.
"""

from __future__ import annotations

import math

import torch

from ..device import streams


def encode_rows(codec, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``codec``'s messages of the rows of ``x`` ([R, C]) into the rows of ``out`` ([R, message bytes]);
    the values they decode to, [R, C] in ``x``'s dtype. One call for a codec that encodes rows, else one a row."""
    if hasattr(codec, "encode_rows"):
        return codec.encode_rows(x, out)
    return torch.stack([codec.encode(row, message) for row, message in zip(x, out)])


def decode_rows(codec, messages: torch.Tensor, n: int, dtype: torch.dtype, out: torch.Tensor | None = None):
    """The [R, n] values of ``codec``'s R ``messages`` ([R, message bytes]), in ``dtype``, written into ``out``
    when given. One call for a codec that decodes rows, else one a row."""
    if hasattr(codec, "decode_rows"):
        return codec.decode_rows(messages, n, dtype, out)
    values = torch.stack([codec.decode(message, n, dtype) for message in messages])
    return values if out is None else out.copy_(values)


def encode_run(codec, values: torch.Tensor, chunk: int, out: torch.Tensor, residual: bool) -> list[torch.Tensor]:
    """Encode a flat run of ``values`` as R = ``out``'s rows of ``chunk`` values (the run's end padded
    with zeros) into ``out`` ([R, message bytes]). ``residual``: ``values`` ← what the messages did not
    carry, in place; else ``values`` is left as it is. Returns that remainder (up to its sign), in
    pieces, for its norm. The whole rows are encoded where they lie; only the rows the run's end
    leaves short are copied, so a run of whole rows costs no copy."""
    members, n = out.shape[0], values.numel()
    whole = min(members, n // chunk)
    pieces = []
    if whole:
        head = values[: whole * chunk].view(whole, chunk)
        sent = encode_rows(codec, head, out[:whole])
        pieces.append(head.sub_(sent) if residual else sent.sub_(head))
    if whole < members:
        rest = values[whole * chunk :]
        tail = values.new_zeros(members - whole, chunk)
        tail.view(-1)[: rest.numel()].copy_(rest)
        tail -= encode_rows(codec, tail, out[whole:])  # the padding's zeros are encoded exactly: no remainder
        if residual:
            rest.copy_(tail.view(-1)[: rest.numel()])
        pieces.append(tail)
    return pieces


def decode_run(codec, messages: torch.Tensor, chunk: int, target: torch.Tensor, dtype: torch.dtype, add: bool = False):
    """The flat run ``target`` ← (``add``: +=) the values of R = ``messages``' rows of ``chunk`` values
    each, decoded in ``dtype`` (the padding past the run's end dropped): whole rows straight into
    ``target`` where its dtype is ``dtype``. Returns the decoded values, in pieces (for a finiteness check)."""
    members, n = messages.shape[0], target.numel()
    whole = min(members, n // chunk)
    pieces = []
    if whole:
        head = target[: whole * chunk].view(whole, chunk)
        if add or head.dtype != dtype:
            values = decode_rows(codec, messages[:whole], chunk, dtype)
            head.add_(values) if add else head.copy_(values)
        else:
            values = decode_rows(codec, messages[:whole], chunk, dtype, out=head)
        pieces.append(values)
    if whole < members and whole * chunk < n:
        rest = target[whole * chunk :]
        values = decode_rows(codec, messages[whole:], chunk, dtype).reshape(-1)[: rest.numel()]
        rest.add_(values) if add else rest.copy_(values)
        pieces.append(values)
    return pieces


class QuantCodec:
    """``bits``-bit codes with a scale per ``block`` values (see the module docstring)."""

    def __init__(self, bits: int = 3, block: int = 256):
        if not (isinstance(bits, int) and 2 <= bits <= 8):
            raise ValueError(f"bits: must be an integer in 2..8, got {bits!r}")
        if not (isinstance(block, int) and block >= 8 and block % 8 == 0):
            raise ValueError(f"block: values per scale, a multiple of 8 and ≥ 8, got {block!r}")
        self.bits, self.block = bits, block
        self.top = 2 ** (bits - 1) - 1  # L
        self.row_multiple = block  # rows of a multiple of this many values are encoded without padding
        self._constants: dict = {}  # (device, stream) -> (bit weights, plane shifts)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_constants": {}}  # device tensors: made again where it is used

    def _layout(self, n: int) -> tuple[int, int, int]:
        """(blocks, bytes of the scales, bytes of the planes) for n values."""
        blocks = math.ceil(n / self.block)
        return blocks, 4 * blocks, math.ceil(n / 8) * self.bits

    def message_bytes(self, n: int) -> int:
        _, scales, planes = self._layout(n)
        return 4 * math.ceil((scales + planes) / 4)

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, 2, 4, … 128: the weight of each of a byte's eight codes' bit, [8]; 0 … bits − 1: the
        planes' shifts, [bits, 1, 1]), uint8 on ``device``, made once per device and stream: a tensor
        made on one stream and read on another would be read unordered the first time."""
        stream = streams.current_stream(device)
        key = (device, getattr(stream, "cuda_stream", 0))
        found = self._constants.get(key)
        if found is None:
            weights = torch.ones(8, dtype=torch.uint8, device=device).bitwise_left_shift_(
                torch.arange(8, dtype=torch.uint8, device=device)
            )
            shifts = torch.arange(self.bits, dtype=torch.uint8, device=device).view(self.bits, 1, 1)
            found = self._constants[key] = (weights, shifts)
        return found

    # ------------------------------------------------------------------ rows
    def encode_rows(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the message of each row of ``x`` ([R, C]) into the row of ``out`` ([R, `message_bytes` (C)],
        uint8); return the values they decode to, [R, C] in ``x``'s dtype, bit for bit what
        `decode_rows` gives."""
        rows, n = x.shape
        blocks, scale_bytes, plane_bytes = self._layout(n)
        padded = blocks * self.block
        values = x if n == padded else torch.nn.functional.pad(x, (0, padded - n))
        values = values.reshape(rows, blocks, self.block)
        scale = values.abs().amax(dim=2).div_(self.top).to(torch.float32)
        safe = torch.where(scale > 0, scale, 1.0).to(x.dtype)
        # q = round(x / scale) in −L…L, as a float; its code q + L; then q · scale, what the code decodes to
        levels = values.div(safe.unsqueeze(2)).round_().clamp_(-self.top, self.top).add_(self.top)
        codes = levels.to(torch.uint8).view(rows, padded)
        del values
        out[:, :scale_bytes].view(torch.float32).copy_(scale)
        self._pack(codes[:, : plane_bytes * 8 // self.bits], out[:, scale_bytes : scale_bytes + plane_bytes])
        if scale_bytes + plane_bytes < out.shape[1]:
            out[:, scale_bytes + plane_bytes :].zero_()
        sent = levels.sub_(self.top).mul_(scale.to(x.dtype).unsqueeze(2)).view(rows, padded)
        return sent if n == padded else sent[:, :n]

    def decode_rows(
        self, messages: torch.Tensor, n: int, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The [R, n] values (``dtype``) of the R ``messages``, written into ``out`` ([R, n]) when given;
        an all-zero message decodes to zeros."""
        rows = messages.shape[0]
        blocks, scale_bytes, plane_bytes = self._layout(n)
        padded = blocks * self.block
        scale = messages[:, :scale_bytes].view(torch.float32).to(dtype).unsqueeze(2)
        codes = self._unpack(messages[:, scale_bytes : scale_bytes + plane_bytes], n)
        if out is not None and n == padded and out.dtype == dtype:
            target = out.view(rows, blocks, self.block)
            target.copy_(codes.view(rows, blocks, self.block))  # n = padded: a row's codes are all its values'
            target.sub_(self.top).mul_(scale)
            return out
        values = codes.to(dtype).sub_(self.top).view(rows, blocks, self.block).mul_(scale).view(rows, padded)
        values = values if n == padded else values[:, :n]
        return values if out is None else out.copy_(values)

    def _pack(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """``codes`` ([R, 8·P], uint8, < 2^bits) into ``out`` ([R, bits·P]): plane k is bit k of every code,
        code i at bit i mod 8 of byte i div 8 of its plane."""
        rows = codes.shape[0]
        weights, shifts = self.constants(codes.device)
        grouped = codes.reshape(rows, 1, -1, 8)  # [R, 1, P, 8]
        bits = grouped.bitwise_right_shift(shifts).bitwise_and_(1).mul_(weights)  # [R, bits, P, 8]
        torch.sum(bits, dim=3, dtype=torch.uint8, out=out.view(rows, self.bits, -1))

    def _unpack(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """The inverse of `_pack`: the codes of rows of ``n`` values, [R, blocks · block] (L past the planes)."""
        rows = packed.shape[0]
        blocks = math.ceil(n / self.block)
        weights, shifts = self.constants(packed.device)
        bits = packed.reshape(rows, self.bits, -1, 1).bitwise_and(weights).ne_(0).bitwise_left_shift_(shifts)
        planes = bits.sum(dim=1, dtype=torch.uint8).view(rows, -1)  # [R, 8·P]
        if planes.shape[1] == blocks * self.block:
            return planes
        codes = torch.full((rows, blocks * self.block), self.top, dtype=torch.uint8, device=packed.device)
        codes[:, : planes.shape[1]] = planes
        return codes

    # ------------------------------------------------------------------ one flat run
    def encode(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the message of the flat ``x`` into ``out`` (uint8, `message_bytes` of it); return the
        values it decodes to, in ``x``'s dtype, bit for bit what `decode` gives."""
        return self.encode_rows(x.reshape(1, -1), out.view(1, -1)).view(-1)

    def decode(self, message: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``n`` values (``dtype``) of ``message``; an all-zero message decodes to zeros."""
        return self.decode_rows(message.view(1, -1), n, dtype)[0]
