"""Tests for gateway/detokenizer.py (incremental detokenization, stop strings)."""

from __future__ import annotations

import random

import pytest
import transformers  # noqa: F401,E402

from gateway.detokenizer import IncrementalDetokenizer, StopMatcher
from services.tiny_models import build_tokenizer

CODE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]


if __name__ == "__main__":
    print(fibonacci(10))  # [0, 1, 1, 2, ...]
'''
ACCENTS = "Héllo wörld! Café, naïve façade, señor — déjà vu. é"
CJK = "中文字符测试：你好，世界。混合 English 和中文。"
EMOJI = "ok 🙂 party 🎉🎉 thumbs 👍🏽 coder 👩‍💻 end🙂"
MIXED = "x = 'é中🙂'  # café 中文 🙂\n" * 3

TEXTS = {"code": CODE, "accents": ACCENTS, "cjk": CJK, "emoji": EMOJI, "mixed": MIXED}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("detok_tok"))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


def _stream(tok, prompt_ids, gen_ids, chunks, skip_special_tokens=True):
    det = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = []
    pos = 0
    for n in chunks:
        pieces.append(det.push(gen_ids[pos : pos + n]))
        pos += n
    assert pos == len(gen_ids)
    tail = det.flush()
    return pieces, tail


# --------------------------------------------------------------------------
# IncrementalDetokenizer
# --------------------------------------------------------------------------
def test_emoji_is_split_across_byte_level_tokens(tokenizer):
    # Precondition for the multi-byte tests to mean something.
    for ch in ("🙂", "中", "é"):
        pieces = [tokenizer.decode([i]) for i in _ids(tokenizer, ch)]
        if len(pieces) > 1:
            assert any("\ufffd" in p for p in pieces)
    assert len(_ids(tokenizer, "🙂")) > 1


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_token_at_a_time_matches_full_decode(tokenizer, name):
    text = TEXTS[name]
    prompt = tokenizer("Here is some text:\n").input_ids  # starts with <s>
    gen = _ids(tokenizer, text)
    pieces, tail = _stream(tokenizer, prompt, gen, [1] * len(gen))
    assert tail == ""
    assert "".join(pieces) == tokenizer.decode(gen) == text
    for p in pieces:
        assert "\ufffd" not in p
    if name in ("emoji", "cjk", "mixed"):
        # some tokens complete no character: their text is held back
        assert "" in pieces


def test_each_piece_is_emitted_as_soon_as_complete(tokenizer):
    gen = _ids(tokenizer, EMOJI)
    det = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    emitted = ""
    for i, t in enumerate(gen):
        emitted += det.push([t])
        full = tokenizer.decode(gen[: i + 1])
        # everything up to the last complete character has been emitted
        assert emitted == full.rstrip("\ufffd")
    assert det.flush() == ""


@pytest.mark.parametrize("seed", range(5))
def test_random_chunk_sizes_give_same_total(tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(TEXTS[k] for k in sorted(TEXTS))
    gen = _ids(tokenizer, text)
    chunks = []
    left = len(gen)
    while left:
        n = min(left, rng.randint(1, 7))
        chunks.append(n)
        left -= n
    prompt = tokenizer(MIXED[:20]).input_ids
    pieces, tail = _stream(tokenizer, prompt, gen, chunks)
    assert "".join(pieces) + tail == text
    assert tail == ""
    assert not any("\ufffd" in p for p in pieces)


def test_no_prompt_and_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    gen = _ids(tokenizer, "abc é") + [eos] + _ids(tokenizer, "🙂 z") + [eos]
    for skip in (True, False):
        pieces, tail = _stream(tokenizer, [], gen, [1] * len(gen), skip_special_tokens=skip)
        assert "".join(pieces) + tail == tokenizer.decode(gen, skip_special_tokens=skip)
    assert "".join(_stream(tokenizer, [], gen, [1] * len(gen))[0]) == "abc é🙂 z"
    with_special = "".join(_stream(tokenizer, [], gen, [1] * len(gen), False)[0])
    assert with_special == "abc é</s>🙂 z</s>"


def test_incomplete_character_at_end_is_flushed(tokenizer):
    emoji_ids = _ids(tokenizer, "🙂")
    assert len(emoji_ids) > 1
    gen = _ids(tokenizer, "hi ") + emoji_ids[:-1]  # stream stops mid-character
    det = IncrementalDetokenizer(tokenizer, tokenizer("x").input_ids)
    out = "".join(det.push([t]) for t in gen)
    assert out == "hi "
    tail = det.flush()
    assert tail.startswith("\ufffd")
    assert out + tail == tokenizer.decode(gen)
    assert det.flush() == ""
    with pytest.raises(RuntimeError):
        det.push([1])


def test_prompt_ending_mid_character(tokenizer):
    # A prompt that ends inside a multi-byte character must not leak into the
    # generated text: the pieces still equal decode(generated).
    emoji_ids = _ids(tokenizer, "🙂")
    prompt = tokenizer("a").input_ids + emoji_ids[:-1]
    gen = emoji_ids[-1:] + _ids(tokenizer, " ok 中文")
    pieces, tail = _stream(tokenizer, prompt, gen, [1] * len(gen))
    assert "".join(pieces) + tail == tokenizer.decode(gen)


def test_window_stays_small(tokenizer):
    """Each push decodes a few recent tokens, not the whole history."""

    class Recording:
        def __init__(self, tok):
            self.tok = tok
            self.lengths: list[int] = []

        def decode(self, ids, **kw):
            self.lengths.append(len(ids))
            return self.tok.decode(ids, **kw)

    rec = Recording(tokenizer)
    gen = _ids(tokenizer, CODE * 4 + EMOJI * 4)
    assert len(gen) > 400
    det = IncrementalDetokenizer(rec, tokenizer(CODE).input_ids)
    out = "".join(det.push([t]) for t in gen) + det.flush()
    assert out == CODE * 4 + EMOJI * 4
    assert max(rec.lengths) <= 12


def test_empty_push(tokenizer):
    det = IncrementalDetokenizer(tokenizer, tokenizer("a").input_ids)
    assert det.push([]) == ""
    assert det.push(_ids(tokenizer, "hello")) == "hello"
    assert det.num_generated == len(_ids(tokenizer, "hello"))
    assert det.flush() == ""


# --------------------------------------------------------------------------
# StopMatcher
# --------------------------------------------------------------------------
def _run_stop(stop, feeds):
    m = StopMatcher(stop)
    out = []
    stopped = False
    for f in feeds:
        piece, stopped = m.feed(f)
        out.append(piece)
        if stopped:
            break
    tail = "" if stopped else m.flush()
    return "".join(out) + tail, stopped, out


def test_stop_split_across_feeds():
    m = StopMatcher(["STOP"])
    assert m.feed("hello ST") == ("hello ", False)  # "ST" held back
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    assert m.stopped and m.matched == "STOP"
    assert m.feed("ignored") == ("", True)
    assert m.flush() == ""


def test_text_before_stop_emitted_exactly():
    text, stopped, _ = _run_stop(["\n\n"], ["line one\nline", " two\n", "\nline three"])
    assert stopped
    assert text == "line one\nline two"


def test_stop_at_start_and_inside_single_feed():
    assert StopMatcher(["<end>"]).feed("<end>abc") == ("", True)
    assert StopMatcher(["<end>"]).feed("ab<end>c") == ("ab", True)


def test_partial_match_that_is_not_a_stop_is_emitted_unchanged():
    m = StopMatcher(["STOP"])
    assert m.feed("abc S") == ("abc ", False)
    assert m.feed("TO") == ("", False)
    assert m.feed("x def ST") == ("STOx def ", False)
    assert m.flush() == "ST"
    assert not m.stopped and m.matched is None
    text, stopped, _ = _run_stop(["STOP"], ["abc S", "TO", "x def ST"])
    assert (text, stopped) == ("abc STOx def ST", False)


def test_multiple_stop_strings_earliest_wins():
    text, stopped, _ = _run_stop(["END", "STOP"], ["a STOP b END c"])
    assert (text, stopped) == ("a ", True)
    m = StopMatcher(["END", "STOP"])
    m.feed("x EN")
    m.feed("D y STOP")
    assert m.matched == "END"
    # overlapping stops: the one that completes first in the stream wins
    assert _run_stop(["abcd", "bc"], ["abcd"])[0] == "a"
    assert _run_stop(["abc", "bc"], ["abc"])[0] == ""


def test_empty_stop_list_is_passthrough():
    m = StopMatcher([])
    assert m.feed("STOP ab") == ("STOP ab", False)
    assert m.feed("") == ("", False)
    assert m.flush() == ""
    m2 = StopMatcher(["", "x"])  # empty strings are ignored
    assert m2.feed("ab") == ("ab", False)


@pytest.mark.parametrize("seed", range(20))
def test_stop_result_independent_of_split(seed):
    rng = random.Random(seed)
    alphabet = "abc é中"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(3)]
    text = "".join(rng.choice(alphabet) for _ in range(60))
    whole = _run_stop(stops, [text])[:2]
    # reference: scan end positions; first completed stop (ties: earliest start)
    ref = (text, False)
    for end in range(1, len(text) + 1):
        hits = [end - len(s) for s in stops if text[:end].endswith(s)]
        if hits:
            ref = (text[: min(hits)], True)
            break
    assert whole == ref
    for _ in range(5):
        feeds = []
        i = 0
        while i < len(text):
            n = rng.randint(0, 5)
            feeds.append(text[i : i + n])
            i += n
        assert _run_stop(stops, feeds)[:2] == ref


def test_detokenizer_with_stop_matcher(tokenizer):
    text = "print('中文 🙂')\n# END of block\nnever shown"
    gen = _ids(tokenizer, text)
    det = IncrementalDetokenizer(tokenizer, tokenizer("code:").input_ids)
    m = StopMatcher(["# END", "never"])
    out = ""
    stopped = False
    for t in gen:
        piece, stopped = m.feed(det.push([t]))
        out += piece
        if stopped:
            break
    assert stopped and m.matched == "# END"
    assert out == "print('中文 🙂')\n"


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer whose decode drops the leading space of
    its first word, so decoding a window needs context to stay correct."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = [CODE, ACCENTS, "Hello there, the world is wide and the sea is deep. " * 20]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


def test_context_window_keeps_leading_spaces(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt_text = "Hello there,"
    full = tok("Hello there, the world is wide and the sea is deep.", add_special_tokens=False).input_ids
    prompt = tok(prompt_text, add_special_tokens=False).input_ids
    assert full[: len(prompt)] == prompt
    gen = full[len(prompt) :]
    # the tokenizer drops a decode's leading space: context matters
    assert tok.decode(gen[:1]) != " " + tok.decode(gen[:1]).lstrip()
    expected = tok.decode(full)[len(tok.decode(prompt)) :]
    assert expected == " the world is wide and the sea is deep."
    for pattern in ([1], [2, 3], [4, 1]):
        chunks, left, i = [], len(gen), 0
        while left:
            chunks.append(min(left, pattern[i % len(pattern)]))
            left -= chunks[-1]
            i += 1
        pieces, tail = _stream(tok, prompt, gen, chunks)
        assert "".join(pieces) + tail == expected
