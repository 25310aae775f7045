"""Chat prompts without a mesh: a model's own chat template, the default one, and a
continued session's turn (the HTTP API's end-to-end chat tests: test_openai_api.py)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from gateway.http.chat import render_chat, validate_messages
from gateway.http.errors import ApiError

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture()
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair[0])


def test_a_models_own_template_is_used_and_a_continued_turn_drops_its_bos(tokenizer):
    tokenizer.chat_template = TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    bos = tokenizer.bos_token
    assert bos
    assert render_chat(tokenizer, messages) == f"{bos}<|system|>Be brief.<|user|>hi<|assistant|>"
    assert render_chat(tokenizer, messages[1:], continuing=True) == "<|user|>hi<|assistant|>"


def test_the_default_template_for_models_without_one(tokenizer):
    assert not tokenizer.chat_template
    messages = validate_messages([{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": [{"type": "text", "text": "h"},
                                                               {"type": "text", "text": "i"}]},
                                  {"role": "assistant", "content": "ok"}])
    assert render_chat(tokenizer, messages) == (
        "System: Be brief.\nUser: hi\nAssistant: ok\nAssistant:")
    assert render_chat(tokenizer, messages[1:2], continuing=True) == "\nUser: hi\nAssistant:"


@pytest.mark.parametrize("messages, param", [
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, "text"], "messages[1]"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ([{"role": "assistant", "content": None, "tool_calls": [{}]}], "messages[0].tool_calls"),
])
def test_bad_messages_name_the_field(messages, param):
    with pytest.raises(ApiError) as err:
        validate_messages(messages)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(param.split(".")[0])
