"""Call streams (VerifyStream / DraftStream): the gateway's calls to a replica over one
long-lived gRPC stream, against real replica processes of the tiny pair.

References come from the HF models (greedy continuations) or from the same call made as a
unary RPC; never from the stream code itself.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import grpc
import pytest

from gateway import clients
from gateway.replicas import ReplicaPool
from services.convert import draft_call_to_pb, speculate_call_to_pb, verify_call_to_pb
from services.errors import InvalidArgument, ResyncRequired
from services.hashing import token_hash
from services.health import wait_serving
from services.local_mesh import free_port
from services.messages import CacheDelta, DraftCall, SpeculateCall, VerifyCall
from services.params import SamplingParams
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.conftest import hf_greedy

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def prompt(target_model) -> tuple[list[int], list[int]]:
    """The prompt's ids and the target's own greedy continuation of it (HF generate)."""
    ids = target_model[1](PROMPT)["input_ids"]
    return ids, hf_greedy(target_model[0], ids, 8)


def _pools(mesh, streams: bool) -> tuple[ReplicaPool, ReplicaPool]:
    return (ReplicaPool("verifier", tuple(mesh.verifier_addresses[:1]), 1.0, [],
                        streams=streams),
            ReplicaPool("drafter", tuple(mesh.drafter_addresses[:1]), 1.0, [], streams=streams))


def _one(pool: ReplicaPool):
    return next(iter(pool.replicas.values()))


def _verify_call(session: str, ids: list[int], drafts: list[int], base: int = 0) -> VerifyCall:
    return VerifyCall(cache=CacheDelta(session, base, token_hash(ids[:base]), tuple(ids[base:])),
                      draft_ids=tuple(drafts), q_ids=(), q_probs=(), params=GREEDY, seed=1)


def _draft_call(session: str, ids: list[int]) -> DraftCall:
    return DraftCall(cache=CacheDelta(session, 0, token_hash([]), tuple(ids)), num_tokens=3,
                     params=GREEDY, seed=1, max_support=8)


def _sid() -> str:
    return f"cs-{uuid.uuid4().hex}"


def _private_verifier(model: str, port: int) -> subprocess.Popen:
    """A verifier process of this test's own, SERVING on ``port``."""
    proc = subprocess.Popen([sys.executable, "-m", "specmesh.cli", "verifier", "--host",
                             "127.0.0.1", "--port", str(port), "--model", model, "--threads",
                             "1", "--log-format", "text"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_serving(f"127.0.0.1:{port}", 120, alive=lambda: proc.poll() is None)
    return proc


async def _pool_with_one_stream_call(port: int, ids: list[int], greedy: list[int]):
    """A streaming pool of the verifier on ``port`` and its replica, after one call on the
    stream that accepted all three of the target's own tokens."""
    pool = ReplicaPool("verifier", (f"127.0.0.1:{port}",), 1.0, [], streams=True)
    v = _one(pool)
    r = await clients.verify(v, _verify_call(_sid(), ids, greedy[:3]), 30)
    assert r.num_accepted == 3
    return pool, v


def test_stream_calls_answer_like_the_target_and_like_unary_calls(mesh, prompt):
    ids, greedy = prompt

    async def main():
        verifiers, drafters = _pools(mesh, streams=True)
        unary_v, unary_d = _pools(mesh, streams=False)
        v, d = _one(verifiers), _one(drafters)
        # The target's own continuation as drafts: all accepted, the next greedy token added.
        r = await clients.verify(v, _verify_call(_sid(), ids, greedy[:3]), 30)
        assert (r.num_accepted, r.extra_token) == (3, greedy[3])
        # A draft and a speculation: the same as the unary RPCs on a twin session.
        streamed = await clients.draft(d, _draft_call(_sid(), ids), 30)
        unary = await clients.draft(_one(unary_d), _draft_call(_sid(), ids), 30)
        assert streamed.token_ids == unary.token_ids and len(unary.token_ids) == 3
        spec = []
        for replica in (d, _one(unary_d)):
            session = _sid()
            await clients.draft(replica, _draft_call(session, ids[:-1]), 30)
            ext = [*ids, *greedy[:3]]
            base = len(ids) - 2
            spec.append(await clients.speculate(replica, SpeculateCall(
                cache=CacheDelta(session, base, token_hash(ext[:base]), tuple(ext[base:])),
                num_drafts=3, num_tokens=3, params=GREEDY, seed=2, max_support=8,
                max_branches=4, acceptance=0.8), 30))
        assert [(b.accepted, b.token, b.draft.token_ids) for b in spec[0].branches] == [
            (b.accepted, b.token, b.draft.token_ids) for b in spec[1].branches]
        assert v.stream._call is not None and d.stream._call is not None  # streams were used
        assert unary_v.replicas and _one(unary_v).stream is None
        for pool in (verifiers, drafters, unary_v, unary_d):
            await pool.close()

    asyncio.run(main())


def test_a_failed_call_does_not_end_its_stream(mesh, prompt):
    """INVALID_ARGUMENT and a resync request arrive as the unary RPC's errors would; the
    stream stays open and answers the next call."""
    ids, greedy = prompt

    async def main():
        verifiers, _ = _pools(mesh, streams=True)
        v = _one(verifiers)
        session = _sid()
        await clients.verify(v, _verify_call(session, ids, greedy[:2]), 30)
        stream = v.stream._call
        with pytest.raises(InvalidArgument, match="vocabulary"):
            await clients.verify(v, _verify_call(_sid(), ids, [10 ** 7]), 30)
        with pytest.raises(ResyncRequired):
            await clients.verify(v, _verify_call(_sid(), ids, greedy[:2], base=3), 30)
        r = await clients.verify(v, _verify_call(_sid(), ids, greedy[:3]), 30)
        assert (r.num_accepted, r.extra_token) == (3, greedy[3])
        assert v.stream._call is stream  # the same stream throughout
        await verifiers.close()

    asyncio.run(main())


def test_concurrent_calls_of_many_sessions_share_one_stream(mesh, prompt):
    ids, greedy = prompt

    async def main():
        verifiers, _ = _pools(mesh, streams=True)
        v = _one(verifiers)
        cuts = list(range(4)) * 10  # each session offers the first `cut` greedy tokens
        results = await asyncio.gather(*(
            clients.verify(v, _verify_call(_sid(), ids, greedy[:cut] + [greedy[cut] + 1]), 30)
            for cut in cuts))
        for cut, r in zip(cuts, results, strict=True):
            assert (r.num_accepted, r.extra_token) == (cut, greedy[cut])
        await verifiers.close()

    asyncio.run(main())


def test_a_killed_replica_fails_its_stream_and_a_restarted_one_gets_a_new_stream(
        tiny_pair, prompt):
    """A private verifier: after SIGKILL the next call fails as ReplicaFailed (not after a
    timeout); after a restart on the same port the next call opens a new stream."""
    ids, greedy = prompt
    port = free_port()

    def start():
        return _private_verifier(tiny_pair[0], port)

    proc = start()
    try:
        async def main():
            pool, v = await _pool_with_one_stream_call(port, ids, greedy)
            first = v.stream._call
            proc.kill()
            proc.wait()
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(clients.ReplicaFailed) as failed:
                await clients.verify(v, _verify_call(_sid(), ids, greedy[:3]), 20)
            assert failed.value.code == grpc.StatusCode.UNAVAILABLE
            assert loop.time() - started < 10
            return pool, v, first

        async def after(pool, v, first):
            r = await clients.verify(v, _verify_call(_sid(), ids, greedy[:3]), 30)
            assert (r.num_accepted, r.extra_token) == (3, greedy[3])
            assert v.stream._call is not None and v.stream._call is not first
            await pool.close()

        async def whole():
            pool, v, first = await main()
            nonlocal proc
            proc = await asyncio.to_thread(start)
            await after(pool, v, first)

        asyncio.run(whole())
    finally:
        proc.kill()
        proc.wait()


def test_a_replica_without_call_streams_gets_unary_calls(mesh, prompt):
    """An older replica (here: a proxy serving only the unary Verify of a real verifier)
    answers the stream with UNIMPLEMENTED: the call is retried as a unary RPC, is not
    counted as a failure, and later calls go unary straight away."""
    ids, greedy = prompt

    async def main():
        upstream = grpc.aio.insecure_channel(mesh.verifier_addresses[0])
        forward = upstream.unary_unary("/specmesh.v1.Verifier/Verify")  # bytes in, bytes out
        unary_calls = []

        async def verify(request: bytes, context) -> bytes:
            unary_calls.append(len(request))
            return await forward(request)

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "specmesh.v1.Verifier", {"Verify": grpc.unary_unary_rpc_method_handler(verify)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = ReplicaPool("verifier", (f"127.0.0.1:{port}",), 1.0, [], streams=True)
        v = _one(pool)
        for _ in range(2):
            r = await clients.verify(v, _verify_call(_sid(), ids, greedy[:3]), 30)
            assert (r.num_accepted, r.extra_token) == (3, greedy[3])
        assert v.stream.supported is False and len(unary_calls) == 2 and v.failures == 0
        await pool.close()
        await server.stop(None)
        await upstream.close()

    asyncio.run(main())


def test_a_stopping_replica_refuses_calls_on_open_streams_at_once(tiny_pair, prompt):
    """SIGTERM starts a replica's graceful stop (5 s of grace for running calls). A call
    that arrives on an already open stream after that is refused with UNAVAILABLE, as a new
    unary call would be, so the gateway goes to another replica now instead of being served
    by this one until the grace period ends."""
    ids, greedy = prompt
    port = free_port()
    proc = _private_verifier(tiny_pair[0], port)
    try:
        async def main():
            pool, v = await _pool_with_one_stream_call(port, ids, greedy)
            stream = v.stream._call
            proc.terminate()
            await asyncio.sleep(0.5)  # the signal is handled; the grace period has begun
            assert proc.poll() is None  # still draining: the open stream keeps it up
            with pytest.raises(clients.ReplicaFailed) as refused:
                await clients.verify(v, _verify_call(_sid(), ids, greedy[:3]), 30)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in str(refused.value)
            assert v.stream._call is stream  # it came back on the open stream
            await pool.close()

        asyncio.run(main())
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


async def _stats(address: str, stub_cls) -> common_pb2.ReplicaStats:
    async with grpc.aio.insecure_channel(address) as channel:
        return await stub_cls(channel).GetStats(common_pb2.StatsRequest(), timeout=10)


def test_a_step_of_many_sessions_is_one_forward_pass_and_each_call_keeps_its_outcome(
        mesh, prompt):
    """Step batching against a real verifier: a wave of Verify calls goes as one
    VerifyBatch, runs as one forward pass, and each call gets what it would get alone (the
    target's greedy tokens); a bad call and a stale prefix in the same step fail alone."""
    ids, greedy = prompt
    address = mesh.verifier_addresses[0]

    async def main():
        pool = ReplicaPool("verifier", (address,), 1.0, [], streams=True, steps=True)
        v = _one(pool)
        cuts = [0, 1, 2, 3, 0, 1, 2, 3]  # each session offers the first `cut` greedy tokens
        before = await _stats(address, verifier_pb2_grpc.VerifierStub)
        results = await asyncio.gather(
            *(clients.verify(v, _verify_call(_sid(), ids, greedy[:cut] + [greedy[cut] + 1]),
                             30) for cut in cuts),
            clients.verify(v, _verify_call(_sid(), ids, [10 ** 7]), 30),
            clients.verify(v, _verify_call(_sid(), ids, greedy[:2], base=3), 30),
            return_exceptions=True)
        after = await _stats(address, verifier_pb2_grpc.VerifierStub)
        for cut, r in zip(cuts, results, strict=False):
            assert (r.num_accepted, r.extra_token) == (cut, greedy[cut])
        assert isinstance(results[8], InvalidArgument) and "vocabulary" in str(results[8])
        assert isinstance(results[9], ResyncRequired)
        assert v.steps["Verify"].steps == 1 and v.steps["Verify"].largest == 10
        assert after.forward_passes - before.forward_passes == 1  # one pass for the 8
        assert after.batched_calls - before.batched_calls == 8
        await pool.close()

    asyncio.run(main())


def test_a_step_of_draft_calls_runs_its_k_steps_together_and_drafts_as_alone(mesh, prompt):
    ids, _ = prompt
    address = mesh.drafter_addresses[0]

    async def main():
        pool = ReplicaPool("drafter", (address,), 1.0, [], streams=True, steps=True)
        unary = ReplicaPool("drafter", (address,), 1.0, [], streams=False)
        d = _one(pool)
        alone = await clients.draft(_one(unary), _draft_call(_sid(), ids), 30)
        before = await _stats(address, drafter_pb2_grpc.DrafterStub)
        results = await asyncio.gather(*(clients.draft(d, _draft_call(_sid(), ids), 30)
                                         for _ in range(5)))
        after = await _stats(address, drafter_pb2_grpc.DrafterStub)
        assert [r.token_ids for r in results] == [alone.token_ids] * 5
        assert len(alone.token_ids) == 3 and d.steps["Draft"].largest == 5
        assert after.forward_passes - before.forward_passes == 3  # k = 3 passes for the 5
        await pool.close()
        await unary.close()

    asyncio.run(main())


@pytest.mark.parametrize("calls, message", [(0, "at least one call"),
                                            (257, "at most 256 calls")])
def test_a_batch_with_no_calls_or_too_many_is_refused_with_what_to_fix(mesh, prompt, calls,
                                                                        message):
    ids, _ = prompt

    async def main():
        async with grpc.aio.insecure_channel(mesh.verifier_addresses[0]) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            request = verifier_pb2.VerifyBatchRequest(calls=[
                verifier_pb2.VerifyStreamRequest(id=i, call=verify_call_to_pb(
                    _verify_call(_sid(), ids, []))) for i in range(calls)])
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.VerifyBatch(request, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in refused.value.details()

    asyncio.run(main())


def test_a_draft_batch_mixing_drafts_a_speculation_and_an_empty_call(mesh, prompt):
    """A DraftBatch the drafter splits: its Draft calls go together (draft_many), its
    Speculate call and a call with neither field are answered one by one; each answer is
    what its unary RPC gives, under its own id."""
    ids, greedy = prompt

    async def main():
        async with grpc.aio.insecure_channel(mesh.drafter_addresses[0]) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            alone = await stub.Draft(draft_call_to_pb(_draft_call(_sid(), ids)), timeout=30)
            session = _sid()
            await stub.Draft(draft_call_to_pb(_draft_call(session, ids[:-1])), timeout=30)
            ext = [*ids, *greedy[:3]]
            base = len(ids) - 2
            speculate = speculate_call_to_pb(SpeculateCall(
                cache=CacheDelta(session, base, token_hash(ext[:base]), tuple(ext[base:])),
                num_drafts=3, num_tokens=3, params=GREEDY, seed=2, max_support=8,
                max_branches=4, acceptance=0.8))
            calls = [drafter_pb2.DraftStreamRequest(id=7, draft=draft_call_to_pb(
                         _draft_call(_sid(), ids))),
                     drafter_pb2.DraftStreamRequest(id=3, speculate=speculate),
                     drafter_pb2.DraftStreamRequest(id=5),
                     drafter_pb2.DraftStreamRequest(id=1, draft=draft_call_to_pb(
                         _draft_call(_sid(), ids)))]
            batch = await stub.DraftBatch(drafter_pb2.DraftBatchRequest(calls=calls),
                                          timeout=30)
            return alone, {o.id: o for o in batch.outcomes}

    alone, by_id = asyncio.run(main())
    assert sorted(by_id) == [1, 3, 5, 7]
    for i in (1, 7):
        assert by_id[i].WhichOneof("outcome") == "draft"
        assert list(by_id[i].draft.token_ids) == list(alone.token_ids)
    assert by_id[3].WhichOneof("outcome") == "speculate" and by_id[3].speculate.branches
    assert by_id[5].WhichOneof("outcome") == "error"
    assert by_id[5].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "draft or a speculate call" in by_id[5].error.message
