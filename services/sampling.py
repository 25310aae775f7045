"""Pure-math sampling and speculative-decoding verification for SpecMesh.

Lossless speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023). The draft
distribution q travels sparse: per drafted position a small support of token
ids with probabilities; tokens outside it have q = 0. The drafter must sample
from exactly that renormalised sparse q (``sparse_draft_sample``) for the rule
to stay lossless. No module-level state; randomness only via explicit generators.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services import cpu_kernels
from services.params import SamplingParams  # noqa: F401 - re-exported

_ROW_SUM_TOL = 1e-3


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into warped probabilities [..., V] (float32).

    Order: divide by temperature, keep the top_k logits (exactly k, ties broken
    by torch.topk), keep the smallest prefix of the sorted distribution whose
    cumulative probability is >= top_p (the most likely token is always kept),
    softmax. Greedy params (temperature 0) give a one-hot of the argmax (first
    index on ties), so one function serves both modes.
    """
    params.validate()
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    x = logits.to(torch.float32)  # [..., V]
    if params.greedy:
        return torch.nn.functional.one_hot(cpu_kernels.argmax(x), vocab).to(torch.float32)  # [..., V]

    x = x / params.temperature  # [..., V]
    if 0 < params.top_k < vocab:
        top_idx = torch.topk(x, params.top_k, dim=-1).indices  # [..., top_k]
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, top_idx, True)  # [..., V]
        x = x.masked_fill(~keep, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # [..., V], [..., V]
        sorted_p = torch.softmax(sorted_x, dim=-1)  # [..., V]
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [..., V] exclusive cumsum
        keep_sorted = mass_before < params.top_p  # [..., V]; position 0 (mass 0) always kept
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)  # [..., V]
        x = x.masked_fill(~keep, float("-inf"))
    return torch.softmax(x, dim=-1)  # [..., V]


def _sample_index(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw i ~ weights[i] / weights.sum() (weights [N] >= 0) by inverse CDF with one uniform.

    Same distribution as torch.multinomial(weights, 1, generator=generator), cheaper here.
    Zero-weight entries are never returned (right=True skips flat CDF steps).
    """
    cdf = torch.cumsum(weights, dim=0, dtype=torch.float64)  # [N]
    u = torch.rand(1, generator=generator, dtype=torch.float64)  # [1] in [0, 1)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if i >= weights.shape[0]:  # u * total rounded up to total: take the last positive weight
        positive = torch.nonzero(weights > 0)  # [M, 1]
        if positive.shape[0] == 0:
            raise ValueError("cannot sample: all probabilities are zero")
        i = int(positive[-1])
    return i


def sparse_draft_sample(
    probs: torch.Tensor, max_support: int, generator: torch.Generator | None
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Sample one draft token from a sparse restriction of ``probs``.

    probs [V] (already warped) -> (token, ids [S] int64, q [S] float32), where
    ids are the (at most) ``max_support`` most likely tokens with nonzero
    probability, q is their renormalised probability (sums to 1), and token is
    drawn from that sparse q with ``generator`` (inverse CDF, one uniform).
    A one-hot input yields S == 1.
    """
    if probs.dim() != 1:
        raise ValueError(f"probs must have shape [V], got {tuple(probs.shape)}")
    if isinstance(max_support, bool) or not isinstance(max_support, int) or max_support < 1:
        raise ValueError(f"max_support must be an integer >= 1, got {max_support!r}")
    p = probs.to(torch.float32)  # [V]
    lo, hi = torch.aminmax(p)  # scalars; NaN propagates and fails both checks below
    if not float(lo) >= 0.0 or not math.isfinite(float(hi)):
        raise ValueError("probs must be finite and non-negative")
    nonzero = int(torch.count_nonzero(p))
    if nonzero == 0:
        raise ValueError("probs has no token with nonzero probability")
    support = min(max_support, nonzero)
    vals, ids = torch.topk(p, support)  # [S], [S]
    q = vals / vals.sum()  # [S]
    return int(ids[_sample_index(q, generator)]), ids.to(torch.int64), q.to(torch.float32)


def sparse_draft_sample_rows(
    probs: torch.Tensor, max_support: int, generators: Sequence[torch.Generator | None],
    greedy: bool = False,
) -> list[tuple[int, list[int], list[float]]]:
    """``sparse_draft_sample`` for each row of probs [B, V] (already warped), with one
    generator per row: one top-k for the whole batch, then one uniform per row.

    -> per row (token, support ids [S_b], q [S_b]) as Python lists; S_b = min(max_support,
    nonzero entries of the row). Same distribution, support and draws as the per-row function.
    ``greedy``: the rows are one-hots (greedy warping): each row's token is its argmax with
    q = [1], and no generator is drawn from (the draw could only pick that token).
    """
    if greedy:
        tokens = cpu_kernels.argmax(probs).tolist()  # [B]
        return [(t, [t], [1.0]) for t in tokens]
    if probs.dim() != 2 or probs.shape[0] != len(generators):
        raise ValueError(f"probs must have shape [B={len(generators)}, V], got {tuple(probs.shape)}")
    p = probs.to(torch.float32)  # [B, V]
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()):
        raise ValueError("probs must be finite and non-negative")
    vals, ids = torch.topk(p, min(max_support, p.shape[1]), dim=-1)  # [B, S], [B, S]
    sizes = (vals > 0).sum(dim=-1).tolist()  # [B] S_b (sorted: the nonzero come first)
    out = []
    for b, gen in enumerate(generators):
        size = sizes[b]
        if size == 0:
            raise ValueError(f"probs row {b} has no token with nonzero probability")
        q = vals[b, :size] / vals[b, :size].sum()  # [S_b]
        support = ids[b, :size]
        out.append((int(support[_sample_index(q, gen)]), support.tolist(), q.tolist()))
    return out


