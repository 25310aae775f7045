"""The gateway's OpenAI-compatible HTTP API through the official `openai` client, against a
real mesh of the demo pair (models/: it has no chat template, so chat uses the default):
greedy output equals HF generate, streams add up, logprobs equal HF log_softmax, chat,
sessions, and the 400/404 errors. Keys, TLS, 401/403/429/503: test_openai_security.py."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from services.local_mesh import MeshSpec, free_port, start_mesh
from specmesh.client import GatewayClient, build_request
from specmesh.v1 import gateway_pb2
from tests.conftest import hf_greedy

DEMO = Path(__file__).resolve().parent.parent / "models"
# float32 rounding: the verifier computes a sequence's logits in other chunks (prefill, k+1
# positions per round) than one full forward; on the demo target HF's own full forward and
# token-by-token cached forward differ by up to 6e-3 in log-probability.
TOL = 1e-2
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self"]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    """The demo pair when it is there (it is in the repository), else the tiny pair."""
    if (DEMO / "demo-target" / "model.safetensors").exists():
        return str(DEMO / "demo-target"), str(DEMO / "demo-drafter")
    return tiny_pair


@pytest.fixture(scope="module")
def http_mesh(pair, redis_url, tmp_path_factory):
    port, metrics = free_port(), free_port()
    mesh = start_mesh(MeshSpec(target=pair[0], draft=pair[1], port=free_port(),
                               redis_url=redis_url, log_dir=tmp_path_factory.mktemp("http"),
                               extra_gateway_args=("--http-port", str(port),
                                                   "--max-new-tokens-cap", "512",
                                                   "--metrics-port", str(metrics))))
    yield mesh, f"http://127.0.0.1:{port}", metrics
    mesh.stop()


@pytest.fixture(scope="module")
def client(http_mesh):
    return openai.OpenAI(base_url=http_mesh[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def target(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(pair[0])
    model.eval()
    return model, AutoTokenizer.from_pretrained(pair[0])


def hf_logprobs(model, ids: list[int], start: int):
    """log_softmax of the target's logits at every position from ``start`` on: row i is
    the distribution of token ids[start + i]."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, start - 1:-1].float()
    return torch.log_softmax(logits, dim=-1)


def test_models_lists_the_target(client, pair):
    assert [m.id for m in client.models.list().data] == [Path(pair[0]).name]


