"""A Llama model's layers as the lean forward (services/lean_llama.py) holds them: which
models it can run, each layer's weights with the projections that share an input fused,
and the dense path's causal masks and attention of grouped queries."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.linear_layers import Linear


def unsupported_reason(model) -> str:
    """Why ``model`` cannot use the lean forward ("" when it can)."""
    c = model.config
    if getattr(c, "model_type", "") != "llama":
        return f"model type {getattr(c, 'model_type', '?')!r} is not llama"
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"activation {c.hidden_act!r} is not silu"
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        return "projections with biases"
    if (getattr(c, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    if not hasattr(getattr(model, "model", None), "rotary_emb"):
        return "no rotary embedding module"
    return ""


@dataclass(frozen=True)
class LeanLayer:
    ln1: torch.Tensor
    qkv: Linear  # [(H + 2 KV) D, h]
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear  # [2 I, h]
    down: Linear

    @property
    def halves(self) -> bool:
        """Whether the output projection and the MLP's have 16-bit copies (``mlp_tail``)."""
        return self.o.half is not None and self.gate_up.half is not None \
            and self.down.half is not None


def fuse(*linears: torch.nn.Linear) -> torch.Tensor:
    """One weight for several projections of the same input; each module's weight becomes a
    view into it, so memory and the state dict stay as they were."""
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused


def lean_layers(model, linear: Callable[[torch.Tensor], Linear]) -> list[LeanLayer]:
    """The model's decoder layers, q/k/v and gate/up fused, each projection ``linear(weight)``."""
    layers = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        layers.append(LeanLayer(
            ln1=layer.input_layernorm.weight,
            qkv=linear(fuse(a.q_proj, a.k_proj, a.v_proj)),
            o=linear(a.o_proj.weight), ln2=layer.post_attention_layernorm.weight,
            gate_up=linear(fuse(mlp.gate_proj, mlp.up_proj)),
            down=linear(mlp.down_proj.weight)))
    return layers


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with grouped queries: q [B, H, m, D] over keys/values [B, KV, L, D];
    ``mask`` [.., G m, L] (G = H / KV query heads per key head, each head's m rows in
    turn, as ``group_mask`` makes it) or None. Returns [B, H, m, D]. The G query heads
    that share a key head go to SDPA as G m query rows of that one head: one query over
    an 800-token cache, cycling through 48 caches as a pass does, took 89 us a call this
    way against 147 us with SDPA's own grouped-query path (``enable_gqa``); a pass over 8
    sessions of 800 tokens, 6% less (docs/performance.md)."""
    B, H, m, D = q.shape
    KV = keys.shape[1]
    grouped = q.reshape(B, KV, (H // KV) * m, D)  # [B, KV, G m, D]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
    return out.reshape(B, H, m, D)


def group_mask(mask: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """A mask over m query rows [.., m, L] for ``attend``: repeated for the ``group`` query
    heads of each key head [.., G m, L]."""
    if mask is None or group == 1:
        return mask
    return mask.repeat(*([1] * (mask.dim() - 2)), group, 1)


def causal_mask(m: int, past: int, attention_mask, device) -> torch.Tensor | None:
    """[B, 1, m, past+m] bool (True = may attend), or None for one query and no padding;
    a 4-D mask is the caller's own (the drafter's tree)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.to(device)  # as SDPA takes it: bool, or added to the scores
    if attention_mask is None and m == 1:
        return None
    keys = past + m
    causal = torch.ones(m, keys, dtype=torch.bool, device=device).tril(diagonal=past)
    if attention_mask is None:
        return causal[None, None]
    return causal[None, None] & attention_mask.to(device=device, dtype=torch.bool)[:, None,
                                                                                  None, -keys:]
