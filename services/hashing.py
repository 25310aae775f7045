"""The hash that names a committed token prefix in cache handles, and the prefix-cache
blocks' chained hashes."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

if array("i").itemsize != 4:  # pragma: no cover - every supported platform has 4-byte int
    raise RuntimeError("array('i') is not 32-bit on this platform")


def _int32(tokens: Sequence[int]) -> bytes:
    """The tokens as the bytes every hash here reads: int32 in the machine's (little-endian)
    order."""
    return array("i", tokens).tobytes()


def token_hash(tokens: Sequence[int]) -> int:
    """blake2b-64 of the tokens as little-endian int32, as an unsigned int."""
    return int.from_bytes(hashlib.blake2b(_int32(tokens), digest_size=8).digest(), "little")


class PrefixHasher:
    """``token_hash(tokens[:n])`` of one growing token list at a cost that does not grow
    with the list: blake2b states are kept every ``STRIDE`` tokens, and a prefix's hash
    copies the state at or below its end and feeds at most ``STRIDE - 1`` more tokens (the
    same bytes through the same hash: the value equals ``token_hash``'s). A session's
    rounds ask for the hash of a prefix they just extended; hashing it whole each time cost
    ~50 us at 1,000 tokens, several times a round.

    The owner keeps one hasher per list, appends freely and calls ``crop(n)`` whenever the
    list is cut to ``n`` tokens; the tokens before the last kept state must not otherwise
    change (a changed token there would give a wrong hash: a cache check that then fails
    makes the caller resend its prefix, services/kv_cache.py)."""

    STRIDE = 64

    def __init__(self) -> None:
        self._states = [hashlib.blake2b(digest_size=8)]  # state i has fed tokens[:i STRIDE]

    def hash(self, tokens: Sequence[int], n: int) -> int:
        """token_hash(tokens[:n]), for 0 <= n <= len(tokens)."""
        if not 0 <= n <= len(tokens):
            raise ValueError(f"prefix of {n} tokens asked of a list of {len(tokens)}")
        step, at = self.STRIDE, n // self.STRIDE
        while len(self._states) <= at:
            i = len(self._states) - 1
            state = self._states[-1].copy()
            state.update(_int32(tokens[i * step:(i + 1) * step]))
            self._states.append(state)
        state = self._states[at].copy()
        if n > at * step:
            state.update(_int32(tokens[at * step:n]))
        return int.from_bytes(state.digest(), "little")

    def crop(self, n: int) -> None:
        """The list now holds its first ``n`` tokens (what it held after them is gone)."""
        del self._states[n // self.STRIDE + 1:]

    def __deepcopy__(self, memo: dict) -> PrefixHasher:
        """A copy for a copy of the list (hashlib states do not pickle; they copy)."""
        twin = PrefixHasher()
        twin._states = [state.copy() for state in self._states]
        return twin

    def __reduce__(self):
        """Pickled as a new hasher: the states are a cache, made again from the list."""
        return PrefixHasher, ()


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The name of a prefix-cache block (services/prefix_cache.py): blake2b-64 of the parent
    block's hash (0 for a prompt's first block) as 8 little-endian bytes followed by the
    block's tokens as little-endian int32, so it names the whole prefix up to the block's
    end. Replicas and the gateway's router compute it alike."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(_int32(tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block: int) -> list[int]:
    """The chained hashes of every full ``block``-token block of ``tokens``."""
    out, parent = [], 0
    for end in range(block, len(tokens) + 1, block):
        parent = block_hash(parent, tokens[end - block:end])
        out.append(parent)
    return out
