"""Attention of a ragged pass over many sessions (services/lean_llama.py ``forward_ragged``)
in few calls per layer: the rows whose KV caches are slots of one pool segment
(services/kv_slab.py ``KVPool``) in one call, and rows whose caches begin with the same
shared prefix (cascade attention) in one call over that prefix plus their own rests.

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

Cascade attention: rows whose caches begin with the same P positions (copies of the same
prefix-cache blocks, services/batching.py ``shared_prefixes``) attend to that prefix in ONE
call over the first row's copy, read once instead of once per row, and to the rest of their
own caches apart (the pooled ones in one call per segment over the slots' positions P..,
the others one by one); the two parts merge by their log-sum-exps:

    o = o_p * exp(lse_p - lse) + o_s * exp(lse_s - lse),  lse = logaddexp(lse_p, lse_s)

Every query of a group sees the whole shared prefix, so with enough of them (``DENSE_MIN``)
that call is two matrix products and a softmax between them (``dense_lse``): each key is then
used by all queries while it is in registers, where the kernel's and SDPA's loops take one
query at a time. 16 sessions behind an 800-token prefix: 259 against 572 us a layer on one
thread, hot in cache (docs/performance.md, 2026-11-27, Xeon).

On an AVX-512 CPU one operator does both, for each pooled plan's padded queries as they are
(``attend`` with ``prefix``): ``specmesh_cpu::prefix_attention`` multiplies 16 or 32 queries
by each key element in registers and merges each query's prefix part with its rest, which
the kernel above attended from position ``shared`` on; nothing is gathered or scattered. A
pass whose rows all share one prefix in one segment also keeps the fused rotary and cache
writes (services/lean_llama.py). Passes of 8 sessions behind 800 shared positions on a wide
target ran at 0.92x the speed of passes without the prefix on one thread, against 0.86x with
the matrix products (docs/performance.md, 2026-11-27).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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


def _written_and_padded(p: PooledRows, buffers: tuple[torch.Tensor, torch.Tensor],
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
    tokens' attention outputs [H, P, D] for queries q [H, T, D] (``_written_and_padded``).
    ``prefix``: a cascade's shared keys and values [KV, shared, D], which every query also
    sees (the CPU kernel attends the slots from ``p.since`` on, ``prefix_attention`` the
    prefix and merges the two)."""
    H, _, D = q.shape
    grouped, keys, values = _written_and_padded(p, buffers, q, k, v)
    if prefix is not None:  # [n, KV, G M, D] in and out
        out = torch.ops.specmesh_cpu.prefix_attention(
            grouped, *prefix, *kernel_attention(grouped, keys, values, p.last, p.since),
            D ** -0.5)
    elif p.mask is None:
        out = kernel_attention(grouped, keys, values, p.last, p.since)[0]
    else:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=p.mask)
    if p.dense:
        return out.reshape(p.n, H, D).transpose(0, 1)  # [H, P, D], a view
    return out.reshape(p.n, H, p.width, D)[p.rel, :, p.j].transpose(0, 1)  # [H, P, D]


def attend_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries q [B, KV, n, D] over keys/values [B, KV, L, D] with its
    log-sum-exp: ([B, KV, n, D], [B, KV, n] float32); ``mask`` [.., n, L] added to the scores
    (0 or -inf) or None. PyTorch's CPU flash kernel, which SDPA runs, returns both."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, False, attn_mask=mask)[:2]
    return out, lse


# Cascade attention on a CPU with the prefix kernel (services/lean_llama.py ``_cascades``):
# a group of rows attends its shared prefix once only when it has this many queries a key
# head: the kernel takes queries in blocks of 16 lanes (csrc/prefix_attention.h), so a smaller
# group pays for a whole block over the prefix. And a pass whose rows could run their layers
# as one operator keeps its groups only when they save SHARED_MIN_SAVED positions (rows after
# a group's first times its prefix) a token of the pass: any group keeps the whole pass in the
# layer-by-layer path. Demo target, one thread, whole passes alternated (docs/performance.md,
# 2026-11-28): 32 sessions in pairs sharing 130-500 positions took 26-46 ms a pass with
# the pairs' cascades, 16-28 without; among 32 sessions one group of 16 sharing 250 positions
# (117 saved a token) or of 8 sharing 800 (175) lost 1.5 ms each, while 16 of 16 sharing 250
# (234) won 1.2 ms and 16 of 32 sharing 800 (375) won 3 ms.
PREFIX_MIN_QUERIES = 16
SHARED_MIN_SAVED = 200
DENSE_MIN = 16  # queries per key head from which a shared prefix is attended by ``dense_lse``
#                (in whole passes behind 800 shared positions, passes alternated on one
#                thread: 16 sessions, 32 queries a head, 5% shorter; 8 sessions 3%; 4, 3% longer)


