"""Drafting a tree of prefixes in one pass per step: the drafter's half of the speculation
cache.

One call (run on the model thread, alone):
1. feed the session's new tokens (the last committed token and this round's drafts
   d_1..d_k) onto its cache, keeping the logits of the last k + 1: the drafter's
   distribution after d_1..d_j for j = 0..k;
2. choose the outcomes (j, t) to draft for (services/speculation.py);
3. draft ``num_tokens`` tokens after each prefix ``committed + d_1..d_j + t``, all B branches
   as ONE sequence of B new tokens per step on the session's own cache (tree attention, as
   in SpecInfer and Medusa): step s appends one token per branch after everything the cache
   holds, at the branch's true position, and a mask lets each branch see only its prefix
   (the first committed + j_b cached positions) and its own earlier tree tokens:

       keys:     [ committed | d_1..d_k | step 0: B tokens | step 1: B tokens | ... ]
       branch b: [ 1 … 1 0…0 (j_b of the d's visible) | e_b | e_b | ... ]      (e_b: one-hot)

   No branch copies the session's cache, and a step costs one pass over B tokens, which on a
   CPU with prepacked weights is little more than a pass over one. Afterwards the cache is
   cropped back to the committed tokens and the drafts.

Each branch draws with its own generator seeded with the next round's draft seed, from the
same warped, sparse q as a plain Draft call (services.sampling.sparse_draft_sample_rows), so
a branch's drafts are the ones a Draft call after that outcome would make (up to float
summation order in its logits).
"""

from __future__ import annotations

import time

import torch

from services.batching import Row, forward_row
from services.kv_cache import SessionCache
from services.messages import Branch, DraftResult, SpeculateCall
from services.sampling import sparse_draft_sample_rows, warp_logits
from services.speculation import plan_branches


def guess_distribution(logits: torch.Tensor, call: SpeculateCall) -> torch.Tensor:
    """logits [k+1, V] -> the distribution guesses are ranked by [k+1, V]: the warped one
    when sampling; for greedy requests (a one-hot when warped) the plain softmax."""
    if call.params.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return warp_logits(logits, call.params)


def tree_visibility(prefix_lengths: list[int], held: int, steps: int) -> torch.Tensor:
    """[B, held + B*steps] bool: which keys branch b may see by the last step (step s's
    tokens are the B keys from held + B*s): the first prefix_lengths[b] cached positions and
    its own token of every step. Step s uses the first held + B*(s+1) columns."""
    B = len(prefix_lengths)
    visible = torch.zeros(B, held + B * steps, dtype=torch.bool)
    visible[:, :held] = torch.arange(held)[None] < torch.tensor(prefix_lengths)[:, None]
    own = torch.eye(B, dtype=torch.bool)
    for step in range(steps):
        visible[:, held + B * step: held + B * (step + 1)] = own
    return visible


@torch.inference_mode()
def draft_tree(model, entry: SessionCache, new_tokens: list[int], call: SpeculateCall,
               device: torch.device) -> tuple[tuple[Branch, ...], float]:
    """Runs steps 1-3 of the module docstring; returns (branches, compute ms)."""
    start = time.perf_counter()
    k, steps = call.num_drafts, call.num_tokens
    logits = forward_row(model, Row(tokens=new_tokens, kv=entry.kv, start=len(entry.tokens),
                                    keep=k + 1), device)  # [k+1, V]
    entry.tokens.extend(new_tokens)
    drafts = entry.tokens[-k:]
    held = len(entry.tokens)  # the committed tokens and the drafts
    plan = plan_branches(drafts, guess_distribution(logits, call), call.acceptance,
                         call.max_branches, call.coverage)
    B = len(plan)
    lengths = [held - k + j for j, _, _ in plan]  # [B] cached positions each branch sees
    # additive (0 / -inf), in the cache's dtype: SDPA, HF's eager attention and the lean
    # forward all take it as is
    dtype = entry.kv.layers[0].keys.dtype
    blocked = torch.zeros(B, held + B * steps, dtype=dtype).masked_fill_(
        ~tree_visibility(lengths, held, steps), float("-inf")).to(device)
    positions = torch.tensor(lengths, dtype=torch.long, device=device)[None]  # [1, B]
    feed = torch.tensor([[t for _, t, _ in plan]], dtype=torch.long)  # [1, B]
    generators = [torch.Generator().manual_seed(call.seed) for _ in plan]
    out: list[list[tuple[int, list[int], list[float]]]] = [[] for _ in plan]
    try:
        for step in range(steps):
            mask = blocked[None, None, :, : held + B * (step + 1)]  # [1, 1, B, keys]
            step_logits = model(input_ids=feed.to(device), attention_mask=mask,
                                position_ids=positions + step, past_key_values=entry.kv,
                                use_cache=True, logits_to_keep=B).logits[0].float().cpu()  # [B, V]
            greedy = call.params.greedy  # argmax of the logits = of the one-hot warp
            sampled = sparse_draft_sample_rows(
                step_logits if greedy else warp_logits(step_logits, call.params),
                call.max_support, generators, greedy)
            for b, draw in enumerate(sampled):
                out[b].append(draw)
            feed = torch.tensor([[token for token, _, _ in sampled]], dtype=torch.long)  # [1, B]
    finally:
        extra = entry.kv.get_seq_length() - held  # the tree's tokens were never the session's
        if extra > 0:
            entry.kv.crop(-extra)
    ms = (time.perf_counter() - start) * 1000.0
    branches = tuple(
        Branch(accepted=j, token=t, probability=p, draft=DraftResult(
            token_ids=tuple(d[0] for d in draws), q_ids=tuple(tuple(d[1]) for d in draws),
            q_probs=tuple(tuple(d[2]) for d in draws), cached_len=len(entry.tokens),
            cache_hit=True, compute_ms=ms))
        for (j, t, p), draws in zip(plan, out, strict=True))
    return branches, ms
