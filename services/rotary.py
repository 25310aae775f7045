"""Rotary position embeddings for the lean forward (services/lean_llama.py): the model's own
rotary module's cos and sin, tabled once per position, and their rotation of the queries
and keys in four operators.

Why a table: the model's rotary module computes a pass's cos and sin from its positions in
about ten operators behind two decorators, every pass; on a 2-core CPU that was 6% of a
16-session verify pass's time (py-spy; docs/performance.md). The table holds the same
module's cos and sin of positions 0..P-1, computed once, and a pass reads its rows. A
model whose module recomputes its frequencies from the positions it is given (dynamic,
longrope) gets no table: its module runs every pass.
"""

from __future__ import annotations

import torch

TABLE_MAX = 16384  # positions tabled at most; a pass past them computes its own


def static_rope(model) -> bool:
    """Whether the model's rotary embedding gives each position the same cos and sin
    whatever the pass: one that recomputes its frequencies from the positions it is given
    (dynamic, longrope) is neither tabled nor captured in a CUDA graph (it would read the
    positions back to the host)."""
    return getattr(model.model.rotary_emb, "rope_type", "default") not in ("dynamic", "longrope")


def signed(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, for ``rope``."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., D], the queries' and keys' heads together: HF's
    x cos + rotate_half(x) sin, where rotate_half(x) sin = cat(-x2, x1) cat(s1, s2) =
    roll(x, D/2) cat(-s1, s2), each product the same floats. Four operators a layer for
    q and k instead of fourteen (two negations, four slices and two cats among them)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class RopeTable:
    """cos and signed sin of a model's positions, tabled (module docstring)."""

    def __init__(self, model, weight: torch.Tensor) -> None:
        """``model``: a transformers Llama model; ``weight``: one of its weights (the table's
        dtype and device)."""
        self.module = model.model.rotary_emb
        self.table = None
        if static_rope(model):
            top = min(model.config.max_position_embeddings, TABLE_MAX)
            with torch.inference_mode():
                positions = torch.arange(top, device=weight.device)[None]  # [1, P]
                cos, sin = self.module(weight[:1, None], positions)  # [1, P, D]
            self.table = (cos[0], signed(sin)[0])  # [P, D] each

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, top: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions [B, m] of x [B, m, h]: [B, m, 1, D] each,
        broadcast over the heads. ``top``: the highest position + 1, if known: below the
        table's end they are read from it, else the rotary module computes them."""
        if self.table is not None and top is not None and top <= len(self.table[0]):
            cos, sin = self.table
            return cos[positions][:, :, None], sin[positions][:, :, None]
        cos, sin = self.module(x, positions)  # [B, m, D]
        return cos[:, :, None], signed(sin)[:, :, None]
