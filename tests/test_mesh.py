"""End to end through the real mesh: gateway, drafter and verifier processes, Redis, gRPC."""

from __future__ import annotations

import time

import grpc
import pytest

from specmesh.client import GatewayClient, build_request
from specmesh.v1 import common_pb2, drafter_pb2_grpc, gateway_pb2, verifier_pb2_grpc
from tests.conftest import hf_greedy

PROMPTS = [
    "def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self",
    "for i in range(10):", "# Copyright", "return self._", "if __name__ == '__main__':",
    "try:\n    import", "The quick brown fox", "x = [i * i for i in", "def __repr__(self):",
    "raise ValueError(", "with open(path) as f:", "while True:\n    ", "lambda x: x +",
    "from collections import", "async def main():", "\"\"\"Return the", "self.assertEqual(",
    "Once upon a time", "print('héllo wörld')", "elif isinstance(value, str):",
]


@pytest.fixture(scope="module")
def client(mesh):
    with GatewayClient(mesh.gateway_address) as c:
        yield c


def test_greedy_output_equals_hf_generate_for_many_prompts(client, target_model):
    """Speculation on, a draft that differs from the target: output is the target's own
    greedy output token for token, and drafts were really accepted and rejected."""
    model, tokenizer = target_model
    accepted = drafted = rounds = tokens = 0
    for prompt in PROMPTS:
        reply = client.generate(build_request(prompt, max_new_tokens=32, num_draft_tokens=4))
        expected = hf_greedy(model, tokenizer(prompt)["input_ids"], 32)
        assert list(reply.token_ids) == expected, prompt
        assert reply.text == tokenizer.decode(expected, skip_special_tokens=True)
        eos = expected[-1] == tokenizer.eos_token_id
        assert reply.finish_reason == (gateway_pb2.FINISH_REASON_EOS if eos
                                       else gateway_pb2.FINISH_REASON_LENGTH)
        u = reply.usage
        assert u.completion_tokens == len(expected)
        assert u.prompt_tokens == len(tokenizer(prompt)["input_ids"])
        accepted, drafted = accepted + u.accepted_draft_tokens, drafted + u.draft_tokens
        rounds, tokens = rounds + u.rounds, tokens + u.completion_tokens
    assert 0 < accepted < drafted, "the draft should agree with the target only partly"
    assert rounds < tokens, "accepted drafts must yield more than one token per round"


def test_speculation_disabled_is_target_only_with_same_output(client, target_model):
    """Target-only: HF's tokens, the first round one token (its time to the first token),
    every later one up to --plain-tokens (8 by default) from one verifier call."""
    model, tokenizer = target_model
    prompt = PROMPTS[0]
    request = build_request(prompt, max_new_tokens=20, disable_speculation=True)
    reply = client.generate(request)
    assert list(reply.token_ids) == hf_greedy(model, tokenizer(prompt)["input_ids"], 20)
    assert reply.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert reply.usage.draft_tokens == 0
    assert reply.usage.rounds == 1 + 3  # 1 + 8 + 8 + 3
    chunks = list(client.stream(request))
    assert [len(c.token_ids) for c in chunks] == [1, 8, 8, 3]
    assert [t for c in chunks for t in c.token_ids] == list(reply.token_ids)


@pytest.mark.parametrize("k", [1, 2, 7])
def test_greedy_output_is_independent_of_draft_length(client, target_model, k):
    model, tokenizer = target_model
    prompt = PROMPTS[3]
    reply = client.generate(build_request(prompt, max_new_tokens=40, num_draft_tokens=k))
    assert list(reply.token_ids) == hf_greedy(model, tokenizer(prompt)["input_ids"], 40)
    assert reply.usage.draft_tokens <= k * reply.usage.rounds


def test_stream_chunks_add_up_to_the_whole_response(client, target_model):
    _, tokenizer = target_model
    request = build_request("print('héllo wörld 中文 🙂')", max_new_tokens=48)
    whole = client.generate(request)
    chunks = list(client.stream(request))
    # One chunk per round (k may differ between the two runs: it adapts; tokens may not).
    assert len(chunks) == chunks[-1].usage.rounds
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert "".join(c.text for c in chunks) == whole.text
    assert all(c.finish_reason == 0 and not c.HasField("usage") for c in chunks[:-1])
    assert chunks[-1].finish_reason != 0 and chunks[-1].usage.completion_tokens == len(
        whole.token_ids)
    assert len({c.session_id for c in chunks}) == 1


