"""The speculation cache's drafter half, in process: which outcomes it drafts for
(services/speculation.py), the batched sparse sampler, and the tree of branches
(drafter_svc/tree.py), whose every branch must hold exactly the drafts a plain Draft call
after that outcome would make (same tokens, same q: that is what makes a hit lossless and
a seeded request reproducible)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
import torch

from drafter_svc.engine import DrafterEngine
from services.errors import InvalidArgument
from services.hashing import token_hash
from services.kv_cache import SessionCaches
from services.messages import CacheDelta, DraftCall, SpeculateCall
from services.model_runner import ModelRunner
from services.models import describe
from services.sampling import SamplingParams, sparse_draft_sample, sparse_draft_sample_rows
from services.speculation import accept_length_probs, plan_branches


def test_accept_length_probs_are_the_geometric_outcomes():
    assert accept_length_probs(0.8, 3) == pytest.approx([0.2, 0.16, 0.128, 0.512])
    assert sum(accept_length_probs(0.37, 5)) == pytest.approx(1.0)
    assert accept_length_probs(1.0, 2) == [0.0, 0.0, 1.0]


def _guesses() -> torch.Tensor:
    # k = 2 drafts [1, 2]; V = 5. Row j: the drafter's distribution after d_1..d_j.
    return torch.tensor([[0.1, 0.6, 0.2, 0.1, 0.0],   # after the prefix; d_1 = 1 has 0.6
                         [0.0, 0.0, 0.5, 0.5, 0.0],   # after d_1; d_2 = 2 has 0.5
                         [0.7, 0.3, 0.0, 0.0, 0.0]])  # after d_1 d_2 (the bonus position)


def test_branches_are_the_most_likely_outcomes_and_never_a_rejected_draft():
    # a = 0.5: P(j) = 0.5, 0.25, 0.25. Weights, worked by hand:
    # j=0: t in {0, 2, 3} renormalised without d_1 (mass 0.4): 0.5 * (0.25, 0.5, 0.25)
    # j=1: t = 3 only (d_2 excluded): 0.25 * 1.0;  j=2: 0.25 * (0.7, 0.3)
    plan = plan_branches([1, 2], _guesses(), acceptance=0.5, max_branches=8, coverage=1.0)
    weights = {(j, t): p for j, t, p in plan}
    assert weights == pytest.approx({(0, 2): 0.25, (1, 3): 0.25, (2, 0): 0.175,
                                     (0, 0): 0.125, (0, 3): 0.125, (2, 1): 0.075})
    assert [p for _, _, p in plan] == sorted((p for _, _, p in plan), reverse=True)
    assert (0, 1) not in weights and (1, 2) not in weights  # rejected drafts never guessed
    assert sum(weights.values()) == pytest.approx(1.0)


def test_fanout_and_coverage_bound_the_branches():
    top3 = plan_branches([1, 2], _guesses(), acceptance=0.5, max_branches=3, coverage=1.0)
    assert {(j, t) for j, t, _ in top3} == {(0, 2), (1, 3), (2, 0)}
    # Coverage 0.4: the first two branches already cover 0.5.
    assert len(plan_branches([1, 2], _guesses(), 0.5, max_branches=8, coverage=0.4)) == 2
    # A drafter sure of everything, a: ~1: the all-accepted branch with its top guess first.
    assert plan_branches([1, 2], _guesses(), 0.99, 1, 1.0)[0][:2] == (2, 0)
    with pytest.raises(ValueError, match="k\\+1"):
        plan_branches([1, 2, 3], _guesses(), 0.5, 4)


def test_batched_sparse_sampling_draws_what_the_per_row_sampler_draws():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 50, generator=g) * 3, dim=-1)
    probs[2, 10:] = 0.0  # a row with a support smaller than max_support
    probs[2] /= probs[2].sum()
    rows = sparse_draft_sample_rows(probs, 8, [torch.Generator().manual_seed(s) for s in range(6)])
    for b, (token, ids, q) in enumerate(rows):
        ref_token, ref_ids, ref_q = sparse_draft_sample(probs[b], 8,
                                                        torch.Generator().manual_seed(b))
        assert token == ref_token and ids == ref_ids.tolist()
        assert q == pytest.approx(ref_q.tolist())
    assert len(rows[2][1]) == 8 and len(rows[0][1]) == 8
    greedy = sparse_draft_sample_rows(probs, 8, [None] * 6, greedy=True)
    assert [t for t, _, _ in greedy] == probs.argmax(dim=-1).tolist()
    assert all(ids == [t] and q == [1.0] for t, ids, q in greedy)


@pytest.fixture(scope="module", params=["hf", "auto"])
def drafter(request, tiny_pair):
    """The tiny drafter with transformers' forward and cache, and with the lean forward
    (prepacked weights, in-place cache): the tree's 4-D mask must mean the same to both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.lean_llama import lean_forward

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    meta = describe(tiny_pair[1], model, AutoTokenizer.from_pretrained(tiny_pair[1]))
    model, _ = lean_forward(model, request.param)
    runner = ModelRunner(model, meta, torch.device("cpu"), max_queue=64, max_batch=16)
    return DrafterEngine(runner, SessionCaches(64, runner.new_kv), max_draft_tokens=16)


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("params", [SamplingParams(),
                                    SamplingParams(temperature=1.0, top_k=20)],
                         ids=["greedy", "sampled"])