@dataclass(frozen=True)
class SparseDraft:
    token_ids: torch.Tensor  # [k] int64 drafted tokens
    q_ids: torch.Tensor  # [k, S] int64 support ids per position (padding allowed where q_probs == 0)
    q_probs: torch.Tensor  # [k, S] float32 probs per position, rows sum to 1 (padding entries 0)


def validate_draft(draft: SparseDraft, vocab_size: int) -> None:
    """Raise ValueError if ``draft`` is not a well-formed sparse draft over ``vocab_size`` tokens."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
    tok, ids, probs = draft.token_ids, draft.q_ids, draft.q_probs
    if tok.dim() != 1:
        raise ValueError(f"token_ids must have shape [k], got {tuple(tok.shape)}")
    k = tok.shape[0]
    if ids.dim() != 2 or ids.shape[0] != k:
        raise ValueError(f"q_ids must have shape [k={k}, S], got {tuple(ids.shape)}")
    if probs.shape != ids.shape:
        raise ValueError(f"q_probs shape {tuple(probs.shape)} must equal q_ids shape {tuple(ids.shape)}")
    if k > 0 and ids.shape[1] < 1:
        raise ValueError("q_ids/q_probs need a support of at least one token per position (S >= 1)")
    for name, t in (("token_ids", tok), ("q_ids", ids)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if not probs.is_floating_point():
        raise ValueError(f"q_probs must be a floating-point tensor, got {probs.dtype}")
    if k == 0:
        return
    if bool(((tok < 0) | (tok >= vocab_size)).any()):
        raise ValueError(f"draft token_ids must lie in [0, {vocab_size}), got {tok.tolist()}")
    if bool(((ids < 0) | (ids >= vocab_size)).any()):
        raise ValueError(f"q_ids must lie in [0, {vocab_size}) (use a valid id such as 0 for padding)")
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("q_probs must be finite")
    if bool((probs < 0).any()):
        raise ValueError("q_probs must be non-negative")
    sums = probs.to(torch.float64).sum(dim=1)  # [k]
    bad = (sums - 1.0).abs() > _ROW_SUM_TOL  # [k]
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"q_probs row {i} sums to {float(sums[i]):.6f}, must sum to 1 within {_ROW_SUM_TOL}")
    q_tok = (probs * (ids == tok[:, None])).sum(dim=1)  # [k] q_i(x_i); duplicate ids add up
    zero = q_tok <= 0  # [k]
    if bool(zero.any()):
        i = int(zero.nonzero()[0])
        raise ValueError(
            f"drafted token {int(tok[i])} at position {i} has q = 0 (not in its support); "
            "the drafter must sample from the sparse q it sends"
        )


def accept_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification (temperature 0).

    Rule (Leviathan et al. 2023, greedy special case): accept draft token x_i
    while x_i == argmax target_logits[i]; at the first mismatch (or after all
    k accepted) emit argmax of that row as the extra token (correction or bonus).

    draft_ids [k], target_logits [k+1, V] -> (num_accepted in 0..k, extra token).
    Out-of-range draft ids simply never match; nothing is indexed by them.
    """
    if draft_ids.dim() != 1:
        raise ValueError(f"draft_ids must have shape [k], got {tuple(draft_ids.shape)}")
    k = draft_ids.shape[0]
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must have shape [k+1={k + 1}, V], got {tuple(target_logits.shape)}")
    best = cpu_kernels.argmax(target_logits).tolist()  # [k+1]
    drafts = draft_ids.tolist()  # [k]: one tensor op and two reads, not seven ops, per row
    num_accepted = 0
    while num_accepted < k and drafts[num_accepted] == best[num_accepted]:
        num_accepted += 1
    return num_accepted, best[num_accepted]


