"""The replica registry in a real Redis: heartbeats keep a replica listed with its load, a
replica that stops beating expires, a clean stop deregisters at once."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from services.registry import Registration, list_replicas


def test_registration_lifecycle(own_redis):
    async def scenario():
        client = aioredis.Redis.from_url(own_redis)
        load = {"kind": "model", "sessions": 3, "queue_depth": 1, "kv_free_bytes": 10}
        alive = Registration(client, "verifier", "10.0.0.1:50071", lambda: load, ttl_s=0.6)
        crashed = Registration(client, "verifier", "10.0.0.2:50071", lambda: load, ttl_s=0.6)
        drafter = Registration(client, "drafter", "10.0.0.3:50061", lambda: load, ttl_s=0.6)
        for r in (alive, crashed, drafter):
            r.start()
        await asyncio.sleep(0.1)
        listed = await list_replicas(client, "verifier")
        assert listed == {"10.0.0.1:50071": load, "10.0.0.2:50071": load}
        assert set(await list_replicas(client, "drafter")) == {"10.0.0.3:50061"}

        crashed._task.cancel()  # a crash: no more beats, no delete
        start = time.monotonic()
        while "10.0.0.2:50071" in await list_replicas(client, "verifier"):
            assert time.monotonic() - start < 2.0, "a dead replica's key must expire"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.7)  # longer than the TTL: the live one is kept alive by beats
        load["queue_depth"] = 7
        await asyncio.sleep(0.3)
        assert await list_replicas(client, "verifier") == {"10.0.0.1:50071": load}

        await alive.stop()  # a clean stop deregisters at once
        assert await list_replicas(client, "verifier") == {}
        await drafter.stop()
        await client.aclose()

    asyncio.run(scenario())