def test_the_bench_runs_an_openai_server_as_a_peer(http_mesh, client):
    """`specmesh bench --peer`: the mesh's own HTTP door as the peer. Each streamed record
    carries the text the official client gets for the same greedy request, the completion
    tokens from the server's usage, and a TTFT within its latency; a server that does not
    answer is an error on the record, not a crash."""
    from specmesh.bench_peers import Peer, complete_one, run_peer_level, served_model

    peer = Peer("self", http_mesh[1] + "/v1")
    model = served_model(peer)
    assert model == client.models.list().data[0].id
    records, wall = run_peer_level(peer, model, PROMPTS[:2], 2, 12, 60.0)
    assert [r["prompt_index"] for r in records] == [0, 1] and wall > 0
    for rec in records:
        want = client.completions.create(model=model, prompt=PROMPTS[rec["prompt_index"]],
                                         max_tokens=12, temperature=0)
        assert rec["error"] == ""
        assert rec["text"] == want.choices[0].text
        assert rec["completion_tokens"] == want.usage.completion_tokens > 0
        assert 0 < rec["ttft_s"] <= rec["latency_s"]
    # --temperature (and --seed): the peer samples, the same seed drawing the same text
    sampled = [complete_one(peer, model, 0, PROMPTS[0], 16, 60.0, temperature=1.0, seed=s)
               ["text"] for s in (5, 5, 6, 7)]
    want = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                     temperature=1.0, seed=5).choices[0].text
    assert sampled[0] == sampled[1] == want and len(set(sampled)) > 1
    dead = Peer("dead", f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(OSError):
        served_model(dead)
    rec = complete_one(dead, model, 0, "x", 4, 5.0)
    assert rec["error"].startswith("PEER:") and rec["completion_tokens"] == 0


def test_greedy_completion_equals_hf_generate(client, target, pair):
    model, tokenizer = target
    for prompt in PROMPTS:
        r = client.completions.create(model=Path(pair[0]).name, prompt=prompt, max_tokens=24,
                                      temperature=0)
        ids = tokenizer(prompt)["input_ids"]
        expected = hf_greedy(model, ids, 24)
        assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True), prompt
        eos = expected[-1] == tokenizer.eos_token_id
        assert r.choices[0].finish_reason == ("stop" if eos else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected))
        assert r.usage.total_tokens == len(ids) + len(expected)
        spec = r.usage.speculation
        assert 0 <= spec["accepted_draft_tokens"] <= spec["draft_tokens"]
        assert spec["rounds"] <= len(expected)
    # The prompt as token ids, speculation off (an extension): the same text, no drafts.
    ids = tokenizer(PROMPTS[0])["input_ids"]
    r = client.completions.create(model=pair[0], prompt=ids, max_tokens=24, temperature=0,
                                  extra_body={"speculation": {"disable": True}})
    assert r.choices[0].text == tokenizer.decode(hf_greedy(model, ids, 24),
                                                 skip_special_tokens=True)
    assert r.usage.speculation["draft_tokens"] == 0


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_join_to_the_whole_text(client, pair, chat):
    name = Path(pair[0]).name
    args = dict(model=name, max_tokens=40, temperature=0)
    if chat:
        args["messages"] = [{"role": "user", "content": "Write a parser."}]
        create = client.chat.completions.create
        whole = create(**args)
        text = whole.choices[0].message.content
    else:
        args["prompt"] = PROMPTS[2]
        create = client.completions.create
        whole = create(**args)
        text = whole.choices[0].text
    chunks = list(create(**args, stream=True, stream_options={"include_usage": True}))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in deltas)
    pieces = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in deltas]
    assert "".join(pieces) == text and len(deltas) > 1
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + [
        whole.choices[0].finish_reason]
    if chat:
        assert deltas[0].choices[0].delta.role == "assistant"
    # Without include_usage the stream carries no usage at all.
    plain = list(create(**args, stream=True))
    assert all(getattr(c, "usage", None) is None for c in plain)
    assert "".join((c.choices[0].delta.content or "") if chat else c.choices[0].text
                   for c in plain) == text


def test_completion_logprobs_equal_hf_log_softmax(client, target, pair):
    """Greedy: the sequence is HF's, so its logprobs are log_softmax of HF's logits on it;
    the same with speculation off (one distribution for both)."""
    model, tokenizer = target
    ids = tokenizer(PROMPTS[1])["input_ids"]
    expected = hf_greedy(model, ids, 20)
    ref = hf_logprobs(model, ids + expected, len(ids))
    for disable in (False, True):
        r = client.completions.create(model=pair[0], prompt=PROMPTS[1], max_tokens=20,
                                      temperature=0, logprobs=3,
                                      extra_body={"speculation": {"disable": disable}})
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(expected)
        for i, token in enumerate(expected):
            assert lp.token_logprobs[i] == pytest.approx(float(ref[i, token]), abs=TOL)
            assert lp.tokens[i] == tokenizer.decode([token])
            # Top 3 by decoded text (two ids may decode alike: then fewer keys).
            top = {tokenizer.decode([int(t)]) for t in ref[i].topk(3).indices}
            assert set(lp.top_logprobs[i]) == top


def test_chat_on_the_default_template_equals_hf_and_carries_logprobs(client, target, pair):
    """The demo pair has no chat template: the documented default renders the messages."""
    model, tokenizer = target
    assert not tokenizer.chat_template
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "Sort a list"}]}]
    r = client.chat.completions.create(model=pair[0], messages=messages, max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=2)
    ids = tokenizer("System: You write Python.\nUser: Sort a list\nAssistant:")["input_ids"]
    expected = hf_greedy(model, ids, 16)
    assert r.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    ref = hf_logprobs(model, ids + expected, len(ids))
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [float(ref[i, t]) for i, t in enumerate(expected)], abs=TOL)
    assert all(len(c.top_logprobs) == 2 for c in content)


def _verifier_stats(mesh):
    import grpc

    from specmesh.v1 import common_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(mesh.verifier_addresses[0]) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetStats(common_pb2.StatsRequest(),
                                                                timeout=10)


