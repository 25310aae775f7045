"""Replica registry in Redis, for clusters without Kubernetes API access.

Each drafter and verifier started with ``--redis`` keeps a key
``specmesh:replica:{kind}:{address}`` alive with a TTL, holding its load as JSON
(sessions held, queue depth, free KV bytes); a replica that dies simply expires.
Gateways with ``--discovery redis`` list the keys every second and route by the load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

PREFIX = "specmesh:replica:"


REPEAT_LOG_S = 10.0  # while writes keep failing, a reminder this often


class KeptKey:
    """A Redis key a replica writes every ``period_s`` seconds (``write``) from ``start()``
    until ``stop()``, which deletes it. A failed write is logged as ``what`` failing and the
    replica keeps serving; the next write retries. While writes keep failing (Redis down) the
    log says so once, then every ``REPEAT_LOG_S`` seconds, and once when a write works again
    with how many failed and for how long: a prefix index written every 0.25 s logged a line
    per write, four a second per replica, through a Redis restart."""

    what = "write"

    def __init__(self, client: aioredis.Redis, key: str, period_s: float) -> None:
        self._r = client
        self.key = key
        self._period_s = period_s
        self._task: asyncio.Task | None = None

    async def write(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        failures, since, told = 0, 0.0, 0.0
        while True:
            try:
                await self.write()
            except RedisError as exc:
                now = time.monotonic()
                if not failures:
                    since = told = now
                    log.warning("%s failed: %s (retried every %.2f s; while it fails, logged "
                                "every %g s)", self.what, exc, self._period_s, REPEAT_LOG_S)
                elif now - told >= REPEAT_LOG_S:
                    told = now
                    log.warning("%s still failing after %.1f s (%d failures): %s", self.what,
                                now - since, failures + 1, exc)
                failures += 1
            else:
                if failures:
                    log.info("%s works again after %d failures over %.1f s", self.what,
                             failures, time.monotonic() - since)
                    failures = 0
            await asyncio.sleep(self._period_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self._r.delete(self.key)
        except RedisError:
            pass


def replica_key(kind: str, address: str) -> str:
    return f"{PREFIX}{kind}:{address}"


class Registration(KeptKey):
    """Keeps one replica's key alive, with its load, until ``stop()`` (which deletes it)."""

    what = "registry heartbeat"

    def __init__(self, client: aioredis.Redis, kind: str, address: str,
                 load: Callable[[], dict], ttl_s: float = 6.0) -> None:
        super().__init__(client, replica_key(kind, address), ttl_s / 3)
        self._load = load
        self._ttl_ms = int(ttl_s * 1000)

    async def write(self) -> None:
        await self._r.set(self.key, json.dumps(self._load()), px=self._ttl_ms)


async def list_replicas(client: aioredis.Redis, kind: str) -> dict[str, dict]:
    """address -> load of every live replica of ``kind``."""
    keys = [k async for k in client.scan_iter(match=f"{PREFIX}{kind}:*", count=500)]
    if not keys:
        return {}
    values = await client.mget(keys)
    prefix = len(f"{PREFIX}{kind}:")
    out = {}
    for key, value in zip(keys, values, strict=True):
        if value is None:  # expired between SCAN and MGET
            continue
        try:
            out[key.decode()[prefix:]] = json.loads(value)
        except ValueError:
            log.warning("ignoring malformed registry entry %s", key)
    return out
