"""Tests for services.sampling: warping, sparse drafting, validation, and the
speculative-sampling acceptance rule (Leviathan et al. 2023).

Statistical tests use fixed seeds and a distribution-free threshold on the
total-variation (TV) distance between an empirical distribution of n samples
over m categories and the true one (see ``tv_bound``). Each of those tests
also shows power: the distribution produced by a plausible wrong rule is
farther than 2 * bound from the target, so that rule would fail the same check.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.sampling import (
    SamplingParams,
    SparseDraft,
    accept_greedy,
    accept_sampled,
    sparse_draft_sample,
    validate_draft,
    verify_tokens,
    warp_logits,
)

# ----------------------------------------------------------------------------
# helpers


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance between two distributions a [m], b [m]."""
    return 0.5 * float((a.double() - b.double()).abs().sum())


def tv_bound(n: int, m: int, delta: float = 1e-4) -> float:
    """Upper bound on TV(empirical of n iid samples, truth) holding w.p. >= 1 - delta.

    E[TV] <= 1/2 * sum_i sqrt(p_i (1 - p_i) / n) <= 1/2 * sqrt((m - 1) / n)
    (Jensen, then Cauchy-Schwarz). Changing one sample moves TV by <= 1/n, so
    McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2); t = sqrt(ln(1/delta) / (2n)).
    """
    return 0.5 * math.sqrt((m - 1) / n) + math.sqrt(math.log(1.0 / delta) / (2.0 * n))


def hoeffding(n: int, delta: float = 1e-4) -> float:
    """Two-sided Hoeffding half-width for a Bernoulli mean of n samples."""
    return math.sqrt(math.log(2.0 / delta) / (2.0 * n))


