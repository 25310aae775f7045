"""SessionStore against a real redis-server: round trips, compare-and-set commits,
leases, TTLs, corruption and an unreachable Redis."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from services.errors import Busy, NotFound, Unavailable
from services.hashing import token_hash
from services.session_store import Cursor, SessionHandle, SessionStore
from tests.conftest import start_redis

TTL_S = 60
LEASE_S = 5.0


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    proc, url = start_redis(tmp_path_factory.mktemp("store-redis"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def prefix() -> str:
    return f"test-store:{uuid.uuid4().hex}:"


@pytest.fixture
def sync(redis_server):
    """A plain client to inspect and tamper with the raw keys."""
    client = redis.Redis.from_url(redis_server, socket_timeout=5)
    yield client
    client.close()


def run(url: str, prefix: str, body, ttl_s: int = TTL_S, lease_s: float = LEASE_S):
    """Runs ``await body(store)`` on a fresh event loop with a fresh client."""

    async def main():
        client = aioredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        store = SessionStore(client, ttl_s, lease_s, prefix=prefix)
        try:
            return await body(store)
        finally:
            await store.close()

    return asyncio.run(main())


def handle(session_id: str, tokens=(1, 2, 3), **kw) -> SessionHandle:
    return SessionHandle(session_id=session_id, version=1, tokens=list(tokens), **kw)


def packed(tokens) -> bytes:
    return b"".join(struct.pack("<i", t) for t in tokens)


def new_id() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- create / load


def test_create_then_load_round_trips_everything(redis_server, prefix, sync):
    sid = new_id()
    tokens = [0, 1, 511, 2**31 - 1, 7, 7, 300]
    original = handle(sid, tokens, verifier=Cursor("127.0.0.1:5001", 6),
                      drafter=Cursor("127.0.0.1:5002", 5), target="fp-target", keep=True,
                      turn={"temperature": 0.7, "top_k": 40, "seed": 12345,
                                "stop": ["\n\n", "é"]})

    async def body(store):
        await store.create(original)
        return await store.load(sid)

    loaded = run(redis_server, prefix, body)
    assert loaded == original
    assert loaded is not original
    # Raw layout: little-endian int32 tokens, length and hash of the committed prefix.
    assert sync.get(prefix + sid + ":tokens") == packed(tokens)
    fields = {k.decode(): v.decode() for k, v in sync.hgetall(prefix + sid).items()}
    assert int(fields["committed_len"]) == len(tokens)
    assert int(fields["committed_hash"]) == token_hash(tokens)
    assert int(fields["version"]) == 1
    # the cursors keep their Redis fields (a handle written before cursors still loads)
    assert (fields["verifier"], fields["verifier_len"]) == ("127.0.0.1:5001", "6")
    assert (fields["drafter"], fields["drafter_len"]) == ("127.0.0.1:5002", "5")


def test_create_defaults_and_empty_tokens(redis_server, prefix):
    sid = new_id()

    async def body(store):
        await store.create(SessionHandle(session_id=sid, version=1, tokens=[]))
        return await store.load(sid)

    loaded = run(redis_server, prefix, body)
    assert loaded.tokens == [] and loaded.keep is False and loaded.turn == {}
    assert loaded.verifier == Cursor() == loaded.drafter


def test_create_existing_session_is_refused_and_keeps_the_original(redis_server, prefix):
    sid = new_id()

    async def body(store):
        await store.create(handle(sid, [1, 2, 3], target="a"))
        with pytest.raises(Busy):
            await store.create(handle(sid, [9, 9], target="b"))
        return await store.load(sid)

    loaded = run(redis_server, prefix, body)
    assert loaded.tokens == [1, 2, 3] and loaded.target == "a"


def test_create_with_an_owner_takes_the_lease_in_the_same_call(redis_server, prefix):
    """``create(h, owner)``: the session is stored and ``owner`` holds its lease, as after
    ``acquire``: another owner is refused until it is released. A session whose lease is held
    (a stale lease left behind) is not created over it, and nothing of it is written."""
    sid, other = new_id(), new_id()

    async def body(store):
        await store.create(handle(sid, [1, 2]), "owner-1")
        with pytest.raises(Busy, match="busy"):
            await store.acquire(sid, "owner-2")
        await store.release(sid, "owner-1")
        await store.acquire(sid, "owner-2")
        await store.acquire(other, "stale")
        with pytest.raises(Busy, match="busy"):
            await store.create(handle(other, [3]), "owner-3")
        with pytest.raises(NotFound):
            await store.load(other)
        return await store.load(sid)

    assert run(redis_server, prefix, body).tokens == [1, 2]


def test_load_unknown_session_is_not_found(redis_server, prefix):
    async def body(store):
        with pytest.raises(NotFound) as err:
            await store.load("never-created")
        return str(err.value)

    assert "never-created" in run(redis_server, prefix, body)


def test_prefix_isolates_stores(redis_server, prefix):
    sid = new_id()

    async def create(store):
        await store.create(handle(sid))

    async def load(store):
        with pytest.raises(NotFound):
            await store.load(sid)

    run(redis_server, prefix, create)
    run(redis_server, prefix + "other:", load)


# --------------------------------------------------------------------------- commit


def test_commit_appends_tokens_and_bumps_version(redis_server, prefix, sync):
    sid = new_id()

    async def body(store):
        h = handle(sid, [10, 11, 12])
        await store.create(h)
        await store.acquire(sid, "owner-1")
        h.tokens += [13, 14]
        h.verifier.length = 4
        h.drafter.replica = "d:1"
        await store.commit(h, [13, 14], "owner-1")
        assert h.version == 2
        first = await store.load(sid)
        h.tokens += [15]
        await store.commit(h, [15], "owner-1")
        assert h.version == 3
        second = await store.load(sid)
        await store.commit(h, [], "owner-1")  # fields only
        third = await store.load(sid)
        return first, second, third

    first, second, third = run(redis_server, prefix, body)
    assert first.tokens == [10, 11, 12, 13, 14] and first.version == 2
    assert first.verifier == Cursor("", 4) and first.drafter == Cursor("d:1", 0)
    assert second.tokens == [10, 11, 12, 13, 14, 15] and second.version == 3
    assert third.tokens == second.tokens and third.version == 4
    fields = {k.decode(): v.decode() for k, v in sync.hgetall(prefix + sid).items()}
    assert int(fields["committed_len"]) == 6
    assert int(fields["committed_hash"]) == token_hash([10, 11, 12, 13, 14, 15])
    assert sync.get(prefix + sid + ":tokens") == packed([10, 11, 12, 13, 14, 15])


def test_commits_round_after_round_keep_the_hash_of_every_committed_token(redis_server, prefix,
                                                                          sync):
    """The handle hashes its growing tokens incrementally (services/hashing.py
    PrefixHasher): over rounds that cross its saved states, and after a resume whose hasher
    starts from the loaded tokens, Redis holds the hash of all of them."""
    sid = new_id()

    def stored_hash() -> int:
        return int(sync.hget(prefix + sid, "committed_hash"))

    async def body(store):
        h = handle(sid, list(range(50)))
        await store.create(h)
        await store.acquire(sid, "owner-1")
        seen = []
        for i in range(40):  # 1-4 tokens a round: 50 -> 150 tokens
            new = [1000 + i] * (1 + i % 4)
            h.tokens += new
            await store.commit(h, new, "owner-1")
            seen.append(stored_hash() == token_hash(h.tokens))
        resumed = await store.load(sid)
        resumed.tokens += [7, 8, 9]
        await store.commit(resumed, [7, 8, 9], "owner-1")
        return h.tokens, seen, await store.load(sid)

    tokens, seen, last = run(redis_server, prefix, body)
    assert len(tokens) == 150 and all(seen)
    assert last.tokens == tokens + [7, 8, 9]
    assert stored_hash() == token_hash(tokens + [7, 8, 9])


def _snapshot(sync, prefix, sid):
    return (sync.hgetall(prefix + sid), sync.get(prefix + sid + ":tokens"))


def test_commit_with_stale_version_is_busy_and_changes_nothing(redis_server, prefix, sync):
    sid = new_id()

    async def setup(store):
        await store.create(handle(sid, [1, 2]))
        await store.acquire(sid, "me")
        a = await store.load(sid)
        b = await store.load(sid)
        a.tokens += [3]
        await store.commit(a, [3], "me")
        return b

    stale = run(redis_server, prefix, setup)
    before = _snapshot(sync, prefix, sid)

    async def body(store):
        stale.tokens += [99, 98]
        stale.target = "changed"
        with pytest.raises(Busy):
            await store.commit(stale, [99, 98], "me")
        return await store.load(sid)

    loaded = run(redis_server, prefix, body)
    assert stale.version == 1, "a refused commit must not bump the caller's version"
    assert _snapshot(sync, prefix, sid) == before
    assert loaded.tokens == [1, 2, 3] and loaded.version == 2 and loaded.target == ""


def test_commit_many_gives_each_commit_its_own_outcome(redis_server, prefix, sync):
    """One pipeline, three sessions: the current one advances, the stale one is refused and
    the closed one is not found, each as its own commit would be, and the refusals change
    nothing in Redis."""
    ok_id, stale_id, gone_id = new_id(), new_id(), new_id()

    async def body(store):
        handles = {}
        for sid in (ok_id, stale_id, gone_id):
            await store.create(handle(sid, [1, 2]))
            await store.acquire(sid, "me")
            handles[sid] = await store.load(sid)
        other = await store.load(stale_id)
        other.tokens += [7]
        await store.commit(other, [7], "me")  # the stale handle is now one version behind
        await store.delete(gone_id)
        before = _snapshot(sync, prefix, stale_id)
        for h in handles.values():
            h.tokens += [3, 4]
        errors = await store.commit_many([store.prepare_commit(h, [3, 4], "me")
                                          for h in handles.values()])
        return handles, errors, before, await store.load(ok_id)

    handles, errors, before, loaded = run(redis_server, prefix, body)
    assert errors[0] is None and isinstance(errors[1], Busy) and isinstance(errors[2], NotFound)
    assert handles[ok_id].version == 2 and loaded.version == 2
    assert loaded.tokens == [1, 2, 3, 4]
    assert handles[stale_id].version == 1, "a refused commit must not bump the caller's version"
    assert _snapshot(sync, prefix, stale_id) == before
    assert not sync.exists(prefix + gone_id)


def test_commit_many_loads_the_script_again_after_redis_lost_it(redis_server, prefix, sync):
    """A Redis that restarted without its script cache answers NOSCRIPT: the commits are
    run again after loading it, and each session's tokens are appended exactly once."""
    ids = [new_id(), new_id()]

    async def body(store):
        handles = []
        for sid in ids:
            await store.create(handle(sid, [5]))
            await store.acquire(sid, "me")
            handles.append(await store.load(sid))
        sync.script_flush()
        for h in handles:
            h.tokens += [6, 7]
        errors = await store.commit_many([store.prepare_commit(h, [6, 7], "me")
                                          for h in handles])
        return errors, [h.version for h in handles]

    errors, versions = run(redis_server, prefix, body)
    assert errors == [None, None] and versions == [2, 2]
    for sid in ids:
        assert sync.get(prefix + sid + ":tokens") == packed([5, 6, 7])


