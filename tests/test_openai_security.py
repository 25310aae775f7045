"""The HTTP API on a secured mesh (TLS + mTLS, API keys, rate limits, a one-request
gateway): the gRPC API's keys, per-key limits, session ownership and TLS hold for HTTP,
with OpenAI's error shapes: 401, 403, 429 with Retry-After, 503 when Redis is gone."""

from __future__ import annotations

import json
import shutil
import ssl
import time
import urllib.error
import urllib.request

import openai
import pytest

from gateway.auth import new_key
from services import local_mesh
from services.certs import make_ca, make_cert
from services.local_mesh import MeshSpec, free_port, start_mesh

KEYS = {"alice": {}, "carol": {}, "bob": {"rate_per_s": 0.2, "burst": 1}}
MODEL = "chat-target"  # the tiny target with a chat template of its own (as a real chat model)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def secured(tiny_pair, tmp_path_factory):
    work = tmp_path_factory.mktemp("openai-secure")
    make_ca(work / "ca")
    certs = make_cert(work / "ca", "mesh", ["127.0.0.1", "localhost"])
    keys, entries = {}, []
    for name, limits in KEYS.items():
        keys[name], digest = new_key()
        entries.append({"name": name, "sha256": digest, **limits})
    (work / "keys.json").write_text(json.dumps({"keys": entries}))
    target = work / MODEL
    shutil.copytree(tiny_pair[0], target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": TEMPLATE}))
    redis, redis_url = local_mesh.start_redis(work)
    http_port = free_port()
    mesh = start_mesh(MeshSpec(
        target=str(target), draft=tiny_pair[1], port=free_port(), redis_url=redis_url,
        log_dir=work, drafters=0, tls=(str(certs.cert), str(certs.key), str(certs.ca)),
        extra_gateway_args=("--api-keys", str(work / "keys.json"), "--http-port",
                            str(http_port), "--max-inflight", "1")))
    try:
        yield {"url": f"https://127.0.0.1:{http_port}", "keys": keys, "ca": str(certs.ca),
               "redis": redis, "model": str(target)}
    finally:
        mesh.stop()
        redis.popen.kill()
        redis.popen.wait(10)


def _client(s, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["url"] + "/v1", api_key=key, max_retries=0,
                         http_client=openai.DefaultHttpxClient(
                             verify=ssl.create_default_context(cafile=s["ca"])))


def _get(s, path: str, headers: dict | None = None):
    """(status, JSON body, headers) of a GET over HTTPS trusting the mesh CA."""
    req = urllib.request.Request(s["url"] + path, headers=headers or {})
    context = ssl.create_default_context(cafile=s["ca"])
    try:
        with urllib.request.urlopen(req, context=context) as resp:
            return resp.status, json.load(resp), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.load(err), err.headers


def _error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as err:
        call()
    return err.value


def test_https_with_a_bearer_key_serves_completions(secured):
    alice = _client(secured, secured["keys"]["alice"])
    assert [m.id for m in alice.models.list().data] == [MODEL]
    r = alice.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4,
                                 temperature=0)
    assert r.usage.completion_tokens == 4
    assert _get(secured, "/ready")[:2] == (200, {"status": "serving"})  # unauthenticated