def empirical(tokens: list[int], vocab: int) -> torch.Tensor:
    """tokens (n ints) -> empirical distribution [vocab] float64."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=vocab)  # [vocab]
    return counts.double() / max(len(tokens), 1)


def sparse_reference(q: torch.Tensor, max_support: int) -> torch.Tensor:
    """Dense [V] view of the sparse q the drafter uses, computed independently (no ties in tests)."""
    order = sorted(range(q.shape[0]), key=lambda i: -float(q[i]))[:max_support]
    out = torch.zeros_like(q, dtype=torch.float64)  # [V]
    for i in order:
        out[i] = float(q[i])
    return out / out.sum()


def make_draft(tokens: list[int], ids: list[torch.Tensor], qs: list[torch.Tensor]) -> SparseDraft:
    """Stack per-position sparse supports (padding with id 0 / prob 0) into a SparseDraft."""
    width = max([t.shape[0] for t in ids], default=1)
    if all(t.shape[0] == width for t in ids):  # fast path: no padding needed
        return SparseDraft(torch.tensor(tokens, dtype=torch.int64), torch.stack(ids), torch.stack(qs))
    q_ids = torch.zeros(len(tokens), width, dtype=torch.int64)  # [k, S]
    q_probs = torch.zeros(len(tokens), width, dtype=torch.float32)  # [k, S]
    for i, (a, b) in enumerate(zip(ids, qs, strict=True)):
        q_ids[i, : a.shape[0]] = a
        q_probs[i, : b.shape[0]] = b
    return SparseDraft(torch.tensor(tokens, dtype=torch.int64), q_ids, q_probs)


def simulate(
    p_rows: torch.Tensor, q_rows: torch.Tensor, max_support: int, trials: int, seed: int
) -> list[list[int]]:
    """Full pipeline: draft k = len(q_rows) tokens with sparse_draft_sample, verify with
    accept_sampled against p_rows [k+1, V]. Returns the emitted tokens of each trial
    (accepted drafts followed by the extra token)."""
    g = torch.Generator().manual_seed(seed)
    k = q_rows.shape[0]
    outputs = []
    for _ in range(trials):
        toks, ids, qs = [], [], []
        for i in range(k):
            t, sid, sq = sparse_draft_sample(q_rows[i], max_support, g)
            toks.append(t)
            ids.append(sid)
            qs.append(sq)
        n, extra = accept_sampled(make_draft(toks, ids, qs), p_rows, g)
        outputs.append(toks[:n] + [extra])
    return outputs


def logits_with_argmax(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    """[len(argmaxes), vocab] logits whose row-wise argmax is exactly argmaxes."""
    base = torch.linspace(-1.0, 1.0, vocab).repeat(len(argmaxes), 1)  # [rows, V]; max 1.0 at V-1
    for r, a in enumerate(argmaxes):
        base[r, a] = 5.0
    return base


# ----------------------------------------------------------------------------
# greedy


GREEDY_CASES = [
    # draft, argmax of each target row (k+1 rows), expected (num_accepted, extra)
    pytest.param([3, 1, 4], [3, 1, 4, 2], (3, 2), id="perfect_match_bonus"),
    pytest.param([3, 1, 4], [0, 1, 4, 2], (0, 0), id="early_mismatch_first_position"),
    pytest.param([3, 1, 4], [3, 5, 4, 2], (1, 5), id="mid_mismatch_later_match_ignored"),
    pytest.param([3, 1, 4], [3, 1, 0, 2], (2, 0), id="last_position_mismatch"),
    pytest.param([], [2], (0, 2), id="empty_draft"),
    pytest.param([5], [5, 0], (1, 0), id="single_token_match"),
]


@pytest.mark.parametrize("draft, argmaxes, expected", GREEDY_CASES)
def test_accept_greedy_table(draft, argmaxes, expected):
    logits = logits_with_argmax(argmaxes)  # [k+1, V]
    assert accept_greedy(torch.tensor(draft, dtype=torch.int64), logits) == expected


@pytest.mark.parametrize("draft, argmaxes, expected", GREEDY_CASES)
def test_verify_tokens_greedy_table(draft, argmaxes, expected):
    logits = logits_with_argmax(argmaxes)  # [k+1, V]
    ids = [torch.tensor([t]) for t in draft]
    qs = [torch.tensor([1.0]) for _ in draft]
    sd = make_draft(draft, ids, qs) if draft else SparseDraft(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1)
    )
    assert verify_tokens(sd, logits, SamplingParams(), None) == expected


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_accept_greedy_matches_reference_loop(data):
    vocab = data.draw(st.integers(1, 5))
    k = data.draw(st.integers(0, 5))
    argmaxes = data.draw(st.lists(st.integers(0, vocab - 1), min_size=k + 1, max_size=k + 1))
    draft = data.draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k))
    expected_n = 0
    while expected_n < k and draft[expected_n] == argmaxes[expected_n]:
        expected_n += 1
    logits = torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()  # [k+1, V]
    assert accept_greedy(torch.tensor(draft, dtype=torch.int64), logits) == (expected_n, argmaxes[expected_n])


def test_accept_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="k\\+1"):
        accept_greedy(torch.tensor([1, 2]), torch.zeros(2, 5))


# ----------------------------------------------------------------------------
# warp_logits

LOGITS = torch.tensor([1.2, -0.3, 2.5, 0.0, 0.7, -1.1])  # [6], distinct values


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_warp_temperature_matches_softmax(temperature):
    out = warp_logits(LOGITS, SamplingParams(temperature=temperature))  # [6]
    e = [math.exp(float(x) / temperature) for x in LOGITS]
    expected = torch.tensor([v / sum(e) for v in e])
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_k", [1, 2, 3, 5])
def test_warp_top_k_keeps_exactly_k_largest(top_k):
    out = warp_logits(LOGITS, SamplingParams(temperature=0.8, top_k=top_k))  # [6]
    kept = set(torch.nonzero(out).flatten().tolist())
    largest = set(sorted(range(6), key=lambda i: -float(LOGITS[i]))[:top_k])
    assert kept == largest
    e = {i: math.exp(float(LOGITS[i]) / 0.8) for i in largest}
    for i in largest:
        assert float(out[i]) == pytest.approx(e[i] / sum(e.values()), rel=1e-5)


def test_warp_top_k_with_ties_keeps_exactly_k():
    out = warp_logits(torch.tensor([1.0, 1.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))  # [4]
    assert int((out > 0).sum()) == 2
    assert float(out.sum()) == pytest.approx(1.0)


def test_warp_top_k_at_least_vocab_is_noop():
    a = warp_logits(LOGITS, SamplingParams(temperature=1.0, top_k=6))
    b = warp_logits(LOGITS, SamplingParams(temperature=1.0, top_k=100))
    c = warp_logits(LOGITS, SamplingParams(temperature=1.0))
    torch.testing.assert_close(a, c)
    torch.testing.assert_close(b, c)


# probs 0.5, 0.3, 0.15, 0.05 placed out of order so the scatter back to vocab order matters.
NUCLEUS_PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])  # [4]


@pytest.mark.parametrize(
    "top_p, kept",
    [
        pytest.param(0.4, {1}, id="p0.4_keeps_1"),
        pytest.param(0.75, {1, 3}, id="p0.75_keeps_2"),
        pytest.param(0.9, {1, 3, 0}, id="p0.9_keeps_3"),
        pytest.param(0.97, {1, 3, 0, 2}, id="p0.97_keeps_4"),
        pytest.param(1e-6, {1}, id="tiny_p_keeps_argmax"),
    ],
)
def test_warp_top_p_keeps_minimal_nucleus(top_p, kept):
    out = warp_logits(NUCLEUS_PROBS.log(), SamplingParams(temperature=1.0, top_p=top_p))  # [4]
    assert set(torch.nonzero(out).flatten().tolist()) == kept
    mass = sum(float(NUCLEUS_PROBS[i]) for i in kept)
    for i in kept:
        assert float(out[i]) == pytest.approx(float(NUCLEUS_PROBS[i]) / mass, rel=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-4.0, 4.0), min_size=1, max_size=10),
    st.floats(0.05, 1.0),
)
def test_warp_top_p_property_minimal_and_sufficient(values, top_p):
    logits = torch.tensor(values)  # [V]
    base = torch.softmax(logits, dim=-1)  # [V]
    out = warp_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))  # [V]
    kept = out > 0  # [V]
    assert float(out.sum()) == pytest.approx(1.0, abs=1e-5)
    assert bool(kept[int(logits.argmax())])
    mass = float(base[kept].sum())
    assert mass >= top_p - 1e-5  # sufficient
    assert mass - float(base[kept].min()) < top_p + 1e-5  # minimal: dropping the smallest kept falls short


def test_warp_greedy_is_one_hot_first_argmax_batched():
    logits = torch.tensor([[[0.1, 3.0, 3.0, -1.0], [2.0, 0.0, 1.0, 2.0]]])  # [1, 2, 4], ties
    out = warp_logits(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))  # [1, 2, 4]
    expected = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]])
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_warp_batch_rows_match_single_rows():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)  # [2, 3, 7]
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.8)
    out = warp_logits(logits, params)  # [2, 3, 7]
    assert out.shape == (2, 3, 7)
    for i in range(2):
        for j in range(3):
            torch.testing.assert_close(out[i, j], warp_logits(logits[i, j], params))


def test_warp_rejects_invalid_params():
    with pytest.raises(ValueError, match="top_p"):
        warp_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.0))


# ----------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        pytest.param({"temperature": -0.1}, "temperature", id="negative_temperature"),
        pytest.param({"temperature": float("nan")}, "temperature", id="nan_temperature"),
        pytest.param({"temperature": float("inf")}, "temperature", id="inf_temperature"),
        pytest.param({"top_k": -1}, "top_k", id="negative_top_k"),
        pytest.param({"top_k": 2.5}, "top_k", id="non_integer_top_k"),
        pytest.param({"top_p": 0.0}, "top_p", id="zero_top_p"),
        pytest.param({"top_p": -0.5}, "top_p", id="negative_top_p"),
        pytest.param({"top_p": 1.5}, "top_p", id="top_p_above_one"),
        pytest.param({"top_p": float("nan")}, "top_p", id="nan_top_p"),
    ],
)
def test_sampling_params_validate_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


@pytest.mark.parametrize(
    "params, greedy",
    [
        (SamplingParams(), True),
        (SamplingParams(temperature=1.0), False),
        (SamplingParams(temperature=0.7, top_k=3, top_p=0.9), False),
        (SamplingParams(temperature=0.0, top_k=5, top_p=0.5), True),
    ],
)
def test_sampling_params_valid(params, greedy):
    params.validate()
    assert params.greedy is greedy


# ----------------------------------------------------------------------------
# sparse_draft_sample


def test_sparse_draft_sample_support_and_renormalisation():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])  # [6]
    g = torch.Generator().manual_seed(1)
    token, ids, q = sparse_draft_sample(probs, 3, g)
    assert ids.dtype == torch.int64 and q.dtype == torch.float32
    assert ids.tolist() == [1, 3, 4]
    torch.testing.assert_close(q, torch.tensor([0.4, 0.25, 0.2]) / 0.85)
    assert token in ids.tolist()
    # max_support above the number of nonzero tokens: zero-probability tokens are excluded.
    _, ids_all, q_all = sparse_draft_sample(probs, 10, g)
    assert sorted(ids_all.tolist()) == [0, 1, 3, 4, 5]
    assert float(q_all.sum()) == pytest.approx(1.0)


def test_sparse_draft_sample_one_hot_gives_single_support():
    probs = warp_logits(LOGITS, SamplingParams())  # [6] one-hot at argmax 2
    token, ids, q = sparse_draft_sample(probs, 8, None)
    assert token == 2 and ids.tolist() == [2] and q.tolist() == [1.0]


def test_sparse_draft_sample_distribution_matches_sparse_q():
    probs = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])  # [5]
    g = torch.Generator().manual_seed(7)
    n = 4000
    tokens = [sparse_draft_sample(probs, 3, g)[0] for _ in range(n)]
    expected = sparse_reference(probs, 3)  # [5]
    assert tv(empirical(tokens, 5), expected) < tv_bound(n, 3)
    # power: sampling from the unrestricted probs would be detected
    assert tv(probs, expected) > 2 * tv_bound(n, 3)


@pytest.mark.parametrize(
    "probs, max_support, match",
    [
        pytest.param(torch.tensor([0.5, 0.5]), 0, "max_support", id="zero_support"),
        pytest.param(torch.zeros(4), 2, "nonzero", id="all_zero"),
        pytest.param(torch.tensor([0.5, -0.1, 0.6]), 2, "non-negative", id="negative"),
        pytest.param(torch.tensor([0.5, float("nan")]), 2, "finite", id="nan"),
        pytest.param(torch.ones(2, 3) / 3, 2, "shape", id="two_dim"),
    ],
)
def test_sparse_draft_sample_rejects_bad_input(probs, max_support, match):
    with pytest.raises(ValueError, match=match):
        sparse_draft_sample(probs, max_support, None)


# ----------------------------------------------------------------------------
# validate_draft

V = 6


def _draft(tokens, ids, probs, tok_dtype=torch.int64):
    return SparseDraft(
        torch.tensor(tokens, dtype=tok_dtype), torch.tensor(ids, dtype=torch.int64), torch.tensor(probs)
    )


def test_validate_draft_accepts_valid_with_padding():
    validate_draft(_draft([2, 0], [[2, 4, 0], [0, 5, 0]], [[0.7, 0.3, 0.0], [0.6, 0.4, 0.0]]), V)
    empty = SparseDraft(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0, 3)
    )  # k = 0
    validate_draft(empty, V)


@pytest.mark.parametrize(
    "draft, match",
    [
        pytest.param(_draft([6], [[6]], [[1.0]]), "token_ids", id="draft_id_too_large"),
        pytest.param(_draft([-1], [[0]], [[1.0]]), "token_ids", id="draft_id_negative"),
        pytest.param(_draft([1], [[1, 6]], [[0.5, 0.5]]), "q_ids", id="support_id_too_large"),
        pytest.param(_draft([1], [[1, -2]], [[0.5, 0.5]]), "q_ids", id="support_id_negative"),
        pytest.param(_draft([1], [[1, 2]], [[1.2, -0.2]]), "non-negative", id="negative_prob"),
        pytest.param(_draft([1], [[1, 2]], [[float("nan"), 1.0]]), "finite", id="nan_prob"),
        pytest.param(_draft([1], [[1, 2]], [[0.5, 0.4]]), "sum", id="row_sums_below_one"),
        pytest.param(
            _draft([1, 1], [[1, 2], [1, 2]], [[0.5, 0.5], [0.9, 0.3]]), "row 1", id="row_sums_above_one"
        ),
        pytest.param(_draft([3], [[1, 2]], [[0.5, 0.5]]), "q = 0", id="draft_token_not_in_support"),
        pytest.param(_draft([0], [[1, 0]], [[1.0, 0.0]]), "q = 0", id="draft_token_only_as_padding"),
        pytest.param(_draft([1], [[1, 2]], [[1.0]]), "shape", id="probs_shape_mismatch"),
        pytest.param(_draft([1, 2], [[1, 2]], [[0.5, 0.5]]), "shape", id="k_mismatch"),
        pytest.param(_draft([1.0], [[1]], [[1.0]], tok_dtype=torch.float32), "integer", id="float_token_ids"),
    ],
)
def test_validate_draft_rejects(draft, match):
    with pytest.raises(ValueError, match=match):
        validate_draft(draft, V)


def test_verify_tokens_validates_before_indexing():
    bad = _draft([7], [[7]], [[1.0]])
    with pytest.raises(ValueError, match="token_ids"):
        verify_tokens(bad, torch.zeros(2, V), SamplingParams(temperature=1.0), None)
    good = _draft([1], [[1]], [[1.0]])
    with pytest.raises(ValueError, match="temperature"):
        verify_tokens(good, torch.zeros(2, V), SamplingParams(temperature=-1.0), None)
    with pytest.raises(ValueError, match="k\\+1"):
        verify_tokens(good, torch.zeros(3, V), SamplingParams(temperature=1.0), None)


# ----------------------------------------------------------------------------
# accept_sampled: deterministic edge cases


def test_accept_sampled_identical_p_and_q_accepts_everything():
    torch.manual_seed(3)
    p = torch.softmax(torch.randn(4, V), dim=-1)  # [4, V]
    ids = torch.arange(V).repeat(3, 1)  # [3, V]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        tokens = torch.stack([torch.multinomial(p[i], 1, generator=g)[0] for i in range(3)])  # [3]
        n, extra = accept_sampled(SparseDraft(tokens, ids, p[:3].clone()), p, g)
        assert n == 3 and 0 <= extra < V


def test_accept_sampled_zero_target_prob_always_rejects_to_residual():
    p = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0, 0.0], [1.0 / 6] * 6])  # [2, V]
    draft = _draft([0], [[0, 3]], [[0.9, 0.1]])  # p(0) = 0 -> ratio 0
    g = torch.Generator().manual_seed(5)
    seen = set()
    for _ in range(200):
        n, extra = accept_sampled(draft, p, g)
        assert n == 0
        seen.add(extra)
    # residual max(0, p - q) = [0, 0.2, 0, 0.7, 0, 0]: only tokens 1 and 3 possible
    assert seen == {1, 3}


def test_accept_sampled_empty_draft_samples_row_zero():
    p = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])  # [1, V]
    empty = SparseDraft(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1)
    )  # k = 0
    g = torch.Generator().manual_seed(0)
    assert all(accept_sampled(empty, p, g) == (0, 4) for _ in range(50))
    p2 = torch.tensor([[0.2, 0.0, 0.5, 0.0, 0.0, 0.3]])  # [1, V]
    tokens = [accept_sampled(empty, p2, g)[1] for _ in range(3000)]
    assert tv(empirical(tokens, V), p2[0]) < tv_bound(3000, 3)


def test_accept_sampled_residual_zero_falls_back_to_p():
    # q >= p everywhere (q row sums to 1.0009, within tolerance), so the residual
    # max(0, p - q) is identically 0 whenever the draft is rejected (prob ~0.0018).
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [1.0 / 6] * 6])  # [2, V]
    draft = _draft([0], [[0, 1]], [[0.5009, 0.5]])
    validate_draft(draft, V)
    g = torch.Generator().manual_seed(11)
    rejections = []
    for _ in range(10_000):
        n, extra = accept_sampled(draft, p, g)
        if n == 0:
            rejections.append(extra)
            if len(rejections) == 3:
                break
    assert rejections, "the test needs at least one rejection to exercise the fallback"
    assert set(rejections) <= {0, 1}


def test_accept_sampled_rejects_bad_shape():
    with pytest.raises(ValueError, match="k\\+1"):
        accept_sampled(_draft([1], [[1]], [[1.0]]), torch.full((1, V), 1.0 / V), None)


# ----------------------------------------------------------------------------
# determinism


def test_sparse_draft_sample_seeded_determinism():
    probs = torch.tensor([0.1, 0.35, 0.05, 0.3, 0.2])  # [5]

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [sparse_draft_sample(probs, 4, g)[0] for _ in range(100)]

    assert run(123) == run(123)
    assert run(123) != run(124)


def test_accept_sampled_seeded_determinism():
    p = torch.tensor([[0.05, 0.1, 0.35, 0.25, 0.15, 0.1], [0.3, 0.05, 0.1, 0.1, 0.15, 0.3]])  # [2, V]
    q = torch.tensor([0.3, 0.12, 0.25, 0.2, 0.08, 0.05])  # [V]

    def run(seed):
        return simulate(p, q[None], 4, 100, seed)

    assert run(99) == run(99)
    assert run(99) != run(100)


# ----------------------------------------------------------------------------
# statistical losslessness

# k = 1: p and q very different; q's sparse support (top 5) even drops p's favourite token 5.
P1 = torch.tensor(
    [
        [0.02, 0.03, 0.05, 0.15, 0.35, 0.40],
        [0.25, 0.05, 0.30, 0.05, 0.30, 0.05],
    ]
)  # [2, V]
Q1 = torch.tensor([[0.40, 0.30, 0.15, 0.08, 0.05, 0.02]])  # [1, V]
SUPPORT1 = 5
N1 = 16_000

# k = 3: distinct p rows per position, distinct q rows, sparse support of 4.
P3 = torch.tensor(
    [
        [0.05, 0.10, 0.35, 0.25, 0.15, 0.10],
        [0.30, 0.05, 0.10, 0.10, 0.15, 0.30],
        [0.10, 0.30, 0.05, 0.30, 0.10, 0.15],
        [0.25, 0.05, 0.30, 0.05, 0.30, 0.05],
    ]
)  # [4, V]
Q3 = torch.tensor(
    [
        [0.30, 0.12, 0.25, 0.20, 0.08, 0.05],
        [0.10, 0.15, 0.30, 0.05, 0.12, 0.28],
        [0.30, 0.24, 0.05, 0.26, 0.11, 0.04],
    ]
)  # [3, V]
SUPPORT3 = 4
N3 = 8_000


@pytest.fixture(scope="module")
def run_k1():
    return simulate(P1, Q1, SUPPORT1, N1, seed=2023)


@pytest.fixture(scope="module")
def run_k3():
    return simulate(P3, Q3, SUPPORT3, N3, seed=4242)


def resample_from_p_bug(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Output distribution [V] if rejections resampled from p instead of the residual."""
    accept = torch.minimum(p.double(), q.double())  # [V]
    return accept + (1.0 - accept.sum()) * p.double()