def test_commit_while_another_request_holds_the_lease_is_busy_and_changes_nothing(
        redis_server, prefix, sync):
    sid = new_id()

    async def setup(store):
        await store.create(handle(sid, [5, 6]))
        await store.acquire(sid, "holder")

    run(redis_server, prefix, setup)
    before = _snapshot(sync, prefix, sid)

    async def body(store):
        h = await store.load(sid)
        h.tokens += [7]
        with pytest.raises(Busy):
            await store.commit(h, [7], "intruder")
        return await store.load(sid)

    loaded = run(redis_server, prefix, body)
    assert loaded.tokens == [5, 6] and loaded.version == 1
    assert _snapshot(sync, prefix, sid) == before
    assert sync.get(prefix + sid + ":lease") == b"holder"


def test_commit_after_the_own_lease_expired_takes_it_again(redis_server, prefix, sync):
    """A round longer than the lease must not fail when nobody else took the session; the
    version check still guards against a conflicting writer."""
    sid = new_id()

    async def body(store):
        h = handle(sid, [5, 6])
        await store.create(h)
        await store.acquire(sid, "me")
        sync.delete(prefix + sid + ":lease")  # the lease ran out during a long round
        h.tokens += [7]
        await store.commit(h, [7], "me")
        stale = await store.load(sid)
        stale.version -= 1
        stale.tokens += [8]
        with pytest.raises(Busy):
            await store.commit(stale, [8], "me")
        return await store.load(sid)

    loaded = run(redis_server, prefix, body)
    assert loaded.tokens == [5, 6, 7] and loaded.version == 2
    assert sync.get(prefix + sid + ":lease") == b"me"


