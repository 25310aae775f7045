"""Gateway authentication: API keys (bearer tokens) and a per-key rate limit.

A client sends ``authorization: Bearer <key>`` (or ``x-api-key: <key>``). The gateway
keeps only SHA-256 digests of the keys (``--api-keys`` file). Each key has its own token
bucket in Redis, so the limit holds across every gateway replica. The key's name becomes
the owner of the sessions it creates: another key cannot continue or close them.
"""

from __future__ import annotations

import hashlib
import math
import secrets

import redis.asyncio as aioredis

from services.config import ApiKey
from services.errors import Overloaded, Unauthenticated
from services.session_store import redis_errors

# Token bucket: KEYS[1] = bucket; ARGV = rate per second, burst. Redis' own clock, so every
# gateway shares one time base. Returns {1, 0} when allowed, {0, ms until a token} when not.
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + (now - ts) * rate / 1000)
local allowed = 0
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait = math.ceil((1 - tokens) * 1000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return {allowed, wait}
"""


def new_key() -> tuple[str, str]:
    """A fresh random API key and its SHA-256 digest (what the --api-keys file stores)."""
    key = "sm-" + secrets.token_urlsafe(32)
    return key, digest(key)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _presented_key(metadata) -> str | None:
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            raise Unauthenticated("the authorization header must be 'Bearer <API key>'")
        if name == "x-api-key" and isinstance(value, str) and value:
            return value
    return None


class Authenticator:
    """Maps request metadata to the name of an API key, or raises UNAUTHENTICATED /
    RESOURCE_EXHAUSTED. With no keys configured every request is anonymous (``None``)."""

    def __init__(self, keys: tuple[ApiKey, ...], client: aioredis.Redis,
                 prefix: str = "specmesh:ratelimit:") -> None:
        self._by_digest = {k.sha256: k for k in keys}
        self._prefix = prefix
        self._take = client.register_script(_TAKE)

    @property
    def enabled(self) -> bool:
        return bool(self._by_digest)

    async def authenticate(self, metadata) -> str | None:
        if not self.enabled:
            return None
        presented = _presented_key(metadata)
        if presented is None:
            raise Unauthenticated("this gateway requires an API key: send the metadata "
                                  "'authorization: Bearer <key>'")
        key = self._by_digest.get(digest(presented))
        if key is None:
            raise Unauthenticated("the API key is not valid: check it, or ask for a new one")
        if key.rate_per_s > 0:
            await self._limit(key)
        return key.name

    async def _limit(self, key: ApiKey) -> None:
        burst = key.burst or math.ceil(key.rate_per_s)  # rate_per_s > 0 here
        async with redis_errors():
            allowed, wait_ms = await self._take(keys=[self._prefix + key.name],
                                                args=[key.rate_per_s, burst])
        if not allowed:
            raise Overloaded(f"API key {key.name!r} is over its rate limit of {key.rate_per_s:g} "
                             f"requests/s (burst {burst}): retry in {int(wait_ms) / 1000:.2f} s")
