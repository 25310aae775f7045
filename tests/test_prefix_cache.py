"""The replica's prefix cache (services/prefix_cache.py) in-process: block naming, lookup,
LRU eviction from a chain's tail, the routing index's change log, and a real tiny model's
session restored from cached blocks computing what a full prefill computes."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from services.batching import Row, forward_one
from services.hashing import block_hash, block_hashes, token_hash
from services.kv_cache import SessionCaches
from services.prefix_cache import PrefixCache


def _by_hand(parent: int, tokens: list[int]) -> int:
    data = parent.to_bytes(8, "little") + struct.pack(f"<{len(tokens)}i", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_block_hashes_chain_each_block_to_the_whole_prefix_before_it():
    tokens = list(range(40))
    first, second = _by_hand(0, tokens[:16]), None
    second = _by_hand(first, tokens[16:32])
    assert block_hashes(tokens, 16) == [first, second]  # the 8 trailing tokens: no full block
    assert block_hash(0, tokens[:16]) == first
    changed = [99] + tokens[1:]  # a different first token renames every later block
    assert all(a != b for a, b in zip(block_hashes(changed, 16), [first, second], strict=True))
    # the same block after another parent is another block
    assert block_hash(12345, tokens[16:32]) != second


class _FakeKv:
    """A cache of one layer whose keys and values at position p are all p (what a block holds
    is then readable): the shape of the real caches' ``layers[i].keys`` [1, KV, P, D]."""

    class _Layer:
        def __init__(self) -> None:
            self.keys = torch.zeros(1, 1, 0, 2)
            self.values = torch.zeros(1, 1, 0, 2)

    def __init__(self) -> None:
        self.layers = [self._Layer()]

    def update(self, keys, values, layer):
        lay = self.layers[layer]
        lay.keys = torch.cat([lay.keys, keys], dim=2)
        lay.values = torch.cat([lay.values, values], dim=2)
        return lay.keys, lay.values

    def fill(self, n: int) -> _FakeKv:
        pos = torch.arange(float(n))[None, None, :, None].expand(1, 1, n, 2)
        self.update(pos.clone(), pos.clone(), 0)
        return self

    def crop(self, max_length: int) -> None:
        for lay in self.layers:
            keep = lay.keys.shape[2] + max_length if max_length < 0 else max_length
            lay.keys, lay.values = lay.keys[:, :, :keep], lay.values[:, :, :keep]


def _publish(cache: PrefixCache, tokens: list[int]) -> list[int]:
    kv, parent, out = _FakeKv().fill(len(tokens)), 0, []
    for start in range(0, len(tokens) - cache.block + 1, cache.block):
        parent = cache.insert(parent, tokens[start:start + cache.block], kv, start)
        out.append(parent)
    return out


def test_lookup_takes_the_longest_cached_run_within_the_limit():
    cache = PrefixCache(block=4, max_blocks=10)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    _publish(cache, shared + [1, 2, 3, 4])
    hashes, blocks = cache.lookup(shared + [0, 0, 0, 0, 0], limit=12)
    assert len(blocks) == 2 and hashes == block_hashes(shared, 4)  # the third block differs
    assert blocks[1][0, 0, 0, :, 0].tolist() == [4.0, 5.0, 6.0, 7.0]  # positions 4..7
    # the limit keeps the last token(s) to compute: 8 tokens with limit 7 reuse one block
    assert len(cache.lookup(shared, limit=7)[1]) == 1
    assert cache.lookup([1] + shared, limit=9) == ([], [])  # not a prefix: nothing
    s = cache.stats
    assert (s.lookups, s.hits, s.hit_tokens) == (3, 2, 12)


def test_eviction_drops_a_chain_from_its_tail_and_keeps_the_hot_head():
    cache = PrefixCache(block=2, max_blocks=4)
    a = _publish(cache, [1, 1, 2, 2, 3, 3])  # a0 -> a1 -> a2
    cache.lookup([1, 1, 2, 2, 3, 3, 0], limit=6)  # a used again
    _publish(cache, [7, 7, 8, 8])  # b0 -> b1: 5 blocks > 4, one must go
    assert a[2] not in cache and a[0] in cache and a[1] in cache  # a's tail, not its head
    assert cache.stats.evicted_blocks == 1 and len(cache) == 4
    assert len(cache.lookup([1, 1, 2, 2, 3, 3, 0], limit=6)[1]) == 2  # a0, a1 still reusable