def test_commit_of_deleted_session_is_not_found(redis_server, prefix):
    sid = new_id()

    async def body(store):
        h = handle(sid, [1])
        await store.create(h)
        await store.acquire(sid, "me")
        assert await store.delete(sid) is True
        assert await store.delete(sid) is False
        h.tokens += [2]
        with pytest.raises(NotFound):
            await store.commit(h, [2], "me")
        with pytest.raises(NotFound):
            await store.load(sid)

    run(redis_server, prefix, body)


# --------------------------------------------------------------------------- leases


def test_acquire_twice_is_busy(redis_server, prefix, sync):
    sid = new_id()

    async def body(store):
        await store.acquire(sid, "first")
        with pytest.raises(Busy):
            await store.acquire(sid, "second")
        with pytest.raises(Busy):
            await store.acquire(sid, "first")  # not re-entrant either

    run(redis_server, prefix, body)
    assert sync.get(prefix + sid + ":lease") == b"first"


def test_release_by_non_owner_does_not_release(redis_server, prefix, sync):
    sid = new_id()

    async def body(store):
        await store.acquire(sid, "owner")
        await store.release(sid, "other")
        with pytest.raises(Busy):
            await store.acquire(sid, "other")
        await store.release(sid, "owner")
        await store.acquire(sid, "other")  # now free

    run(redis_server, prefix, body)
    assert sync.get(prefix + sid + ":lease") == b"other"


