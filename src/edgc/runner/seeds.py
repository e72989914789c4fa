"""Seeds from names and numbers that are the same in every process: what the engine's warm start, the
warm-up probe, the inter-stage compressor and the random sparsifiers draw from."""

from __future__ import annotations

import zlib


def stable_seed(*parts: object) -> int:
    """A seed from names and numbers that is the same in every process (unlike ``hash``).

    Args:
        parts: names and numbers, compared by their ``repr``.

    Returns:
        A non-negative 31-bit seed.
    """
    return zlib.crc32(repr(parts).encode()) & 0x7FFF_FFFF
