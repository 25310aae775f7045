"""The prompt-lookup (n-gram) drafter: the proposal rule, and serving through the mesh."""

from __future__ import annotations

import grpc
import pytest

from drafter_svc.ngram import propose
from specmesh.client import GatewayClient, build_request
from specmesh.v1 import common_pb2, drafter_pb2_grpc
from tests.conftest import hf_greedy, launch

CASES = [
    ("no repeat", [1, 2, 3, 4], 3, []),
    ("unigram match", [5, 6, 7, 5], 3, [6, 7, 5]),
    ("longest n-gram wins over a later shorter match", [1, 2, 9, 8, 3, 2, 7, 1, 2], 2, [9, 8]),
    ("most recent occurrence of the longest n-gram", [1, 2, 3, 1, 2, 4, 1, 2], 1, [4]),
    ("proposal stops at the end of the sequence", [4, 4], 5, [4]),
    ("k limits the proposal", [1, 2, 3, 4, 5, 1], 2, [2, 3]),
    ("single token has no history", [7], 3, []),
]


@pytest.mark.parametrize("tokens, k, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_propose(tokens, k, expected):
    assert propose(tokens, k, min_n=1, max_n=3) == expected


def test_min_n_excludes_shorter_matches():
    assert propose([5, 6, 7, 5], 3, min_n=2, max_n=3) == []


def _ngram_stats(mesh) -> common_pb2.ReplicaStats:
    address = mesh.proc("ngram-0").address
    with grpc.insecure_channel(address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        assert stub.GetModelInfo(common_pb2.ModelInfoRequest()).kind == "ngram"
        return stub.GetStats(common_pb2.StatsRequest())


@pytest.fixture(scope="module")
def unpipelined(tiny_pair, redis_url, tmp_path_factory):
    """An n-gram drafter behind a gateway with --no-pipeline: one draft call per round, so
    the drafter's counters must equal the request's usage exactly."""
    m = launch(tiny_pair, redis_url, tmp_path_factory.mktemp("ngram-plain"), drafters=0,
               ngram_drafters=1, extra_gateway_args=("--no-pipeline",))
    yield m
    m.stop()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "no-pipeline"])
def test_ngram_drafter_through_the_mesh_is_lossless_and_drafts(pipelined, mesh, unpipelined,
                                                              target_model):
    model, tokenizer = target_model
    m = mesh if pipelined else unpipelined
    prompt = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"
    before = _ngram_stats(m)
    with GatewayClient(m.gateway_address) as client:
        reply = client.generate(build_request(prompt, max_new_tokens=40, drafter="ngram",
                                              num_draft_tokens=4))
    after = _ngram_stats(m)
    assert list(reply.token_ids) == hf_greedy(model, tokenizer(prompt)["input_ids"], 40)
    assert reply.usage.draft_tokens > 0
    drafted = after.draft_tokens - before.draft_tokens
    if pipelined:  # it also drafted ahead for rounds whose guess did not hold
        assert drafted >= reply.usage.draft_tokens
    else:
        assert drafted == reply.usage.draft_tokens
    assert after.calls > before.calls


def test_unknown_drafter_kind_is_invalid(mesh):
    with GatewayClient(mesh.gateway_address) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(build_request("x", drafter="medusa"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "drafter" in err.value.details()
