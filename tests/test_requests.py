"""One request model for both doors (gateway/requests.py): the gRPC API's and the HTTP API's
requests are validated by one set of rules, so a request one door rejects the other rejects
for the same field, each naming it in its own API's words. In process: pure logic."""

from __future__ import annotations

import json

import pytest

from gateway.http.schemas import CHAT, COMPLETIONS
from gateway.requests import GRPC, RequestFields, validate
from gateway.servicer import request_fields
from services.config import GatewayConfig, ServerConfig
from services.errors import InvalidArgument
from specmesh.client import build_request
from specmesh.v1 import gateway_pb2

CONFIG = GatewayConfig(server=ServerConfig(port=1), redis_url="redis://unused",
                       verifiers=("h:1",), drafters=("h:2",), max_new_tokens_cap=512,
                       default_max_new_tokens=64, max_stop_strings=4)
VOCAB = 1000
OK = RequestFields(prompt="x")

# (the bad request, the neutral field, its name in gRPC, completions and chat, message part)
BAD = [
    (dict(temperature=2.5), "temperature", "sampling.temperature", "temperature",
     "temperature", "must be in [0, 2] (0 = greedy), got 2.5"),
    (dict(temperature=float("nan")), "temperature", "sampling.temperature", "temperature",
     "temperature", "must be in [0, 2]"),
    (dict(temperature=-0.1), "temperature", "sampling.temperature", "temperature",
     "temperature", "got -0.1"),
    (dict(top_p=0.0), "top_p", "sampling.top_p", "top_p", "top_p", "must be in (0, 1], got 0"),
    (dict(top_k=-2), "top_k", "sampling.top_k", "top_k", "top_k", "must be >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens", "sampling.max_new_tokens", "max_tokens",
     "max_tokens", "must be in 1..512, got 0"),
    (dict(max_new_tokens=513), "max_new_tokens", "sampling.max_new_tokens", "max_tokens",
     "max_tokens", "must be in 1..512, got 513"),
    (dict(stop=("",)), "stop", "sampling.stop", "stop", "stop", "1..256 characters"),
    (dict(stop=("a",) * 5), "stop", "sampling.stop", "stop", "stop", "holds 5 strings"),
    (dict(seed=2**64), "seed", "sampling.seed", "seed", "seed", "0..2^64-1"),
    (dict(num_draft_tokens=65), "num_draft_tokens", "speculation.num_draft_tokens",
     "speculation.num_draft_tokens", "speculation.num_draft_tokens", "0..64"),
    (dict(drafter="big"), "drafter", "speculation.drafter", "speculation.drafter",
     "speculation.drafter", "got 'big'"),
    (dict(session_id="s" * 129), "session_id", "session_id", "session_id", "session_id",
     "at most 128 printable"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "top_logprobs", "logprobs",
     "top_logprobs", "must be in 0..20, got 21"),
    (dict(prompt="", prompt_ids=(1, 1000)), "prompt_ids", "prompt_token_ids", "prompt",
     "messages", "outside the vocabulary [0, 1000): [1000]"),
    (dict(prompt="", prompt_ids=(-4,)), "prompt_ids", "prompt_token_ids", "prompt", "messages",
     "outside the vocabulary"),
    (dict(prompt=""), "prompt", "prompt", "prompt", "messages", "is empty"),
    (dict(prompt="x" * 1_000_001), "prompt", "prompt", "prompt", "messages",
     "1000001 characters"),
]


@pytest.mark.parametrize("bad, neutral, grpc_name, completions_name, chat_name, part", BAD)
def test_every_door_rejects_the_same_field_in_its_own_words(bad, neutral, grpc_name,
                                                             completions_name, chat_name, part):
    fields = RequestFields(**{"prompt": "x", **bad})
    for door, name in ((GRPC, grpc_name), (COMPLETIONS, completions_name), (CHAT, chat_name)):
        with pytest.raises(InvalidArgument) as err:
            validate(fields, CONFIG, door, VOCAB)
        assert err.value.field == neutral, door.name
        assert str(err.value).startswith(name) or f" {name} " in str(err.value), (door.name,
                                                                                   str(err.value))
        assert part in str(err.value), (door.name, str(err.value))


def test_top_logprobs_without_logprobs_is_worded_per_door():
    fields = RequestFields(prompt="x", top_logprobs=3)
    words = {}
    for door in (GRPC, COMPLETIONS, CHAT):
        with pytest.raises(InvalidArgument) as err:
            validate(fields, CONFIG, door, VOCAB)
        words[door.name] = str(err.value)
    assert words == {"grpc": "top_logprobs needs logprobs = true",
                     "completions": "logprobs needs logprobs",
                     "chat": "top_logprobs needs logprobs: true"}


