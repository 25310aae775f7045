"""The hash that names a committed token prefix in cache handles."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def token_hash(tokens: Sequence[int]) -> int:
    """blake2b-64 of the tokens as little-endian int32, as an unsigned int."""
    data = array("i", tokens)
    if data.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte int
        raise RuntimeError("array('i') is not 32-bit on this platform")
    return int.from_bytes(hashlib.blake2b(data.tobytes(), digest_size=8).digest(), "little")