def test_chat_session_keeps_the_conversation(client, target, pair, http_mesh):
    """A kept session (extension): the second turn sends only its new messages and
    continues the session's tokens, on the verifier's kept KV cache (no prefill, no
    resync): output = HF greedy on all of it."""
    model, tokenizer = target
    first = client.chat.completions.create(
        model=pair[0], messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=8,
        temperature=0, extra_body={"keep_session": True})
    sid = first.model_extra["session_id"]
    ids = tokenizer("User: def add(a, b):\nAssistant:")["input_ids"]
    reply = hf_greedy(model, ids, 8)
    before = _verifier_stats(http_mesh[0])
    second = client.chat.completions.create(
        model=pair[0], messages=[{"role": "user", "content": "Now subtract."}], max_tokens=8,
        temperature=0, extra_body={"session_id": sid})
    after = _verifier_stats(http_mesh[0])
    assert after.calls > before.calls
    assert (after.fresh_prefills, after.resyncs_requested) == (before.fresh_prefills,
                                                               before.resyncs_requested)
    turn = tokenizer("\nUser: Now subtract.\nAssistant:", add_special_tokens=False)["input_ids"]
    expected = hf_greedy(model, ids + reply + turn, 8)
    assert second.choices[0].message.content == tokenizer.decode(expected,
                                                                  skip_special_tokens=True)
    assert second.usage.prompt_tokens == len(turn)
    req = urllib.request.Request(f"{client.base_url}sessions/{sid}", method="DELETE")
    with urllib.request.urlopen(req) as resp:
        body = json.load(resp)
    assert body["deleted"] and body["committed_tokens"] == len(ids + reply + turn) + len(
        expected)


def test_grpc_logprobs_are_the_raw_distribution_whatever_the_sampling(http_mesh, target):
    """Sampling at temperature 0.7 / top_k 5: the logprobs are still log_softmax of the
    raw logits (not the warped distribution) on the sampled sequence."""
    model, tokenizer = target
    ids = tokenizer(PROMPTS[0])["input_ids"]
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPTS[0], logprobs=True, top_logprobs=1,
        sampling=gateway_pb2.SamplingParams(temperature=0.7, top_k=5, seed=11,
                                            max_new_tokens=16))
    with GatewayClient(http_mesh[0].gateway_address) as grpc_client:
        reply = grpc_client.generate(request)
    tokens = list(reply.token_ids)
    assert [t.token_id for t in reply.logprobs] == tokens
    ref = hf_logprobs(model, ids + tokens, len(ids))
    for i, t in enumerate(reply.logprobs):
        assert t.logprob == pytest.approx(float(ref[i, t.token_id]), abs=TOL)
        assert t.top_logprobs[0].token_id == int(ref[i].argmax())
    assert not any(math.isinf(t.logprob) for t in reply.logprobs)


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    return err.value


@pytest.mark.parametrize("kwargs, status, param, message", [
    ({"temperature": 2.5}, 400, "temperature", "temperature must be in [0, 2] (0 = greedy), "
                                               "got 2.5"),
    ({"top_p": 0}, 400, "top_p", "top_p must be in (0, 1], got 0"),
    ({"max_tokens": 0}, 400, "max_tokens", "max_tokens must be in 1..512, got 0"),
    ({"max_tokens": 513}, 400, "max_tokens", "max_tokens must be in 1..512, got 513"),
    ({"n": 0}, 400, "n", "n must be in 1..128, got 0"),
    ({"logprobs": 21}, 400, "logprobs", "logprobs must be in 0..20, got 21"),
    ({"best_of": 2}, 400, "best_of", "best_of must be 1, got 2"),
    ({"stop": [""]}, 400, "stop", "stop strings must be 1..256 characters"),
    ({"extra_body": {"top_k": -2}}, 400, "top_k", "top_k must be >= 0 (0 = off), got -2"),
    ({"presence_penalty": 1.0}, 400, "presence_penalty", "presence_penalty is not supported"),
    ({"model": "gpt-4"}, 404, "model", "the model 'gpt-4' does not exist"),
    ({"extra_body": {"session_id": "no-such-session"}}, 404, None, "no-such-session"),
])
def test_completion_errors_have_openai_shape_status_and_message(client, pair, kwargs, status,
                                                                param, message):
    args = {"model": Path(pair[0]).name, "prompt": "x", "max_tokens": 2, **kwargs}
    err = _error(lambda: client.completions.create(**args))
    assert err.status_code == status
    assert message in err.body["message"] and err.body["param"] == param
    assert set(err.body) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("kwargs, param, message", [
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant, got 'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "messages[0].content[0].type must be \"text\""),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "messages[0].content is required"),
    ({"top_logprobs": 3}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"max_completion_tokens": "many"}, "max_completion_tokens", "max_completion_tokens: "),
])
def test_chat_errors_name_the_field(client, pair, kwargs, param, message):
    args = {"model": pair[0], "messages": [{"role": "user", "content": "hi"}], **kwargs}
    err = _error(lambda: client.chat.completions.create(**args))
    assert err.status_code == 400 and err.body["type"] == "invalid_request_error"
    assert message in err.body["message"] and err.body["param"] == param