def test_a_joined_run_is_reused_counted_in_the_budget_and_dropped_with_its_blocks():
    cache = PrefixCache(block=2, max_blocks=16)  # joined runs: at most 16 // 8 = 2 blocks
    shared = [1, 1, 2, 2]
    _publish(cache, shared)
    hashes, blocks = cache.lookup(shared + [0], limit=4)
    first = cache.joined(hashes, blocks)
    assert torch.equal(first, torch.cat(blocks, dim=3))  # positions 0..3, in order
    assert first[0, 0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert cache.joined(*cache.lookup(shared + [5], limit=4)) is first  # not joined again
    assert cache.stats.runs_reused == 1
    one = cache.lookup(shared, limit=3)  # one block: that block itself, no run
    assert cache.joined(*one) is one[1][0]
    # the run's 2 blocks count in the budget: 12 more blocks fill it, a 13th evicts one
    _publish(cache, list(range(100, 124)))
    assert cache.stats.evicted_blocks == 0 and len(cache) == 14
    _publish(cache, [7, 7])
    assert cache.stats.evicted_blocks == 1 and len(cache) == 14  # (the run went with it)
    assert hashes[1] not in cache and hashes[0] in cache  # the shared chain's tail
    _publish(cache, shared)  # its second block computed again: a new run
    assert cache.joined(*cache.lookup(shared + [0], limit=4)) is not first
    assert cache.stats.runs_reused == 1


def test_drain_changes_reports_each_block_once_and_forgets_unpublished_evictions():
    cache = PrefixCache(block=1, max_blocks=2)
    one, two = (block_hash(0, [t]) for t in (1, 2))  # two one-block chains
    _publish(cache, [1])
    _publish(cache, [2])
    assert cache.drain_changes() == ({one, two}, set())
    assert cache.drain_changes() == (set(), set())
    _publish(cache, [3])  # evicts [1], the least recently used, which the index holds
    assert cache.drain_changes() == ({block_hash(0, [3])}, {one})
    # [4] is added and evicted again between two drains: the index never hears of it
    for t in (4, 5, 6):
        _publish(cache, [t])
    added, removed = cache.drain_changes()
    assert added == {block_hash(0, [5]), block_hash(0, [6])}
    assert removed == {two, block_hash(0, [3])}


def test_disabled_cache_holds_nothing():
    cache = PrefixCache(block=4, max_blocks=0)
    _publish(cache, list(range(8)))
    assert len(cache) == 0 and cache.lookup(list(range(9)), 8) == ([], [])
    with pytest.raises(ValueError, match="block size"):
        PrefixCache(block=0, max_blocks=1)


@pytest.fixture(scope="module")
def lean_target(tiny_pair):
    from services.models import load_for_serving

    model, meta, device = load_for_serving(tiny_pair[0], "cpu", "float32", 1, "auto")
    return model, meta, device


def _prefill(caches: SessionCaches, sid: str, tokens: list[int], model, device):
    """A fresh session's first call, as the engines make it: returns (tokens restored,
    logits of the last token)."""
    with caches.checkout(sid, 0, token_hash([]), tokens) as entry:
        restored = len(entry.tokens)
        fed = tokens[restored:]
        logits = forward_one(model, Row(tokens=fed, kv=entry.kv, start=restored, keep=1),
                             device)
        entry.tokens.extend(fed)
    return restored, logits


def test_a_session_restored_from_cached_blocks_computes_what_a_full_prefill_does(lean_target):
    model, meta, device = lean_target
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, meta.vocab_size, (70,), generator=gen).tolist()
    first = system + torch.randint(0, meta.vocab_size, (9,), generator=gen).tolist()
    second = system + torch.randint(0, meta.vocab_size, (5,), generator=gen).tolist()

    cold = SessionCaches(16, model.new_cache)  # no prefix cache: every prompt in full
    warm = SessionCaches(16, model.new_cache, prefix=PrefixCache(block=16, max_blocks=100))
    assert _prefill(warm, "a", first, model, device)[0] == 0
    restored, logits = _prefill(warm, "b", second, model, device)
    assert restored == 64  # four whole blocks of the 70 shared tokens
    _, reference = _prefill(cold, "b", second, model, device)
    assert torch.allclose(logits, reference, atol=1e-4, rtol=0)
    assert logits.argmax() == reference.argmax()
    # the restored session goes on like any other: its next step matches the cold one's
    nxt = int(reference.argmax())
    for caches in (warm, cold):
        with caches.checkout("b", len(second), token_hash(second), [nxt]) as entry:
            out = forward_one(model, Row(tokens=[nxt], kv=entry.kv, start=len(second), keep=1),
                              device)
            entry.tokens.append(nxt)
        if caches is warm:
            warm_next = out
    assert torch.allclose(warm_next, out, atol=1e-4, rtol=0)
    # a prompt that is exactly the cached prefix still computes its last token
    assert _prefill(warm, "c", system[:64], model, device)[0] == 48
    s = warm.prefix.stats
    assert (s.lookups, s.hits, s.hit_tokens) == (3, 2, 64 + 48)


