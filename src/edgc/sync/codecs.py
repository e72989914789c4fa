"""Codecs of the two-stage compressed all-reduce (`edgc.sync.two_stage`): a flat run of values to a message of
bytes whose size depends only on how many values it carries, and back.

`QuantCodec`: ``bits`` bits a value (2 ≤ bits ≤ 8) with one fp32 scale (max |x| / L) per block of
``block`` values, rounded to the nearest of the 2L + 1 levels −L…L (L = 2^(bits−1) − 1), as
`edgc.sync.outer_sync.QuantizedState` rounds. The message is the scales, then the codes as ``bits`` bit
planes (plane k holds bit k of every code, eight codes a byte): the codes stay one byte each while
they are made and read, never a wider integer, so a codec call needs about 10 bytes per value of
the run it is given, whatever the model. Bytes for n values: 4·⌈n/block⌉ + ⌈n/8⌉·bits, rounded up to
a multiple of 4 (so that a message placed at any multiple of its size keeps its scales aligned).
"""

from __future__ import annotations

import math

import torch


def _bit_weights(device: torch.device) -> torch.Tensor:
    """1, 2, 4, … 128 as uint8 on ``device`` (the weight of each of a byte's eight codes' bit), made on
    the device on the caller's stream at each call: a tensor cached across calls would be made on one
    stream and read on others (the first use unordered on an accelerator)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    return torch.ones(8, dtype=torch.uint8, device=device).bitwise_left_shift_(shifts)


def pack_planes(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """``codes`` (uint8, < 2^bits, a multiple of 8 of them) into ``out`` (uint8, len(codes)/8 · bits bytes):
    plane k is bit k of every code, code i at bit i mod 8 of byte i div 8 of its plane."""
    rows = codes.view(-1, 8)
    weights = _bit_weights(codes.device)
    planes = out.view(bits, -1)
    for k in range(bits):
        plane = torch.bitwise_right_shift(rows, k).bitwise_and_(1).mul_(weights)
        torch.sum(plane, dim=1, dtype=torch.uint8, out=planes[k])


def unpack_planes(packed: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """The inverse of `pack_planes`: the codes into ``out`` (uint8, 8 per byte of a plane)."""
    planes = packed.view(bits, -1)
    rows = out.view(-1, 8)
    rows.zero_()
    weights = _bit_weights(packed.device)
    for k in range(bits):
        bit = planes[k].unsqueeze(1).bitwise_and(weights).ne_(0).to(torch.uint8)
        rows.bitwise_or_(bit.bitwise_left_shift_(k))


class QuantCodec:
    """``bits``-bit codes with a scale per ``block`` values (see the module docstring)."""

    def __init__(self, bits: int = 3, block: int = 256):
        if not (isinstance(bits, int) and 2 <= bits <= 8):
            raise ValueError(f"bits: must be an integer in 2..8, got {bits!r}")
        if not (isinstance(block, int) and block >= 8 and block % 8 == 0):
            raise ValueError(f"block: values per scale, a multiple of 8 and ≥ 8, got {block!r}")
        self.bits, self.block = bits, block
        self.top = 2 ** (bits - 1) - 1  # L

    def _layout(self, n: int) -> tuple[int, int, int]:
        """(blocks, bytes of the scales, bytes of the planes) for n values."""
        blocks = math.ceil(n / self.block)
        return blocks, 4 * blocks, math.ceil(n / 8) * self.bits

    def message_bytes(self, n: int) -> int:
        _, scales, planes = self._layout(n)
        return 4 * math.ceil((scales + planes) / 4)

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the message of the flat ``x`` into ``out`` (uint8, `message_bytes` of it); return the
        values it decodes to, in ``x``'s dtype, bit for bit what `decode` gives."""
        n = x.numel()
        blocks, scale_bytes, plane_bytes = self._layout(n)
        padded = blocks * self.block
        values = x if n == padded else torch.cat([x, x.new_zeros(padded - n)])
        values = values.view(blocks, self.block)
        scale = values.abs().amax(dim=1).div_(self.top).to(torch.float32)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype)
        codes = values.div(safe.unsqueeze(1)).round_().clamp_(-self.top, self.top).add_(self.top).to(torch.uint8)
        del values
        out[:scale_bytes].view(torch.float32).copy_(scale)
        pack_planes(
            codes.view(-1)[: plane_bytes * 8 // self.bits], self.bits, out[scale_bytes : scale_bytes + plane_bytes]
        )
        out[scale_bytes + plane_bytes :].zero_()
        return self._values(codes.view(-1), scale, n, x.dtype)

    def decode(self, message: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``n`` values (``dtype``) of ``message``; an all-zero message decodes to zeros."""
        blocks, scale_bytes, plane_bytes = self._layout(n)
        codes = torch.full((blocks * self.block,), self.top, dtype=torch.uint8, device=message.device)
        unpack_planes(
            message[scale_bytes : scale_bytes + plane_bytes], self.bits, codes[: plane_bytes * 8 // self.bits]
        )
        return self._values(codes, message[:scale_bytes].view(torch.float32), n, dtype)

    def _values(self, codes: torch.Tensor, scale: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        values = codes.to(dtype).sub_(self.top).view(-1, self.block)
        return values.mul_(scale.to(dtype).unsqueeze(1)).view(-1)[:n]