def test_lossless_k1_first_token_is_p0(run_k1):
    q0 = sparse_reference(Q1[0], SUPPORT1)  # [V]
    first = empirical([out[0] for out in run_k1], V)  # [V]
    bound = tv_bound(N1, V)
    assert tv(first, P1[0]) < bound
    # power: always-accept (output ~ q) and resample-from-p would both fail this threshold
    assert tv(q0, P1[0]) > 2 * bound
    assert tv(resample_from_p_bug(P1[0], q0), P1[0]) > 2 * bound


def test_lossless_k1_residual_path_rate_and_bonus(run_k1):
    q0 = sparse_reference(Q1[0], SUPPORT1)  # [V]
    beta = float(torch.minimum(P1[0].double(), q0).sum())  # expected acceptance rate ~0.23
    rejected = sum(1 for out in run_k1 if len(out) == 1)
    assert rejected / N1 > 0.5  # residual path taken in most trials
    assert abs(rejected / N1 - (1.0 - beta)) < hoeffding(N1)
    # token 5 is outside q's support: it can only come from the residual
    assert sum(1 for out in run_k1 if out[0] == 5) > 0.3 * N1
    # bonus token after acceptance is distributed as p_1
    bonus = [out[1] for out in run_k1 if len(out) == 2]
    assert tv(empirical(bonus, V), P1[1]) < tv_bound(len(bonus), V)
    assert tv(P1[0], P1[1]) > 2 * tv_bound(len(bonus), V)  # wrong-row bonus would be caught


