"""A draft model's greedy passes in one operator (services/lean_llama.py ``greedy_drafts``,
``specmesh_cpu::greedy_drafts``): the tokens and caches of as many ragged passes with an
argmax between them, and None, nothing fed, where the rows cannot run so.

Real models: the committed demo drafter (exactly 16-bit weights: every projection has its
copy) loaded with ``from_pretrained``; the reference is the lean forward's own pass by pass
path, itself checked against transformers in test_lean_forward.py, and one case against
transformers' greedy ``generate`` directly."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from services.batching import Row, forward_rows
from services.lean_llama import LeanLlama
from tests.test_lean_forward import _fed, _no_batch_cache, _same_caches, _segments_of

DEMO_DRAFTER = "models/demo-drafter"


@pytest.fixture(scope="module")
def lean() -> LeanLlama:
    model = AutoModelForCausalLM.from_pretrained(DEMO_DRAFTER, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    assert lean.kernel_rope and lean._uniform(1)  # the kernels build and run on these CPUs
    return lean


def _prompts(rows: int, base: int = 30) -> list[list[int]]:
    return [torch.randint(0, 8000, (base + 17 * b,), generator=torch.Generator().manual_seed(b))
            .tolist() for b in range(rows)]


def _pass_by_pass(lean, caches, first: list[list[int]], steps: int) -> list[list[int]]:
    """The reference: ``steps`` ragged passes, each row's argmax fed back but the last."""
    chosen = [[] for _ in caches]
    feed = first
    for _ in range(steps):
        logits = forward_rows(lean, [Row(tokens=f, kv=kv, start=s, keep=1)
                                     for f, (kv, s) in zip(feed, caches, strict=True)], "cpu",
                              _no_batch_cache)
        for b, lg in enumerate(logits):
            chosen[b].append(int(lg[0].argmax()))
            caches[b][1] += len(feed[b])
        feed = [[c[-1]] for c in chosen]
    return chosen


@pytest.mark.parametrize("rows, width, steps, mixed, gap", [
    (1, 1, 1, False, False), (1, 1, 3, False, False), (1, 2, 4, False, False),
    (5, 1, 3, False, False), (4, 2, 3, True, False), (5, 1, 3, True, True)],
    ids=["one-pass", "one-stream", "two-tokens-first", "five-rows", "out-of-slot-order",
         "a-gap"])
def test_greedy_drafts_are_the_tokens_and_caches_of_passes_one_by_one(lean, rows, width, steps,
                                                                      mixed, gap):
    """Rows in one operator get the tokens that ragged passes with an argmax between them
    give, bit for bit (the same operators, called from C++), and their caches then hold the
    same positions, keys and values: each row's first tokens and its chosen tokens but the
    last. Rows out of their slots' order get their own tokens back; a session holding a slot
    between the rows (``gap``, between its rounds) keeps its cache."""
    fused, stepped = _fed(lean, _prompts(rows + gap)), _fed(lean, _prompts(rows + gap))
    idle = []
    if gap:
        idle = [fused.pop(1), stepped.pop(1)]
        before = [kv.layers[0].keys.clone() for kv, _ in idle]
    if mixed:
        fused, stepped = fused[2:] + fused[:2], stepped[2:] + stepped[:2]
        assert [kv.slot for kv, _ in fused] != sorted(kv.slot for kv, _ in fused)
    first = [list(range(9 + b, 9 + b + width)) for b in range(rows)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = lean.greedy_drafts([Row(tokens=f, kv=kv, start=s, keep=1)
                                  for f, (kv, s) in zip(first, fused, strict=True)], steps)
    ops = {e.key: e.count for e in prof.key_averages()}
    assert ops.get("specmesh_cpu::greedy_drafts") == 1
    assert got == _pass_by_pass(lean, stepped, first, steps)
    for c in fused:
        c[1] += width + steps - 1
    _same_caches(fused, stepped)
    for (kv, _), keys in zip(idle, before if gap else [], strict=True):
        assert torch.equal(kv.layers[0].keys, keys)


def test_greedy_drafts_continue_a_prompt_as_transformers_greedy_generate(lean):
    """The demo drafter's own greedy continuation of a prompt, 6 tokens in one operator after
    the prompt's pass, is what transformers' ``generate`` gives (float32, its own forward)."""
    hf = AutoModelForCausalLM.from_pretrained(DEMO_DRAFTER, dtype=torch.float32).eval()
    prompt = _prompts(1, 40)[0]
    (kv, n), = _fed(lean, [prompt[:-1]])
    got = lean.greedy_drafts([Row(tokens=prompt[-1:], kv=kv, start=n, keep=1)], 6)[0]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                      pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


def test_rows_that_cannot_run_as_one_uniform_pass_are_left_to_the_caller(lean):
    """None, with nothing fed, where the rows do not run as one aligned pooled pass: rows of
    different sizes, a row whose cache is outside the pool, steps that would run past its
    slot, or a pool of two segments with rows in both."""
    caches = _fed(lean, _prompts(2))
    kv0, n0 = caches[0]
    kv1, n1 = caches[1]
    lengths = [kv0.get_seq_length(), kv1.get_seq_length()]

    def rows(a, b, start0=n0):
        return [Row(tokens=a, kv=kv0, start=start0, keep=1), Row(tokens=b, kv=kv1, start=n1,
                                                                   keep=1)]

    assert lean.greedy_drafts(rows([5], [6, 7]), 3) is None
    outside = lean.new_cache()
    assert outside.leave_pool()
    assert lean.greedy_drafts([Row(tokens=[5], kv=outside, start=0, keep=1)], 3) is None
    slot_len = lean.pool.slot_len
    kv0.crop(0)
    with torch.inference_mode():  # (a cache that fills its slot but the last position)
        for _ in range(2):
            forward_rows(lean, [Row(tokens=[3] * ((slot_len - 2) // 2), kv=kv0,
                                    start=kv0.get_seq_length(), keep=1)], "cpu", _no_batch_cache)
    full = kv0.get_seq_length()
    assert lean.greedy_drafts([Row(tokens=[5], kv=kv0, start=full, keep=1)], 3) is None
    assert kv0.get_seq_length() == full and kv1.get_seq_length() == lengths[1]
    assert lean.greedy_drafts([Row(tokens=[5], kv=kv0, start=full, keep=1)], 2) is not None


def test_rows_in_two_pool_segments_are_left_to_the_caller():
    """Sessions in two segments of the pool (more than a segment's slots): one operator runs
    over one segment's window, so the caller runs their passes."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_DRAFTER, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    _segments_of(lean, 2)
    caches = _fed(lean, _prompts(3))
    assert len({kv.slot // 2 for kv, _ in caches}) == 2
    rows = [Row(tokens=[5], kv=kv, start=s, keep=1) for kv, s in caches]
    assert lean.greedy_drafts(rows, 3) is None
    assert lean.greedy_drafts(rows[:2], 3) is not None


def test_the_operator_refuses_a_step_count_below_one(lean):
    """No pass to run: the operator says so (no tokens, no cache written)."""
    (kv, n), = _fed(lean, _prompts(1))
    with pytest.raises(RuntimeError, match="steps must be >= 1, got 0"):
        lean.greedy_drafts([Row(tokens=[5], kv=kv, start=n, keep=1)], 0)
    assert kv.get_seq_length() == n
