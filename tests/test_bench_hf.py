"""`specmesh bench`'s in-process HF rows on the tiny pair: plain generate gives the target's own
greedy token ids, on a static cache too, assisted generation (fixed k and HF's defaults) gives
the same ones, the counts add up, and the draft's generation config is left as it was."""

from __future__ import annotations

import pytest

from specmesh.bench_hf import HfSetting, generate_set, run_hf

PROMPTS = ["def add(a, b):\n    return", "import os\n\nclass Path:"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def hf_results(tiny_pair):
    target, draft = tiny_pair
    settings = [HfSetting("hf-plain"), HfSetting("hf", assistant=True, k=3),
                HfSetting("hf-default", assistant=True)]
    return run_hf(target, draft, PROMPTS, settings, max_new_tokens=MAX_NEW, threads=1,
                  warmup=False)


def _greedy(model, tok, prompt: str) -> list[int]:
    """The target's own greedy generate, outside the code under test."""
    import torch

    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                             max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def test_plain_generate_gives_the_targets_greedy_ids(hf_results, target_model):
    model, tok = target_model
    plain = hf_results["hf-plain"]
    assert [r["token_ids"] for r in plain.records] == [_greedy(model, tok, p) for p in PROMPTS]
    for r in plain.records:
        assert r["error"] == "" and r["completion_tokens"] == len(r["token_ids"]) > 0
        assert r["rounds"] == r["completion_tokens"]  # one target pass per token
        assert r["draft_tokens"] == 0 and r["accepted_draft_tokens"] == 0
    assert set(plain.forward) == {"target"} and plain.assistant is None
    assert plain.wall_s > 0


def test_assisted_generation_gives_the_same_ids(hf_results):
    plain = [r["token_ids"] for r in hf_results["hf-plain"].records]
    for key in ("hf", "hf-default"):
        res = hf_results[key]
        assert [r["token_ids"] for r in res.records] == plain, key  # greedy: lossless
        assert set(res.forward) == {"target", "draft"}
        assert sum(r["draft_tokens"] for r in res.records) > 0
    assert hf_results["hf"].assistant == {"num_assistant_tokens": 3,
                                          "num_assistant_tokens_schedule": "constant",
                                          "assistant_confidence_threshold": 0.0}
    assert hf_results["hf-default"].assistant == {"num_assistant_tokens": 20,
                                                  "num_assistant_tokens_schedule": "constant",
                                                  "assistant_confidence_threshold": 0.4}


def test_hf_default_after_a_fixed_k_sees_the_config_as_saved(tiny_pair):
    """The fixed-k setting's config is undone before the next setting runs."""
    target, draft = tiny_pair
    settings = [HfSetting("hf", assistant=True, k=2), HfSetting("hf-default", assistant=True)]
    res = run_hf(target, draft, PROMPTS[:1], settings, max_new_tokens=4, threads=1,
                 warmup=False)
    assert res["hf"].assistant["num_assistant_tokens"] == 2
    assert res["hf-default"].assistant["num_assistant_tokens"] == 20


def test_an_assisted_setting_needs_a_draft(tiny_pair):
    with pytest.raises(ValueError, match="needs a draft"):
        run_hf(tiny_pair[0], None, PROMPTS[:1], [HfSetting("hf", assistant=True, k=2)],
               max_new_tokens=2, threads=1, warmup=False)


def test_the_static_cache_row_runs_on_a_static_cache_and_gives_the_same_ids(target_model):
    """``hf-static``: every forward of its generate gets transformers' StaticCache."""
    model, tok = target_model
    caches = []
    hook = model.register_forward_pre_hook(
        lambda _m, _args, kwargs: caches.append(type(kwargs.get("past_key_values")).__name__),
        with_kwargs=True)
    try:
        res = generate_set(model, tok, PROMPTS, max_new_tokens=MAX_NEW, warmup=False,
                           static_cache=True)
    finally:
        hook.remove()
    assert caches and set(caches) == {"StaticCache"}
    assert [r["token_ids"] for r in res.records] == [_greedy(model, tok, p) for p in PROMPTS]
    with pytest.raises(ValueError, match="plain generate only"):
        generate_set(model, tok, PROMPTS, draft=model, max_new_tokens=2, static_cache=True)


def test_sampled_rows_draw_by_the_seed_at_the_temperature(tiny_pair, hf_results):
    """`specmesh bench --temperature`: the HF rows sample (plain and assisted), the same seed
    draws the same ids again, another seed others, and neither is the greedy output."""
    target, draft = tiny_pair
    settings = [HfSetting("hf-plain"), HfSetting("hf", assistant=True, k=3)]

    def ids(seed: int) -> dict[str, list[list[int]]]:
        res = run_hf(target, draft, PROMPTS, settings, max_new_tokens=MAX_NEW, threads=1,
                     warmup=False, seed=seed, temperature=1.0)
        return {key: [r["token_ids"] for r in res[key].records] for key in res}

    first, again, other = ids(1), ids(1), ids(2)
    greedy = [r["token_ids"] for r in hf_results["hf-plain"].records]
    assert first == again
    for key in ("hf-plain", "hf"):
        assert first[key] != other[key] and first[key] != greedy, key