def test_lease_expires_and_another_owner_takes_over(redis_server, prefix):
    sid = new_id()

    async def body(store):
        h = handle(sid, [1, 2])
        await store.create(h)
        await store.acquire(sid, "slow")
        with pytest.raises(Busy):
            await store.acquire(sid, "fast")
        await asyncio.sleep(0.5)
        await store.acquire(sid, "fast")  # the lease of "slow" has expired
        h.tokens += [3]
        with pytest.raises(Busy):
            await store.commit(h, [3], "slow")
        fresh = await store.load(sid)
        fresh.tokens += [4]
        await store.commit(fresh, [4], "fast")
        return await store.load(sid)

    loaded = run(redis_server, prefix, body, lease_s=0.3)
    assert loaded.tokens == [1, 2, 4] and loaded.version == 2


def test_commit_renews_the_lease(redis_server, prefix, sync):
    sid = new_id()

    async def body(store):
        h = handle(sid, [1])
        await store.create(h)
        await store.acquire(sid, "me")
        for t in range(2, 6):  # 4 commits spaced over ~1.0 s > lease of 0.6 s
            await asyncio.sleep(0.25)
            h.tokens.append(t)
            await store.commit(h, [t], "me")
        with pytest.raises(Busy):
            await store.acquire(sid, "other")
        return await store.load(sid)

    loaded = run(redis_server, prefix, body, lease_s=0.6)
    assert loaded.tokens == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------- TTLs


