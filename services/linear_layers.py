"""How the lean forward's linear layers run (services/lean_llama.py): PyTorch's ``linear``,
oneDNN's on weights prepacked once, and the 16-bit kernel on 16-bit weights.

On a CPU with float32 weights the projections and the LM head are prepacked once for oneDNN
(``pack``). PyTorch's own ``linear`` repacks the weight on every call with more than one row,
so a pass over 4 tokens cost 1.6-1.8x a pass over one on these machines; with prepacked
weights it costs about the same as one (docs/performance.md, "Issue #14, third session").
The packed copies take the projections' memory a second time, and the kernels sum in another
order: logits differ from transformers' by ~1e-5 (within the tests' bound), about as much as
PyTorch's own results for a position differ between a pass over one row and one over four.

Weights whose values are exactly 16-bit numbers (a float16 or bfloat16 checkpoint loaded as
float32) get a 16-bit copy instead, which every call reads: half the memory traffic for the
same float32 products and sums (services/half_linear.py), and its kernel keeps near a core's
peak of multiply-adds over many rows too. Calls over more than 32 rows (prompts, and passes of
16 sessions verifying 3 drafts each) once ran PyTorch's ``linear`` on the float32 weight, which
on a Zen 5 EPYC took 2.5-3.1x the kernel's time on one thread over the demo target's 25 layers
from 16 to 256 rows (the AVX2 kernel's 1.25-1.95x): a 512-token prompt's passes took 131 against 72 ms
and a 16-session pass of 4-token verify rows 24.4 against 10.5 ms on one thread
(docs/performance.md, 2026-11-29). A weight with a 16-bit copy is not prepacked: no call
reads its float32 copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services import half_linear


def packing_unavailable(weight: torch.Tensor) -> str:
    """Why ``weight`` cannot be prepacked for oneDNN ("" when it can)."""
    if weight.device.type != "cpu":
        return f"weights on {weight.device.type}, not the CPU"
    if weight.dtype != torch.float32:
        return f"{weight.dtype} weights"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - present in this build?
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return "this PyTorch lacks oneDNN's prepacked linear"
    return ""


class Linear:
    """x @ W.T for one weight [out, in]: PyTorch's ``linear``, or oneDNN's on a copy of W
    packed once (see the module docstring); with ``half`` (only when W's values are exactly
    16-bit numbers), the 16-bit kernel on a 16-bit copy of W."""

    __slots__ = ("weight", "packed", "half")

    def __init__(self, weight: torch.Tensor, pack: bool, half: torch.dtype | None = None) -> None:
        self.weight = weight
        self.half = None if half is None else half_linear.blocks(weight, half)
        # the row count is a blocking hint. A weight with a 16-bit copy is not packed: every
        # call reads the copy
        pack = pack and self.half is None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.half is not None:
            return half_linear.linear(x, self.half, self.weight.shape[0])
        if self.packed is None:
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def half_copies(linears: list[Linear], why_not: str) -> str:
    """What the replica says of its 16-bit copies: "25 of 25 weights as float16", or why
    there are none."""
    if why_not:
        return f"none ({why_not})"
    dtypes = sorted({str(lin.half.dtype).removeprefix("torch.") for lin in linears
                     if lin.half is not None})
    copies = sum(lin.half is not None for lin in linears)
    if not copies:
        return f"none of {len(linears)} weights is exactly 16-bit"
    return f"{copies} of {len(linears)} weights as {'/'.join(dtypes)}"