def test_defaults_differ_only_where_the_apis_do():
    grpc_spec = validate(OK, CONFIG, GRPC, VOCAB)
    http_spec = validate(OK, CONFIG, COMPLETIONS, VOCAB)
    assert grpc_spec.params.temperature == 0.0  # the gRPC API is greedy by default
    assert http_spec.params.temperature == 1.0  # OpenAI's default
    for spec in (grpc_spec, http_spec):
        assert spec.max_new_tokens == 64 and spec.params.top_p == 1.0
        assert spec.params.top_k == 0 and spec.seed is None and spec.logprobs == -1
        assert spec.speculate and spec.explicit == frozenset()
    assert validate(RequestFields(prompt="x", temperature=2.0), CONFIG, GRPC,
                    VOCAB).params.temperature == 2.0  # the bound itself is allowed


def test_explicit_marks_the_settings_given_even_when_equal_to_a_default():
    spec = validate(RequestFields(prompt="x", temperature=0.0, top_k=0, stop=("\n",),
                                  drafter="model", disable_speculation=True),
                    CONFIG, GRPC, VOCAB)
    assert spec.explicit == {"temperature", "top_k", "stop", "drafter", "disable_speculation"}
    assert not spec.speculate and spec.drafter_kind == "model"


def test_grpc_message_maps_set_and_unset_fields():
    unset = request_fields(build_request("hi"))
    assert unset == RequestFields(prompt="hi")  # nothing given: every setting None/empty
    req = build_request("hi", max_new_tokens=5, temperature=0.0, top_p=0.5, top_k=3, seed=7,
                        stop=["\n"], num_draft_tokens=4, drafter="ngram", session_id="s1",
                        resume_from=0)
    req.logprobs, req.top_logprobs = True, 2
    f = request_fields(req)
    assert (f.max_new_tokens, f.temperature, f.top_p, f.top_k, f.seed) == (5, 0.0, 0.5, 3, 7)
    assert (f.stop, f.num_draft_tokens, f.drafter, f.session_id) == (("\n",), 4, "ngram", "s1")
    assert f.logprobs and f.top_logprobs == 2
    spec = validate(f, CONFIG, GRPC, VOCAB)
    assert spec.logprobs == 2 and spec.keep_session  # a named session is kept


def test_resume_rules():
    with pytest.raises(InvalidArgument, match="resume_from needs the session_id") as err:
        validate(RequestFields(resume_from=3), CONFIG, GRPC, VOCAB)
    assert err.value.field == "resume_from"
    with pytest.raises(InvalidArgument, match="leave prompt empty"):
        validate(RequestFields(prompt="x", session_id="s", resume_from=3), CONFIG, GRPC, VOCAB)
    spec = validate(RequestFields(session_id="s", resume_from=3), CONFIG, GRPC, VOCAB)
    assert spec.resume_from == 3 and spec.prompt == ""
    with pytest.raises(InvalidArgument, match="either prompt or prompt_token_ids"):
        validate(RequestFields(prompt="x", prompt_ids=(1,)), CONFIG, GRPC, VOCAB)


def test_the_proto_has_every_field_the_grpc_door_names():
    """A renamed proto field would make the gRPC door's errors name a field that is not there."""
    req = gateway_pb2.GenerateRequest
    for name in GRPC.names.values():
        message = req.DESCRIPTOR
        for part in name.split("."):
            field = message.fields_by_name[part]  # KeyError if the proto has no such field
            message = field.message_type or message


def test_a_resume_keeps_the_turns_settings_and_rejects_a_different_one():
    from gateway.turns import TurnRecord, resumed_spec

    original = validate(RequestFields(prompt="x", temperature=0.7, top_k=5, seed=3,
                                      max_new_tokens=40, stop=("\n",)), CONFIG, GRPC, VOCAB)
    turn = TurnRecord.begin(original, start=10, prompt_tokens=10, seed=3)
    # the record survives its trip through Redis (JSON) field for field
    turn.rounds, turn.finish = 4, "LENGTH"
    stored = json.loads(json.dumps(turn.to_dict()))
    assert stored["stop"] == ["\n"] and stored["temperature"] == 0.7 and stored["rounds"] == 4
    assert TurnRecord.from_dict(stored) == turn
    # a resume that gives no setting continues with the turn's own
    spec = resumed_spec(validate(RequestFields(session_id="s", resume_from=12), CONFIG, GRPC,
                                 VOCAB), turn)
    assert (spec.params.temperature, spec.params.top_k, spec.seed) == (0.7, 5, 3)
    assert (spec.max_new_tokens, spec.stop, spec.resume_from) == (40, ("\n",), 12)
    # one that repeats a setting unchanged is fine, even a default-looking one
    same = validate(RequestFields(session_id="s", resume_from=12, temperature=0.7, top_k=5),
                    CONFIG, GRPC, VOCAB)
    assert resumed_spec(same, turn).params.temperature == 0.7
    # one that changes a setting is refused, naming it as the gRPC API does
    for change, neutral, name in ((dict(temperature=0.0), "temperature", "sampling.temperature"),
                                  (dict(top_k=0), "top_k", "sampling.top_k"),
                                  (dict(drafter="ngram"), "drafter", "speculation.drafter")):
        other = validate(RequestFields(session_id="s", resume_from=12, **change), CONFIG, GRPC,
                         VOCAB)
        with pytest.raises(InvalidArgument, match=f"^{name} is .* was started with") as err:
            resumed_spec(other, turn)
        assert err.value.field == neutral