def test_lossless_k1_error_shrinks_with_n(run_k1):
    first = [out[0] for out in run_k1]
    chunk = 1_000
    chunk_tvs = [tv(empirical(first[i : i + chunk], V), P1[0]) for i in range(0, N1, chunk)]
    mean_chunk_tv = sum(chunk_tvs) / len(chunk_tvs)
    full_tv = tv(empirical(first, V), P1[0])
    # Unbiased sampling: TV ~ 1/sqrt(N), so 16x the samples should cut it by ~4x.
    # A biased rule would plateau at its bias and fail this.
    assert full_tv < mean_chunk_tv / 2


def test_lossless_k3_every_position_is_p(run_k3):
    q_sparse = [sparse_reference(Q3[i], SUPPORT3) for i in range(3)]
    for j in range(4):
        # output position j exists iff at least j drafts were accepted; p rows do not
        # depend on the prefix here, so conditioned on that it must be ~ p_j.
        tokens = [out[j] for out in run_k3 if len(out) > j]
        bound = tv_bound(len(tokens), V)
        assert tv(empirical(tokens, V), P3[j]) < bound, f"position {j}"
        if j < 3:
            assert tv(q_sparse[j], P3[j]) > 2 * bound, f"position {j} lacks power"


def test_lossless_k3_num_accepted_distribution(run_k3):
    betas = [float(torch.minimum(P3[i].double(), sparse_reference(Q3[i], SUPPORT3)).sum()) for i in range(3)]
    expected = []
    reach = 1.0
    for b in betas:
        expected.append(reach * (1.0 - b))
        reach *= b
    expected.append(reach)  # all 3 accepted
    counts = empirical([len(out) - 1 for out in run_k3], 4)  # [4]
    assert tv(counts, torch.tensor(expected)) < tv_bound(N3, 4)
    assert min(counts[:3].tolist()) > 0.05  # rejections happen at every position


