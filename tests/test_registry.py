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


def test_a_redis_outage_is_logged_once_then_every_few_seconds_and_when_it_ends(
        own_redis, caplog, monkeypatch):
    """A replica's keys are written every 0.25 s (its prefix index) or 2 s (its heartbeat);
    through a Redis outage each failed write logged a line (a chaos run's drafter: 4 a
    second). Now: the first failure, a reminder every REPEAT_LOG_S, and one line when writes
    work again, with the count. The outage is a client whose Redis is a port nobody listens
    on; the recovery, the same key's writer given the live server's client."""
    import logging
    import socket

    from services import registry

    monkeypatch.setattr(registry, "REPEAT_LOG_S", 0.2)
    # A port held bound but not listening refuses connections for the whole scenario: a port
    # closed again may be taken by another process meanwhile (a full suite's run once got
    # "Connection lost" there, a second kind of failure and a second first-failure line).
    hold = socket.socket()
    hold.bind(("127.0.0.1", 0))
    dead_port = hold.getsockname()[1]

    async def scenario():
        dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{dead_port}/0")
        live = aioredis.Redis.from_url(own_redis)
        kept = Registration(dead, "drafter", "10.0.0.9:50061", lambda: {"sessions": 0},
                            ttl_s=0.06)  # a write every 20 ms
        kept.start()
        await asyncio.sleep(0.5)  # ~25 failed writes
        kept._r = live  # Redis is back
        await asyncio.sleep(0.1)
        assert "10.0.0.9:50061" in await list_replicas(live, "drafter")
        await kept.stop()
        await dead.aclose()
        await live.aclose()

    with hold, caplog.at_level(logging.INFO, logger="services.registry"):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "services.registry"]
    failed = [m for m in lines if m.startswith("registry heartbeat failed")]
    still = [m for m in lines if "still failing" in m]
    back = [m for m in lines if "works again" in m]
    assert len(failed) == 1 and failed[0].endswith("logged every 0.2 s)")
    assert len(back) == 1
    count = int(back[0].split("after ")[1].split(" failures")[0])
    outage = float(back[0].split(" over ")[1].split(" s")[0])  # ~0.5 s, longer on a slow machine
    assert 1 <= len(still) <= outage / 0.2 + 1  # a reminder every 0.2 s, not one per write
    assert count >= 10 and len(lines) < count
