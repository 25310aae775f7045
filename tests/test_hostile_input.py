"""Property-based hostile input: malformed and extreme requests, thrown straight at the gateway
and at the drafter and verifier (which must not trust the gateway). Every answer is OK or a
precise client-error status with a message; no service dies; sessions are not corrupted."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specmesh.client import GatewayClient, build_request
from specmesh.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    gateway_pb2,
    verifier_pb2,
    verifier_pb2_grpc,
)

CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

ints = st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-5, 600))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
token_lists = st.lists(ints, max_size=40)
sessions = st.one_of(st.just(""), st.text(max_size=200), st.uuids().map(str))


def _call(fn, request) -> None:
    try:
        fn(request, timeout=30)
    except grpc.RpcError as err:
        assert err.code() in CLIENT_ERRORS, (err.code(), err.details(), request)
        assert err.details() and len(err.details()) > 10, request


@st.composite
def gateway_requests(draw):
    sampling = gateway_pb2.SamplingParams(stop=draw(st.lists(st.text(max_size=300),
                                                             max_size=20)))
    for name, strategy in (("temperature", floats), ("top_p", floats),
                           ("top_k", st.integers(-10, 2**31 - 1)),
                           ("max_new_tokens", st.integers(-10, 10**6)),
                           ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(sampling, name, draw(strategy))
    return gateway_pb2.GenerateRequest(
        prompt=draw(st.text(max_size=300)), prompt_token_ids=draw(token_lists),
        sampling=sampling,
        speculation=gateway_pb2.SpeculationParams(
            num_draft_tokens=draw(st.integers(-100, 100)), disable=draw(st.booleans()),
            drafter=draw(st.sampled_from(["", "model", "ngram", "bogus"]))),
        session_id=draw(sessions), keep_session=draw(st.booleans()))


def test_gateway_survives_hostile_requests(mesh):
    with GatewayClient(mesh.gateway_address) as client:

        @SETTINGS
        @given(gateway_requests())
        def check(request):
            if request.HasField("sampling") and request.sampling.HasField("max_new_tokens"):
                request.sampling.max_new_tokens = min(request.sampling.max_new_tokens, 4)
            _call(client.stub.Generate, request)

        check()
        ok = client.generate(build_request("import os", max_new_tokens=3))
        assert ok.usage.completion_tokens >= 1


@st.composite
def verify_requests(draw):
    k = draw(st.integers(0, 20))
    return verifier_pb2.VerifyRequest(
        cache=common_pb2.CacheDelta(session_id=draw(sessions),
                                    base_len=draw(st.integers(0, 2**32 - 1)),
                                    base_hash=draw(st.integers(0, 2**64 - 1)),
                                    new_tokens=draw(token_lists)),
        draft_token_ids=draw(st.lists(ints, min_size=k, max_size=k)),
        draft_dists=[common_pb2.SparseDist(token_ids=draw(token_lists),
                                           probs=draw(st.lists(floats, max_size=40)))
                     for _ in range(draw(st.integers(0, k + 1)))],
        warp=common_pb2.WarpParams(temperature=draw(floats),
                                   top_k=draw(st.integers(-5, 2**31 - 1)),
                                   top_p=draw(floats), seed=draw(st.integers(0, 2**64 - 1))))


@st.composite
def draft_requests(draw):
    return drafter_pb2.DraftRequest(
        cache=common_pb2.CacheDelta(session_id=draw(sessions),
                                    base_len=draw(st.integers(0, 2**32 - 1)),
                                    base_hash=draw(st.integers(0, 2**64 - 1)),
                                    new_tokens=draw(token_lists)),
        num_tokens=draw(st.integers(-5, 100)), max_support=draw(st.integers(-5, 1000)),
        warp=common_pb2.WarpParams(temperature=draw(floats),
                                   top_k=draw(st.integers(-5, 2**31 - 1)),
                                   top_p=draw(floats), seed=draw(st.integers(0, 2**64 - 1))))


def test_internal_services_survive_hostile_requests(mesh):
    with grpc.insecure_channel(mesh.verifier_addresses[0]) as vch, \
            grpc.insecure_channel(mesh.drafter_addresses[0]) as dch:
        verifier = verifier_pb2_grpc.VerifierStub(vch)
        drafter = drafter_pb2_grpc.DrafterStub(dch)

        @SETTINGS
        @given(verify_requests(), draft_requests())
        def check(vreq, dreq):
            _call(verifier.Verify, vreq)
            _call(drafter.Draft, dreq)

        check()
        good = common_pb2.CacheDelta(session_id="after-hostile", new_tokens=[1, 5, 9])
        assert verifier.Verify(verifier_pb2.VerifyRequest(cache=good)).cached_len == 3
        assert len(drafter.Draft(drafter_pb2.DraftRequest(cache=good, num_tokens=2,
                                                          max_support=4)).token_ids) == 2
