"""Decode and verify passes of the lean forward replayed as CUDA graphs: one launch for the
whole pass instead of one per kernel.

Why: on a GPU a pass of the demo target is bound by launching its kernels, not by the GPU's
work. On an H100 a one-token pass took 2.4-3.7 ms, of which the GPU worked about 0.6 ms;
the rest was the CPU launching some 140 kernels and the Python around them
(docs/performance.md, "A GPU run, and the compute a call of several passes was told"). A
CUDA graph records the kernels of a pass once and replays them with one call.

A graph replays the same kernels on the same memory, so its pass has a fixed shape and
reads its inputs from fixed buffers, refilled before each replay:

    shape   (segment, B, M, L): B rows, their count rounded up to a power of two; M new
            tokens a row, the most of any row; L keys a row, the most rounded up to
            KEY_BUCKET; every row's cache a slot of pool segment ``segment``
    staged  [5 T + B] int64, T = B M, one copy to the device a pass: per padded token its id,
            position (the last key it sees), the slot and position its keys are written
            to, the token whose logits go to output row t; per row its slot
    x = embed(ids) ; per layer:
        q, k, v = qkv(x)                                     # [T, H, D], [T, KV, D]
        K[wslot, :, wpos] = k ; V[wslot, :, wpos] = v        # into the segment's buffers
        keys = K[:, :, :L][slot]                             # [B, KV, L, D] (gathered: a copy)
        attn = sdpa(q as [B, KV, G M, D], keys, values, mask [B, 1, G M, L])
        x = finish_layer(x, attn)
    logits = head(x[wanted])                                 # [T, V]; the first K are read

The padding is harmless: a row's queries past its own new tokens, and the rows added to
reach B, write their keys into the segment's scratch row (services/kv_slab.py ``KVPool``
``scratch``), which no session owns, and their outputs are never read. Each real query sees
its own cache up to its own position (the mask), and the pool makes the masked keys past a
row's length hold numbers (``KVPool.ready``), as in the eager pass.

A shape's first pass runs eagerly on a side stream (the warm-up CUDA asks for before a
capture; it writes the pass's keys and values, which the replay then writes again with the
same values), is captured and replayed. The graphs share one memory pool; at most
``MAX_GRAPHS`` shapes are kept, the least recently used dropped. Their logits go to one
shared buffer (``_logits``): a graph's own [T, V] output would stay allocated for as long
as the graph, so the graphs of a replica would hold one such tensor each, up to several GB
with a large vocabulary; the run copies a pass's logits out before the next replay. Passes
of any other kind (prompts, rows in several segments or off the pool, tree masks) run
eagerly, and so does
everything after a capture fails (logged once). On a CPU (``capture=False``) the same code
runs eagerly: the tests check its indices, masks and padding against the ragged pass there.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services import ragged_attention

log = logging.getLogger(__name__)

KEY_BUCKET = 256  # a graph's keys a row, rounded up to this: fewer shapes to capture
MAX_GRAPHS = 128  # shapes kept captured; the least recently used goes first


@dataclass
class _Graph:
    segment: int
    B: int
    M: int
    L: int
    staged: torch.Tensor  # [5 T + B] on the device: the pass's inputs (module docstring)
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # [T, V]: the replay's logits, in the shared buffer


def _bucket(n: int) -> int:
    """The power of two at or above n."""
    return 1 << (n - 1).bit_length()


class DecodeGraphs:
    """Runs a lean model's (services/lean_llama.py ``LeanLlama``) decode and verify passes
    as CUDA graphs, or with ``capture=False`` the same fixed-shape pass eagerly. ``row_max``:
    the most new tokens of a row that qualifies. Every row gathers as many keys as the
    longest (rounded up): unlike the eager pass, where a row far longer than the others
    attends alone, a graph's pass keeps it, since on a GPU the gather costs far less than
    the launches a second pass would take."""

    def __init__(self, lean, capture: bool, row_max: int) -> None:
        if lean.pool is None or lean.pool.scratch is None:
            raise ValueError("fixed-shape passes need the model's KV pool with a scratch row")
        self.lean, self.capture, self.row_max = lean, capture, row_max
        self.device = lean.hf.model.embed_tokens.weight.device
        self.enabled = True
        self.replays = 0  # passes run by this module (a graph's replay, or eagerly on a CPU)
        self.captures = 0
        self._graphs: OrderedDict[tuple[int, int, int, int], _Graph] = OrderedDict()
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self._out: torch.Tensor | None = None  # [rows, V]: the graphs' logits (``_logits``)

    def shape(self, rows) -> tuple[int, int, int, int] | None:
        """The graph shape (segment, B, M, L) that runs ``rows`` (services.batching.Row), or
        None when the pass must run eagerly."""
        pool = self.lean.pool
        if not self.enabled or not rows or pool is None:
            return None
        segments, M, keys = set(), 0, 0
        for r in rows:
            m = len(r.tokens)
            if not (1 <= m <= self.row_max and 1 <= r.keep <= m) \
                    or getattr(r.kv, "pool", None) is not pool or r.kv.slot is None \
                    or r.start + m > pool.slot_len:
                return None
            segments.add(r.kv.slot // pool.segment)
            M, keys = max(M, m), max(keys, r.start + m)
        if len(segments) != 1:  # (one segment holds at most its own count of rows)
            return None
        L = min(pool.slot_len, -(-keys // KEY_BUCKET) * KEY_BUCKET)
        return segments.pop(), _bucket(len(rows)), M, L

    @torch.inference_mode()
    def run(self, rows) -> list[torch.Tensor] | None:
        """One pass over ``rows`` (their caches advanced by their tokens); per row logits
        [keep_b, V] float32 on the CPU. None, with nothing done, when the pass must run
        eagerly (``shape``)."""
        shape = self.shape(rows)
        if shape is None:
            return None
        segment, B, M, L = shape
        pool, T = self.lean.pool, B * M
        ids, pos, wpos = [0] * T, [0] * T, [0] * T
        wslot = [pool.scratch] * T
        wanted, slots = [], [pool.scratch] * B
        for b, r in enumerate(rows):
            m, start, slot = len(r.tokens), r.start, r.kv.slot
            pool.ready(slot, start + m, L)  # keys past the row's own hold numbers
            slots[b] = slot % pool.segment
            for j in range(M):
                t = b * M + j
                pos[t] = start + min(j, m - 1)  # (a padded query's: its row's last)
                if j < m:
                    ids[t], wslot[t], wpos[t] = r.tokens[j], slots[b], start + j
            wanted += range(b * M + m - r.keep, b * M + m)
        K = len(wanted)
        staged = torch.tensor(ids + pos + wslot + wpos + wanted + [0] * (T - K) + slots,
                              dtype=torch.long)
        try:
            logits = self._pass(shape, staged)[:K].float()
        except RuntimeError as exc:  # CUDA refused a capture: eager passes from now on
            if not self.capture:
                raise
            log.warning("CUDA graphs off for this replica: %s; passes run eagerly", exc)
            self.enabled = False
            self._graphs.clear()
            return None  # (the warm-up wrote this pass's keys; the eager pass rewrites them)
        if logits.device.type != "cpu":
            logits = logits.cpu()  # one wait for the pass
        for r in rows:
            for layer in r.kv.layers:
                layer.length += len(r.tokens)
        self.replays += 1
        return list(logits.split([r.keep for r in rows]))

    def _pass(self, shape: tuple[int, int, int, int], staged: torch.Tensor) -> torch.Tensor:
        """The pass's logits [T, V] on the device: the graph of ``shape`` replayed on
        ``staged`` inputs (captured first if new), or on a CPU the same pass run eagerly."""
        if not self.capture:
            return self._body(_Graph(*shape, staged=staged))
        g = self._graphs.get(shape)
        if g is None:
            g = _Graph(*shape, staged=torch.empty(staged.shape, dtype=torch.long,
                                                  device=self.device))
        g.staged.copy_(staged, non_blocking=True)
        if g.graph is None:
            self._capture(g)
            self._graphs[shape] = g
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(shape)
        g.graph.replay()
        return g.out

    def _capture(self, g: _Graph) -> None:
        """Warms ``g``'s pass up on a side stream and records it (module docstring)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warm = self._body(g)
        torch.cuda.current_stream(self.device).wait_stream(side)
        out = self._logits(warm)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            out.copy_(self._body(g))  # (the body's own logits go back to the pool)
        g.graph, g.out = graph, out
        self.captures += 1

    def _logits(self, like: torch.Tensor) -> torch.Tensor:
        """A view [T, V] of the graphs' shared logits buffer for a pass whose logits are
        ``like`` (the replica's vocabulary and dtype); allocated outside any capture. A
        buffer too small is replaced by one of at least twice its rows: graphs captured
        before keep the old one until they go, so the buffers held are at most about twice
        the largest."""
        T, buf = like.shape[0], self._out
        if buf is None or len(buf) < T:
            rows = T if buf is None else max(T, 2 * len(buf))
            buf = self._out = like.new_empty((rows, *like.shape[1:]))
        return buf[:T]

    def _body(self, g: _Graph) -> torch.Tensor:
        """The fixed-shape pass over ``g.staged`` (module docstring): logits [T, V]."""
        lean, B, M, L = self.lean, g.B, g.M, g.L
        T = B * M
        H, KV, D = lean._heads, lean._kv_heads, lean._head_dim
        ids, pos, wslot, wpos, wanted = g.staged[:5 * T].view(5, T)
        slot = g.staged[5 * T:]  # [B]
        x = lean.hf.model.embed_tokens(ids[None])  # [1, T, h]
        cos, sin = (t[0] for t in lean.rope(x, pos[None], L))  # [T, 1, D]
        buffers = lean.pool.segments[g.segment]
        # a query sees the keys up to its own position: [B, 1, G M, L]
        mask = ragged_attention.additive_mask(pos.view(B, M), 0, L, H // KV, buffers[0][0].dtype)
        for i, w in enumerate(lean.layers):
            q, k, v = lean.qkv(x[0], w, cos, sin)  # [T, H, D], [T, KV, D]
            keys, values = buffers[i]  # [S + 1, KV, slot_len, D]
            keys[wslot, :, wpos] = k
            values[wslot, :, wpos] = v
            grouped = q.view(B, M, H, D).transpose(1, 2).reshape(B, KV, (H // KV) * M, D)
            out = F.scaled_dot_product_attention(
                grouped, keys[:, :, :L].index_select(0, slot),
                values[:, :, :L].index_select(0, slot), attn_mask=mask)  # [B, KV, G M, D]
            attn = out.reshape(B, H, M, D).transpose(1, 2).reshape(1, T, H * D)
            x = lean.finish_layer(x, attn, w)
        return lean.head(x[:, wanted])[0]  # [T, V]
