"""The verifier's KV memory budget: idle sessions are evicted least recently used first, and an
evicted session resyncs transparently on its next turn."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.hashing import token_hash
from services.kv_cache import SessionCaches
from specmesh.client import GatewayClient, build_request
from specmesh.v1 import common_pb2, verifier_pb2_grpc
from tests.conftest import hf_greedy, launch


def _use(caches: SessionCaches, sid: str, tokens: list[int]) -> None:
    with caches.checkout(sid, 0, token_hash([])) as entry:
        entry.tokens.extend(tokens)


def test_token_budget_evicts_least_recently_used_first():
    caches = SessionCaches(max_sessions=100, new_kv=lambda: None, max_tokens=25)
    for sid in ("a", "b", "c"):
        _use(caches, sid, [1] * 10)  # 30 tokens > 25: "a" (oldest) goes
    assert "a" not in caches and "b" in caches and "c" in caches
    assert caches.total_tokens() == 20 and caches.evictions == 1
    with caches.checkout("b", 10, token_hash([1] * 10)):
        pass  # "b" is now the most recent
    _use(caches, "d", [2] * 10)
    assert "c" not in caches and "b" in caches and "d" in caches
    caches.release("b")
    assert caches.total_tokens() == 10


def _stats(address: str) -> common_pb2.ReplicaStats:
    with grpc.insecure_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetStats(common_pb2.StatsRequest())


@pytest.fixture(scope="module")
def budget_mesh(tiny_pair, redis_url, tmp_path_factory):
    # The tiny target holds 512 B per token and the tiny drafter, which the verifier holds
    # beside it (launch's local drafts), 256 B: 1 MB is 1,365 tokens of both (2.7 full
    # contexts; the target's alone would have 2,048).
    m = launch(tiny_pair, redis_url, tmp_path_factory.mktemp("budget-logs"),
               extra_verifier_args=("--kv-budget-mb", "1", "--max-sessions", "100000"))
    yield m
    m.stop()


def test_thousand_sessions_stay_under_the_budget_and_evicted_ones_resync(budget_mesh,
                                                                         target_model):
    model, tokenizer = target_model
    verifier = budget_mesh.verifier_addresses[0]
    first_prompt = "def parse(text):\n    return"
    with GatewayClient(budget_mesh.gateway_address) as client:
        first = client.generate(build_request(first_prompt, max_new_tokens=6,
                                              keep_session=True))

        def one(i: int) -> None:
            client.generate(build_request(f"x{i} = {i} * {i}", max_new_tokens=2,
                                          keep_session=True, num_draft_tokens=1))

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(1000)))
        stats = _stats(verifier)
        assert stats.kv_token_budget == 1024 * 1024 // (512 + 256)
        assert 0 < stats.kv_tokens <= stats.kv_token_budget
        assert stats.evictions >= 1000 - 1365 // 8  # each session holds >= 8 tokens
        assert stats.sessions < 1001

        # The first session was evicted long ago: its next turn resyncs and is still right.
        resyncs = stats.resyncs_requested
        follow = client.generate(build_request("\n", session_id=first.session_id,
                                               max_new_tokens=10))
    history = (tokenizer(first_prompt)["input_ids"] + list(first.token_ids)
               + tokenizer("\n", add_special_tokens=False)["input_ids"])
    assert list(follow.token_ids) == hf_greedy(model, history, 10)
    assert _stats(verifier).resyncs_requested == resyncs + 1
