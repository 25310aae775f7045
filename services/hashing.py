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


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The name of a prefix-cache block (services/prefix_cache.py): blake2b-64 of the parent
    block's hash (0 for a prompt's first block) as 8 little-endian bytes followed by the
    block's tokens as little-endian int32, so it names the whole prefix up to the block's
    end. Replicas and the gateway's router compute it alike."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("i", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block: int) -> list[int]:
    """The chained hashes of every full ``block``-token block of ``tokens``."""
    out, parent = [], 0
    for end in range(block, len(tokens) + 1, block):
        parent = block_hash(parent, tokens[end - block:end])
        out.append(parent)
    return out
