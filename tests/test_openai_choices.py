"""Several choices in one OpenAI request (gateway/http/choices.py): ``n`` samples of a prompt
and /v1/completions' list of prompts, through the official `openai` client against a real
mesh of the demo pair (each choice's greedy text equals HF generate on its prompt; seeded
choices equal single requests seeded seed + j; streams carry each choice's index; usage counts
each prompt once), and the fan-out's own logic in process (seeds, limits, the merge of the
choices' streams)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from gateway.chunks import Chunk, Finish, Usage
from gateway.http.choices import MAX_N, choice_specs, merged, total_usage
from gateway.http.errors import ApiError
from gateway.requests import GenerationSpec
from services.params import SamplingParams
from tests import test_openai_api
from tests.conftest import hf_greedy
from tests.test_openai_api import PROMPTS

# the same fixtures as test_openai_api's (module-scoped: this module starts its own mesh)
pair, http_mesh, client, target = (test_openai_api.pair, test_openai_api.http_mesh,
                                   test_openai_api.client, test_openai_api.target)

# -- in process ------------------------------------------------------------------------------


def _spec(seed: int | None = None, **fields) -> GenerationSpec:
    return GenerationSpec(prompt=fields.pop("prompt", "x"), prompt_ids=(),
                          params=SamplingParams(temperature=1.0), max_new_tokens=4, stop=(),
                          seed=seed, num_draft_tokens=0, speculate=True, drafter_kind="",
                          session_id=fields.pop("session_id", ""),
                          keep_session=fields.pop("keep_session", False))


def test_choices_run_prompt_by_prompt_with_seed_plus_j():
    specs = choice_specs([_spec(7, prompt="a"), _spec(7, prompt="b")], 3, 64)
    assert [(s.prompt, s.seed) for s in specs] == [("a", 7), ("a", 8), ("a", 9),
                                                   ("b", 7), ("b", 8), ("b", 9)]
    assert [s.seed for s in choice_specs([_spec(2**64 - 1)], 2, 64)] == [2**64 - 1, 0]
    assert [s.seed for s in choice_specs([_spec(None)], 2, 64)] == [None, None]
    assert choice_specs([_spec(5)], None, 64) == [_spec(5)]


@pytest.mark.parametrize("prompts, n, inflight, param, message", [
    (1, 0, 64, "n", f"n must be in 1..{MAX_N}, got 0"),
    (1, MAX_N + 1, 1000, "n", f"n must be in 1..{MAX_N}, got {MAX_N + 1}"),
    (2, 3, 5, "n", "n (3) × 2 prompts asks 6 choices; this gateway runs at most 5 at once"),
    (6, 1, 5, "prompt", "n (1) × 6 prompts asks 6 choices"),
    (1, 9, 5, "n", "n (9) × one prompt asks 9 choices; this gateway runs at most 5 at once"),
])
def test_choices_out_of_range_name_the_field(prompts, n, inflight, param, message):
    with pytest.raises(ApiError) as err:
        choice_specs([_spec()] * prompts, n, inflight)
    assert err.value.status == 400 and err.value.param == param
    assert message in err.value.message


@pytest.mark.parametrize("fields", [{"keep_session": True}, {"session_id": "s1"}])
def test_several_choices_keep_and_continue_no_session(fields):
    for prompts, n, param in ((1, 2, "n"), (2, 1, "prompt")):
        with pytest.raises(ApiError) as err:
            choice_specs([_spec(**fields)] * prompts, n, 64)
        assert err.value.param == param and "take one choice" in err.value.message
    assert choice_specs([_spec(**fields)], 1, 64) == [_spec(**fields)]


def test_usage_counts_each_prompt_once_and_every_completion():
    usages = [Usage(10, 3, 2, 4, 1), Usage(10, 5, 3, 6, 2), Usage(7, 1, 1, 0, 0),
              Usage(7, 2, 1, 3, 3)]
    assert total_usage(usages, 2) == Usage(17, 11, 7, 13, 6)
    assert total_usage(usages, 1) == Usage(34, 11, 7, 13, 6)


async def _stream(name: str, rounds: int, delay: float, log: list, fail: bool = False):
    """A generation's chunks: ``rounds`` of them ``delay`` s apart, the last finished (or a
    failure after the first); ``log`` records each read and the close."""
    try:
        for r in range(rounds):
            await asyncio.sleep(delay)
            if fail and r == 1:
                raise RuntimeError(f"{name} failed")
            log.append((name, r))
            yield Chunk(text=f"{name}{r}", token_ids=[r], session_id=name,
                        finish=Finish.LENGTH if r == rounds - 1 else None)
    finally:
        log.append((name, "closed"))


def test_merged_streams_come_as_they_are_ready_each_to_its_finish():
    async def run():
        log: list = []
        streams = [_stream("a", 3, 0.06, log), _stream("b", 4, 0.01, log)]
        firsts = [await anext(s) for s in streams]
        got = [(i, c.text) async for i, c in merged(streams, firsts)]
        return got
    got = asyncio.run(run())
    assert sorted(got) == sorted([(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1"),
                                  (1, "b2"), (1, "b3")])
    assert got[:2] == [(0, "a0"), (1, "b0")]  # each choice's first chunk first
    assert [t for i, t in got if i == 0] == ["a0", "a1", "a2"]  # each in its own order
    assert got.index((1, "b3")) < got.index((0, "a2"))  # the faster choice is not held back


def test_a_choice_that_fails_fails_the_merge_and_the_rest_stop_reading():
    async def run():
        log: list = []
        streams = [_stream("a", 50, 0.01, log), _stream("b", 3, 0.005, log, fail=True)]
        firsts = [await anext(s) for s in streams]
        with pytest.raises(RuntimeError, match="b failed"):
            async for _ in merged(streams, firsts):
                pass
        for s in streams:
            await s.aclose()
        return log
    log = asyncio.run(run())
    assert ("a", "closed") in log and ("b", "closed") in log
    assert max(r for name, r in log if name == "a" and r != "closed") < 10  # stopped early


# -- through the mesh ------------------------------------------------------------------------


def _greedy_texts(target, prompts: list[str], tokens: int) -> list[str]:
    model, tokenizer = target
    return [tokenizer.decode(hf_greedy(model, tokenizer(p)["input_ids"], tokens),
                             skip_special_tokens=True) for p in prompts]


def test_a_list_of_prompts_gets_a_choice_each_equal_to_hf(client, target, pair):
    """Greedy, 3 prompts × n 2: choices 2i and 2i+1 are prompt i's HF greedy text; usage
    counts each prompt's tokens once and every choice's completion."""
    model, tokenizer = target
    r = client.completions.create(model=Path(pair[0]).name, prompt=PROMPTS, max_tokens=12,
                                  temperature=0, n=2)
    expected = _greedy_texts(target, PROMPTS, 12)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in expected for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert r.usage.completion_tokens == 6 * 12
    assert r.model_extra["session_id"] == ""


def test_seeded_choices_are_the_single_requests_seeded_seed_plus_j(client, pair):
    """n 3 with seed s samples what three single requests seeded s, s + 1, s + 2 sample
    (the choices differ: their seeds do), and the same request samples it again."""
    args = dict(model=pair[0], prompt=PROMPTS[0], max_tokens=16, temperature=0.9)
    many = [c.text for c in client.completions.create(**args, n=3, seed=1234).choices]
    singles = [client.completions.create(**args, seed=1234 + j).choices[0].text
               for j in range(3)]
    assert many == singles
    assert len(set(many)) > 1, "three seeds should sample something else"
    assert [c.text for c in client.completions.create(**args, n=3, seed=1234).choices] == many


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_carry_their_index_and_join_to_the_whole(client, pair, chat):
    """4 choices streamed (chat: n 4; completions: 2 prompts × n 2): each index's deltas join
    to that choice's non-streamed text, each ends once with its finish reason, a chat
    choice's first delta carries the role, and the usage chunk sums the choices'."""
    name = Path(pair[0]).name
    if chat:
        create = client.chat.completions.create
        args = dict(model=name, max_tokens=20, temperature=0, n=4,
                    messages=[{"role": "user", "content": "Write a parser."}])
    else:
        create = client.completions.create
        args = dict(model=name, max_tokens=20, temperature=0, n=2, prompt=PROMPTS[1:])
    whole = create(**args)
    texts = [c.message.content if chat else c.text for c in whole.choices]
    *deltas, last = list(create(**args, stream=True, stream_options={"include_usage": True}))
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    # several choices keep no session: none is named, in the body or in any chunk
    assert {c.model_extra["session_id"] for c in [whole, *deltas, last]} == {""}
    joined, finished, firsts = ["" for _ in texts], [[] for _ in texts], set()
    for chunk in deltas:
        (choice,) = chunk.choices
        if choice.index not in firsts and chat:
            assert choice.delta.role == "assistant"
        firsts.add(choice.index)
        joined[choice.index] += (choice.delta.content or "") if chat else choice.text
        if choice.finish_reason:
            finished[choice.index].append(choice.finish_reason)
    assert joined == texts
    assert finished == [[c.finish_reason] for c in whole.choices]


def test_list_prompts_logprobs_start_each_choice_at_offset_zero(client, pair):
    r = client.completions.create(model=pair[0], prompt=PROMPTS[:2], max_tokens=6,
                                  temperature=0, logprobs=1)
    for choice in r.choices:
        lp = choice.logprobs
        assert lp.text_offset[0] == 0 and len(lp.tokens) == 6
        assert "".join(lp.tokens) == choice.text


@pytest.mark.parametrize("kwargs, param, message", [
    ({"n": 0}, "n", f"n must be in 1..{MAX_N}, got 0"),
    ({"n": 65}, "n", "n (65) × one prompt asks 65 choices; this gateway runs at most 64"),
    ({"n": 2, "extra_body": {"keep_session": True}}, "n", "session_id and keep_session take "
                                                          "one choice"),
    ({"prompt": ["a", "b"], "extra_body": {"keep_session": True}}, "prompt",
     "session_id and keep_session take one choice"),
])
def test_bad_choices_are_400_naming_the_field(client, pair, kwargs, param, message):
    args = {"model": pair[0], "prompt": "x", "max_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert message in err.value.body["message"]


def _counter(metrics_port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_a_client_that_leaves_a_stream_of_choices_stops_every_choice(client, http_mesh, pair):
    """Eight streamed choices of 512 tokens each; the client reads the first chunk and closes
    the connection: every choice's generation ends (no request stays in flight) having
    decoded a small part of the 4,096 tokens the choices would have run to."""
    import time

    port = http_mesh[2]
    before = _counter(port, "specmesh_tokens_generated_total")
    stream = client.completions.create(model=pair[0], prompt=PROMPTS[0], max_tokens=512,
                                       temperature=0, n=8, stream=True)
    assert next(iter(stream)).choices
    assert _counter(port, "specmesh_requests_active") == 8
    stream.close()
    deadline = time.monotonic() + 10
    while _counter(port, "specmesh_requests_active") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _counter(port, "specmesh_requests_active") == 0
    assert _counter(port, "specmesh_tokens_generated_total") - before < 4096 / 4