def test_committed_tokens_of_a_running_session_are_published_as_they_fill_blocks(lean_target):
    model, meta, device = lean_target
    prefix = PrefixCache(block=4, max_blocks=100)
    caches = SessionCaches(16, model.new_cache, prefix=prefix)
    tokens = list(range(1, 7))
    _prefill(caches, "s", tokens, model, device)
    assert len(prefix) == 1  # 6 tokens: one full block
    # a call whose last 3 tokens are drafts (not committed): only committed ones publish
    with caches.checkout("s", 6, token_hash(tokens), [7, 8, 9, 10], committed=1) as entry:
        forward_one(model, Row(tokens=[7, 8, 9, 10], kv=entry.kv, start=6, keep=1), device)
        entry.tokens.extend([7, 8, 9, 10])
    assert len(prefix) == 1  # 7 committed tokens: still one full block
    with caches.checkout("s", 8, token_hash([*tokens, 7, 8]), [9]) as entry:
        forward_one(model, Row(tokens=[9], kv=entry.kv, start=8, keep=1), device)
        entry.tokens.append(9)
    assert len(prefix) == 2  # 9 committed: the second block [5, 6, 7, 8] is out
    assert block_hashes([*tokens, 7, 8], 4)[1] in prefix


def test_sessions_on_one_cached_prefix_carry_its_block_hashes(lean_target):
    """A session's cache remembers the chained hashes of the prefix blocks it begins with
    (SessionCache.hashes, which its rows carry): the session that computed a prompt and
    published its blocks and one that restored them have the same hashes for the shared
    blocks, so a pass groups their rows (cascade attention), and their own after those; a
    committed tail taken back clears them, and the blocks still committed are named again."""
    from services.batching import shared_prefixes

    model, meta, device = lean_target
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(0, meta.vocab_size, (40,), generator=gen).tolist()
    first = system + torch.randint(0, meta.vocab_size, (9,), generator=gen).tolist()
    second = system + torch.randint(0, meta.vocab_size, (8,), generator=gen).tolist()
    caches = SessionCaches(16, model.new_cache, prefix=PrefixCache(block=8, max_blocks=100))
    _prefill(caches, "a", first, model, device)
    assert _prefill(caches, "b", second, model, device)[0] == 40  # five shared blocks
    a, b = caches._entries["a"], caches._entries["b"]
    assert a.hashes == block_hashes(first, 8) and len(a.hashes) == 6
    assert b.hashes == block_hashes(second, 8) and len(b.hashes) == 6
    assert a.hashes[:5] == b.hashes[:5] and a.hashes[5] != b.hashes[5]
    rows = [Row(tokens=[1], kv=e.kv, start=len(e.tokens), keep=1, chain=e.hashes,
                chain_tokens=e.published) for e in (a, b)]
    assert shared_prefixes(rows, min_tokens=32) == [([0, 1], 40)]
    with caches.checkout("a", 30, token_hash(first[:30]), []) as entry:
        assert entry.hashes == []  # cropped below its published blocks: re-walked
    assert caches._entries["a"].hashes == block_hashes(first[:30], 8)  # three blocks again
