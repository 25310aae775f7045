"""A gateway killed mid-stream: the client picks the session up on another gateway with
``resume_from``; the committed tokens come from Redis and no token is lost or repeated."""

from __future__ import annotations

import time

import grpc
import pytest

from services.local_mesh import _spawn, _wait, free_port
from specmesh.client import GatewayClient, build_request
from tests.conftest import hf_greedy, launch


@pytest.fixture(scope="module")
def two_gateways(tiny_pair, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("failover-gw-logs")
    m = launch(tiny_pair, redis_url, logs)
    first = m.proc("gateway")
    argv = list(first.argv)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    second = _spawn("gateway-2", argv, logs)
    second.address = f"127.0.0.1:{port}"
    m.procs.append(second)
    _wait(second, 120)
    yield m, first, second
    m.stop()


def test_stream_resumes_on_another_gateway_after_a_crash(two_gateways, target_model):
    mesh, first, second = two_gateways
    model, tokenizer = target_model
    prompt = "def tokenize(source):\n"
    prompt_ids = tokenizer(prompt)["input_ids"]
    received: list[int] = []
    with GatewayClient(first.address) as client:
        stream = client.stream(build_request(prompt, max_new_tokens=300, num_draft_tokens=2,
                                             keep_session=True))
        for _ in range(3):
            chunk = next(stream)
            assert chunk.offset == len(prompt_ids) + len(received)  # positions are exact
            received.extend(chunk.token_ids)
        session_id = chunk.session_id
        mesh.kill("gateway")  # SIGKILL: no cleanup, its lease stays until it expires

    resume_from = chunk.offset + len(chunk.token_ids)
    deadline = time.monotonic() + 15
    with GatewayClient(second.address) as client:
        while True:
            try:
                resumed = list(client.stream(build_request(
                    session_id=session_id, resume_from=resume_from, max_new_tokens=20)))
                break
            except grpc.RpcError as err:  # the dead gateway's lease has not expired yet
                assert err.code() == grpc.StatusCode.ABORTED, err.details()
                assert time.monotonic() < deadline, "the dead gateway's lease never expired"
                time.sleep(0.2)
        client.close_session(session_id)

    assert resumed[0].offset == resume_from
    tokens = received + [t for c in resumed for t in c.token_ids]
    # Lossless and gap-free: exactly the target's own greedy continuation of the prompt.
    assert tokens == hf_greedy(model, prompt_ids, len(tokens))
    assert len(tokens) >= len(received) + 20


def test_resume_from_needs_a_session_and_no_prompt(two_gateways):
    _, _, second = two_gateways
    with GatewayClient(second.address) as client:
        for request, hint in ((build_request(resume_from=5, max_new_tokens=2), "session_id"),
                              (build_request("x", session_id="s", resume_from=5), "prompt")):
            with pytest.raises(grpc.RpcError) as err:
                client.generate(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert hint in err.value.details()
        kept = client.generate(build_request("import os", max_new_tokens=3, keep_session=True))
        with pytest.raises(grpc.RpcError) as err:
            client.generate(build_request(session_id=kept.session_id, resume_from=10**6))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "past" in err.value.details()
        client.close_session(kept.session_id)