def accept_sampled(
    draft: SparseDraft, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative-sampling verification (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

    For each drafted position i, accept x_i with probability
    min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample the replacement
    from norm(max(0, p_i - q_i)) and stop; if all k are accepted, sample a bonus
    token from p_k. The output is then distributed exactly as the target p.
    If the residual is all zero (p == q numerically) the replacement is drawn
    from p_i instead.

    draft: SparseDraft with k positions, target_probs [k+1, V] already warped
    with the same params as q -> (num_accepted in 0..k, extra token).
    Every random draw uses ``generator``: k uniforms at once, then one
    categorical draw. Shapes are checked here; ids and q are assumed to have
    passed ``validate_draft`` (``verify_tokens`` calls it). An out-of-range id
    that is used makes torch's gather/index_add raise; none is silently indexed.
    """
    k = draft.token_ids.shape[0]
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1 or target_probs.shape[1] < 1:
        raise ValueError(f"target_probs must have shape [k+1={k + 1}, V], got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    p = target_probs.to(torch.float32)  # [k+1, V]
    if k == 0:
        return 0, _sample_index(p[0], generator)

    tok = draft.token_ids.to(torch.int64)  # [k]
    q_ids = draft.q_ids.to(torch.int64)  # [k, S]
    q_probs = draft.q_probs.to(torch.float32)  # [k, S]
    p_tok = p[:k].gather(1, tok[:, None])[:, 0]  # [k] p_i(x_i)
    q_tok = (q_probs * (q_ids == tok[:, None])).sum(dim=1)  # [k] q_i(x_i); duplicate ids add up
    u = torch.rand(k, generator=generator)  # [k] uniforms in [0, 1)
    # u < p/q  <=>  u * q < p  for q > 0, so P(accept) = min(1, p/q) without a division
    # (q == 0 cannot be drafted; validate_draft rejects it).
    accepted = (u * q_tok < p_tok).tolist()  # [k] as Python bools
    num_accepted = accepted.index(False) if False in accepted else k

    if num_accepted == k:
        return k, _sample_index(p[k], generator)
    n = num_accepted
    q_row = torch.zeros(vocab, dtype=torch.float32).index_add_(0, q_ids[n], q_probs[n])  # [V] dense q_n
    residual = (p[n] - q_row).clamp_min_(0.0)  # [V] max(0, p_n - q_n)
    if not float(residual.sum()) > 0.0:
        residual = p[n]  # [V] fallback: p == q numerically, residual vanished
    return n, _sample_index(residual, generator)


def verify_tokens(
    draft: SparseDraft,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Validate inputs, then verify ``draft`` against target_logits [k+1, V].

    Greedy params -> accept_greedy(draft.token_ids, target_logits); otherwise
    accept_sampled(draft, warp_logits(target_logits, params), generator).
    Raises ValueError on invalid params, draft, or shapes.
    """
    params.validate()
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must have shape [k+1, V], got {tuple(target_logits.shape)}")
    validate_draft(draft, int(target_logits.shape[1]))
    if params.greedy:
        return accept_greedy(draft.token_ids, target_logits)
    return accept_sampled(draft, warp_logits(target_logits, params), generator)
