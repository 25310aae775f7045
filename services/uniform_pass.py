"""A pass of aligned rows as one operator: the lean forward's layers (services/lean_llama.py)
where every row of a pass holds as many new tokens, in its slots' order in one pool segment
(``PooledRows.aligned``, services/ragged_attention.py: every decode and verify pass of one
stream, and several sessions' in slot order; slots between them held by sessions between
their rounds get zero queries whose outputs are not read).

Such a pass runs all of its layers in ``specmesh_cpu::dense_layers``
(services/csrc/layer_parts.h), which calls per layer the very operators the layer loop runs
(``norm_qkv_store``, the pooled attention kernel over the padded batch, padded only where
the window has gaps, and ``mlp_tail``) from C++: the same floats, without the interpreter, the views and
the dispatch of three operators between them (~20 us a layer on one row). A one-session
decode pass of the demo target ran ~12% shorter with it, a 4-token verify ~19%
(docs/performance.md, 2026-11-28). A pass over more sessions than a pool segment's slots
(64 on a CPU) runs one such operator per segment, each over its own rows
(``parts_in_order``): rows do not mix within a layer, so the parts give the pass's floats,
the weights read once a part. A pass whose rows all share one prefix (one cascade group,
services/cascade_attention.py) runs so too, the operator given each layer's prefix: each
row's queries attend it in ``prefix_attention`` and merge with their rests, the layer loop's
floats; so does one whose rows fall in several such groups (``joint_plan``), each group's
queries attending its own prefix in a call of their own.

Calls join a replica's running batch in the order they arrive, which after the first wave of
requests is not their slots' order: ``slot_order`` says how to take a pass's rows so that
their slots line up (a row's floats do not depend on its place in the pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class UniformPass:
    """A lean model's layers as ``dense_layers`` reads them: per kind (ln1, qkv, o, ln2,
    gate_up, down) every layer's weight, the projections' 16-bit copies
    (services/half_linear.py). ``weights`` is None where a projection has no copy."""

    def __init__(self, layers: Sequence, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float) -> None:
        self._heads, self._kv_heads, self._head_dim = heads, kv_heads, head_dim
        self._inter, self._eps = intermediate, eps
        halves = all(w.halves and w.qkv.half is not None for w in layers)
        self.weights = [[w.ln1 for w in layers], [w.qkv.half for w in layers],
                        [w.o.half for w in layers], [w.ln2 for w in layers],
                        [w.gate_up.half for w in layers],
                        [w.down.half for w in layers]] if halves else None

    def run(self, x: torch.Tensor, p, segment: Sequence[tuple[torch.Tensor, torch.Tensor]],
            cos: torch.Tensor, sin: torch.Tensor,
            prefix: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]] = (),
            prefix_of: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer over x [1, T, h] for the rows of ``p`` (their one pooled plan, whose
        rows are ``aligned``), their keys and values written into the segment's buffers
        (``segment``: per layer keys, values [S, KV, slot_len, D]); cos, sin [T, D].
        ``prefix``: none, or per layer each cascade group's shared prefix [KV, p.since, D]
        (keys, values), which its rows' caches begin with: the rows attend it in
        ``prefix_attention``; with several groups, ``prefix_of`` [rows] (int64) holds each
        row's. Returns the last layer's output [1, T, h]."""
        H, KV, D = self._heads, self._kv_heads, self._head_dim
        ln1, qkv, o, ln2, gate_up, down = self.weights
        return torch.ops.specmesh_cpu.dense_layers(
            x[0], ln1, qkv, (H + 2 * KV) * D, o, ln2, gate_up, 2 * self._inter, down,
            [b[0] for b in segment], [b[1] for b in segment], cos, sin, H, KV, self._eps,
            D ** -0.5, p.slot, p.pos, p.lo, p.width, p.since, p.keys, p.last,
            p.rel if p.width == 1 else p.rel[::p.width].contiguous(),
            [k for layer in prefix for k, _ in layer], [v for layer in prefix for _, v in layer],
            p.pos.new_empty(0) if prefix_of is None else prefix_of)[None]


    def drafts(self, x: torch.Tensor, p, segment: Sequence[tuple[torch.Tensor, torch.Tensor]],
               cos: torch.Tensor, sin: torch.Tensor, embed: torch.Tensor, norm: torch.Tensor,
               head, tables: tuple[torch.Tensor, torch.Tensor], steps: int) -> torch.Tensor:
        """``steps`` greedy passes from x [T, h] over ``p``'s rows (``run``'s arguments, no
        prefix): the first over x, each next over the tokens the one before chose, one a row
        (``specmesh_cpu::greedy_drafts``, services/csrc/draft_loop.h). ``embed`` [V, h],
        ``norm`` [h]: the model's embedding and final norm; ``head``: its LM head
        (services/linear_layers.py ``Linear``, with its 16-bit copy); ``tables``: cos and
        signed sin of every position [P, D] each. Returns the chosen tokens [rows, steps]."""
        H, KV, D = self._heads, self._kv_heads, self._head_dim
        ln1, qkv, o, ln2, gate_up, down = self.weights
        return torch.ops.specmesh_cpu.greedy_drafts(
            x, ln1, qkv, (H + 2 * KV) * D, o, ln2, gate_up, 2 * self._inter, down,
            [b[0] for b in segment], [b[1] for b in segment], cos, sin, H, KV, self._eps,
            D ** -0.5, p.slot, p.pos, p.lo, p.width, p.keys, p.last,
            p.rel if p.width == 1 else p.rel[::p.width].contiguous(),
            embed, norm, head.half, head.weight.shape[0], *tables, steps)


def slot_order(rows: Sequence) -> list[int] | None:
    """The rows' indices by their caches' pool slots, or None where they are in that order
    already or a row's cache has no slot."""
    if len(rows) < 2:
        return None
    slots = [getattr(r.kv, "slot", None) for r in rows]
    if None in slots:
        return None
    order = sorted(range(len(rows)), key=slots.__getitem__)
    return None if order == list(range(len(rows))) else order


def parts_in_order(plans: Sequence, tokens: int) -> bool:
    """Whether the pooled rows of ``plans`` (services/ragged_attention.py ``PooledRows``, one
    per pool segment) are each aligned and hold the pass's ``tokens`` tokens in order, one
    plan's after the other's: each plan's part then runs as a uniform pass of its own. At 32
    streams a pass's sessions fill two segments of 16 slots, and such a pass ran the layer
    loop: 2.2-2.9x a 16-session pass's time in process, and in the mesh 32 streams served
    less than 16 (docs/performance.md, 2026-11-28)."""
    at = 0
    for p in plans:
        if not p.aligned or p.span is None or p.span.start != at:
            return False
        at = p.span.stop
    return at == tokens
