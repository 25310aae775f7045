"""Drafting a tree of prefixes in one batch: the drafter's half of the speculation cache.

One call (run on the model thread, alone):
1. feed the session's new tokens (the last committed token and this round's drafts
   d_1..d_k) onto its cache, keeping the logits of the last k + 1: the drafter's
   distribution after d_1..d_j for j = 0..k;
2. choose the outcomes (j, t) to draft for (services/speculation.py);
3. draft ``num_tokens`` tokens after each prefix ``committed + d_1..d_j + t``, all branches
   in one batch: the session cache is copied once into a left-padded batch cache
   ([B, H, L, D], row b holding the first n + j_b positions), then every step feeds one
   token per row at its true position and appends to that batch cache in place.

Each branch draws with its own generator seeded with the next round's draft seed, from the
same warped, sparse q as a plain Draft call (services.sampling.sparse_draft_sample_rows), so
a branch's drafts are the ones a Draft call after that outcome would make.
"""

from __future__ import annotations

import time

import torch

from services.batching import Row, forward_one
from services.kv_cache import SessionCache
from services.kv_slab import SlabCache
from services.messages import Branch, DraftResult, SpeculateCall
from services.sampling import sparse_draft_sample_rows, warp_logits
from services.speculation import plan_branches


def guess_distribution(logits: torch.Tensor, call: SpeculateCall) -> torch.Tensor:
    """logits [k+1, V] -> the distribution guesses are ranked by [k+1, V]: the warped one
    when sampling; for greedy requests (a one-hot when warped) the plain softmax."""
    if call.params.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return warp_logits(logits, call.params)


def batch_cache(kv, lengths: list[int], room: int, new_cache) -> tuple[object, int]:
    """A batch cache whose row b holds the first lengths[b] positions of ``kv`` (a batch-1
    cache), left-padded with zeros to the longest: (cache, padded length). A SlabCache gets
    ``room`` free positions after them, so the steps that follow append without a copy."""
    batch = new_cache()
    longest = max(lengths)
    extra = room if isinstance(batch, SlabCache) else 0
    for layer, source in enumerate(kv.layers):
        padded = []
        for held in (source.keys, source.values):  # [1, H, L, D]
            rows = held.new_zeros(len(lengths), held.shape[1], longest + extra, held.shape[3])
            for b, n in enumerate(lengths):
                rows[b, :, longest - n:longest] = held[0, :, :n]
            padded.append(rows)  # [B, H, longest + extra, D]
        if extra:
            batch.layers[layer].adopt(*padded, length=longest)
        else:
            batch.update(*padded, layer)
    return batch, longest


@torch.inference_mode()
def draft_tree(model, entry: SessionCache, new_tokens: list[int], call: SpeculateCall,
               device: torch.device, new_cache) -> tuple[tuple[Branch, ...], float]:
    """Runs steps 1-3 of the module docstring; returns (branches, compute ms)."""
    start = time.perf_counter()
    k, steps = call.num_drafts, call.num_tokens
    logits = forward_one(model, Row(tokens=new_tokens, kv=entry.kv, start=len(entry.tokens),
                                    keep=k + 1), device)  # [k+1, V]
    entry.tokens.extend(new_tokens)
    drafts = entry.tokens[-k:]
    committed = len(entry.tokens) - k
    plan = plan_branches(drafts, guess_distribution(logits, call), call.acceptance,
                         call.max_branches, call.coverage)
    lengths = [committed + j for j, _, _ in plan]
    cache, longest = batch_cache(entry.kv, lengths, steps, new_cache)
    rows = len(plan)
    feed = torch.tensor([[t] for _, t, _ in plan], dtype=torch.long)  # [B, 1]
    mask = torch.zeros(rows, longest, dtype=torch.long)  # [B, longest] 1 = real key
    for b, n in enumerate(lengths):
        mask[b, longest - n:] = 1
    positions = torch.tensor(lengths, dtype=torch.long)[:, None]  # [B, 1]
    generators = [torch.Generator().manual_seed(call.seed) for _ in plan]
    out: list[list[tuple[int, list[int], list[float]]]] = [[] for _ in plan]
    for step in range(steps):
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], dim=1)  # [B, L+s+1]
        step_logits = model(input_ids=feed.to(device), attention_mask=mask.to(device),
                            position_ids=(positions + step).to(device), past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1].float().cpu()  # [B, V]
        greedy = call.params.greedy  # argmax of the logits = of the one-hot warp
        sampled = sparse_draft_sample_rows(
            step_logits if greedy else warp_logits(step_logits, call.params),
            call.max_support, generators, greedy)
        for b, draw in enumerate(sampled):
            out[b].append(draw)
        feed = torch.tensor([[token] for token, _, _ in sampled], dtype=torch.long)  # [B, 1]
    ms = (time.perf_counter() - start) * 1000.0
    branches = tuple(
        Branch(accepted=j, token=t, probability=p, draft=DraftResult(
            token_ids=tuple(d[0] for d in draws), q_ids=tuple(tuple(d[1]) for d in draws),
            q_probs=tuple(tuple(d[2]) for d in draws), cached_len=len(entry.tokens),
            cache_hit=True, compute_ms=ms))
        for (j, t, p), draws in zip(plan, out, strict=True))
    return branches, ms