def test_keys_have_a_ttl_within_the_configured_one(redis_server, prefix, sync):
    sid = new_id()
    ttl = 30

    async def create(store):
        await store.create(handle(sid, [1, 2]))
        await store.acquire(sid, "me")

    run(redis_server, prefix, create, ttl_s=ttl, lease_s=2.0)
    for key in (prefix + sid, prefix + sid + ":tokens"):
        assert 0 < sync.ttl(key) <= ttl, key
    assert 0 < sync.pttl(prefix + sid + ":lease") <= 2000

    # A commit refreshes the TTL of both keys (a live session does not expire).
    sync.expire(prefix + sid, 3)
    sync.expire(prefix + sid + ":tokens", 3)

    async def commit(store):
        h = await store.load(sid)
        h.tokens.append(3)
        await store.commit(h, [3], "me")

    run(redis_server, prefix, commit, ttl_s=ttl, lease_s=2.0)
    for key in (prefix + sid, prefix + sid + ":tokens"):
        assert 3 < sync.ttl(key) <= ttl, key


def test_session_expires_after_ttl(redis_server, prefix):
    sid = new_id()

    async def body(store):
        await store.create(handle(sid))
        await store.load(sid)
        await asyncio.sleep(1.3)
        with pytest.raises(NotFound):
            await store.load(sid)

    run(redis_server, prefix, body, ttl_s=1)


# --------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("corrupt", [
    "truncated", "odd_length", "extra_token",
    "other_content", "missing"])
def test_corrupted_tokens_make_load_unavailable(redis_server, prefix, sync, corrupt):
    sid = new_id()
    tokens = [3, 1, 4, 1, 5, 9]

    async def create(store):
        await store.create(handle(sid, tokens))

    run(redis_server, prefix, create)
    key = prefix + sid + ":tokens"
    data = packed(tokens)
    if corrupt == "truncated":
        sync.set(key, data[:-4])
    elif corrupt == "odd_length":
        sync.set(key, data[:-1])
    elif corrupt == "extra_token":
        sync.set(key, data + packed([2]))
    elif corrupt == "other_content":
        sync.set(key, packed([3, 1, 4, 1, 5, 8]))
    else:
        sync.delete(key)

    async def load(store):
        with pytest.raises(Unavailable) as err:
            await store.load(sid)
        return str(err.value)

    assert sid in run(redis_server, prefix, load)


# --------------------------------------------------------------------------- Redis down


async def _commit_many_raising(store, h):
    """commit_many reports errors per commit: every commit of a pipeline to a dead Redis
    fails on its own (distinct errors), raised here for the test's table."""
    errors = await store.commit_many([store.prepare_commit(h, [4], "me"),
                                      store.prepare_commit(h, [4], "me")])
    assert all(isinstance(e, Unavailable) for e in errors) and errors[0] is not errors[1]
    raise errors[0]


def test_stopped_redis_makes_every_operation_unavailable(tmp_path):
    proc, url = start_redis(tmp_path)
    prefix = "down:"
    sid = new_id()
    try:
        async def create(store):
            await store.create(handle(sid))
            await store.acquire(sid, "me")
            await store.ping()

        run(url, prefix, create)
    finally:
        proc.terminate()
        proc.wait(10)

    async def body(store):
        h = handle(sid, [1, 2, 3, 4])
        operations = {
            "ping": store.ping(),
            "create": store.create(handle(new_id())),
            "load": store.load(sid),
            "commit": store.commit(h, [4], "me"),
            "commit_many": _commit_many_raising(store, h),
            "acquire": store.acquire(sid, "other"),
            "release": store.release(sid, "me"),
            "delete": store.delete(sid),
        }
        messages = {}
        for name, op in operations.items():
            start = time.monotonic()
            with pytest.raises(Unavailable) as err:
                await op
            assert time.monotonic() - start < 10, f"{name} hung on a dead Redis"
            messages[name] = str(err.value)
        return messages

    messages = run(url, prefix, body)
    for name, message in messages.items():
        assert "redis" in message.lower(), (name, message)

