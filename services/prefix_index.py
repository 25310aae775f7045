"""The prefix-block index in Redis: which replica's prefix cache holds which blocks.

Each drafter and verifier started with ``--redis`` keeps a set
``specmesh:prefix:{role}:{address}`` of the block hashes its prefix cache
(services/prefix_cache.py) holds, as 16 hex digits each. It starts the set afresh (a
restarted replica's cache is cold), sends what was added and evicted every
``period_s``, and keeps a TTL on it, so a replica that dies drops out of the index. After a
failed write the next one republishes the whole set (the changes in between are unknown).

The gateway, placing a new session, asks every candidate replica's set which of the
prompt's block hashes it holds (one pipelined round trip) and counts the leading run: the
tokens that replica would not compute again (gateway/replicas.py weighs them against load).
The index may be stale (a block evicted since its last write, a replica restarted): a wrong
guess only costs a longer prefill, since the replica itself looks each block up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.hashing import block_hashes
from services.registry import KeptKey

if TYPE_CHECKING:  # the gateway imports this module and must not need torch
    from services.prefix_cache import PrefixCache

PREFIX = "specmesh:prefix:"


def index_key(role: str, address: str) -> str:
    return f"{PREFIX}{role}:{address}"


def _member(block_id: int) -> str:
    return f"{block_id:016x}"


class IndexPublisher(KeptKey):
    """Keeps one replica's set in step with its prefix cache until ``stop()`` (which deletes
    the set)."""

    what = "prefix index write"

    def __init__(self, client: aioredis.Redis, role: str, address: str, cache: PrefixCache,
                 period_s: float = 0.25, ttl_s: float = 30.0) -> None:
        super().__init__(client, index_key(role, address), period_s)
        self._cache = cache
        self._ttl_ms = int(ttl_s * 1000)
        self._whole = True  # the next write replaces the set

    async def write(self) -> None:
        """One write: the whole set after a start or a failure, else the changes."""
        added, removed = self._cache.drain_changes()
        pipe = self._r.pipeline(transaction=True)
        if self._whole:
            pipe.delete(self.key)
            added, removed = set(self._cache.held()), set()
        if added:
            pipe.sadd(self.key, *map(_member, added))
        if removed:
            pipe.srem(self.key, *map(_member, removed))
        pipe.pexpire(self.key, self._ttl_ms)
        try:
            await pipe.execute()
        except RedisError:
            self._whole = True  # what the set holds now is unknown
            raise
        self._whole = False


async def cached_tokens(client: aioredis.Redis, role: str, tokens: Sequence[int],
                        replicas: Iterable[tuple[str, int]]) -> dict[str, int]:
    """address -> leading tokens of ``tokens`` its index says it holds, for each (address,
    its block size) of ``replicas`` (block size 0: no prefix cache, left out). One
    pipelined round trip; raises RedisError."""
    asked, hashes = [], {}
    pipe = client.pipeline(transaction=False)
    for address, block in replicas:
        if block <= 0 or len(tokens) < block:
            continue
        if block not in hashes:
            hashes[block] = [_member(h) for h in block_hashes(tokens, block)]
        pipe.smismember(index_key(role, address), hashes[block])
        asked.append((address, block))
    if not asked:
        return {}
    answers = await pipe.execute()
    out = {}
    for (address, block), held in zip(asked, answers, strict=True):
        run = 0
        for present in held:
            if not present:
                break
            run += 1
        out[address] = run * block
    return out
