"""The prefix index in a real Redis and cache-aware routing on a real mesh of two verifiers:
replicas publish the blocks their prefix caches hold, the gateway places a new session on
the one holding most of its prompt, and a stale index (blocks it no longer holds, a replica
restarted with a cold cache) costs only a longer prefill, never a wrong token."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from services.hashing import block_hashes
from services.prefix_cache import PrefixCache
from services.prefix_index import IndexPublisher, cached_tokens, index_key
from specmesh.client import GatewayClient, build_request
from specmesh.v1 import common_pb2, verifier_pb2_grpc
from tests.conftest import hf_greedy, launch
from tests.test_prefix_cache import _publish


def _hex(ids) -> set[bytes]:
    return {f"{h:016x}".encode() for h in ids}


def test_publisher_keeps_the_set_in_step_and_republishes_after_a_failure(own_redis):
    async def scenario():
        client = aioredis.Redis.from_url(own_redis)
        cache = PrefixCache(block=2, max_blocks=3)
        key = index_key("verifier", "10.0.0.1:1")
        await client.sadd(key, "ffffffffffffffff")  # left by an earlier run: must go
        pub = IndexPublisher(client, "verifier", "10.0.0.1:1", cache, ttl_s=5)
        a = _publish(cache, [1, 1, 2, 2])
        await pub.write()
        assert await client.smembers(key) == _hex(a)
        assert 0 < await client.pttl(key) <= 5000
        b = _publish(cache, [3, 3, 4, 4])  # 4 blocks > 3: a's tail goes
        await pub.write()
        assert await client.smembers(key) == _hex([a[0], *b])
        # a write that fails leaves the set unknown: the next one replaces it whole
        broken = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        pub._r = broken
        c = _publish(cache, [5, 5])
        with pytest.raises(RedisConnectionError):
            await pub.write()
        pub._r = client
        await client.sadd(key, "eeeeeeeeeeeeeeee")  # what the lost write cannot account for
        await pub.write()
        assert await client.smembers(key) == _hex(cache.held()) and _hex(c) <= _hex(
            cache.held())
        await pub.stop()
        assert not await client.exists(key)
        await broken.aclose()
        await client.aclose()

    asyncio.run(scenario())


def test_cached_tokens_counts_each_replicas_leading_run_of_blocks(own_redis):
    async def scenario():
        client = aioredis.Redis.from_url(own_redis)
        tokens = list(range(50))
        hashes = block_hashes(tokens, 8)  # 6 blocks
        await client.sadd(index_key("verifier", "a"), *(f"{h:016x}" for h in hashes[:4]))
        # b holds blocks 0, 1 and 3: its run stops at the missing block 2
        await client.sadd(index_key("verifier", "b"),
                          *(f"{h:016x}" for h in (hashes[0], hashes[1], hashes[3])))
        got = await cached_tokens(client, "verifier", tokens,
                                  [("a", 8), ("b", 8), ("c", 8), ("d", 0)])
        assert got == {"a": 32, "b": 16, "c": 0}  # d has no prefix cache: not asked
        # a replica with other blocks is asked with its own block size
        await client.sadd(index_key("verifier", "e"), f"{block_hashes(tokens, 16)[0]:016x}")
        assert (await cached_tokens(client, "verifier", tokens, [("e", 16)])) == {"e": 16}
        await client.aclose()

    asyncio.run(scenario())


def _stats(address: str) -> common_pb2.ReplicaStats:
    with grpc.insecure_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetStats(common_pb2.StatsRequest())


def _until(predicate, timeout: float = 10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_verifiers(tiny_pair, redis_url, tmp_path_factory):
    m = launch(tiny_pair, redis_url, tmp_path_factory.mktemp("prefix-routing-logs"),
               verifiers=2, extra_verifier_args=("--prefix-block", "8"))
    yield m
    m.stop()


SYSTEM = ("# You are a careful assistant. Answer with short Python functions, typed and\n"
          "# documented, and never import anything that is not in the standard library.\n")


def test_new_sessions_follow_the_prefix_index_and_a_stale_one_changes_no_token(
        two_verifiers, target_model):
    model, tokenizer = target_model
    mesh = two_verifiers
    first, second = sorted(mesh.verifier_addresses)  # by load alone, ties go to ``first``
    r = redis.Redis.from_url(mesh.redis_url)
    prompts = [SYSTEM + "def add(a, b):", SYSTEM + "def mul(a, b):", SYSTEM + "class Stack:"]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert len(ids[0]) > 40

    def run(i: int) -> list[int]:
        with GatewayClient(mesh.gateway_address) as client:
            return list(client.generate(build_request(prompts[i], max_new_tokens=8)).token_ids)

    # A stale index: ``second`` is said to hold the prompt's blocks, but it has never seen it.
    # The session goes there (the index is followed), prefills in full, and is right.
    time.sleep(0.5)  # past each replica's first index write, which starts its set afresh
    r.sadd(index_key("verifier", second), *(f"{h:016x}" for h in block_hashes(ids[0], 8)))
    before = {a: _stats(a) for a in (first, second)}
    assert run(0) == hf_greedy(model, ids[0], 8)
    mid = {a: _stats(a) for a in (first, second)}
    assert mid[second].fresh_prefills == before[second].fresh_prefills + 1
    assert mid[second].prefix_hit_tokens == before[second].prefix_hit_tokens  # it held none
    assert mid[first].calls == before[first].calls

    # ``second`` now really holds the shared blocks (and publishes them); the next session
    # with the same system prompt goes there and reuses them.
    shared = block_hashes(ids[1], 8)
    _until(lambda: r.sismember(index_key("verifier", second), f"{shared[-2]:016x}"))
    assert run(1) == hf_greedy(model, ids[1], 8)
    after = _stats(second)
    assert after.prefix_hit_tokens > mid[second].prefix_hit_tokens
    assert after.prefix_hit_tokens - mid[second].prefix_hit_tokens >= 40
    assert _stats(first).calls == before[first].calls

    # A restart empties ``second``'s cache and its index: sessions go by load again (to
    # ``first``), and every token is still the target's.
    mesh.restart(next(p.name for p in mesh.procs if p.address == second))
    _until(lambda: not r.sismember(index_key("verifier", second), f"{shared[0]:016x}"))
    prefills = _stats(first).fresh_prefills
    assert run(2) == hf_greedy(model, ids[2], 8)
    assert _stats(first).fresh_prefills == prefills + 1
    assert _stats(second).calls == 0