def test_health_readiness_and_unknown_routes(http_mesh):
    base = http_mesh[1]
    for path, body in (("/health", {"status": "ok"}), ("/ready", {"status": "serving"})):
        with urllib.request.urlopen(base + path) as resp:
            assert (resp.status, json.load(resp)) == (200, body)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/v1/embeddings")
    assert err.value.code == 404 and json.load(err.value)["error"]["code"] == "not_found"


def test_http_requests_are_counted_by_route_and_status(http_mesh):
    """Runs after the tests above (same module): their requests are in the gateway's
    Prometheus metrics, by route and status, with their durations."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_mesh[2]}/metrics") as resp:
        text = resp.read().decode()

    def count(name: str, route: str, status: int) -> float:
        total = 0.0
        for line in text.splitlines():
            if (line.startswith(name + "{") and f'http_route="{route}"' in line
                    and f'http_response_status_code="{status}"' in line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    assert count("specmesh_http_requests_total", "/v1/completions", 200) >= 8
    assert count("specmesh_http_requests_total", "/v1/completions", 400) >= 9
    assert count("specmesh_http_requests_total", "/v1/completions", 404) >= 2
    assert count("specmesh_http_requests_total", "/v1/chat/completions", 200) >= 5
    assert count("specmesh_http_request_duration_seconds_count", "/v1/completions", 200) == \
        count("specmesh_http_requests_total", "/v1/completions", 200)


@pytest.mark.parametrize("data, message", [
    (b'{"prompt": "x",', "the request body is not valid JSON"),
    (b"", "the request body must be a JSON object"),
])
def test_malformed_bodies_are_400(http_mesh, data, message):
    req = urllib.request.Request(http_mesh[1] + "/v1/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    body = json.load(err.value)
    assert err.value.code == 400 and body["error"]["message"].startswith(message)


def test_stop_strings_and_seeds(client, target, pair):
    """A stop string cuts the greedy text before it (finish_reason stop); the same seed
    samples the same text again."""
    model, tokenizer = target
    ids = tokenizer(PROMPTS[0])["input_ids"]
    full = tokenizer.decode(hf_greedy(model, ids, 40), skip_special_tokens=True)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    r = client.completions.create(model=pair[0], prompt=PROMPTS[0], max_tokens=40,
                                  temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    texts = [client.completions.create(model=pair[0], prompt=PROMPTS[0], max_tokens=24,
                                       temperature=0.9, top_p=0.95, seed=seed).choices[0].text
             for seed in (1234, 1234, 1, 2, 3)]
    assert texts[0] == texts[1]
    assert len(set(texts)) > 1, "other seeds should sample something else"


def test_grpc_logprobs_per_chunk_and_their_validation(http_mesh):
    import grpc

    request = gateway_pb2.GenerateRequest(
        prompt=PROMPTS[2], logprobs=True, sampling=gateway_pb2.SamplingParams(max_new_tokens=12))
    with GatewayClient(http_mesh[0].gateway_address) as grpc_client:
        chunks = list(grpc_client.stream(request))
        assert sum(len(c.token_ids) for c in chunks) == chunks[-1].usage.completion_tokens
        for c in chunks:
            assert [t.token_id for t in c.logprobs] == list(c.token_ids)
            assert all(not t.top_logprobs for t in c.logprobs)  # top_logprobs 0: none
        for bad, message in (
                (dict(logprobs=True, top_logprobs=21), "top_logprobs must be in 0..20, got 21"),
                (dict(top_logprobs=2), "top_logprobs needs logprobs = true")):
            with pytest.raises(grpc.RpcError) as err:
                grpc_client.generate(gateway_pb2.GenerateRequest(prompt="x", **bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()


def test_the_running_gateway_has_no_torch_loaded(http_mesh):
    """A full install has torch (the drafter and verifier need it); the gateway process
    still runs without it: no torch library is mapped into it, while the verifier's is."""
    import psutil

    def torch_mapped(name: str) -> bool:
        maps = psutil.Process(http_mesh[0].proc(name).popen.pid).memory_maps()
        return any("libtorch" in m.path for m in maps)

    assert torch_mapped("verifier-0")  # the check can see torch where it is
    assert not torch_mapped("gateway")


