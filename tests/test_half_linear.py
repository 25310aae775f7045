"""The 16-bit-weight linear kernel (services/half_linear.py, services/csrc/cpu_kernels.cpp).

The kernel is compiled with this machine's C++ compiler on first use, as a replica does; on
these machines it must build and run (a CPU with AVX2 at least), so a failure to build fails
here rather than quietly leaving the replicas on float32 weights.
"""

from __future__ import annotations

import pytest
import torch

from services import cpu_kernels, half_linear

EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", autouse=True)
def kernel_ready():
    assert cpu_kernels.kernel() == ""


def _weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(dtype).float()


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A float32 sum of K products in order is within K eps sum|x w| of the exact one."""
    return x.shape[-1] * EPS * (x.abs().double() @ w.abs().double().T) + 1e-30


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 16, 1), (1, 768, 384), (3, 40, 5), (7, 100, 70),
                                   (8, 2112, 384), (9, 384, 1056), (17, 48, 33), (32, 8192, 64)])
def test_matches_the_exact_product_within_float32_rounding(dtype, m, n, k):
    w = _weight(n, k, dtype, seed=m * n + k)
    x = torch.randn(2, m, k, generator=torch.Generator().manual_seed(k))
    got = half_linear.linear(x, half_linear.blocks(w, dtype), n)
    exact = x.double() @ w.double().T
    assert got.shape == (2, m, n) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("n", [2112, 200], ids=["64-wide-tiles", "32-wide-tiles"])
def test_a_row_gets_the_same_floats_alone_in_a_batch_and_on_any_threads(n):
    """Each output is one accumulator summed over the inputs in order: a session's logits do
    not depend on which other sessions share its pass, nor on the thread count. (Calls of
    one or two rows take tiles of several blocks on AVX2, 64 outputs wide where the padded
    N allows and 32 where not: the same sums.)"""
    w = _weight(n, 384, torch.float16, seed=1)
    blocks = half_linear.blocks(w, torch.float16)
    x = torch.randn(29, 384, generator=torch.Generator().manual_seed(2))
    batch = half_linear.linear(x, blocks, n)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for i in (0, 5, 13, 27):
                for rows in (1, 2, 3):
                    assert torch.equal(half_linear.linear(x[i:i + rows], blocks, n)[0], batch[i])
                assert torch.equal(half_linear.linear(x[i:i + 2], blocks, n)[1], batch[i + 1])
    finally:
        torch.set_num_threads(threads)


def test_the_avx2_kernel_gives_the_avx512_kernels_floats():
    """Both kernels sum each output in the same order with FMAs: the same floats, so the
    machine a replica runs on does not change its logits."""
    if torch.ops.specmesh_cpu.isa() != "avx512":
        pytest.skip("this CPU runs the AVX2 kernel only; the comparison needs AVX-512")
    for dtype in (torch.float16, torch.bfloat16):
        w = _weight(200, 97, dtype, seed=3)
        x = torch.randn(13, 97, generator=torch.Generator().manual_seed(4))
        blocks = half_linear.blocks(w, dtype)
        assert torch.equal(half_linear.linear(x, blocks, 200),
                           half_linear.linear(x, blocks, 200, isa="avx2"))


def test_only_exactly_representable_weights_get_a_16_bit_copy():
    halves = _weight(8, 8, torch.float16, seed=5)
    assert half_linear.exact_dtype(halves) == torch.float16
    # bfloat16 numbers that float16 cannot hold: 3e-7 has finer bits than float16's
    # subnormals (multiples of 2^-24), 1e20 is past its largest number
    brains = torch.tensor([[3.0e-7, 1e20], [-2.5e-6, 1.0]]).bfloat16().float()
    assert half_linear.exact_dtype(brains) == torch.bfloat16
    assert half_linear.exact_dtype(torch.tensor([[1.0 + 2 ** -12]])) is None  # float32 only
    assert half_linear.exact_dtype(halves.double()) is None
    assert half_linear.exact_dtype(halves.half()) is None  # already 16-bit: nothing to widen


def test_layout_pads_outputs_to_whole_tiles_and_the_kernel_returns_only_the_real_ones():
    w = _weight(40, 6, torch.float16, seed=6)
    blocks = half_linear.blocks(w, torch.float16)
    assert blocks.shape == (4, 6, 16) and blocks.dtype == torch.float16  # 40 -> 64 outputs
    assert torch.equal(blocks[0, :, 3], w[3].half())  # block 0, output 3, every input
    assert torch.equal(blocks[2, :, 7], w[39].half())  # 2 * 16 + 7 = 39
    assert not blocks[2, :, 8:].any() and not blocks[3].any()  # the padding is zeros
    assert half_linear.linear(torch.ones(1, 6), blocks, 40).shape == (1, 40)


@pytest.mark.parametrize("call,message", [
    (lambda b: half_linear.linear(torch.ones(2, 6, dtype=torch.float64), b, 40), "float32"),
    (lambda b: half_linear.linear(torch.ones(2, 7), b, 40), "7 features"),
    (lambda b: half_linear.linear(torch.ones(2, 6), b, 65), "n out of range"),
    (lambda b: half_linear.linear(torch.ones(2, 6), b.float(), 40), "float16 or bfloat16"),
    (lambda b: half_linear.linear(torch.ones(2, 6), b, 40, isa="sse"), "isa must be"),
])
def test_bad_arguments_are_refused_with_what_to_fix(call, message):
    blocks = half_linear.blocks(_weight(40, 6, torch.float16, seed=7), torch.float16)
    with pytest.raises(RuntimeError, match=message):
        call(blocks)


def test_a_lean_pass_reads_the_16_bit_copies_over_any_number_of_tokens():
    """The demo target (a float16 checkpoint) with its copies: each of a pass's 25 linear
    calls runs the kernel, a decode pass's and a prompt's alike (the 24 projections over
    every token, the LM head over the position whose logits are kept): over many rows the
    kernel kept near a core's peak, where PyTorch's float32 linear took 2.5-3.1x its time
    (docs/performance.md, 2026-11-29). A bug that sent long calls back to the float32
    weights counts one kernel call, the LM head's."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from services.batching import Row
    from services.lean_llama import LeanLlama

    model = AutoModelForCausalLM.from_pretrained("models/demo-target", dtype=torch.float32)
    lean = LeanLlama(model.eval(), pack=True, half=True)

    def kernel_calls(tokens: list[int], kv, start: int) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            lean.forward_ragged([Row(tokens=tokens, kv=kv, start=start, keep=1)])
        # (a layer's fused operators run the kernel over 3 projections, and 1; a uniform
        # pass's one operator over all four of every layer)
        weight = {"specmesh_cpu::linear": 1, "specmesh_cpu::mlp_tail": 3,
                  "specmesh_cpu::norm_qkv_store": 1,
                  "specmesh_cpu::dense_layers": 4 * len(lean.layers)}
        return sum(e.count * weight.get(e.key, 0) for e in prof.key_averages())

    kv = lean.new_cache()
    assert kernel_calls(list(range(5, 53)), kv, 0) == 25  # a 48-token prompt
    assert kernel_calls([7], kv, 48) == 6 * 4 + 1  # one token: every projection, the LM head
    assert kernel_calls(list(range(5, 37)), kv, 49) == 25  # 32 tokens
    assert kernel_calls(list(range(100, 400)), kv, 81) == 25  # 300 tokens
