"""A replica's prefix cache: KV blocks of committed token prefixes, shared across sessions.

A session that starts (base_len 0) with a prompt whose first blocks some earlier session
already computed gets those positions' keys and values copied from here and computes only
the rest, as vLLM's automatic prefix caching does. Chat traffic repeats long system prompts
and whole conversations; without it every prompt is computed in full on every replica.

Blocks hold ``block`` tokens each and are named by a chained hash (services/hashing.py
``block_hash``): block i's hash covers its own tokens and block i-1's hash, so a hash names
the whole prefix up to the block's end and a lookup walks the prompt block by block,
stopping at the first miss. Keys and values at a position depend only on the tokens up to
it, so a block computed in one session's pass holds what a fresh pass would compute (the
same numbers; a hit's logits differ from a full prefill's only by float summation order,
as a batched pass's do).

Memory: at most ``max_blocks`` blocks, least recently used out first. A lookup touches the
blocks it matched deepest first, so a prefix's first block is the most recent of its
chain and a chain is evicted from its tail (a block whose parent is gone could never be
matched again). Blocks are copies: a session's own cache (services/kv_cache.py) and the
blocks published from it hold the same positions twice.

A restore writes one tensor of the matched blocks joined (``joined``) into the session's
cache. Joining them is a copy of its own, and sessions behind a shared prompt join the same
blocks again and again, on the replica's event loop, where a burst of new sessions waits for
each other's: the last ``RUNS_MAX`` runs joined are kept, within ``1 / RUN_SHARE`` of the
budget (counted in it), and a run is dropped with any of its blocks (demo target, 800
positions: a lookup and restore took 2.0-2.2 ms a session joining every time, 1.1-1.2 with
the run kept; docs/performance.md, 2026-11-29).

The replica publishes which blocks it holds (``drain_changes``) to a Redis index the
gateway routes new sessions by (services/prefix_index.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.hashing import block_hash

RUNS_MAX = 4  # joined runs kept (``joined``)
RUN_SHARE = 8  # ... within 1 / RUN_SHARE of the budget, in blocks


@dataclass
class PrefixStats:
    lookups: int = 0  # fresh sessions that looked for a cached prefix
    hits: int = 0  # of which found at least one block
    hit_tokens: int = 0  # prompt tokens not computed thanks to a hit
    lookup_tokens: int = 0  # prompt tokens looked up (the hit rate's denominator)
    evicted_blocks: int = 0
    runs_reused: int = 0  # restores that took a run joined before (``joined``)


def extract_block(kv: Any, start: int, end: int) -> torch.Tensor:
    """Positions [start, end) of a session's cache (SlabCache or DynamicCache, batch 1) as one
    tensor [L, 2, KV, end-start, D] (a copy)."""
    return torch.stack([torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
                        for layer in kv.layers])


def restore(kv: Any, whole: torch.Tensor) -> None:
    """Writes ``whole`` [L, 2, KV, P, D] (``PrefixCache.joined``) into the empty cache ``kv``."""
    for layer in range(whole.shape[0]):
        kv.update(whole[layer, 0][None], whole[layer, 1][None], layer)  # [1, KV, P, D] each


class PrefixCache:
    """hash -> KV block, LRU within ``max_blocks``; ``max_blocks`` 0 disables the cache."""

    def __init__(self, block: int, max_blocks: int) -> None:
        if block < 1:
            raise ValueError(f"prefix block size must be >= 1, got {block}")
        self.block = block
        self.max_blocks = max_blocks
        self.stats = PrefixStats()
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()
        # the last runs joined, by their last block's hash: (their blocks' hashes, the run)
        self._runs: OrderedDict[int, tuple[frozenset[int], torch.Tensor]] = OrderedDict()
        self._run_blocks = 0  # blocks the runs hold, counted in ``max_blocks``
        self._added: set[int] = set()  # since the last drain_changes
        self._removed: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[list[int], list[torch.Tensor]]:
        """The longest run of cached blocks that starts ``tokens`` and ends within its first
        ``limit`` tokens: (their hashes, their KV blocks)."""
        if not self.enabled:
            return [], []
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(tokens)
        hashes, blocks, h = [], [], 0
        for end in range(self.block, limit + 1, self.block):  # no hashing past the first miss
            h = block_hash(h, tokens[end - self.block:end])
            kv = self._blocks.get(h)
            if kv is None:
                break
            hashes.append(h)
            blocks.append(kv)
        for h in reversed(hashes):  # deepest first: the chain's head ends up most recent
            self._blocks.move_to_end(h)
        if blocks:
            self.stats.hits += 1
            self.stats.hit_tokens += len(blocks) * self.block
        return hashes, blocks

    def joined(self, hashes: Sequence[int], blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        """``blocks`` as ``lookup`` gave them (``hashes`` theirs) joined into one tensor
        [L, 2, KV, P, D]: the run joined before where it is still kept (the last hash names
        the whole run), else a new one, kept where it fits its share of the budget."""
        if len(blocks) == 1:
            return blocks[0]
        key = hashes[-1]
        run = self._runs.get(key)
        if run is not None:
            self._runs.move_to_end(key)
            self.stats.runs_reused += 1
            return run[1]
        whole = torch.cat(list(blocks), dim=3)
        share = self.max_blocks // RUN_SHARE
        if len(blocks) <= share:
            self._runs[key] = (frozenset(hashes), whole)
            self._run_blocks += len(blocks)
            while self._run_blocks > share or len(self._runs) > RUNS_MAX:
                self._drop_run(next(iter(self._runs)))
            self._evict()
        return whole

    def _drop_run(self, key: int) -> None:
        hashes, _ = self._runs.pop(key)
        self._run_blocks -= len(hashes)

    def insert(self, parent: int, tokens: Sequence[int], kv: Any, start: int) -> int:
        """Publishes the block of ``tokens`` (``block`` of them, at positions start.. of the
        session cache ``kv``) after the block hashed ``parent`` (0: the first block); returns
        its hash. A block already held is only touched."""
        h = block_hash(parent, tokens)
        if not self.enabled:
            return h
        if h in self._blocks:
            self._blocks.move_to_end(h)
        else:
            self._blocks[h] = extract_block(kv, start, start + self.block)
            self._added.add(h)
            self._removed.discard(h)
        if parent in self._blocks:  # keep the parent more recent than its child
            self._blocks.move_to_end(parent)
        self._evict()
        return h

    def _evict(self) -> None:
        while self._blocks and len(self._blocks) + self._run_blocks > self.max_blocks:
            h, _ = self._blocks.popitem(last=False)
            self.stats.evicted_blocks += 1
            for key in [key for key, (hashes, _) in self._runs.items() if h in hashes]:
                self._drop_run(key)  # (a block computed again may differ in its last bits)
            if h in self._added:
                self._added.discard(h)
            else:
                self._removed.add(h)

    def drain_changes(self) -> tuple[set[int], set[int]]:
        """(blocks added, blocks removed) since the last call, for the routing index."""
        added, removed = self._added, self._removed
        self._added, self._removed = set(), set()
        return added, removed

    def held(self) -> list[int]:
        """Every block hash held now (a full republish after the index was lost)."""
        return list(self._blocks)
