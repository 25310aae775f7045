"""Session handles in Redis: committed tokens, cache holders, a version, a TTL.

Layout (``P`` = key prefix, default ``specmesh:session:``):
- ``P{id}`` hash: version, committed_len, committed_hash, verifier, verifier_len, drafter,
  drafter_len, target, keep, turn (the current request's settings and progress, JSON:
  gateway/turns.py), trace, tenant, writer (request@base length of the
  last commit), created, updated
- ``P{id}:tokens`` string: the committed token ids as little-endian int32, appended per round
- ``P{id}:lease`` string: the request that may advance the session, with a TTL

Every update is a compare-and-set on the version inside a Lua script, so two
gateways can never advance one session at once; the lease makes a second
concurrent request fail fast (ABORTED) instead of racing.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.errors import Busy, NotFound, Unavailable
from services.hashing import PrefixHasher

# A new session's handle and tokens, and with an owner (ARGV[3] not empty) its lease as
# ``acquire`` takes it (ARGV[4] ms): one round trip where a request's start made two.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[3] ~= '' and redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('SET', KEYS[2], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
if ARGV[3] ~= '' then redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4]) end
return 1
"""

_COMMIT = """
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return -2 end
local add = ARGV[3]
local writer = ARGV[4] .. '@' .. (tonumber(ARGV[7]) - string.len(add) / 4)
if v ~= ARGV[1] then
  -- This request's commit from the same version and length may have been applied with its
  -- reply lost (Redis went down): then the version is one ahead, written by that commit, and
  -- the tokens end with the first `done` bytes of `add` (ARGV[7] is the new committed_len);
  -- append only the rest.
  if tonumber(v) ~= tonumber(ARGV[1]) + 1 or redis.call('HGET', KEYS[1], 'writer') ~= writer
  then return -1 end
  local done = 4 * (tonumber(redis.call('HGET', KEYS[1], 'committed_len')) - tonumber(ARGV[7]))
               + string.len(add)
  local tlen = redis.call('STRLEN', KEYS[2])
  if done < 0 or done > string.len(add) or (done > 0 and
      redis.call('GETRANGE', KEYS[2], tlen - done, tlen - 1) ~= string.sub(add, 1, done))
  then return -1 end
  add = string.sub(add, done + 1)
end
local holder = redis.call('GET', KEYS[3])
if holder and holder ~= ARGV[4] then return -3 end
redis.call('SET', KEYS[3], ARGV[4], 'PX', ARGV[5])
if string.len(add) > 0 then redis.call('APPEND', KEYS[2], add) end
local nv = tonumber(v) + 1
redis.call('HSET', KEYS[1], 'version', nv, 'writer', writer, unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return nv
"""

# Commits run by SHA1 in pipelines: redis-py's registered scripts would make each pipeline
# ask SCRIPT EXISTS first, one more round trip every time (a Redis that lost its scripts
# answers NOSCRIPT, and commit_many loads it then).
_COMMIT_SHA = hashlib.sha1(_COMMIT.encode()).hexdigest()
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass
class Cursor:
    """A session's cache in one tier: the replica that holds it and how many of the committed
    tokens it holds (gpt-fast's ``input_pos``, vLLM's ``num_computed_tokens``). A call that
    lands on a replica moves ``replica`` (gateway/rounds.py); a committed round advances
    ``length`` (gateway/session_rounds.py ``SessionRounds.advance``); ``reset`` when no
    replica of the tier holds it any more, so the next call sends the whole prefix."""

    replica: str = ""  # address; "" = none
    length: int = 0

    def advance(self, length: int) -> None:
        """The replica's cache now holds the first ``length`` committed tokens."""
        if length < 0:
            raise ValueError(f"a cache holds 0 or more tokens, not {length}")
        self.length = length

    def reset(self) -> None:
        self.replica, self.length = "", 0


@dataclass
class SessionHandle:
    session_id: str
    version: int
    tokens: list[int]
    verifier: Cursor = field(default_factory=Cursor)
    drafter: Cursor = field(default_factory=Cursor)
    target: str = ""
    keep: bool = False
    turn: dict = field(default_factory=dict)  # the current turn's record (gateway/turns.py)
    last_trace: str = ""  # "traceid-spanid" of the latest turn's span, to link the next one
    tenant: str = ""  # name of the API key that created the session ("" = no authentication)
    # hashes prefixes of ``tokens``, which only ever grow, at a cost independent of their
    # length (each round's cache deltas and commit name one)
    # (not an init field: dataclasses.replace with other tokens gets a hasher of its own)
    hasher: PrefixHasher = field(default_factory=PrefixHasher, init=False, repr=False,
                                 compare=False)

    def prefix_hash(self, n: int) -> int:
        """token_hash(tokens[:n])."""
        return self.hasher.hash(self.tokens, n)