def test_a_models_own_chat_template_prompts_the_target(secured):
    """The template writes the BOS itself: the prompt is its text tokenized without adding
    special tokens (one BOS, not two), and the reply is HF greedy on exactly those ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(secured["model"])
    model = AutoModelForCausalLM.from_pretrained(secured["model"]).eval()
    alice = _client(secured, secured["keys"]["alice"])
    r = alice.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "short"}, {"role": "user", "content": "def f(x):"}])
    ids = tokenizer(f"{tokenizer.bos_token}<|system|>short<|user|>def f(x):<|assistant|>",
                    add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)

def test_plain_http_and_untrusted_certificates_are_refused(secured):
    plain = openai.OpenAI(base_url=secured["url"].replace("https", "http") + "/v1",
                          api_key=secured["keys"]["alice"], max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        plain.models.list()
    untrusted = openai.OpenAI(base_url=secured["url"] + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIConnectionError):
        untrusted.models.list()


@pytest.mark.parametrize("headers, message", [
    ({}, "this gateway requires an API key: send the metadata 'authorization: Bearer <key>'"),
    ({"Authorization": "Bearer sm-not-a-key"}, "the API key is not valid"),
    ({"Authorization": "Basic abc"}, "the authorization header must be 'Bearer <API key>'"),
])
def test_missing_or_bad_keys_get_401(secured, headers, message):
    status, body, _ = _get(secured, "/v1/models", headers)
    assert status == 401
    assert body["error"]["message"].startswith(message)
    assert body["error"]["type"] == "authentication_error"


def test_x_api_key_header_is_accepted(secured):
    status, body, _ = _get(secured, "/v1/models", {"x-api-key": secured["keys"]["alice"]})
    assert status == 200 and body["data"][0]["id"] == MODEL


def test_a_session_belongs_to_the_key_that_created_it(secured):
    alice = _client(secured, secured["keys"]["alice"])
    carol = _client(secured, secured["keys"]["carol"])
    first = alice.completions.create(model=MODEL, prompt="import os", max_tokens=3,
                                     temperature=0, extra_body={"keep_session": True})
    sid = first.model_extra["session_id"]
    err = _error(lambda: carol.completions.create(model=MODEL, prompt=" #", max_tokens=2,
                                                  extra_body={"session_id": sid}))
    assert err.status_code == 403 and "belongs to another API key" in err.body["message"]
    again = alice.completions.create(model=MODEL, prompt=" #", max_tokens=2, temperature=0,
                                     extra_body={"session_id": sid})
    assert again.usage.completion_tokens == 2


def test_rate_limit_is_429_with_retry_after(secured):
    """bob: 0.2 requests/s, burst 1: the second request at once is refused, saying when."""
    bob = _client(secured, secured["keys"]["bob"])
    bob.completions.create(model=MODEL, prompt="a", max_tokens=1)
    err = _error(lambda: bob.completions.create(model=MODEL, prompt="a", max_tokens=1))
    assert err.status_code == 429 and err.body["type"] == "rate_limit_error"
    assert "'bob' is over its rate limit of 0.2 requests/s (burst 1): retry in " in \
        err.body["message"]
    assert 1 <= int(err.response.headers["retry-after"]) <= 5


def test_a_full_gateway_is_429_with_retry_after(secured):
    """--max-inflight 1: while alice streams, carol's request is refused at once."""
    alice = _client(secured, secured["keys"]["alice"])
    carol = _client(secured, secured["keys"]["carol"])
    stream = alice.completions.create(model=MODEL, prompt="for i in", max_tokens=4000,
                                      temperature=0, stream=True)
    try:
        next(iter(stream))
        err = _error(lambda: carol.completions.create(model=MODEL, prompt="a", max_tokens=1))
    finally:
        stream.close()
    assert err.status_code == 429
    assert "gateway is at its limit of 1 concurrent requests" in err.body["message"]
    assert err.response.headers["retry-after"] == "1"
    # The client that went away freed its slot: carol gets in (once the stream is torn down).
    deadline = time.monotonic() + 10
    while True:
        try:
            assert carol.completions.create(model=MODEL, prompt="a",
                                            max_tokens=1).usage.completion_tokens == 1
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "a closed stream kept its slot"
            time.sleep(0.2)


def test_redis_down_is_503_with_retry_after(secured):
    """Last: stops this module's Redis."""
    secured["redis"].popen.kill()
    secured["redis"].popen.wait(10)
    alice = _client(secured, secured["keys"]["carol"])
    err = _error(lambda: alice.completions.create(model=MODEL, prompt="a", max_tokens=1))
    assert err.status_code == 503 and err.body["type"] == "service_unavailable_error"
    assert "session store (Redis) is unreachable" in err.body["message"]
    assert err.response.headers["retry-after"] == "1"
