"""Tests for services/tiny_models.py (tiny deterministic target/draft pair)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

from services.tiny_models import MARKER_NAME, build_tiny_pair, build_tokenizer, load_corpus


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny_pair")
    t0 = time.perf_counter()
    target_dir, draft_dir = build_tiny_pair(root, seed=0)
    elapsed = time.perf_counter() - t0
    assert target_dir == root / "target" and draft_dir == root / "draft"
    assert elapsed < 30, f"build took {elapsed:.1f}s"
    return root


@pytest.fixture(scope="session")
def tokenizer(tiny_root):
    return AutoTokenizer.from_pretrained(str(tiny_root / "target"))


@pytest.fixture(scope="session")
def target(tiny_root):
    return AutoModelForCausalLM.from_pretrained(str(tiny_root / "target")).eval()


@pytest.fixture(scope="session")
def draft(tiny_root):
    return AutoModelForCausalLM.from_pretrained(str(tiny_root / "draft")).eval()


@pytest.fixture(scope="session")
def corpus_ids(tokenizer) -> list[list[int]]:
    """A few teacher-forcing sequences of stdlib text (with bos)."""
    texts = load_corpus()
    seqs = []
    for text in texts[1::4]:
        ids = tokenizer(text[500:4000]).input_ids[:200]
        if len(ids) >= 100:
            seqs.append(ids)
    assert len(seqs) >= 5
    return seqs


def _state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------
# Loading / tokenizer
# --------------------------------------------------------------------------
def test_pair_loads_and_shares_vocabulary(tiny_root, tokenizer, target, draft):
    draft_tok = AutoTokenizer.from_pretrained(str(tiny_root / "draft"))
    assert tokenizer.get_vocab() == draft_tok.get_vocab()
    assert len(tokenizer) == 512
    for model in (target, draft):
        assert model.config.model_type == "llama"
        assert model.config.vocab_size == len(tokenizer)
        assert model.config.bos_token_id == tokenizer.bos_token_id
        assert model.config.eos_token_id == tokenizer.eos_token_id
        assert model.generation_config.eos_token_id == tokenizer.eos_token_id
        assert model.generation_config.bos_token_id == tokenizer.bos_token_id
        assert not model.config.tie_word_embeddings
        assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert target.config.num_hidden_layers == 2
    assert draft.config.num_hidden_layers == 1
    # the draft really is a different model
    assert not torch.equal(target.lm_head.weight, draft.lm_head.weight)
    assert (tiny_root / "target" / "model.safetensors").is_file()
    marker = json.loads((tiny_root / MARKER_NAME).read_text())
    assert marker["seed"] == 0 and marker["vocab_size"] == 512


def test_tokenizer_adds_bos_not_eos(tokenizer):
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.unk_token == "<unk>"
    ids = tokenizer("def main():").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.eos_token_id not in ids
    plain = tokenizer("def main():", add_special_tokens=False).input_ids
    assert ids[1:] == plain
    assert tokenizer.bos_token_id not in plain
    # BPE merges were learned: common code words take fewer tokens than bytes
    assert len(tokenizer("return self", add_special_tokens=False).input_ids) < len("return self")


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x + 1  # comment\n",
        "héllo wörld, café",
        "中文字符测试",
        "smile 🙂 party 🎉 thumbs 👍🏽 coder 👩‍💻!",
        "  leading and trailing spaces \t\n",
        "mixed: é中🙂a\u0301",
    ],
)
def test_decode_encode_round_trip(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == "<s>" + text


def test_multibyte_characters_split_across_tokens(tokenizer):
    # the emoji's 4 UTF-8 bytes are not a single token: byte-level pieces
    ids = tokenizer("🙂", add_special_tokens=False).input_ids
    assert len(ids) > 1
    assert tokenizer.decode(ids) == "🙂"


# --------------------------------------------------------------------------
# Determinism / cache
# --------------------------------------------------------------------------
def test_same_seed_identical_different_seed_different(tiny_root, tmp_path):
    ref_t = _state_dict(tiny_root / "target")
    ref_d = _state_dict(tiny_root / "draft")
    ref_vocab = json.loads((tiny_root / "target" / "tokenizer.json").read_text())

    other = tmp_path / "again"
    build_tiny_pair(other, seed=0)
    _assert_same_weights(_state_dict(other / "target"), ref_t)
    _assert_same_weights(_state_dict(other / "draft"), ref_d)
    assert json.loads((other / "target" / "tokenizer.json").read_text()) == ref_vocab

    # rebuilding over an existing dir with another seed replaces the weights
    build_tiny_pair(other, seed=1)
    new_t = _state_dict(other / "target")
    new_d = _state_dict(other / "draft")
    assert not torch.equal(new_t["lm_head.weight"], ref_t["lm_head.weight"])
    assert not torch.equal(new_t["model.embed_tokens.weight"], ref_t["model.embed_tokens.weight"])
    assert not torch.equal(new_d["lm_head.weight"], ref_d["lm_head.weight"])
    assert json.loads((other / MARKER_NAME).read_text())["seed"] == 1
    # same vocabulary regardless of the model seed
    assert json.loads((other / "draft" / "tokenizer.json").read_text()) == ref_vocab


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    build_tiny_pair(tmp_path / "p", seed=3)
    assert torch.equal(torch.rand(3), expected)


def test_cache_reuses_complete_pair_and_rebuilds_incomplete(tiny_root, tmp_path):
    weights = tiny_root / "target" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_pair(tiny_root, seed=0) == (tiny_root / "target", tiny_root / "draft")
    assert time.perf_counter() - t0 < 1.0
    assert weights.stat().st_mtime_ns == mtime  # not rewritten

    # an incomplete pair (missing draft weights) is rebuilt
    other = tmp_path / "broken"
    build_tiny_pair(other, seed=0)
    (other / "draft" / "model.safetensors").unlink()
    build_tiny_pair(other, seed=0)
    _assert_same_weights(_state_dict(other / "draft"), _state_dict(tiny_root / "draft"))
    # no staging leftovers
    assert sorted(p.name for p in other.iterdir() if not p.name.startswith(".specmesh")) == [
        "draft",
        MARKER_NAME,
        "target",
    ]


def test_build_tokenizer_standalone(tmp_path, tokenizer):
    tok = build_tokenizer(tmp_path / "tok")
    assert tok.get_vocab() == tokenizer.get_vocab()
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert loaded("x").input_ids[0] == loaded.bos_token_id
    small = build_tokenizer(tmp_path / "small", vocab_size=300)
    assert len(small) == 300
    assert small.decode(small("naïve 中文 🙂").input_ids, skip_special_tokens=True) == "naïve 中文 🙂"


# --------------------------------------------------------------------------
# Draft/target behaviour
# --------------------------------------------------------------------------
@torch.no_grad()
def test_greedy_agreement_partial(target, draft, corpus_ids):
    agree = total = 0
    for ids in corpus_ids:
        x = torch.tensor([ids])
        t_arg = target(input_ids=x).logits[0].argmax(-1)
        d_arg = draft(input_ids=x).logits[0].argmax(-1)
        agree += int((t_arg == d_arg).sum())
        total += t_arg.numel()
    rate = agree / total
    print(f"draft/target greedy agreement: {rate:.3f} over {total} positions")
    assert 0.2 < rate < 0.95


@torch.no_grad()
def test_logits_are_peaky(target, corpus_ids):
    rel_gaps = []
    for ids in corpus_ids:
        logits = target(input_ids=torch.tensor([ids])).logits[0]
        top2 = logits.topk(2, dim=-1).values
        rel_gaps.append((top2[:, 0] - top2[:, 1]) / logits.abs().amax(dim=-1))
    rel = torch.cat(rel_gaps)
    frac_tiny = float((rel < 1e-3).float().mean())
    print(
        f"top1-top2 relative gap: median {float(rel.median()):.3g}, "
        f"min {float(rel.min()):.3g}, frac<1e-3 {frac_tiny:.4f}"
    )
    assert float(rel.median()) > 1e-2
    assert frac_tiny < 0.02
    # logits are far from flat
    assert float(logits.std(dim=-1).mean()) > 1.0


@torch.no_grad()
def test_incremental_logits_match_batched(target, corpus_ids):
    """One-token-at-a-time cached forward ~= full forward (rounding only)."""
    ids = corpus_ids[0][:48]
    x = torch.tensor([ids])
    full = target(input_ids=x).logits[0]
    cache = DynamicCache(config=target.config)
    steps = []
    for i in range(len(ids)):
        out = target(
            input_ids=x[:, i : i + 1],
            past_key_values=cache,
            position_ids=torch.tensor([[i]]),
            use_cache=True,
        )
        steps.append(out.logits[0, -1])
    inc = torch.stack(steps)
    rel_diff = float(((full - inc).abs().amax(-1) / full.abs().amax(-1)).max())
    top2 = full.topk(2, dim=-1).values
    min_rel_gap = float(((top2[:, 0] - top2[:, 1]) / full.abs().amax(-1)).min())
    print(f"batched vs incremental: max rel diff {rel_diff:.2e}, min rel gap {min_rel_gap:.2e}")
    assert rel_diff < 1e-5
    assert torch.equal(full.argmax(-1), inc.argmax(-1))


def _forward_chunk(model, cache, tokens: list[int], start: int) -> torch.Tensor:
    pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
    out = model(
        input_ids=torch.tensor([tokens]), past_key_values=cache, position_ids=pos, use_cache=True
    )
    return out.logits[0]


@torch.no_grad()
def _speculative_greedy(target, draft, prompt: list[int], max_new: int, eos: int, rng):
    """Greedy speculative decoding with a chunked, cropped target KV cache.

    The target cache always holds every token but the last (``pending``).
    Each round the draft proposes k (3..5) tokens; the target verifies
    [pending] + proposals in ONE forward, accepts the matching prefix plus its
    own next token, and crops the rejected positions from the cache.
    """
    cache = DynamicCache(config=target.config)
    ctx = prompt[:-1]
    pos = 0
    while pos < len(ctx):  # chunked prefill, 3..5 tokens per forward
        n = rng.randint(3, 5)
        _forward_chunk(target, cache, ctx[pos : pos + n], pos)
        pos += len(ctx[pos : pos + n])
    assert cache.get_seq_length() == len(ctx)

    seq = list(prompt)
    generated: list[int] = []
    proposed = accepted = 0
    while len(generated) < max_new and (not generated or generated[-1] != eos):
        k = rng.randint(3, 5)
        proposal: list[int] = []
        for _ in range(k):  # draft: plain greedy, no cache
            logits = draft(input_ids=torch.tensor([seq + proposal])).logits[0, -1]
            proposal.append(int(logits.argmax()))
        n_cached = cache.get_seq_length()
        assert n_cached == len(seq) - 1
        logits = _forward_chunk(target, cache, [seq[-1]] + proposal, n_cached)
        preds = logits.argmax(-1).tolist()  # k+1 predictions
        j = 0
        while j < k and proposal[j] == preds[j]:
            j += 1
        new = proposal[:j] + [preds[j]]
        proposed += k
        accepted += j
        if k - j:
            cache.crop(-(k - j))  # drop the rejected positions
        seq += new
        generated += new
        if eos in generated:
            generated = generated[: generated.index(eos) + 1]
    return generated[:max_new], proposed, accepted


@torch.no_grad()
def test_generate_matches_chunked_speculative_verifier(target, draft, tokenizer):
    texts = load_corpus()
    rng = random.Random(0)
    prompts = []
    for i in range(20):
        text = texts[i % len(texts)]
        start = rng.randrange(0, max(1, len(text) - 200))
        n_chars = rng.randint(5, 80)
        prompts.append(tokenizer(text[start : start + n_chars]).input_ids)
    eos = tokenizer.eos_token_id
    total_prop = total_acc = 0
    for prompt in prompts:
        ref = target.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
        )[0, len(prompt) :].tolist()
        got, prop, acc = _speculative_greedy(target, draft, prompt, 24, eos, rng)
        assert got == ref, f"prompt {prompt}: {got} != {ref}"
        total_prop += prop
        total_acc += acc
    rate = total_acc / total_prop
    print(f"speculative acceptance of draft proposals: {rate:.3f} ({total_acc}/{total_prop})")
    # both accept and reject paths (cache crop) were exercised
    assert 0 < total_acc < total_prop