def _pack(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


def _unpack(data: bytes) -> list[int]:
    out = array("i")
    out.frombytes(data)
    return out.tolist()


@dataclass(frozen=True)
class Commit:
    """One session's commit, its arguments taken when it was prepared."""

    handle: SessionHandle
    keys: tuple[str, str, str]
    args: tuple


def _again(exc: Unavailable) -> Unavailable:
    """The same failure for another commit of the pipeline (each caller raises its own)."""
    copy = Unavailable(str(exc))
    copy.__cause__ = exc.__cause__
    return copy


def _settle(h: SessionHandle, result) -> Exception | None:
    """What a commit's script answered, as ``SessionStore.commit`` reports it."""
    if isinstance(result, Exception):
        if isinstance(result, Unavailable):
            return result
        return Unavailable(f"session store (Redis) failed, retry shortly: {result}")
    if result == -2:
        return NotFound(f"session {h.session_id!r} was closed or expired during the request")
    if result == -1:
        return Busy(f"session {h.session_id!r} was advanced by another request")
    if result == -3:
        return Busy(f"session {h.session_id!r}: this request's lease expired and another "
                    "request took the session")
    h.version = int(result)
    return None


class SessionStore:
    def __init__(self, client: aioredis.Redis, ttl_s: int, lease_s: float,
                 prefix: str = "specmesh:session:") -> None:
        self._r = client
        self._ttl = ttl_s
        self._lease_ms = int(lease_s * 1000)
        self._prefix = prefix
        self._create = client.register_script(_CREATE)
        self._release = client.register_script(_RELEASE)

    @classmethod
    def from_url(cls, url: str, ttl_s: int, lease_s: float) -> SessionStore:
        # Explicit limits: while Redis is down a request fails at once (refused) or within
        # about a second (unreachable host) with UNAVAILABLE, instead of hanging. One
        # immediate retry on a fresh connection: after a Redis restart the pooled connections
        # are dead and the first command on each would fail (a commit repeated after a lost
        # reply is safe, see _COMMIT).
        client = aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=1.0,
                                         retry=Retry(NoBackoff(), 1))
        return cls(client, ttl_s, lease_s)

    def _keys(self, session_id: str) -> tuple[str, str, str]:
        base = self._prefix + session_id
        return base, base + ":tokens", base + ":lease"

    @property
    def client(self) -> aioredis.Redis:
        return self._r

    async def ping(self) -> None:
        async with redis_errors():
            await self._r.ping()

    async def create(self, h: SessionHandle, owner: str = "") -> None:
        """Stores a new session; with ``owner``, ``owner`` holds its lease too, as after
        ``acquire`` (Busy if the session exists or another owner holds its lease)."""
        hkey, tkey, lkey = self._keys(h.session_id)
        async with redis_errors():
            ok = await self._create(keys=[hkey, tkey, lkey],
                                    args=[self._ttl, _pack(h.tokens), owner, self._lease_ms,
                                          *self._fields(h, True)])
        if ok == -1:
            raise Busy(f"session {h.session_id!r} is busy with another request: wait for it "
                       "to finish, then retry")
        if not ok:
            raise Busy(f"session {h.session_id!r} already exists")

    async def load(self, session_id: str) -> SessionHandle:
        hkey, tkey, _ = self._keys(session_id)
        async with redis_errors():
            async with self._r.pipeline(transaction=True) as pipe:
                fields, data = await pipe.hgetall(hkey).get(tkey).execute()
        if not fields:
            raise NotFound(f"unknown session_id {session_id!r}: it was closed, expired or never "
                           "existed; start a new session without session_id")
        f = {k.decode(): v.decode() for k, v in fields.items()}
        data = data or b""
        try:
            if len(data) % 4:
                raise ValueError("token bytes are not a multiple of 4")
            tokens = _unpack(data)
            handle = SessionHandle(
                session_id=session_id, version=int(f["version"]), tokens=tokens,
                verifier=Cursor(f.get("verifier", ""), int(f.get("verifier_len", 0))),
                drafter=Cursor(f.get("drafter", ""), int(f.get("drafter_len", 0))),
                target=f.get("target", ""), keep=f.get("keep") == "1",
                turn=json.loads(f.get("turn") or "{}"), last_trace=f.get("trace", ""),
                tenant=f.get("tenant", ""))
            if len(tokens) != int(f["committed_len"]) or handle.prefix_hash(len(tokens)) != int(
                    f["committed_hash"]):  # (its hasher then holds the states the commits use)
                raise ValueError("tokens do not match the committed length and hash")
            return handle
        except (ValueError, KeyError) as exc:
            raise Unavailable(f"session {session_id!r} handle is corrupt in Redis ({exc}); "
                              "close it and start a new session") from exc

    def prepare_commit(self, h: SessionHandle, appended: list[int], owner: str) -> Commit:
        """A commit of ``appended`` (h.tokens must already end with it) and of h's fields as
        they are now, for ``commit_many``."""
        hkey, tkey, lkey = self._keys(h.session_id)
        return Commit(h, (hkey, tkey, lkey), (h.version, self._ttl, _pack(appended), owner,
                                              self._lease_ms, *self._fields(h, False)))

    async def commit(self, h: SessionHandle, appended: list[int], owner: str) -> None:
        """Appends ``appended`` to the committed tokens and stores h's fields, if the
        version is still h.version and no other request holds the lease (``owner``'s lease
        is renewed, or taken again if it expired meanwhile: the version check still stops
        a conflicting writer); bumps h.version. h.tokens must already include ``appended``.
        Repeating a commit whose reply was lost, with more tokens appended or not, is safe."""
        error = (await self.commit_many([self.prepare_commit(h, appended, owner)]))[0]
        if error is not None:
            raise error

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Several sessions' commits, each exactly as ``commit`` makes it, in one pipelined
        round trip (not a transaction: each commit's script is atomic on its own and they
        succeed or fail one by one). Returns per commit None (its handle's version bumped) or
        the error ``commit`` would have raised."""
        results = await self._evalsha_all(commits)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:  # Redis restarted and lost its script cache: load it, run those again
            try:
                async with redis_errors():
                    await self._r.script_load(_COMMIT)
                again = await self._evalsha_all([commits[i] for i in missing])
            except Unavailable as exc:
                again = [_again(exc) for _ in missing]
            for i, result in zip(missing, again, strict=True):
                results[i] = result
        return [_settle(c.handle, result) for c, result in zip(commits, results, strict=True)]

    async def _evalsha_all(self, commits: Sequence[Commit]) -> list:
        """Each commit's script result or its ResponseError (``_settle`` maps them all); all
        Unavailable when Redis is unreachable."""
        try:
            async with redis_errors():
                if len(commits) == 1:  # (a pipeline of one costs ~10% more CPU)
                    c = commits[0]
                    try:
                        return [await self._r.evalsha(_COMMIT_SHA, len(c.keys), *c.keys, *c.args)]
                    except ResponseError as exc:  # as a pipeline returns it (NOSCRIPT included)
                        return [exc]
                async with self._r.pipeline(transaction=False) as pipe:
                    for c in commits:
                        pipe.evalsha(_COMMIT_SHA, len(c.keys), *c.keys, *c.args)
                    return await pipe.execute(raise_on_error=False)
        except Unavailable as exc:
            return [_again(exc) for _ in commits]

    async def acquire(self, session_id: str, owner: str) -> None:
        _, _, lkey = self._keys(session_id)
        async with redis_errors():
            ok = await self._r.set(lkey, owner, nx=True, px=self._lease_ms)
        if not ok:
            raise Busy(f"session {session_id!r} is busy with another request: wait for it to "
                       "finish, then retry")

    async def release(self, session_id: str, owner: str) -> None:
        _, _, lkey = self._keys(session_id)
        async with redis_errors():
            await self._release(keys=[lkey], args=[owner])

    async def delete(self, session_id: str) -> bool:
        async with redis_errors():
            return bool(await self._r.delete(*self._keys(session_id)))

    async def close(self) -> None:
        await self._r.aclose()

    @staticmethod
    def _fields(h: SessionHandle, created: bool) -> list:
        now = f"{time.time():.3f}"
        fields = [  # committed_len first: _COMMIT reads it as ARGV[7]
            "committed_len", len(h.tokens), "committed_hash", h.prefix_hash(len(h.tokens)),
            "verifier", h.verifier.replica, "verifier_len", h.verifier.length,
            "drafter", h.drafter.replica, "drafter_len", h.drafter.length,
            "target", h.target, "keep", int(h.keep), "turn", json.dumps(h.turn),
            "trace", h.last_trace, "updated", now,
        ]
        if created:
            fields += ["version", h.version, "created", now, "tenant", h.tenant]
        return fields


class redis_errors:
    """Turns Redis connection failures into UNAVAILABLE with a clear message."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
            raise Unavailable(f"session store (Redis) is unreachable, retry shortly: {exc}"
                              ) from exc
        if isinstance(exc, RedisError):
            raise Unavailable(f"session store (Redis) failed, retry shortly: {exc}") from exc
        return False
