"""`specmesh bench --peer NAME=URL`: what the option accepts and the error for what it does
not (the peer runs themselves: tests/test_openai_api.py, against a real server)."""

from __future__ import annotations

import pytest

from specmesh.bench_peers import Peer, parse_peers


def test_peers_parse_from_repeated_and_comma_separated_values():
    got = parse_peers(["vllm=http://127.0.0.1:8101/v1/,llama_cpp=http://h:8103/v1",
                       "vllm-draft=https://x/v1"])
    assert got == [Peer("vllm", "http://127.0.0.1:8101/v1"), Peer("llama_cpp", "http://h:8103/v1"),
                   Peer("vllm-draft", "https://x/v1")]
    assert got[0].key == "peer:vllm"
    assert parse_peers([]) == []


@pytest.mark.parametrize("value, words", [
    ("vllm", "NAME=URL"), ("=http://x/v1", "NAME=URL"), ("vllm=127.0.0.1:8101", "http(s)"),
    ("v llm=http://x/v1", "letters, digits"), ("a=http://x/v1,a=http://y/v1", "twice"),
])
def test_bad_peers_say_what_to_fix(value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_peers([value])
