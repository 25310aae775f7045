"""The handle hash of a token prefix (services/hashing.py): ``token_hash`` against the bytes
hashed by hand, and ``PrefixHasher``, which the rounds use to name the prefix they just
extended, giving the same value at every length while its list grows and is cut; then the
two owners that keep one: a replica's session cache (checkouts accept the right prefix and
refuse a stale one after crops) and the gateway's handle (the committed hash in Redis)."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from services.errors import ResyncRequired
from services.hashing import PrefixHasher, token_hash
from services.kv_cache import SessionCaches

STRIDE = PrefixHasher.STRIDE


def by_hand(tokens: list[int]) -> int:
    data = struct.pack(f"<{len(tokens)}i", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def test_token_hash_is_blake2b_64_of_little_endian_int32():
    tokens = [0, 1, -1, 2**31 - 1, -(2**31), 300]
    assert token_hash(tokens) == by_hand(tokens)
    assert token_hash([]) == by_hand([])
    assert token_hash([1, 2]) != token_hash([2, 1])


def test_prefix_hasher_names_every_prefix_as_the_whole_hash_does_while_the_list_grows_and_is_cut():
    rng = random.Random(7)
    tokens: list[int] = []
    hasher = PrefixHasher()
    longest = crossed = 0
    for _ in range(400):  # rounds: append 1-5 tokens, often drop a few (rejected drafts),
        # now and then cut back across saved states
        r = rng.random()
        if tokens and r < 0.22:
            cut = max(0, len(tokens) - (rng.randint(1, 8) if r < 0.2 else
                                        rng.randint(STRIDE // 2, STRIDE + 8)))
            crossed += cut // STRIDE < len(tokens) // STRIDE
            del tokens[cut:]
            hasher.crop(cut)
        tokens += [rng.randrange(-5, 50_000) for _ in range(rng.randint(1, 5))]
        for n in {len(tokens), max(0, len(tokens) - 1), len(tokens) // 2,
                  len(tokens) // STRIDE * STRIDE}:
            assert hasher.hash(tokens, n) == by_hand(tokens[:n]), (len(tokens), n)
        longest = max(longest, len(tokens))
    assert longest > 3 * STRIDE and crossed >= 5  # the walk went past saved states and back


def test_a_cut_hasher_drops_the_states_of_what_was_cut():
    tokens = list(range(3 * STRIDE))
    hasher = PrefixHasher()
    assert hasher.hash(tokens, len(tokens)) == by_hand(tokens)  # states saved to 3 strides
    del tokens[STRIDE + 3:]
    hasher.crop(STRIDE + 3)
    tokens += [-7] * (2 * STRIDE)  # other tokens where states had been saved
    assert hasher.hash(tokens, len(tokens)) == by_hand(tokens)
    assert hasher.hash(tokens, 2 * STRIDE + 1) == by_hand(tokens[:2 * STRIDE + 1])


def test_prefix_hasher_refuses_a_prefix_longer_than_the_list():
    with pytest.raises(ValueError, match="prefix of 4 tokens asked of a list of 3"):
        PrefixHasher().hash([1, 2, 3], 4)


def test_a_replica_checkout_accepts_the_prefix_it_holds_after_crops_and_refuses_a_stale_one():
    """A replica's cache holds the committed tokens and drafts past them; a checkout crops
    it to the caller's base and the next pass appends other tokens: the next checkout must
    check against what the cache holds now, not against states of the cut drafts."""
    caches = SessionCaches(max_sessions=4, new_kv=lambda: None)
    committed = list(range(100, 100 + 2 * STRIDE + 10))
    with caches.checkout("s", 0, 0) as entry:
        entry.tokens.extend(committed)
        entry.tokens.extend([1, 2, 3] * STRIDE)  # drafts well past the next saved states
    base = len(committed) - 20  # the caller had 20 fewer tokens committed than it sent
    with caches.checkout("s", len(entry.tokens), by_hand(entry.tokens)) as entry:
        pass  # the hasher saved states over the drafts
    with caches.checkout("s", base, by_hand(committed[:base])) as entry:
        assert entry.tokens == committed[:base]  # cropped to the caller's base
        entry.tokens.extend([9] * (2 * STRIDE))  # other tokens where the drafts were
    now = committed[:base] + [9] * (2 * STRIDE)
    stale = (committed + [1, 2, 3] * STRIDE)[:len(now)]  # what it held before the crop
    with pytest.raises(ResyncRequired):
        with caches.checkout("s", len(now), by_hand(stale)):
            pass
    with caches.checkout("s", len(now), by_hand(now)) as entry:
        assert entry.tokens == now


def test_a_handle_copied_deep_replaced_or_pickled_hashes_its_own_tokens():
    """Handles are copied (tests of a lost Redis reply deep-copy the gateway's view) and may
    be replaced with other tokens: each copy must hash its own list, never through states
    built from another's."""
    import copy
    import dataclasses
    import pickle

    from services.session_store import SessionHandle

    h = SessionHandle(session_id="s", version=1, tokens=list(range(3 * STRIDE)))
    assert h.prefix_hash(len(h.tokens)) == by_hand(h.tokens)  # states saved to 3 strides
    twin = copy.deepcopy(h)
    twin.tokens += [5, 6]
    assert twin.prefix_hash(len(twin.tokens)) == by_hand(twin.tokens)
    assert h.prefix_hash(len(h.tokens)) == by_hand(h.tokens)
    other = dataclasses.replace(h, tokens=[-1] * (3 * STRIDE))
    assert other.prefix_hash(3 * STRIDE) == by_hand([-1] * (3 * STRIDE))
    revived = pickle.loads(pickle.dumps(h))
    assert revived.prefix_hash(2 * STRIDE + 1) == by_hand(h.tokens[:2 * STRIDE + 1])