def dense_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [B, KV, n, D] over all of keys/values [B, KV, L, D], no mask,
    as matrix products, in float32: outputs [B, KV, n, D] (q's dtype) and log-sum-exps
    [B, KV, n] float32."""
    q32, k32, v32 = q.float(), keys.float(), values.float()
    scores = torch.matmul(q32 * q.shape[-1] ** -0.5, k32.transpose(-1, -2))  # [B, KV, n, L]
    top = scores.amax(-1, keepdim=True)  # [B, KV, n, 1]
    weights = scores.sub_(top).exp_()
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights, v32).div_(total)  # [B, KV, n, D]
    return out.to(q.dtype), (top + total.log()).squeeze(-1)


def _attend_slots_lse(p: PooledRows, buffers: tuple[torch.Tensor, torch.Tensor],
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` over the slots' positions from ``p.since`` on, with log-sum-exps: outputs
    [KV, G, P, D] and lse [KV, G, P]."""
    KV = k.shape[0]
    G = q.shape[0] // KV
    grouped, keys, values = _written_and_padded(p, buffers, q, k, v)
    out, lse = (kernel_attention(grouped, keys, values, p.last, p.since) if p.mask is None
                else attend_lse(grouped, keys, values, p.mask))  # [n, KV, G M, D], [n, KV, G M]
    out = out.reshape(p.n, KV, G, p.width, -1)[p.rel, :, :, p.j]  # [P, KV, G, D]
    lse = lse.reshape(p.n, KV, G, p.width)[p.rel, :, :, p.j]  # [P, KV, G]
    return out.permute(1, 2, 0, 3), lse.permute(1, 2, 0)


@dataclass
class Cascade:
    """A group of rows sharing their caches' first ``shared`` positions, planned once a
    pass: their tokens in T (the group's columns, row after row), the pooled rows' plans
    and the other rows' columns [c0, c1) with their additive masks over their rests."""

    rows: list[int]
    shared: int
    tok: torch.Tensor  # [N]
    pooled: list[PooledRows] = field(default_factory=list)
    alone: list[tuple[int, int, int, torch.Tensor | None]] = field(default_factory=list)
    # with the CPU kernel, every query's last shared position [1, 1] (made once a pass; the
    # pooled rests' plans carry their own): None where SDPA attends
    shared_last: torch.Tensor | None = None
    # the shared prefix attended and merged by ``specmesh_cpu::prefix_attention``
    prefix_kernel: bool = False


def cascade_plan(rows: Sequence, idx: Sequence[int], shared: int, starts: Sequence[int],
                 pooled: set[int], pool, group: int, device: torch.device,
                 rest_mask: Callable[[int], torch.Tensor | None],
                 kernel: bool = False, prefix_kernel: bool = False) -> Cascade:
    """Plans a group's attention; ``pooled``: which of its rows attend in their slots,
    ``rest_mask(b)``: a lone row's additive mask over its rest [G m, L - shared] (or None);
    ``kernel``: the CPU kernel attends the pooled rows' rests; ``prefix_kernel``: the
    shared prefix and the merge run in ``specmesh_cpu::prefix_attention``."""
    tok, columns, alone = [], {}, []
    for b in idx:
        m = len(rows[b].tokens)
        if b not in pooled:
            alone.append((b, len(tok), len(tok) + m, rest_mask(b)))
        for t in range(starts[b], starts[b] + m):
            columns[t] = len(tok)
            tok.append(t)
    mine = [b for b in idx if b in pooled]
    return Cascade(rows=list(idx), shared=shared, tok=torch.tensor(tok, device=device),
                   pooled=plan(rows, mine, starts, pool, group, device, shared, columns,
                               kernel),
                   shared_last=torch.full((1, 1), shared - 1, dtype=torch.long,
                                          device=device) if kernel else None,
                   alone=alone, prefix_kernel=prefix_kernel)


def shared_part(c: Cascade, layer: int, rows: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's shared keys and values in ``layer``, [KV, shared, D] each: its first
    row's copy (every row's holds the same)."""
    first = rows[c.rows[0]].kv.layers[layer]
    return first.keys[0, :, :c.shared], first.values[0, :, :c.shared]


def _rests_alone(c: Cascade, layer: int, rows: Sequence, starts: Sequence[int],
                 q: torch.Tensor, kv_heads: int):
    """Per row of the group outside the pool: its columns c0, c1, its queries [1, KV, G m, D]
    and their attention over the row's own rest (outputs and log-sum-exps, ``attend_lse``)."""
    H, _, D = q.shape
    G = H // kv_heads
    for b, c0, c1, mask in c.alone:
        cache = rows[b].kv.layers[layer]
        s, m = starts[b], c1 - c0
        grouped = q[None, :, s:s + m].reshape(1, kv_heads, G * m, D)
        yield (c0, c1, grouped, *attend_lse(grouped, cache.keys[:, :, c.shared:],
                                            cache.values[:, :, c.shared:], mask))


def cascade(c: Cascade, layer: int, rows: Sequence, starts: Sequence[int], pool,
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The group's attention outputs [H, N, D] for queries q [H, T, D] in ``layer``; writes
    its pooled rows' new keys and values (the others' caches were updated before)."""
    H, _, D = q.shape
    KV = k.shape[0]
    G, N = H // KV, len(c.tok)
    if c.prefix_kernel:  # each part's queries attend the prefix and merge in one operator
        prefix = shared_part(c, layer, rows)
        out = q.new_empty(H, N, D)
        for p in c.pooled:
            out[:, p.cols] = attend(p, pool.segments[p.segment][layer], q, k, v, prefix)
        for c0, c1, grouped, o_s, lse_s in _rests_alone(c, layer, rows, starts, q, KV):
            out[:, c0:c1] = torch.ops.specmesh_cpu.prefix_attention(
                grouped, *prefix, o_s, lse_s, D ** -0.5).reshape(H, c1 - c0, D)
        return out
    o_s = q.new_empty(KV, G, N, D)  # over each row's own rest
    lse_s = q.new_empty(KV, G, N, dtype=torch.float32)
    for p in c.pooled:
        o_s[:, :, p.cols], lse_s[:, :, p.cols] = _attend_slots_lse(
            p, pool.segments[p.segment][layer], q, k, v)
    for c0, c1, _, out, lse in _rests_alone(c, layer, rows, starts, q, KV):
        m = c1 - c0
        o_s[:, :, c0:c1], lse_s[:, :, c0:c1] = out.reshape(KV, G, m, D), lse.reshape(KV, G, m)
    grouped = q[:, c.tok].view(1, KV, G * N, D)  # every query sees all the shared positions
    keys, values = (t[None] for t in shared_part(c, layer, rows))  # [1, KV, shared, D]
    if G * N >= DENSE_MIN:
        o_p, lse_p = dense_lse(grouped, keys, values)
    elif c.shared_last is not None:
        o_p, lse_p = kernel_attention(grouped, keys, values, c.shared_last)
    else:
        o_p, lse_p = attend_lse(grouped, keys, values, None)  # [1, KV, G N, D], [1, KV, G N]
    o_p, lse_p = o_p.reshape(KV, G, N, D), lse_p.reshape(KV, G, N)
    lse = torch.logaddexp(lse_p, lse_s)
    out = (o_p * (lse_p - lse).exp()[..., None]
           + o_s * (lse_s - lse).exp()[..., None]).to(q.dtype)  # (lse is float32)
    return out.reshape(H, N, D)


def advance(rows: Sequence, plans: Sequence[PooledRows]) -> None:
    """After the pass: each pooled row's cache now holds its new tokens in every layer."""
    for p in plans:
        for b in p.rows:
            m = len(rows[b].tokens)
            for layer in rows[b].kv.layers:
                layer.length += m
