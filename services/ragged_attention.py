"""Attention of a ragged pass over many sessions (services/lean_llama.py ``forward_ragged``)
in few calls per layer: the rows whose KV caches are slots of one pool segment
(services/kv_slab.py ``KVPool``) in one call.

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

On a CPU the project's kernel attends instead of SDPA (services/csrc/pooled_attention.h,
``specmesh_cpu::attention``): it takes each padded query's last visible key, not a mask, and
reads each row's own keys only, not the window padded to the longest. SDPA's CPU kernel spent
about twice the time reading the keys and values of a decode pass over 16 sessions
(docs/performance.md, 2026-11-27).

Rows whose caches begin with the same shared prefix attend to it once per layer
(services/cascade_attention.py); their pooled rests go through the plans here, with
``since`` their shared positions, and a pass that is one such group in one segment attends
through ``attend`` with its ``prefix``.
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
    last: torch.Tensor  # [n, M] each padded query's last visible key (its position)
    mask: torch.Tensor | None  # [n, 1, G M, Lmax - since]: added to the scores (0 = may
    # attend, -inf), in the pool's dtype: made once a pass, where a bool mask is turned into
    # this by SDPA in every layer's call (two operators a layer; on a GPU, two kernel
    # launches); None where the CPU kernel attends (``last`` is what it reads)
    since: int = 0  # keys before this position are not read (a cascade's shared prefix)
    cols: torch.Tensor | None = None  # [P] with since > 0: each token's column in its group
    # The common decode pass (one stream's, and rows in slot order): the rows' tokens are
    # the pass's tokens [a, b) in order (``span``; else None), and every row holds ``width``
    # new tokens, the rows in their slots' order (``aligned``), with or without slots of the
    # window between them that hold no row of the pass (sessions between rounds): what the
    # one-operator pass takes (services/uniform_pass.py). With ``span`` the rows' queries,
    # keys and values are slices of the pass's, not gathered; with ``dense`` the queries are
    # not scattered into a zero-filled padded batch nor the outputs gathered back out of it.
    # The same floats, fewer operators (on a GPU, kernel launches).
    span: slice | None = None
    aligned: bool = False

    @property
    def uniform(self) -> bool:
        """Each slot of the window is one row, in order: ``aligned`` without gaps (the padded
        batch has no padding, and is the pass's queries in another order)."""
        return self.aligned and self.n == len(self.rows)

    @property
    def dense(self) -> bool:
        """Slot i of the window is query i: ``uniform`` with one new token a row."""
        return self.uniform and self.width == 1

    @property
    def where(self) -> slice | torch.Tensor:
        """The rows' tokens among the pass's: a slice when they are consecutive."""
        return self.span if self.span is not None else self.tok


def additive_mask(last: torch.Tensor, since: int, keys: int, group: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    """The scores' mask of padded queries whose last visible keys are ``last`` [n, M] over
    keys since..keys-1: [n, 1, G M, keys - since], 0 where a query may attend and -inf
    where not, each key head's G query heads' M rows in turn (``group`` G)."""
    hidden = (torch.arange(since, keys, device=last.device)[None, None]
              > last[:, :, None]).repeat(1, group, 1)[:, None]  # [n, 1, G M, keys - since]
    return torch.zeros(hidden.shape, dtype=dtype, device=last.device).masked_fill_(
        hidden, float("-inf"))


def plan(rows: Sequence, members: Sequence[int], starts: Sequence[int], pool, group: int,
         device: torch.device, since: int = 0, columns: dict[int, int] | None = None,
         kernel: bool = False) -> list[PooledRows]:
    """Splits the pass's rows ``members`` (each ``rows[b].kv`` a cache of ``pool`` with a
    slot, room for its tokens) by segment, and in a segment the rows of one new token apart
    from the rows of several: in one plan every row is padded to the widest, so a decode
    row beside a verify row of 4 tokens had 3 padded queries attend its whole cache (beside
    a prompt, as many as its tokens less one), and the pass could not run its parts as one
    operator each (services/uniform_pass.py). 16 decode rows beside a 4-token verify, demo
    target, in process: 4.4-4.7 against 5.6-6.1 ms a pass on two threads, 7.0 against
    9.0-9.2 on one (docs/performance.md, 2026-11-29). ``starts``: each row's first token in T; ``group``
    G: query heads per key head. For a cascade group: ``since`` its shared positions,
    ``columns`` each token's column among the group's tokens. ``kernel``: the CPU kernel
    attends (no mask is made)."""
    slot_of = {b: rows[b].kv.slot for b in members}  # (a property over every layer)
    by_segment: dict[tuple[int, bool], list[int]] = {}
    for b in members:  # (segment, whether the row feeds more than one token)
        by_segment.setdefault((slot_of[b] // pool.segment, len(rows[b].tokens) > 1),
                              []).append(b)
    plans = []
    # in the order of their tokens in the pass: a verify row before a segment's one-token
    # rows still lets each part run as one operator (uniform_pass.parts_in_order)
    for (segment, _), idx in sorted(by_segment.items(), key=lambda item: starts[item[1][0]]):
        slots = [slot_of[b] % pool.segment for b in idx]
        sizes = [len(rows[b].tokens) for b in idx]
        lo, hi = min(slots), max(slots)
        n, width = hi - lo + 1, max(sizes)
        keys = max(rows[b].start + m for b, m in zip(idx, sizes, strict=True))
        for b, m in zip(idx, sizes, strict=True):  # (its new positions are written first)
            pool.ready(slot_of[b], rows[b].start + m, keys)
        tok, slot, pos, j = [], [], [], []
        limit = [[0] * width for _ in range(n)]  # per padded query: its last visible key
        for b, s, m in zip(idx, slots, sizes, strict=True):
            start = rows[b].start
            tok += range(starts[b], starts[b] + m)
            slot += [s] * m
            pos += range(start, start + m)
            j += range(m)
            limit[s - lo] = [start + min(i, m - 1) for i in range(width)]
        # the plan's indices in one copy to the device: tok, slot, pos, j [P] each, the
        # padded queries' last visible keys [n M], and a cascade's columns [P]
        cols = [] if columns is None else [columns[t] for t in tok]
        P = len(tok)
        staged = torch.tensor(tok + slot + pos + j + [x for row in limit for x in row] + cols,
                              dtype=torch.long, device=device)
        slot_t = staged[P:2 * P]
        last = staged[4 * P:4 * P + n * width].view(n, width)  # [n, M]
        mask = None if kernel else additive_mask(last, since, keys, group, pool.dtype)
        consecutive = tok == list(range(tok[0], tok[0] + len(tok)))
        plans.append(PooledRows(
            segment=segment, rows=idx, tok=staged[:P], slot=slot_t, pos=staged[2 * P:3 * P],
            rel=slot_t - lo, j=staged[3 * P:4 * P], lo=lo, n=n, width=width, keys=keys,
            last=last, mask=mask, since=since, cols=None if columns is None else staged[-P:],
            span=slice(tok[0], tok[-1] + 1) if consecutive else None,
            aligned=min(sizes) == width and all(
                a < b for a, b in zip(slots, slots[1:], strict=False))))
    return plans


def written_and_padded(p: PooledRows, buffers: tuple[torch.Tensor, torch.Tensor],
                       q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Writes the rows' new keys and values k, v [KV, T, D] into their slots of the
    segment's ``buffers`` (keys, values [S, KV, slot_len, D]); returns their queries from q
    [H, T, D] padded [n, KV, G M, D] and the slots' keys and values [n, KV, Lmax - since, D]
    (views)."""
    keys, values = buffers
    H, _, D = q.shape
    KV = keys.shape[1]
    if k is not None:  # (None: the pass wrote them, ``rope_store``)
        keys[p.slot, :, p.pos] = k[:, p.where].transpose(0, 1)  # [P, KV, D]
        values[p.slot, :, p.pos] = v[:, p.where].transpose(0, 1)
    window = slice(p.lo, p.lo + p.n)
    if p.dense:  # slot i is query i: [P, H, D] as [n, KV, G, D], a view
        padded = q[:, p.where].transpose(0, 1).view(p.n, KV, H // KV, D)
    else:
        padded = q.new_zeros(p.n, H, p.width, D)
        padded[p.rel, :, p.j] = q[:, p.where].transpose(0, 1)  # [P, H, D]
        padded = padded.view(p.n, KV, (H // KV) * p.width, D)  # head g's M rows in turn
    return padded, keys[window, :, p.since:p.keys], values[window, :, p.since:p.keys]


def kernel_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     last: torch.Tensor, since: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel (services/csrc/pooled_attention.h): queries q [n, KV, R, D] over keys and
    values [n, KV, L, D] that begin at position ``since``, query r of row i seeing those up to
    ``last[i, r % M]`` (last [n, M]); outputs [n, KV, R, D] and log-sum-exps [n, KV, R]."""
    return torch.ops.specmesh_cpu.attention(q, keys, values, last, since, q.shape[-1] ** -0.5)


def attend(p: PooledRows, buffers: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
           k: torch.Tensor | None, v: torch.Tensor | None,
           prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Writes the rows' new keys and values (k, v None: already written) and returns their
    tokens' attention outputs [H, P, D] for queries q [H, T, D] (``written_and_padded``).
    ``prefix``: a cascade's shared keys and values [KV, shared, D], which every query also
    sees (the CPU kernel attends the slots from ``p.since`` on, ``prefix_attention`` the
    prefix and merges the two, over the rows' own queries only: ``_with_prefix``)."""
    H, _, D = q.shape
    grouped, keys, values = written_and_padded(p, buffers, q, k, v)
    if prefix is not None:
        return _with_prefix(p, q, grouped, keys, values, prefix)
    if p.mask is None:
        out = kernel_attention(grouped, keys, values, p.last, p.since)[0]
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=p.mask)
    if p.dense:
        return out.reshape(p.n, H, D).transpose(0, 1)  # [H, P, D], a view
    return out.reshape(p.n, H, p.width, D)[p.rel, :, p.j].transpose(0, 1)  # [H, P, D]


def _with_prefix(p: PooledRows, q: torch.Tensor, grouped: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor]
                 ) -> torch.Tensor:
    """``attend``'s outputs [H, P, D] where every query also sees a shared ``prefix``: the
    rests over the padded batch ``grouped`` [n, KV, G M, D] (the kernel), then the prefix
    and the merge (``prefix_attention``) for the rows' P queries a head alone. A padded
    query (a slot of the window between the pass's rows, or a short row's query past its
    tokens) attends none of its slot's keys, but each of it would take a lane of the prefix
    kernel's blocks, whose cost is the prefix's length whatever they hold: 16 rows spread
    over 20 slots made 40 queries a key head, two blocks of 32 where 32 fill one."""
    H, _, D = q.shape
    KV = grouped.shape[1]
    rest = kernel_attention(grouped, keys, values, p.last, p.since)
    if p.dense:  # [n, KV, G, D] in and out: no padding
        out = torch.ops.specmesh_cpu.prefix_attention(grouped, *prefix, *rest, D ** -0.5)
        return out.reshape(p.n, H, D).transpose(0, 1)
    o_s, lse_s = compact(p, *rest)  # [P, KV, G, D], [P, KV, G]
    mine = q[:, p.where].view(KV, H // KV, -1, D).permute(2, 0, 1, 3)  # [P, KV, G, D]
    out = torch.ops.specmesh_cpu.prefix_attention(mine, *prefix, o_s, lse_s, D ** -0.5)
    return out.reshape(-1, H, D).transpose(0, 1)  # [H, P, D]


def compact(p: PooledRows, out: torch.Tensor, lse: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' own tokens' part of a padded batch's outputs [n, KV, G M, D] and
    log-sum-exps [n, KV, G M] (head g's M rows in turn): [P, KV, G, D] and [P, KV, G], the
    tokens in the plan's order."""
    n, KV, _, D = out.shape
    if p.dense:
        return out, lse
    return (out.reshape(n, KV, -1, p.width, D)[p.rel, :, :, p.j],
            lse.reshape(n, KV, -1, p.width)[p.rel, :, :, p.j])


def advance(rows: Sequence, plans: Sequence[PooledRows]) -> None:
    """After the pass: each pooled row's cache now holds its new tokens in every layer."""
    for p in plans:
        for b in p.rows:
            m = len(rows[b].tokens)
            for layer in rows[b].kv.layers:
                layer.length += m
