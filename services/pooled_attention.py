"""Attention for many sessions in one call per layer: the rows of a pass whose KV caches are
slots of one pool segment (services/kv_slab.py ``KVPool``).

Per session, a pass's attention is small (a decode row: G query rows over L keys), so over
16 sessions a pass made 16 calls per layer (cache write, slicing, SDPA), and that Python and
dispatch cost was most of each row's share of the pass. With the caches as rows of one
buffer per layer, the pass writes every row's new keys and values with one indexed store
and attends with one SDPA call over the segment's slots, padded to the longest row:

    segment buffer  K [S, KV, slot_len, D]    rows' slots s_b in [lo, lo + n)
    queries         q_pad [n, H, M, D]        row b's m_b queries at [s_b - lo, :, :m_b]
    keys            K[lo:lo + n, :, :Lmax]    a view: nothing copied
    mask            [n, 1, G M, Lmax]         query j of row b sees keys <= start_b + j

Padding costs little against the calls it replaces: slots between the rows' that are not in
the pass, and a row's queries past its m_b, attend to one key (their outputs are never
read), and keys past a row's own length are masked (the pool makes sure they hold numbers:
a masked NaN would still reach the softmax). Each real query sees exactly its own cache and
the new keys before it, as in a pass of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PooledRows:
    """The pooled rows of a pass in one segment, and what each layer's call needs."""

    segment: int
    rows: list[int]  # their indices in the pass
    tok: torch.Tensor  # [P] each of their tokens' index in the pass's T tokens
    slot: torch.Tensor  # [P] the token's slot in the segment
    pos: torch.Tensor  # [P] the token's position in its cache
    rel: torch.Tensor  # [P] slot - lo: the token's row in the padded batch
    j: torch.Tensor  # [P] the token's index among its row's new tokens
    lo: int
    n: int  # slots lo..lo+n-1 are read
    width: int  # M: the most new tokens of a row
    keys: int  # Lmax: the most positions of a row after the pass
    mask: torch.Tensor  # [n, 1, G M, Lmax] bool, True = may attend


def plan(rows: Sequence, members: Sequence[int], starts: Sequence[int], pool, group: int,
         device: torch.device) -> list[PooledRows]:
    """Splits the pass's rows ``members`` (each ``rows[b].kv`` a cache of ``pool`` with a
    slot, room for its tokens) by segment. ``starts``: each row's first token in T; ``group``
    G: query heads per key head."""
    by_segment: dict[int, list[int]] = {}
    for b in members:
        by_segment.setdefault(rows[b].kv.slot // pool.segment, []).append(b)
    plans = []
    for segment, idx in sorted(by_segment.items()):
        slots = [rows[b].kv.slot % pool.segment for b in idx]
        sizes = [len(rows[b].tokens) for b in idx]
        lo, hi = min(slots), max(slots)
        n, width = hi - lo + 1, max(sizes)
        keys = max(rows[b].start + m for b, m in zip(idx, sizes, strict=True))
        for b in idx:
            pool.ready(rows[b].kv.slot, rows[b].start, keys)
        tok, slot, pos, j = [], [], [], []
        limit = [[0] * width for _ in range(n)]  # per padded query: its last visible key
        for b, s, m in zip(idx, slots, sizes, strict=True):
            start = rows[b].start
            tok += range(starts[b], starts[b] + m)
            slot += [s] * m
            pos += range(start, start + m)
            j += range(m)
            limit[s - lo] = [start + min(i, m - 1) for i in range(width)]
        slot_t = torch.tensor(slot, device=device)
        last = torch.tensor(limit, device=device)  # [n, M]
        mask = torch.arange(keys, device=device)[None, None] <= last[:, :, None]  # [n, M, L]
        plans.append(PooledRows(
            segment=segment, rows=idx, tok=torch.tensor(tok, device=device), slot=slot_t,
            pos=torch.tensor(pos, device=device), rel=slot_t - lo,
            j=torch.tensor(j, device=device), lo=lo, n=n, width=width, keys=keys,
            mask=mask.repeat(1, group, 1)[:, None]))  # [n, 1, G M, L]: head g's rows in turn
    return plans


def attend(p: PooledRows, buffers: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Writes the rows' new keys and values k, v [KV, T, D] into their slots of the
    segment's ``buffers`` (keys, values [S, KV, slot_len, D]) and returns their tokens'
    attention outputs [H, P, D] for queries q [H, T, D]."""
    keys, values = buffers
    H, _, D = q.shape
    KV = k.shape[0]
    keys[p.slot, :, p.pos] = k[:, p.tok].transpose(0, 1)  # [P, KV, D]
    values[p.slot, :, p.pos] = v[:, p.tok].transpose(0, 1)
    padded = q.new_zeros(p.n, H, p.width, D)
    padded[p.rel, :, p.j] = q[:, p.tok].transpose(0, 1)  # [P, H, D]
    grouped = padded.view(p.n, KV, (H // KV) * p.width, D)  # [n, KV, G M, D]
    window = slice(p.lo, p.lo + p.n)
    out = F.scaled_dot_product_attention(grouped, keys[window, :, :p.keys],
                                         values[window, :, :p.keys], attn_mask=p.mask)
    return out.view(p.n, H, p.width, D)[p.rel, :, p.j].transpose(0, 1)  # [H, P, D]


def advance(rows: Sequence, plans: Sequence[PooledRows]) -> None:
    """After the pass: each pooled row's cache now holds its new tokens in every layer."""
    for p in plans:
        for b in p.rows:
            m = len(rows[b].tokens)
            for layer in rows[b].kv.layers:
                layer.length += m