# (gRPC build_request kwargs, HTTP /v1/completions fields, gRPC name, HTTP param)
BOTH_DOORS = [
    ({"temperature": 2.5}, {"temperature": 2.5}, "sampling.temperature", "temperature"),
    ({"top_p": 0.0}, {"top_p": 0}, "sampling.top_p", "top_p"),
    ({"max_new_tokens": 513}, {"max_tokens": 513}, "sampling.max_new_tokens", "max_tokens"),
    ({"stop": [""]}, {"stop": [""]}, "sampling.stop", "stop"),
    ({"num_draft_tokens": 65}, {"speculation": {"num_draft_tokens": 65}},
     "speculation.num_draft_tokens", "speculation.num_draft_tokens"),
    ({"drafter": "big"}, {"speculation": {"drafter": "big"}}, "speculation.drafter",
     "speculation.drafter"),
    ({"session_id": "s" * 129}, {"session_id": "s" * 129}, "session_id", "session_id"),
    ({"prompt": "", "prompt_token_ids": [1, 99999]}, {"prompt": [1, 99999]},
     "prompt_token_ids", "prompt"),
    ({"prompt": "def f(x): return x\n" * 400}, {"prompt": "def f(x): return x\n" * 400},
     None, "prompt"),  # longer than the context: found by the engine, after tokenizing
]


@pytest.mark.parametrize("grpc_kwargs, body, grpc_name, param", BOTH_DOORS)
def test_a_request_one_door_rejects_the_other_rejects_for_the_same_field(
        http_mesh, grpc_kwargs, body, grpc_name, param):
    import grpc

    mesh, base, _ = http_mesh
    args = {"prompt": "x", "max_new_tokens": 2, **grpc_kwargs}
    with GatewayClient(mesh.gateway_address) as client, pytest.raises(grpc.RpcError) as err:
        client.generate(build_request(args.pop("prompt"), **args), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    if grpc_name:
        assert err.value.details().startswith(grpc_name), err.value.details()

    request = urllib.request.Request(
        base + "/v1/completions", method="POST", headers={"content-type": "application/json"},
        data=json.dumps({"prompt": "x", "max_tokens": 2, "temperature": 0, **body}).encode())
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=60)
    error = json.loads(http_err.value.read())["error"]
    assert http_err.value.code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    # the same rule answered both: the messages differ only in the field's name
    if grpc_name:
        assert error["message"] == err.value.details().replace(grpc_name, param, 1)
    else:
        assert error["message"] == err.value.details()


def test_readiness_follows_grpc_health_through_a_drain(http_mesh):
    """Last in this module (it stops the gateway): SIGTERM while a gRPC stream runs; the
    gateway drains, its gRPC health is NOT_SERVING, and /ready answers 503 with it."""
    import signal
    import time

    mesh, base, _ = http_mesh
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPTS[0], sampling=gateway_pb2.SamplingParams(max_new_tokens=500))
    seen = []
    with GatewayClient(mesh.gateway_address) as grpc_client:
        stream = grpc_client.stream(request)
        next(stream)
        mesh.proc("gateway").popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and 503 not in seen:
            try:
                with urllib.request.urlopen(base + "/ready", timeout=2) as resp:
                    seen.append(resp.status)
            except urllib.error.HTTPError as err:
                seen.append(err.code)
                assert json.load(err) == {"status": "not_serving"}
            except urllib.error.URLError:
                break  # the HTTP server is gone: the drain ended before a probe saw it
            time.sleep(0.02)
        stream.cancel()
    assert 503 in seen, seen
