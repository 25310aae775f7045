"""A gateway killed mid-stream: the client picks the session up on another gateway with
``resume_from``. The committed tokens come from Redis, no token is lost or repeated, and the
continuation is the original request (its sampling settings, seed, stop strings, token budget
and speculation settings come from the session handle): the joined stream equals the same
request run without a crash, token for token, with the same finish reason and usage."""

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


def _summary(chunks) -> dict:
    last = chunks[-1]
    return {"tokens": [t for c in chunks for t in c.token_ids],
            "text": "".join(c.text for c in chunks), "finish": last.finish_reason,
            "usage": (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.rounds,
                      last.usage.draft_tokens, last.usage.accepted_draft_tokens)}


def _resume(address: str, session_id: str, resume_from: int, **settings) -> list:
    """Resumes on ``address``, retrying while the dead gateway's lease (<= 5 s) holds
    (ABORTED); any other error is raised."""
    deadline = time.monotonic() + 15
    with GatewayClient(address) as client:
        while True:
            try:
                return list(client.stream(build_request(
                    session_id=session_id, resume_from=resume_from, **settings)))
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.ABORTED:
                    raise
                assert time.monotonic() < deadline, "the dead gateway's lease never expired"
                time.sleep(0.2)


def _cut_and_resume(mesh, first, second, request, chunks_before_kill: int = 3,
                    **resume_settings) -> tuple[list, list]:
    """Streams ``request`` on the first gateway, SIGKILLs it after a few chunks, resumes on the
    second; restarts the first for the next test. Returns (chunks received, resumed chunks)."""
    with GatewayClient(first.address) as client:
        stream = client.stream(request)
        received = [next(stream) for _ in range(chunks_before_kill)]
        mesh.kill("gateway")  # SIGKILL: no cleanup, its lease stays until it expires
    try:
        last = received[-1]
        resumed = _resume(second.address, last.session_id, last.offset + len(last.token_ids),
                          **resume_settings)
    finally:
        mesh.restart("gateway")
    return received, resumed


def _whole(address: str, request) -> list:
    with GatewayClient(address) as client:
        return list(client.stream(request))


@pytest.mark.parametrize("settings", [
    pytest.param(dict(num_draft_tokens=2), id="greedy"),
    pytest.param(dict(temperature=0.9, top_k=40, seed=1234), id="seeded-sampling"),
])
def test_resumed_stream_equals_the_uninterrupted_one(two_gateways, target_model, settings):
    mesh, first, second = two_gateways
    model, tokenizer = target_model
    prompt = "def tokenize(source):\n"
    request = build_request(prompt, max_new_tokens=40, **settings)
    whole = _summary(_whole(second.address, request))

    received, resumed = _cut_and_resume(mesh, first, second, request)
    prompt_len = len(tokenizer(prompt)["input_ids"])
    offsets = [c.offset for c in received]
    assert offsets[0] == prompt_len and resumed[0].offset == sum(
        len(c.token_ids) for c in received) + prompt_len  # positions are exact
    joined = _summary(received + resumed)
    # The resume ran the original request: 40 tokens in all (not the gateway's default of
    # 128), the same seed and k, so the same tokens, text, finish and usage totals.
    assert joined == whole
    assert len(joined["tokens"]) == 40
    if "seed" not in settings:
        assert joined["tokens"] == hf_greedy(model, tokenizer(prompt)["input_ids"], 40)


def test_a_resumed_stream_keeps_its_stop_string(two_gateways, target_model):
    mesh, first, second = two_gateways
    model, tokenizer = target_model
    prompt = "def tokenize(source):\n"
    reference = tokenizer.decode(hf_greedy(model, tokenizer(prompt)["input_ids"], 60))
    stop = reference[len(reference) * 2 // 3:][:3]  # a string the stream meets late
    request = build_request(prompt, max_new_tokens=60, stop=[stop], num_draft_tokens=1)
    whole = _summary(_whole(second.address, request))
    assert whole["finish"] == 3  # FINISH_REASON_STOP
    received, resumed = _cut_and_resume(mesh, first, second, request, chunks_before_kill=2)
    assert _summary(received + resumed) == whole
    assert stop not in whole["text"]


def test_a_resume_cannot_change_the_request(two_gateways):
    mesh, first, second = two_gateways
    request = build_request("import os\n", max_new_tokens=300, num_draft_tokens=2,
                            keep_session=True)
    with GatewayClient(first.address) as client:
        stream = client.stream(request)
        chunk = next(stream)
        mesh.kill("gateway")
    try:
        resume_from = chunk.offset + len(chunk.token_ids)
        for settings, field in ((dict(max_new_tokens=20), "sampling.max_new_tokens"),
                                (dict(temperature=0.5), "sampling.temperature"),
                                (dict(num_draft_tokens=3), "speculation.num_draft_tokens")):
            with pytest.raises(grpc.RpcError) as err:
                _resume(second.address, chunk.session_id, resume_from, **settings)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details() and "resume" in err.value.details()
        # The same settings given again are no conflict; the session was not touched.
        resumed = _resume(second.address, chunk.session_id, resume_from, max_new_tokens=300)
        assert sum(len(c.token_ids) for c in resumed) + len(chunk.token_ids) == 300
        # A kept session's next turn is a new request with its own settings.
        with GatewayClient(second.address) as client:
            turn = client.generate(build_request("\n", session_id=chunk.session_id,
                                                 max_new_tokens=5))
            assert turn.usage.completion_tokens == 5
            client.close_session(chunk.session_id)
    finally:
        mesh.restart("gateway")


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
        for resume_from in (10**6, 1):  # past the committed tokens; inside the prompt
            with pytest.raises(grpc.RpcError) as err:
                client.generate(build_request(session_id=kept.session_id,
                                              resume_from=resume_from))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "resume_from" in err.value.details()
        # A finished turn resumed: the missing tokens and its finish, nothing generated.
        n = kept.usage.prompt_tokens
        again = client.generate(build_request(session_id=kept.session_id, resume_from=n + 1))
        assert list(again.token_ids) == list(kept.token_ids[1:])
        assert again.finish_reason == kept.finish_reason
        assert again.usage == kept.usage
        client.close_session(kept.session_id)
