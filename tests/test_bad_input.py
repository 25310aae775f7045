"""Bad requests to the gateway get a precise status and a message that says what to fix,
and the gateway keeps serving."""

from __future__ import annotations

import grpc
import pytest

from specmesh.client import GatewayClient, build_request
from specmesh.v1 import gateway_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT

CASES = [
    ("empty prompt", build_request(""), INVALID, "prompt"),
    ("negative temperature", build_request("x", temperature=-0.5), INVALID, "temperature"),
    ("nan temperature", build_request("x", temperature=float("nan")), INVALID, "temperature"),
    ("top_p zero", build_request("x", top_p=0.0), INVALID, "top_p"),
    ("top_p above one", build_request("x", top_p=1.5), INVALID, "top_p"),
    ("negative top_k", build_request("x", top_k=-1), INVALID, "top_k"),
    ("zero max_new_tokens", build_request("x", max_new_tokens=0), INVALID, "max_new_tokens"),
    ("negative max_new_tokens", build_request("x", max_new_tokens=-3), INVALID, "max_new_tokens"),
    ("max_new_tokens above cap", build_request("x", max_new_tokens=513), INVALID,
     "max_new_tokens"),
    ("prompt longer than context", build_request("def f(x): return x\n" * 400), INVALID,
     "context"),
    ("prompt ids longer than context", build_request(prompt_token_ids=[5] * 600), INVALID,
     "context"),
    ("prompt and ids", build_request("x", prompt_token_ids=[1, 2]), INVALID, "either"),
    ("out of vocabulary ids", build_request(prompt_token_ids=[1, 99999]), INVALID,
     "vocabulary"),
    ("negative ids", build_request(prompt_token_ids=[1, -4]), INVALID, "vocabulary"),
    ("negative draft tokens", build_request("x", num_draft_tokens=-1), INVALID,
     "num_draft_tokens"),
    ("empty stop string", build_request("x", stop=[""]), INVALID, "stop"),
    ("unknown session", build_request("x", session_id="no-such-session"),
     grpc.StatusCode.NOT_FOUND, "session"),
]


@pytest.fixture(scope="module")
def client(mesh):
    with GatewayClient(mesh.gateway_address) as c:
        yield c


@pytest.mark.parametrize("request_, code, hint", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_precise_status_and_service_keeps_serving(client, request_, code, hint):
    for call in (client.generate, lambda r: list(client.stream(r))):
        with pytest.raises(grpc.RpcError) as err:
            call(request_)
        assert err.value.code() == code
        assert hint in err.value.details()
    good = client.generate(build_request("import os", max_new_tokens=3))
    assert good.usage.completion_tokens >= 1
    assert good.finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED


def test_close_session_without_id_is_invalid(client):
    with pytest.raises(grpc.RpcError) as err:
        client.stub.CloseSession(gateway_pb2.CloseSessionRequest())
    assert err.value.code() == INVALID


def test_overload_answers_resource_exhausted_at_once_and_recovers(mesh):
    """With --max-inflight requests streaming, one more is refused quickly instead of queued;
    when they end, requests are served again."""
    import time

    from tests.conftest import MAX_INFLIGHT

    with GatewayClient(mesh.gateway_address) as client:
        streams = [client.stream(build_request("while True:", max_new_tokens=500,
                                               num_draft_tokens=1))
                   for _ in range(MAX_INFLIGHT)]
        for s in streams:
            next(s)  # each is now in flight
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.generate(build_request("import os", max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in err.value.details()
        assert time.monotonic() - start < 2.0
        for s in streams:
            s.cancel()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.generate(build_request("import os", max_new_tokens=2)).token_ids
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline
                time.sleep(0.05)