def test_every_branch_holds_the_drafts_a_draft_call_after_that_outcome_makes(drafter, params):
    vocab = drafter.meta.vocab_size
    committed = _tokens(1, 40, vocab)
    k, seed = 3, 4242

    async def body():
        sid = uuid.uuid4().hex
        first = await drafter.draft(DraftCall(CacheDelta(sid, 0, 0, tuple(committed)), k,
                                              params, 7, 16))
        drafts = list(first.token_ids)
        # As the gateway sends it: the last committed token and the drafts, on the cache.
        base = len(committed) - 1
        spec = await drafter.speculate(SpeculateCall(
            cache=CacheDelta(sid, base, token_hash(committed[:base]),
                             (committed[-1], *drafts)),
            num_drafts=k, num_tokens=k, params=params, seed=seed, max_support=16,
            max_branches=6, acceptance=0.6, coverage=1.0))
        assert spec.cached_len == len(committed) + k and 1 <= len(spec.branches) <= 6
        assert [b.probability for b in spec.branches] == sorted(
            (b.probability for b in spec.branches), reverse=True)
        for branch in spec.branches:
            assert branch.accepted == k or branch.token != drafts[branch.accepted]
            prefix = [*committed, *drafts[:branch.accepted], branch.token]
            ref = await drafter.draft(DraftCall(CacheDelta(uuid.uuid4().hex, 0, 0,
                                                           tuple(prefix)), k, params, seed, 16))
            assert branch.draft.token_ids == ref.token_ids
            for got, want in zip(branch.draft.q_probs, ref.q_probs, strict=True):
                assert got == pytest.approx(want, abs=1e-5)
            assert branch.draft.q_ids == ref.q_ids

    asyncio.run(body())


def test_speculate_rejects_bad_calls_without_touching_the_cache(drafter):
    good = SpeculateCall(cache=CacheDelta("s", 0, 0, (1, 2, 3, 4)), num_drafts=3, num_tokens=2,
                         params=SamplingParams(), seed=1, max_support=8, max_branches=4,
                         acceptance=0.5)
    cases = [(dict(num_drafts=4), "new_tokens must hold"),
             (dict(max_branches=0), "max_branches"), (dict(acceptance=1.5), "acceptance"),
             (dict(num_tokens=0), "num_tokens"), (dict(max_support=0), "max_support"),
             (dict(num_drafts=0), "num_drafts")]
    for change, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            asyncio.run(drafter.speculate(dataclasses.replace(good, **change)))
    assert "s" not in drafter.caches
