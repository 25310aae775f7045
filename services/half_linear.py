"""Linear layers over 16-bit copies of float32 weights whose values are 16-bit numbers.

A replica's decode and verify passes carry a few rows each, so their linear layers read every
weight once and do little else with it: on a CPU they are bound by memory traffic, not
arithmetic. Checkpoints are usually saved in float16 or bfloat16 (the demo pair in float16)
and loaded as float32 for exact serving, so each float32 weight is a 16-bit number widened.
Stored in those 16 bits and widened again inside the kernel, the weights give the same
products in float32 and sums in float32: the same linear layer, at half the traffic. A weight
is used this way only when it is exactly representable (``exact_dtype``).

The kernel (services/cpu_kernels.py builds it; AVX-512 or AVX2 chosen at run time) sums each
output over the input features in order in one float32 accumulator, so a row's result does not
depend on the batch it is in or the threads that run it; its sums are ordered differently from
oneDNN's, so logits differ from the prepacked float32 path by about as much as that path's
differ from transformers' (~1e-5; the tests bound both). Where it cannot be built or run, the
replica keeps its float32 weights and says why in its log (``cpu_kernels.kernel``).
"""

from __future__ import annotations

import torch

BLOCK, PAD = 16, 32  # the layout's output block, and N's padding (csrc/cpu_kernels.cpp)


def exact_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """float16 or bfloat16 when every value of the float32 ``weight`` is exactly one, else
    None (float16 first: more mantissa, so it holds more checkpoints' values)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(weight.to(dtype).to(torch.float32), weight):
            return dtype
    return None


def blocks(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's layout of ``weight`` [N, K]: [NB, K, 16] in ``dtype``, N padded with zeros
    to a multiple of 32."""
    n, k = weight.shape
    padded = weight.new_zeros(-(-n // PAD) * PAD, k, dtype=dtype)
    padded[:n] = weight.to(dtype)
    return padded.view(-1, BLOCK, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, weight_blocks: torch.Tensor, n: int, isa: str = "") -> torch.Tensor:
    """x [..., K] float32 @ W.T for W in ``blocks``' layout: [..., n] float32. ``isa``: "" for
    the best kernel this CPU runs, "avx2" for that one (the tests compare them)."""
    return torch.ops.specmesh_cpu.linear(x, weight_blocks, n, isa)

