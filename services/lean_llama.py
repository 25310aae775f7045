"""A lean forward pass for Llama-architecture models: the same maths as transformers' eager
``LlamaForCausalLM.forward`` with the SDPA attention, without its per-call Python layers.

Why: a replica's forward pass is on every round's critical path. On a CPU, a small model's
HF forward spends much of its time in Python around the kernels (output capturing,
config-default decorators, mask construction, per-layer modules): for the 2-layer demo
drafter about half of each forward, for the 6-layer demo target about a quarter
(docs/performance.md, "Lean forward"). This module runs the same kernels on the same
weights in the same order:

    x = embed(ids)                                               # [B, m, h]
    per layer:  h = rms(x) ; q, k, v = split(h @ Wqkv)           # q/k/v projections fused
                q, k = rope(q, k, position_ids)                  # HF's own rotary module
                k, v = cache.update(k, v, layer)                 # [B, KV, P+m, D]
                x = x + sdpa(q, k, v, mask) @ Wo                 # G query heads as rows
                                                                 # of their key head
                h = rms(x) ; g, u = split(h @ Wgu)               # gate/up fused
                x = x + (silu(g) * u) @ Wdown
    logits = rms(x[:, -keep:]) @ Wlm

The fused weights are one tensor each whose slices replace the HF modules' weights (views:
no second copy, and the state dict, hence the model's fingerprint, is unchanged). Whatever
this module does not support falls back to the HF forward (``lean_forward`` says which).
The tests check its logits against HF's, alone and batched with padding.

On a CPU with float32 weights the projections and the LM head are also prepacked once for
oneDNN (``pack=True``; the ``auto`` and ``packed`` modes), and with ``half=True`` (``auto``)
weights whose values are exactly 16-bit numbers get 16-bit copies, which every call reads
(services/linear_layers.py says why and what each costs). ``lean`` runs PyTorch's ``linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from services import cascade_attention, cpu_kernels, half_linear, ragged_attention, rotary
from services.config import FORWARD_MODES
from services.cuda_graphs import DecodeGraphs
from services.kv_slab import KVPool, SlabCache, free_memory, pool_segment, pool_slots
from services.lean_layers import (
    LeanLayer,
    attend,
    causal_mask,
    group_mask,
    lean_layers,
    unsupported_reason,
)
from services.linear_layers import Linear, half_copies, packing_unavailable
from services.uniform_pass import UniformPass, parts_in_order, slot_order

POOL_SLOT_CAP = 4096  # positions of a pool slot at most; a longer session leaves its slot
POOL_ROW_MAX = 8  # a row of more new tokens (a prompt) attends alone: the batch pads to it
POOL_PAD = 512  # padded positions the longest row may add to the others' before it goes alone
UNIFORM_MAX = 32  # tokens a pass runs as one operator at most (services/uniform_pass.py), which
#                   only pooled rows (POOL_ROW_MAX) join: it bounds passes of many decode and
#                   verify rows. Lifted, a 16-session pass of 4-token verify rows ran 10.5
#                   against 11.0-11.3 ms in process, a gain the one mesh run with it lifted
#                   (long prompts, 16 streams) did not show; kept as it was until one does


@dataclass
class LeanOutput:
    logits: torch.Tensor  # [B, keep, V]


class LeanLlama(torch.nn.Module):
    """Wraps a loaded ``LlamaForCausalLM``; call it like the HF model with ``input_ids``,
    ``position_ids``, ``past_key_values`` (``new_cache()`` or a transformers ``Cache``: only
    its ``update`` and ``get_seq_length`` are used), ``attention_mask``
    (2-D, 1 = real key, covering past and new positions; or 4-D [B, 1, m, keys] as SDPA takes
    it, used as given) and ``logits_to_keep``. ``pack``: prepack the weights for oneDNN
    where ``packing_unavailable`` allows it; ``half``: also keep 16-bit copies of the weights
    that are exactly 16-bit numbers, which every call then reads (services/half_linear.py;
    ``half_weights`` says how many were made, or why none); ``graphs``: decode and verify
    passes of pooled rows replayed as CUDA graphs (``graphs``, services/cuda_graphs.py)."""

    def __init__(self, model, pack: bool = False, half: bool = False,
                 graphs: bool = False) -> None:
        super().__init__()
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        self.hf = model
        self.config = model.config
        c = model.config
        self._heads = c.num_attention_heads
        self._kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self._head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self._inter = c.intermediate_size
        self._eps = c.rms_norm_eps
        unpackable = packing_unavailable(model.lm_head.weight)
        self.packed = pack and not unpackable
        why_not = (unpackable or cpu_kernels.kernel()) if half else "not asked for"

        def linear(weight: torch.Tensor) -> Linear:
            return Linear(weight, self.packed,
                          None if why_not else half_linear.exact_dtype(weight))

        self.layers = lean_layers(model, linear)
        self._lm_head = linear(model.lm_head.weight)
        linears = [self._lm_head] + [lin for layer in self.layers for lin in
                                     (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.half_weights = half_copies(linears, why_not)
        weight = model.lm_head.weight
        # caches are slots of one pool while there are slots: a pass attends over many in
        # one call per layer (on a GPU, one kernel instead of one per session and layer)
        slot_len = min(c.max_position_embeddings, POOL_SLOT_CAP)
        slot_bytes = (2 * c.num_hidden_layers * self._kv_heads * slot_len * self._head_dim
                      * weight.element_size())
        slots = pool_slots(weight.device, slot_bytes, free_memory(weight.device))
        # (with graphs, one segment: a graph's rows must share one, and on a GPU a
        # segment's memory is taken at once anyway)
        self.pool = KVPool(c.num_hidden_layers, self._kv_heads, self._head_dim, slot_len,
                           segment=slots if graphs else pool_segment(weight.device, slots),
                           max_slots=slots,
                           dtype=weight.dtype, device=weight.device,
                           scratch=graphs) if slots else None
        self.rope = rotary.RopeTable(model, weight)  # cos, signed sin of the positions
        # pooled rows attend in the project's CPU kernel (services/ragged_attention.py)
        self.kernel_attention = bool(
            half and self.pool is not None and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and self._head_dim % 8 == 0
            and self._head_dim <= 128 and not cpu_kernels.kernel())
        # a pass whose tokens all attend in one pooled call (every decode pass of one
        # stream, most of several) rotates its queries and keys, splits the heads and writes
        # the keys and values into their slots in one kernel operator a layer
        # (``specmesh_cpu::rope_store``: PyTorch's floats; it took the rotary module's four
        # operators, two cache writes and their views)
        self.kernel_rope = self.kernel_attention
        # a cascade's shared prefix attended by all its queries at once and merged with their
        # rests in one operator (``specmesh_cpu::prefix_attention``, AVX-512 or AVX2)
        self.prefix_isa = (torch.ops.specmesh_cpu.prefix_attention_isa()
                           if self.kernel_attention else "")  # "avx512", "avx2" or ""
        self.kernel_prefix = bool(self.prefix_isa)
        # RMS norms of float32 activations on a CPU in the project's kernel (one operator
        # for PyTorch's six; ``_rms``)
        self.kernel_norm = bool(half and weight.device.type == "cpu"
                                and weight.dtype == torch.float32 and not cpu_kernels.kernel())
        # a layer's steps over its 16-bit copies as one operator each (``finish_layer``)
        self.kernel_layer = self.kernel_norm
        # a pass of aligned rows runs its layers as one operator (``_uniform``)
        self.uniform_pass = UniformPass(self.layers, self._heads, self._kv_heads,
                                        self._head_dim, self._inter, self._eps)
        # decode and verify passes as CUDA graphs (on a CPU, their fixed shapes run eagerly)
        self.graphs = None if not (graphs and self.pool) else DecodeGraphs(
            self, capture=weight.device.type == "cuda", row_max=POOL_ROW_MAX)

    def new_cache(self) -> SlabCache:
        """An empty KV cache for this model, written in place (services/kv_slab.py): a slot
        of the model's pool while one is free."""
        return SlabCache(self.config.num_hidden_layers, pool=self.pool)

    def _pooled(self, rows) -> list[int]:
        """The rows whose attention runs per segment of the pool: decode and verify rows
        (at most ``POOL_ROW_MAX`` new tokens) whose caches are in a slot of this model's pool
        with room for them."""
        if self.pool is None:
            return []
        limit = self.pool.slot_len
        pooled = sorted((r.start + len(r.tokens), b) for b, r in enumerate(rows)
                        if len(r.tokens) <= POOL_ROW_MAX
                        and getattr(r.kv, "pool", None) is self.pool
                        and r.kv.slot is not None and r.start + len(r.tokens) <= limit)
        # SDPA's call pads every row to the longest: a row far longer than the others (one long
        # document among chats) attends alone rather than making every row read its length
        # (the CPU kernel reads each row's own keys: nothing to pad)
        while (not self.kernel_attention and len(pooled) > 1
               and (pooled[-1][0] - pooled[-2][0]) * (len(pooled) - 1) > POOL_PAD):
            pooled.pop()
        return [b for _, b in pooled]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm. In float32 on a CPU with the project's kernels
        (``kernel_norm``), ``specmesh_cpu::rms_norm``: the same products in the same order,
        the squares summed in another (within 2e-6 of transformers' floats, a test); PyTorch's
        ``rms_norm`` runs six operators on a CPU, about 40 us a call inside a pass, and a
        one-session pass of the demo target ran 14% shorter with the kernel
        (docs/performance.md, 2026-11-27). Else in float32 PyTorch's own ``rms_norm``: on
        the CPU its floats are transformers' own (a test checks they are equal); on a GPU,
        where a pass is bound by kernel launches, one operator for six (the logits' largest
        distance from transformers' went from 1.5e-5 to 1.3e-5 on an H100).
        Other dtypes norm in float32 and cast before the weight, as transformers does."""
        if self.kernel_norm and x.dtype == torch.float32:
            return torch.ops.specmesh_cpu.rms_norm(x, weight, self._eps)
        if x.dtype == weight.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self._eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._eps)
        return weight * x.to(dtype)

    def _split_heads(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's fused projection qkv [..., (H + 2 KV) D] split into heads, the queries'
        and keys' rotated (``rotary.rope``; cos, signed_sin broadcast over the heads' dimension):
        q [..., H, D], k and v [..., KV, D]."""
        H, KV, D = self._heads, self._kv_heads, self._head_dim
        lead = qkv.shape[:-1]
        qk = rotary.rope(qkv[..., :(H + KV) * D].view(*lead, H + KV, D), cos, signed_sin)
        return qk[..., :H, :], qk[..., H:, :], qkv[..., (H + KV) * D:].view(*lead, KV, D)

    def qkv(self, x: torch.Tensor, w: LeanLayer, cos: torch.Tensor, signed_sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's queries [..., H, D] and keys and values [..., KV, D] of x [..., h]."""
        return self._split_heads(w.qkv(self._rms(x, w.ln1)), cos, signed_sin)

    def finish_layer(self, x: torch.Tensor, attn: torch.Tensor, w: LeanLayer) -> torch.Tensor:
        """The layer's output projection of its attention [..., H D] added to x [..., h], and
        its MLP: the next layer's input [..., h]. Where the three projections read their
        16-bit copies and the norm is the project's kernel, the same operators run as one
        (``specmesh_cpu::mlp_tail``, services/csrc/layer_parts.h): the same floats, without
        the interpreter and PyTorch's dispatch between them (~45 us a layer on one row)."""
        if self.kernel_layer and w.halves:
            return torch.ops.specmesh_cpu.mlp_tail(x, attn, w.o.half, w.ln2, self._eps,
                                                   w.gate_up.half, 2 * self._inter, w.down.half)
        x = x + w.o(attn)
        gate, up = w.gate_up(self._rms(x, w.ln2)).split([self._inter, self._inter], dim=-1)
        return x + w.down(F.silu(gate) * up)

    def _stored_qkv(self, x: torch.Tensor, w: LeanLayer, cos: torch.Tensor, sin: torch.Tensor,
                    buffers: tuple[torch.Tensor, torch.Tensor], p) -> torch.Tensor:
        """A fused pass's layer start for x [T, h]: its queries [T, H, D] rotated, its keys
        and values written into ``p``'s slots of the segment's ``buffers``
        (``specmesh_cpu::rope_store``; with the norm and the projection in the same operator,
        ``norm_qkv_store``, where the projection reads its 16-bit copy)."""
        H, KV, D = self._heads, self._kv_heads, self._head_dim
        qkv = w.qkv.half if self.kernel_layer else None
        if qkv is None:
            return torch.ops.specmesh_cpu.rope_store(w.qkv(self._rms(x, w.ln1)), cos, sin, H, KV,
                                                     *buffers, p.slot, p.pos)
        return torch.ops.specmesh_cpu.norm_qkv_store(x, w.ln1, self._eps, qkv, (H + 2 * KV) * D,
                                                     cos, sin, H, KV, *buffers, p.slot, p.pos)

    def _uniform(self, tokens: int) -> bool:
        """Whether aligned rows of ``tokens`` tokens can run as one operator
        (services/uniform_pass.py): the layers' fused operators are on, every projection has
        its 16-bit copy, and the tokens are few (``UNIFORM_MAX``)."""
        return (self.kernel_layer and tokens <= UNIFORM_MAX
                and self.uniform_pass.weights is not None)

    def _cascades(self, shared: list[tuple[list[int], int]], rows, sizes: list[int],
                  pooled: set[int]) -> list[tuple[list[int], int]]:
        """The groups of ``shared`` whose rows attend their shared prefix once
        (``cascade_attention.cascade_groups`` has the rule)."""
        if not self.kernel_prefix or not shared:  # (most passes share nothing)
            return list(shared)
        return cascade_attention.cascade_groups(
            shared, rows, sizes, pooled, self._heads // self._kv_heads,
            self._uniform(sizes[0]) if len(set(sizes)) == 1 else False, self.pool.segment,
            self.prefix_isa)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: logits [..., V] of x [..., h]."""
        return self._lm_head(self._rms(x, self.hf.model.norm.weight))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                past_key_values=None, attention_mask: torch.Tensor | None = None,
                use_cache: bool = True, logits_to_keep: int = 0, **_ignored) -> LeanOutput:
        B, m = input_ids.shape
        if past_key_values is None:
            past_key_values = self.new_cache()
        past = past_key_values.get_seq_length()
        top = None  # (positions of the caller's own: the rotary module computes theirs)
        if position_ids is None:
            position_ids = torch.arange(past, past + m, device=input_ids.device)[None].expand(B, m)
            top = past + m
        H, D = self._heads, self._head_dim
        x = self.hf.model.embed_tokens(input_ids)  # [B, m, h]
        cos, sin = self.rope(x, position_ids, top)  # [B, m, 1, D]
        mask = group_mask(causal_mask(m, past, attention_mask, x.device),
                          H // self._kv_heads)
        for i, w in enumerate(self.layers):
            q, k, v = (t.transpose(1, 2) for t in self.qkv(x, w, cos, sin))
            # q [B, H, m, D], k and v [B, KV, m, D]
            k, v = past_key_values.update(k, v, i)  # [B, KV, past+m, D]
            attn = attend(q, k, v, mask)  # [B, H, m, D]
            x = self.finish_layer(x, attn.transpose(1, 2).reshape(B, m, H * D), w)
        keep = m if not logits_to_keep else min(logits_to_keep, m)
        return LeanOutput(logits=self.head(x[:, -keep:]))  # [B, keep, V]

    @torch.inference_mode()
    def forward_ragged(self, rows, shared: list[tuple[list[int], int]] = ()
                       ) -> list[torch.Tensor]:
        """``_ragged`` over the rows in their slots' order where the pass can run its layers
        as one operator (``_uniform``), its logits given back in the rows' own order: rows
        in slot order make a pass aligned, where the order in which calls joined the batch
        would leave most passes of several sessions out."""
        order = None
        if self._uniform(len(rows[0].tokens)):  # (a part of it could be)
            order = slot_order(rows)
        if order is None:
            return self._ragged(rows, shared)
        where = {old: new for new, old in enumerate(order)}
        logits = self._ragged([rows[b] for b in order],
                              [(sorted(where[b] for b in idx), p) for idx, p in shared])
        return [logits[where[b]] for b in range(len(rows))]

    @torch.inference_mode()
    def greedy_drafts(self, rows, steps: int) -> list[list[int]] | None:
        """``steps`` greedy tokens for each row in one operator (``UniformPass.drafts``): its
        tokens fed, then each token chosen (the argmax of the last logits) fed in turn, the
        last one not; the tokens and caches of as many ``forward_ragged`` passes with argmax
        between them. A draft model's drafting step (verifier_svc/local_drafts.py) ran its k
        passes so with ~0.3 ms less of the interpreter and dispatch each (docs/performance.md).
        None, nothing fed, where the rows cannot run as one uniform pass (the caller runs its
        passes): rows of different sizes, a cache outside the pool or without room for the
        steps, positions past the rotary table, or a weight without its 16-bit copy."""
        width, table = len(rows[0].tokens), self.rope.table
        ends = [r.start + width + steps - 1 for r in rows]
        if (not (self.kernel_rope and self._uniform(width)) or table is None
                or self._lm_head.half is None
                or any(len(r.tokens) != width or r.keep != 1 for r in rows)
                or max(ends) > min(self.pool.slot_len, len(table[0]))
                or len(self._pooled(rows)) != len(rows)):
            return None
        order = slot_order(rows) or list(range(len(rows)))
        rows = [rows[b] for b in order]
        dev = self.hf.model.embed_tokens.weight.device
        plans = ragged_attention.plan(rows, range(len(rows)), range(0, len(rows) * width, width),
                                      self.pool, self._heads // self._kv_heads, dev, kernel=True)
        p = plans[0]
        if len(plans) != 1 or not p.aligned or p.span != slice(0, len(rows) * width):
            return None
        for r, end in zip(rows, ends, strict=True):  # (positions the steps read hold numbers)
            self.pool.ready(r.kv.slot, r.start + width, end)
        ids = torch.tensor([t for r in rows for t in r.tokens], device=dev)
        chosen = self.uniform_pass.drafts(
            self.hf.model.embed_tokens(ids), p, self.pool.segments[p.segment], table[0][p.pos],
            table[1][p.pos], self.hf.model.embed_tokens.weight, self.hf.model.norm.weight,
            self._lm_head, table, steps).tolist()  # [rows, steps]
        for r in rows:
            for layer in r.kv.layers:
                layer.length += width + steps - 1
        where = {old: new for new, old in enumerate(order)}
        return [chosen[where[b]] for b in range(len(rows))]

    def _ragged(self, rows, shared: list[tuple[list[int], int]] = ()
                ) -> list[torch.Tensor]:
        """One pass over several sessions' new tokens, each on its own KV cache, read and
        written in place: no cache is stacked or copied. The projections and the LM head run
        once over all the rows' tokens together (that is where batching pays: each weight is
        read once for the whole batch); attention reads each row's cache where it lies: the
        decode and verify rows whose caches are pool slots in one call per slot buffer
        (services/ragged_attention.py), the others one by one. ``rows``:
        services.batching.Row, each with a cache (``new_cache()``'s, or a transformers
        ``Cache``: only ``update`` is used) holding ``start`` positions. Returns per row
        logits [keep_b, V].

            tokens of all rows, concatenated:  T = sum m_b
            x [1, T, h] ; per layer  q [H, T, D], k, v [KV, T, D]
            row b: its slice [o_b, o_b + m_b) of q, k, v ; its cache [1, KV, L_b + m_b, D]

        ``shared``: groups of rows whose caches begin with the same P positions, as (row
        indices, P) (services/batching.py ``shared_prefixes``): on a CPU their attention
        reads those positions once for the group (services/cascade_attention.py).
        """
        H, KV, D = self._heads, self._kv_heads, self._head_dim
        sizes = [len(r.tokens) for r in rows]
        ends = list(accumulate(sizes))
        starts = [e - m for e, m in zip(ends, sizes, strict=True)]
        T = ends[-1]
        dev = self.hf.model.embed_tokens.weight.device
        # the pass's token ids, positions and rows with logits, in one copy to the device
        staged = torch.tensor(
            [t for r in rows for t in r.tokens]
            + [p for r, m in zip(rows, sizes, strict=True) for p in range(r.start, r.start + m)]
            + [j for r, e in zip(rows, ends, strict=True) for j in range(e - r.keep, e)],
            dtype=torch.long, device=dev)
        ids, positions = staged[:T][None], staged[T:2 * T][None]  # [1, T] each
        wanted = staged[2 * T:]  # [K]
        x = self.hf.model.embed_tokens(ids)  # [1, T, h]
        top = max(r.start + m for r, m in zip(rows, sizes, strict=True))
        cos, sin = (t[0] for t in self.rope(x, positions, top))  # [T, 1, D], over heads
        pooled = set(self._pooled(rows))  # rows attended in their pool slots
        groups = self._cascades(shared, rows, sizes, pooled) if dev.type == "cpu" else []
        grouped = {b for idx, _ in groups for b in idx}
        masks = {b: None if sizes[b] == 1 else  # one query sees every key: no mask needed
                 group_mask(torch.ones(sizes[b], rows[b].start + sizes[b], dtype=torch.bool,
                                       device=dev).tril(diagonal=rows[b].start), H // KV)
                 for b in range(len(rows)) if b not in pooled}  # [G m_b, L_b + m_b]

        def rest_mask(b: int, p: int) -> torch.Tensor | None:  # additive [G m_b, L_b + m_b - P]
            return None if masks[b] is None else torch.zeros(
                masks[b][:, p:].shape, device=dev).masked_fill_(~masks[b][:, p:], float("-inf"))

        # groups beside other groups or rows sharing none: one plan for the pass as one operator
        joint = cascade_attention.joint_plan(rows, groups, pooled, starts, self.pool, H // KV, dev) if (
            self.kernel_prefix and self.kernel_attention and self.kernel_rope
            and self._uniform(T)) else None
        plans = ragged_attention.plan(rows, sorted(pooled - grouped), starts, self.pool,
                                      H // KV, dev, kernel=self.kernel_attention
                                      ) if joint is None else []  # (its rows: all of them)
        cascades = [cascade_attention.cascade_plan(rows, idx, p, starts, pooled, self.pool,
                                                  H // KV, dev, lambda b, p=p: rest_mask(b, p),
                                                  self.kernel_attention,
                                                  self.kernel_attention and self.kernel_prefix)
                    for idx, p in groups] if joint is None else []
        # one segment's call attends every token of the pass, in order: its output is the
        # layer's attention as it comes (a decode pass of one stream, rows in slot order)
        whole = len(plans) == 1 and plans[0].span == slice(0, T)
        # or one cascade's call does: every row shares one prefix and sits in one segment
        solo = cascades[0] if (not plans and len(cascades) == 1 and cascades[0].prefix_kernel
                               and len(cascades[0].pooled) == 1
                               and cascades[0].pooled[0].span == slice(0, T)) else None
        fused = self.kernel_rope and (whole and not cascades or solo is not None)
        # every segment's rows aligned, the pass's tokens one segment's after the other's
        # (one segment: every decode and verify pass of one stream): each segment's part runs
        # all of its layers as one operator (rows do not mix within a layer)
        # (so does one cascade group's, its shared prefix attended in the same operator)
        # (and several groups' calls, that hold every row: ``joint``)
        parts = ([joint[0]] if joint is not None else plans if not cascades
                 else solo.pooled if solo is not None else None)
        one_op = (self.kernel_rope and parts is not None and parts_in_order(parts, T)
                  and all(self._uniform(p.span.stop - p.span.start) for p in parts))
        if fused or one_op:
            cos_t, sin_t = cos[:, 0].contiguous(), sin[:, 0].contiguous()  # [T, D]
        if one_op:
            prefix, prefix_of = (), None
            if solo is not None:
                prefix = [[cascade_attention.shared_part(solo, i, rows)]
                          for i in range(len(self.layers))]
            elif joint is not None:  # each group's first row's copy of the shortest prefix
                since, prefix_of = joint[0].since, joint[1]
                prefix = [[cascade_attention.first_positions(rows[idx[0]], i, since)
                           for idx, _ in groups] for i in range(len(self.layers))]
            outs = [self.uniform_pass.run(x[:, p.span], p, self.pool.segments[p.segment],
                                          cos_t[p.span], sin_t[p.span], prefix, prefix_of)
                    for p in parts]
            x = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        for i, w in enumerate(self.layers if not one_op else ()):
            if fused:  # rotate, split and write the keys and values in one operator
                p = plans[0] if solo is None else solo.pooled[0]
                buffers = self.pool.segments[p.segment][i]
                q = self._stored_qkv(x[0], w, cos_t, sin_t, buffers, p).transpose(0, 1)  # [H, T, D]
                attn = ragged_attention.attend(
                    p, buffers, q, None, None,
                    None if solo is None else cascade_attention.shared_part(solo, i, rows))
                x = self.finish_layer(x, attn.transpose(0, 1).reshape(1, T, H * D), w)
                continue
            q, k, v = (t.transpose(0, 1) for t in self.qkv(x[0], w, cos, sin))
            # q [H, T, D], k and v [KV, T, D]
            if whole:
                attn = ragged_attention.attend(plans[0], self.pool.segments[plans[0].segment][i],
                                               q, k, v)  # [H, T, D]
            else:
                attn = q.new_empty(H, T, D)
                for p in plans:  # one call per pool segment for all of its rows
                    attn[:, p.where] = ragged_attention.attend(
                        p, self.pool.segments[p.segment][i], q, k, v)  # [H, P, D]
            for b in range(len(rows)):
                if b in pooled:
                    continue
                r, s, e = rows[b], starts[b], ends[b]
                keys, values = r.kv.update(k[None, :, s:e], v[None, :, s:e], i)  # [1, KV, L+m, D]
                if b not in grouped:
                    attn[:, s:e] = attend(q[None, :, s:e], keys, values, masks[b])[0]
            for c in cascades:  # one call over each shared prefix, its rows' rests apart
                attn[:, c.tok] = cascade_attention.cascade(c, i, rows, starts, self.pool, q, k, v)
            x = self.finish_layer(x, attn.transpose(0, 1).reshape(1, T, H * D), w)
        ragged_attention.advance(rows, plans + [p for c in cascades for p in c.pooled]
                                 + ([joint[0]] if joint is not None else []))
        logits = self.head(x[:, wanted])[0].float()  # [K, V]
        return list(logits.split([r.keep for r in rows]))


def lean_forward(model, mode: str):
    """The model a replica runs: ``mode`` "auto" wraps supported models in LeanLlama with
    prepacked weights where they can be (on a CUDA device, with its decode and verify
    passes as CUDA graphs), "lean" without either, "hf" keeps transformers' forward.
    Returns (model, the reason it was not wrapped or "")."""
    if mode not in FORWARD_MODES:
        raise ValueError(f"forward must be one of {', '.join(FORWARD_MODES)}, got {mode!r}")
    if mode == "hf":
        return model, "--forward hf"
    reason = unsupported_reason(model)
    if reason:
        return model, reason
    on_gpu = model.lm_head.weight.device.type == "cuda"
    return LeanLlama(model, pack=mode in ("auto", "packed"), half=mode == "auto",
                     graphs=mode == "auto" and on_gpu and rotary.static_rope(model)), ""
