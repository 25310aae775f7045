"""Cascade attention of a ragged pass (services/lean_llama.py ``forward_ragged``): rows whose
KV caches begin with the same shared prefix attend to it in one call per layer, plus their
own rests (the pooled ones through services/ragged_attention.py's plans).

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

On an AVX-512 or AVX2 CPU one operator does both (``cascade``; ``attend`` with ``prefix``
for a pass that is one group in one segment): ``specmesh_cpu::prefix_attention`` multiplies
16 or 32 queries by each key element in registers and merges each query's prefix part with
its rest, which the slots' kernel (services/ragged_attention.py) attended from position
``shared`` on. It takes the group's own queries only, once a layer for all of them wherever
their caches lie: a padded query (a slot between the pass's rows) would take a lane of a
block that costs the prefix's length whatever it holds. A pass whose rows all share one
prefix in one segment also keeps the fused rotary and cache writes (services/lean_llama.py).
Passes of 8 sessions behind 800 shared positions on a wide target ran at 0.92x the speed of
passes without the prefix on one thread, against 0.86x with the matrix products
(docs/performance.md, 2026-11-27).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from services import ragged_attention
from services.ragged_attention import PooledRows, compact, kernel_attention


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
# a group's first times its prefix) a token of the pass: a group keeps the whole pass in the
# layer-by-layer path (one group holding every row in one segment keeps the pass one
# operator, services/uniform_pass.py taking its prefix: the rule does not drop it). Demo
# target, one thread, whole passes alternated (docs/performance.md, 2026-11-28): 32 sessions
# in pairs sharing 130-500 positions took 26-46 ms a pass with the pairs' cascades, 16-28
# without; among 32 sessions one group of 16 sharing 250 positions (117 saved a token) or of
# 8 sharing 800 (175) lost 1.5 ms each, while 16 of 16 sharing 250 (234) won 1.2 ms and 16 of
# 32 sharing 800 (375) won 3 ms.
# A pass's only group, holding every row of a one-operator pass, whose queries fill only part
# of a block (PART_MIN_QUERIES, half of one, or more) is kept where its rows after the first
# skip PART_MIN_SAVED positions of the prefix together (``cascade_groups``: elsewhere such
# groups took the pass layer by layer and lost):
# the half-empty block costs the work of a full one over the prefix, and the call has costs
# of its own, while the copies not read grow with the prefix. Demo target, one-token rows (8
# queries a key head for 4 sessions), whole passes alternated in one process, 2-core AMD EPYC
# (Zen 3, AVX2), one / two threads: 4 sessions sharing 800 positions (2,400 skipped) 1.20x /
# 1.15x as fast with the cascade, 6 sharing 800 1.39x / 1.47x, 4 sharing 512 (1,536) 1.15x /
# 1.08x, 6 sharing 512 1.23x / 1.12x; 4 sharing 304 (912) 0.96x / 0.90x, 3 sharing 800
# (6 queries) 1.02x, pairs sharing 800 (4 queries) 0.88x / 0.94x (docs/performance.md,
# 2026-11-29)
# On an AVX2 CPU (2-core AMD EPYC, Zen 3, the same demo-target passes, alternated), groups
# taking a one-operator pass layer by layer paid only further: 2 groups of 8 sessions sharing
# 250 positions each (219 saved a token) 1.00x / 0.76x as fast as without (one / two threads),
# sharing 400 (350) 0.91x / 0.77x, 4 groups of 8 sharing 250 0.83x; sharing 800 (700) 1.34x /
# 0.96x, 4 groups of 8 1.38x (docs/performance.md, 2026-11-29). On an AVX-512 CPU (2-core
# AMD EPYC, Zen 5, the same passes, one / two threads) one group beside rows sharing nothing
# paid from ~175 positions a token (16 of 32 sessions sharing 500, 234 a token, 1.03x / 1.10x;
# sharing 800, 375, 1.12x / 1.15x; 8 of 32 sharing 800, 175, 1.00x / 1.03x), but several
# groups did not below ~500, as on AVX2: 2 groups of 8 sharing 250 (219) 0.96x / 0.79x, 400
# (350) 1.07x / 0.96x, 800 (700) 1.25x / 1.20x; 4 groups of 8 sharing 250 0.97x / 0.94x
# (docs/performance.md, 2026-11-29). Per the prefix kernel's path (``prefix_attention_isa``)
# for one group, and GROUPS_MIN_SAVED for several on either path. Several groups that hold
# every row of a one-operator pass, in one segment, each filling a block, keep it one
# operator (``joint_plan``) whatever they save: on the Zen 5, 2 groups of 8 sessions sharing
# 250 / 400 / 800 positions each ran 1.13x / 1.24x / 1.45x as fast as without on one thread
# (2 groups of 8 sharing 16 or 64, 1.00x), and with the groups' sessions in alternate slots,
# as a replica's arrivals leave them, 1.10x / 1.22x / 1.51x on two threads (each thread then
# takes one group's rows: services/csrc/layer_parts.h); four groups of four (half a block)
# gained little or lost on two threads, 1.03x sharing 800, 0.80x sharing 512 (each group's
# claim reads every weight for its 4 rows), and are not kept (docs/performance.md, 2026-11-29).
# Groups that fill a block beside rows sharing no prefix, in one segment, keep the pass one
# operator too, each of those rows attending its own slot from position 0 (``joint_plan``):
# where such a pass dropped its groups to stay one operator (they saved too few positions a
# token), one group of 8 demo-target sessions sharing 800 positions beside 8 sessions of 820
# positions of their own ran 1.26x / 1.21x as fast (one / two threads; 2-core AMD EPYC, Zen 3,
# AVX2), beside 8 of 100 1.36x / 1.25x, 8 sharing 400 beside 8 of 820 1.17x / 1.12x, 8 sharing
# 250 or 128 beside 8 of 100 1.02-1.05x, 16 sharing 128 beside 8 of 100 1.19x on two threads;
# where the layer loop took the group (14 sharing 800 beside 2 of 820), 1.00x / 0.99-1.03x
# (docs/performance.md, 2026-11-30):
PREFIX_MIN_QUERIES = 16
PART_MIN_QUERIES = 8
PART_MIN_SAVED = 1500
SHARED_MIN_SAVED = {"avx512": 200, "avx2": 500}  # one group beside rows that share nothing
GROUPS_MIN_SAVED = 500  # several groups, on either path (at least either path's one-group bar)
DENSE_MIN = 16  # queries per key head from which a shared prefix is attended by ``dense_lse``
#                (in whole passes behind 800 shared positions, passes alternated on one
#                thread: 16 sessions, 32 queries a head, 5% shorter; 8 sessions 3%; 4, 3% longer)


def cascade_groups(shared: Sequence[tuple[list[int], int]], rows: Sequence, sizes: Sequence[int],
                   pooled: set[int], group: int, uniform: bool, segment: int,
                   isa: str = "avx512") -> list[tuple[list[int], int]]:
    """The groups of ``shared`` ((row indices, P): rows whose caches begin with the same P
    positions) whose rows attend that prefix once, in the prefix kernel
    (``prefix_attention``). A group only when it fills one of the kernel's blocks of queries
    (``PREFIX_MIN_QUERIES`` a key head, ``group`` query heads each: a smaller one pays for a
    whole block over the prefix). Where the pass could otherwise run its layers in one
    operator (every row pooled, ``pooled``, all of one size that runs so, ``uniform``) in one
    segment (``segment`` slots each), it stays one operator with each group's prefix
    attended in it and the rows outside the groups attending their own slots from position 0
    (``joint_plan``, or one cascade for an only group of every row), which paid even where
    little is shared (16 demo-target sessions sharing 150 positions: 4.85 against 4.92 ms a
    pass on two threads, 7.57 against 8.23 on one; docs/performance.md, 2026-11-29). An only
    group of every row may fill half a block where its rows skip many positions
    (``PART_MIN_QUERIES``, ``PART_MIN_SAVED``); elsewhere groups of half a block made passes
    slower (4 groups of 4 demo-target sessions sharing 800 positions each: 13.8 against 11.0
    ms on two threads, the pass layer by layer; 2 groups of 4 sharing 512: 8.3 against 7.0 on
    one; in one operator, 4 groups of 4 sharing 512, their sessions in alternate slots, 4.77
    against 3.79 ms on two threads). A one-operator pass over two segments keeps its groups
    only when they save ``SHARED_MIN_SAVED`` positions a token of the pass (one group;
    ``isa``: the prefix kernel's path, whose figure applies) or ``GROUPS_MIN_SAVED``
    (several; ``sizes``: each row's new tokens): they take the whole pass layer by layer."""
    one_operator = uniform and len(pooled) == len(rows)
    one_segment = one_operator and len({rows[b].kv.slot // segment for b in pooled}) == 1
    if one_segment and sum(len(idx) for idx, _ in shared) == len(rows):
        # groups of every row in one segment: the pass stays one operator where each group
        # fills a block (an only group: or half of one over enough positions its rows skip)
        queries = [sum(sizes[b] for b in idx) * group for idx, _ in shared]
        if min(queries) >= PREFIX_MIN_QUERIES:
            return list(shared)
        if len(shared) == 1:
            (idx, p), = shared
            half = queries[0] >= PART_MIN_QUERIES and (len(idx) - 1) * p >= PART_MIN_SAVED
            return list(shared) if half else []
    groups = [(idx, p) for idx, p in shared
              if sum(sizes[b] for b in idx) * group >= PREFIX_MIN_QUERIES]
    if not groups or not one_operator:
        return groups  # (the rule covers passes of pooled rows of one size only)
    if one_segment:  # rows sharing none beside them: the pass stays one operator (``joint_plan``)
        return groups
    saved = sum((len(idx) - 1) * p for idx, p in groups)  # positions not read again
    bar = SHARED_MIN_SAVED[isa] if len(groups) == 1 else GROUPS_MIN_SAVED
    return groups if saved >= bar * sum(sizes) else []


def joint_plan(rows: Sequence, groups: Sequence[tuple[list[int], int]], pooled: set[int],
               starts: Sequence[int], pool, group: int, device: torch.device
               ) -> tuple[PooledRows, torch.Tensor] | None:
    """Where groups (``cascade_groups``' choice) share a pass of pooled rows in one segment,
    in their slots' order, all of one size, with other groups or with rows that share no
    prefix: one plan of all the rows from the groups' shortest prefix on, and each row's
    group [rows] (int64; -1: a row sharing none, which attends its own slot from position 0),
    for the pass as one operator with each group's prefix attended in it
    (services/uniform_pass.py ``run``). None elsewhere (an only group that holds every row
    runs as one cascade, ``_ragged``'s ``solo``; other groups' plans run layer by layer)."""
    grouped = sum(len(idx) for idx, _ in groups)
    if not groups or len(pooled) != len(rows) or (len(groups) == 1 and grouped == len(rows)):
        return None
    plans = ragged_attention.plan(rows, range(len(rows)), starts, pool, group, device,
                                  min(p for _, p in groups), kernel=True)
    T = sum(len(r.tokens) for r in rows)
    if len(plans) != 1 or not plans[0].aligned or plans[0].span != slice(0, T):
        return None
    group_of = {b: g for g, (idx, _) in enumerate(groups) for b in idx}
    return plans[0], torch.tensor([group_of.get(b, -1) for b in plans[0].rows], device=device)


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
    [P, KV, G, D] and lse [P, KV, G] (``compact``)."""
    grouped, keys, values = ragged_attention.written_and_padded(p, buffers, q, k, v)
    return compact(p, *(kernel_attention(grouped, keys, values, p.last, p.since)
                        if p.mask is None else attend_lse(grouped, keys, values, p.mask)))


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
                   pooled=ragged_attention.plan(rows, mine, starts, pool, group, device,
                                                shared, columns, kernel),
                   shared_last=torch.full((1, 1), shared - 1, dtype=torch.long,
                                          device=device) if kernel else None,
                   alone=alone, prefix_kernel=prefix_kernel)


def shared_part(c: Cascade, layer: int, rows: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's shared keys and values in ``layer``, [KV, shared, D] each: its first
    row's copy (every row's holds the same)."""
    return first_positions(rows[c.rows[0]], layer, c.shared)


def first_positions(row, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's first ``count`` keys and values in ``layer``, [KV, count, D] each (views)."""
    cache = row.kv.layers[layer]
    return cache.keys[0, :, :count], cache.values[0, :, :count]


def _rests_alone(c: Cascade, layer: int, rows: Sequence, starts: Sequence[int],
                 q: torch.Tensor, kv_heads: int):
    """Per row of the group outside the pool: its columns c0, c1 and its queries' attention
    over the row's own rest (outputs [1, KV, G m, D] and log-sum-exps, ``attend_lse``)."""
    H, _, D = q.shape
    G = H // kv_heads
    for b, c0, c1, mask in c.alone:
        cache = rows[b].kv.layers[layer]
        s, m = starts[b], c1 - c0
        grouped = q[None, :, s:s + m].reshape(1, kv_heads, G * m, D)
        yield (c0, c1, *attend_lse(grouped, cache.keys[:, :, c.shared:],
                                   cache.values[:, :, c.shared:], mask))


def cascade(c: Cascade, layer: int, rows: Sequence, starts: Sequence[int], pool,
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The group's attention outputs [H, N, D] for queries q [H, T, D] in ``layer``; writes
    its pooled rows' new keys and values (the others' caches were updated before)."""
    H, _, D = q.shape
    KV = k.shape[0]
    G, N = H // KV, len(c.tok)
    o_s = q.new_empty(N, KV, G, D)  # over each row's own rest
    lse_s = q.new_empty(N, KV, G, dtype=torch.float32)
    for p in c.pooled:
        o_s[p.cols], lse_s[p.cols] = _attend_slots_lse(p, pool.segments[p.segment][layer],
                                                       q, k, v)
    for c0, c1, out, lse in _rests_alone(c, layer, rows, starts, q, KV):
        o_s[c0:c1] = out.reshape(KV, G, c1 - c0, D).permute(2, 0, 1, 3)
        lse_s[c0:c1] = lse.reshape(KV, G, c1 - c0).permute(2, 0, 1)
    if c.prefix_kernel:  # every query of the group attends the prefix and merges at once
        mine = q[:, c.tok].view(KV, G, N, D).permute(2, 0, 1, 3)  # [N, KV, G, D]
        out = torch.ops.specmesh_cpu.prefix_attention(mine, *shared_part(c, layer, rows),
                                                      o_s, lse_s, D ** -0.5)
        return out.view(N, H, D).transpose(0, 1)  # [H, N, D]
    o_s, lse_s = o_s.permute(1, 2, 0, 3), lse_s.permute(1, 2, 0)  # [KV, G, N, D], [KV, G, N]
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