def test_lossless_with_warping_top_k_and_temperature():
    params = SamplingParams(temperature=0.7, top_k=3)
    p_logits = torch.tensor(
        [[2.0, 1.5, 0.2, -0.5, 1.0, -1.0], [0.0, 0.3, 1.0, 0.8, -0.2, 0.5]]
    )  # [2, V]; top-3 of row 0 = {0, 1, 4}
    q_logits = torch.tensor([0.1, 1.8, 2.2, 1.0, -0.3, 0.0])  # [V]; top-3 = {2, 1, 3}
    p = warp_logits(p_logits, params)  # [2, V]
    q = warp_logits(q_logits, params)  # [V]

    # verify_tokens (validate + warp + accept_sampled) equals accept_sampled on pre-warped probs
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        tok, ids, qs = sparse_draft_sample(q, 8, g)
        draft = make_draft([tok], [ids], [qs])
        a = verify_tokens(draft, p_logits, params, torch.Generator().manual_seed(seed))
        b = accept_sampled(draft, p, torch.Generator().manual_seed(seed))
        assert a == b

    n = 6_000
    outputs = simulate(p, q[None], 8, n, seed=77)
    first = empirical([out[0] for out in outputs], V)  # [V]
    bound = tv_bound(n, V)
    assert tv(first, p[0]) < bound
    assert float(first[[2, 3, 5]].sum()) == 0.0  # tokens outside the target's top-3 never emitted
    assert tv(q.double(), p[0].double()) > 2 * bound  # always-accept would fail