def test_max_new_tokens_is_exact(client):
    for n in (1, 2, 5, 9):
        reply = client.generate(build_request(PROMPTS[5], max_new_tokens=n, num_draft_tokens=4))
        assert len(reply.token_ids) <= n
        if reply.finish_reason == gateway_pb2.FINISH_REASON_LENGTH:
            assert len(reply.token_ids) == n


def test_stop_string_ends_generation_before_it(client):
    base = client.generate(build_request(PROMPTS[0], max_new_tokens=48))
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3
    cut = text.index(stop)
    reply = client.generate(build_request(PROMPTS[0], max_new_tokens=48, stop=[stop]))
    assert reply.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert reply.text == text[:cut]
    assert list(reply.token_ids) == list(base.token_ids[: len(reply.token_ids)])
    streamed = "".join(c.text for c in client.stream(
        build_request(PROMPTS[0], max_new_tokens=48, stop=[stop])))
    assert streamed == text[:cut]


def test_prompt_token_ids_equal_text_prompt(client, target_model):
    _, tokenizer = target_model
    ids = tokenizer(PROMPTS[7])["input_ids"]
    by_text = client.generate(build_request(PROMPTS[7], max_new_tokens=16))
    by_ids = client.generate(build_request(prompt_token_ids=ids, max_new_tokens=16))
    assert list(by_ids.token_ids) == list(by_text.token_ids)


def test_a_finished_sessions_replica_caches_are_freed_after_the_response(client, mesh):
    """The gateway frees an ephemeral session's KV caches on the drafter and the verifier
    after it has answered (off the response's path), but it does free them. (The count
    before is read once the earlier tests' sessions are freed: the test before this one
    had just been answered, and its free landed in this one's wait once, leaving one
    session fewer than it had read.)"""
    stubs = [verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(a))
             for a in mesh.verifier_addresses]
    stubs += [drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(a))
              for a in mesh.drafter_addresses]

    def sessions() -> int:
        return sum(s.GetStats(common_pb2.StatsRequest(), timeout=10).sessions for s in stubs)

    before, deadline = sessions(), time.monotonic() + 10
    while time.monotonic() < deadline:  # settled: the same count 0.3 s apart
        time.sleep(0.3)
        now = sessions()
        if now == before:
            break
        before = now
    client.generate(build_request(PROMPTS[2], max_new_tokens=12))
    deadline = time.monotonic() + 10
    while sessions() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sessions() == before


def test_ephemeral_session_is_gone_after_the_request(client):
    reply = client.generate(build_request(PROMPTS[1], max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as err:
        client.generate(build_request("more", session_id=reply.session_id, max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_local_mesh_gives_its_verifier_the_cores_for_prompts_and_plain_passes(mesh):
    """start_mesh: each model process gets its share of the cores for decode passes, the
    verifier all the cores the verifiers share for prompt passes (--prefill-threads) and to
    try for passes without drafts (--plain-threads), and the verifier's OpenMP threads spin
    only briefly between passes (GOMP_SPINCOUNT) unless the environment chose a policy; the
    drafters are left as they were."""
    import os

    import psutil

    from services.local_mesh import OMP_SPIN

    cores = os.cpu_count() or 1
    verifier = psutil.Process(mesh.proc("verifier-0").popen.pid)
    drafter = psutil.Process(mesh.proc("drafter-0").popen.pid)
    args = verifier.cmdline()
    assert args[args.index("--prefill-threads") + 1] == str(cores)
    assert args[args.index("--plain-threads") + 1] == str(cores)
    assert args[args.index("--threads") + 1] == str(max(1, cores // 2))  # with one drafter
    assert "--prefill-threads" not in drafter.cmdline()
    assert "--plain-threads" not in drafter.cmdline()
    chosen = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys()
    expected = os.environ.get("GOMP_SPINCOUNT") if chosen else str(OMP_SPIN)
    assert verifier.environ().get("GOMP_SPINCOUNT") == expected
    assert drafter.environ().get("GOMP_SPINCOUNT") == os.environ.get("GOMP_SPINCOUNT")
