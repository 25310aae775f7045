"""Per-session KV caches with hash-checked handles, bounded and LRU-evicted.

A replica keeps, per session, the token ids whose keys and values its cache
holds. A caller names the prefix it assumes (``base_len`` tokens hashing to
``base_hash``); when the cache holds that prefix (possibly followed by tokens
that were not committed, e.g. rejected drafts) it is cropped to it and reused;
otherwise the caller is told to resync. A handle is never silently wrong.

With a prefix cache (services/prefix_cache.py), a session that starts afresh begins with
the longest prefix of its tokens that the replica's prefix cache holds, and the full blocks
of every session's committed tokens are published to it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from services.errors import Busy, ResyncRequired
from services.hashing import PrefixHasher
from services.prefix_cache import PrefixCache, restore


@dataclass
class SessionCache:
    tokens: list[int]
    kv: Any  # a DynamicCache or SlabCache (services/kv_slab.py); holds len(tokens) positions
    last_used: float = field(default_factory=time.monotonic)
    published: int = 0  # leading tokens whose blocks are in the prefix cache
    hashes: list[int] = field(default_factory=list)  # each of those blocks' chained hash
    # hashes prefixes of ``tokens`` for checkouts' base_hash checks; tokens only change by
    # appending or by ``crop`` (``_restore`` fills a fresh entry's, before any hashing)
    hasher: PrefixHasher = field(default_factory=PrefixHasher, init=False, repr=False,
                                 compare=False)

    @property
    def chain(self) -> int:
        """The hash of the last published block (0: none), which the next one chains to."""
        return self.hashes[-1] if self.hashes else 0

    def unfed(self, base_len: int, new_tokens: Sequence[int]) -> list[int]:
        """What a call that sent ``new_tokens`` after ``base_len`` still has to feed after its
        checkout: all of them, less the prefix a fresh session restored from the prefix
        cache."""
        return list(new_tokens[len(self.tokens) - base_len:])

    def crop(self, length: int) -> None:
        """Keeps the first ``length`` positions (cache.crop(-n) drops the last n)."""
        drop = len(self.tokens) - length
        if drop > 0:
            if self.kv is not None:  # None: a drafter without a model (n-gram)
                self.kv.crop(-drop)
            del self.tokens[length:]
            self.hasher.crop(length)


class SessionCaches:
    """Session id -> SessionCache, least recently used out first when more than
    ``max_sessions`` are held or their tokens exceed ``max_tokens`` (the KV memory budget
    divided by the bytes one token takes; None = no budget). Caches in use are not counted
    and never evicted."""

    def __init__(self, max_sessions: int, new_kv: Callable[[], Any],
                 max_tokens: int | None = None, prefix: PrefixCache | None = None) -> None:
        self._max = max_sessions
        self.prefix = prefix if prefix is not None and prefix.enabled else None
        self._max_tokens = max_tokens
        self._tokens = 0  # tokens held by the entries at rest
        self._new_kv = new_kv
        self._entries: OrderedDict[str, SessionCache] = OrderedDict()
        self._busy: set[str] = set()
        self.evictions = 0
        self.fresh_prefills = 0  # checkouts with base_len 0
        self.resyncs_requested = 0  # checkouts answered ResyncRequired

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    @contextmanager
    def checkout(self, session_id: str, base_len: int, base_hash: int,
                 new_tokens: Sequence[int] = (), committed: int | None = None
                 ) -> Iterator[SessionCache]:
        """Yields the session's cache cropped to ``base_len`` tokens.

        base_len == 0 starts the session afresh: with a prefix cache, from the longest
        cached prefix of ``new_tokens`` (the call's tokens after the base, of which the
        first ``committed`` are committed; default all), leaving at least the last committed
        one to compute. The body then feeds ``entry.unfed(base_len, new_tokens)``.
        Raises ResyncRequired when the cache does not hold the named prefix, Busy when
        another call is using the session. If the body raises, the session's cache is
        dropped (it may be half-written), so the next call resyncs. When it returns, the
        full blocks of the committed tokens go to the prefix cache.
        """
        committed = len(new_tokens) if committed is None else committed
        if session_id in self._busy:
            raise Busy(f"session {session_id!r} is busy with another call on this replica")
        entry = self._entries.get(session_id)
        if base_len == 0:
            self.fresh_prefills += 1
            kv = self._new_kv()
            if getattr(kv, "missed_slot", False) and self._free_a_slot():
                kv = self._new_kv()  # the slot a resting session gave up
            entry = SessionCache(tokens=[], kv=kv)
            if self.prefix is not None and entry.kv is not None:
                self._restore(entry, new_tokens, committed - 1)
        elif entry is None:
            self.resyncs_requested += 1
            raise ResyncRequired(
                f"session {session_id!r} has no cache on this replica: resend the committed "
                "prefix with base_len=0")
        elif len(entry.tokens) < base_len or entry.hasher.hash(entry.tokens, base_len) != base_hash:
            self.resyncs_requested += 1
            raise ResyncRequired(
                f"session {session_id!r}: cache holds {len(entry.tokens)} tokens that do not "
                f"start with the assumed {base_len}-token prefix: resend with base_len=0")
        else:
            entry.crop(base_len)
            if entry.published > base_len:  # a committed tail was taken back: re-walk
                entry.published, entry.hashes = 0, []
        self._remove(session_id)
        self._busy.add(session_id)
        try:
            yield entry
        except BaseException:
            self._busy.discard(session_id)
            raise
        self._busy.discard(session_id)
        if self.prefix is not None and entry.kv is not None:
            self._publish(entry, base_len + committed)
        entry.last_used = time.monotonic()
        self._entries[session_id] = entry
        self._tokens += len(entry.tokens)
        self._evict()

    def _free_a_slot(self) -> bool:
        """The pool of KV slots is full (services/kv_slab.py): the least recently used
        resting session that holds a slot moves its cache out of it, so that sessions being
        served, not sessions at rest, attend over the pool together."""
        for entry in self._entries.values():  # least recently used first
            leave = getattr(entry.kv, "leave_pool", None)
            if leave is not None and leave():
                return True
        return False

    def _restore(self, entry: SessionCache, tokens: Sequence[int], limit: int) -> None:
        hashes, blocks = self.prefix.lookup(tokens, limit)
        if blocks:
            restore(entry.kv, self.prefix.joined(hashes, blocks))
            entry.published = len(blocks) * self.prefix.block
            entry.tokens = list(tokens[:entry.published])  # (a fresh entry: nothing hashed)
            entry.hashes = list(hashes)

    def _publish(self, entry: SessionCache, committed: int) -> None:
        """Publishes the full blocks of the first ``committed`` tokens not yet published."""
        block = self.prefix.block
        end = min(committed, len(entry.tokens))
        while entry.published + block <= end:
            start = entry.published
            entry.hashes.append(self.prefix.insert(entry.chain, entry.tokens[start:start + block],
                                                   entry.kv, start))
            entry.published += block

    def total_tokens(self) -> int:
        return self._tokens

    @property
    def max_tokens(self) -> int | None:
        return self._max_tokens

    def bound_tokens(self, max_tokens: int) -> None:
        """Lowers the token budget (a verifier's local draft model takes its share of
        --kv-budget-mb: verifier_svc/local_drafts.py); sessions at rest past it go."""
        self._max_tokens = min(max_tokens, self._max_tokens or max_tokens)
        self._evict()

    def _remove(self, session_id: str) -> SessionCache | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._tokens -= len(entry.tokens)
        return entry

    def release(self, session_id: str) -> bool:
        return self._remove(session_id) is not None

    def _over(self) -> bool:
        return len(self._entries) > self._max or (
            self._max_tokens is not None and self._tokens > self._max_tokens)

    def _evict(self) -> None:
        while self._entries and self._over():
            self._remove(next(iter(self._entries)))
            self.evictions += 1
