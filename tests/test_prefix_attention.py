"""The CPU kernel that attends a cascade's shared prefix for all of its queries and merges it
with what each query attended on its own (``specmesh_cpu::prefix_attention``,
services/csrc/prefix_attention.h; services/ragged_attention.py ``attend`` and ``cascade`` use
it): against PyTorch's CPU flash kernel over each query's whole view (the prefix, then its
own keys up to its last), the floats' independence from the batch and the threads, and the
arguments it refuses. The passes through the lean forward with it are tested against
transformers in tests/test_lean_forward.py. It runs on AVX-512 and on AVX2 (elsewhere the
Python side keeps its matrix products, which tests/test_pooled_attention.py covers): every
test runs the CPU's best path and the AVX2 one, which must give the very floats of the
AVX-512 one.
"""

from __future__ import annotations

import pytest
import torch

from services import cpu_kernels
from services.ragged_attention import additive_mask


@pytest.fixture(scope="module", autouse=True)
def kernel_ready():
    assert cpu_kernels.kernel() == ""
    if not torch.ops.specmesh_cpu.prefix_attention_isa():
        pytest.skip("prefix_attention needs AVX-512 or AVX2; this CPU has neither")


@pytest.fixture(params=["", "avx2"], ids=["best-isa", "avx2"])
def isa(request) -> str:
    """The kernel's path: the CPU's best, or AVX2's (on an AVX2 CPU the same)."""
    return request.param


def _case(n, kv, group, m, d, shared, own, seed=0, scale=1.0):
    """Rows of M queries (G M a key head) behind ``shared`` common positions, each seeing its
    own keys shared..last: the prefix [KV, P, D] as a view of a [P, KV, D] buffer (a stride
    between positions other than D), the rows' own keys as slot buffers, queries strided."""
    g = torch.Generator().manual_seed(seed)
    prefix_k = torch.randn(shared, kv, d, generator=g).transpose(0, 1)  # [KV, P, D]
    prefix_v = torch.randn(shared, kv, d, generator=g).transpose(0, 1)
    keys = torch.randn(n, kv, 256, d, generator=g)[:, :, :own]  # positions shared..
    values = torch.randn(n, kv, 256, d, generator=g)[:, :, :own]
    q = (torch.randn(n, group * m, kv, d, generator=g) * scale).transpose(1, 2)  # [n, KV, G M, D]
    last = torch.randint(shared, shared + own, (n, m), generator=g).sort(dim=1).values
    return q, prefix_k, prefix_v, keys, values, last


def _flash(q, keys, values, mask):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), keys.contiguous(), values.contiguous(), 0.0, False, attn_mask=mask)[:2]
    return out, lse


def _rest(q, keys, values, last, shared, group):
    """Each query's own part: PyTorch's flash kernel with the plan's mask over its keys."""
    return _flash(q, keys, values, additive_mask(last, shared, shared + keys.shape[2], group,
                                                 torch.float32))


def _whole(q, prefix_k, prefix_v, keys, values, last, shared, group):
    """What each query should get: flash attention over the prefix and its own keys as one
    sequence, the prefix seen whole."""
    n = q.shape[0]
    k = torch.cat([prefix_k.expand(n, -1, -1, -1), keys], dim=2)
    v = torch.cat([prefix_v.expand(n, -1, -1, -1), values], dim=2)
    mask = additive_mask(last, 0, shared + keys.shape[2], group, torch.float32)
    return _flash(q, k, v, mask)[0]


def _kernel(q, prefix_k, prefix_v, rest_out, rest_lse, isa=""):
    return torch.ops.specmesh_cpu.prefix_attention(q, prefix_k, prefix_v, rest_out, rest_lse,
                                                   q.shape[-1] ** -0.5, isa)


@pytest.mark.parametrize("n, kv, group, m, d, shared, own", [
    (8, 8, 4, 1, 64, 800, 150),  # 8 decode rows of a 4-to-1 grouped model behind 800
    (5, 2, 3, 4, 64, 130, 40),  # verify rows of 4; prefix blocks and 8-key tiles with tails
    (3, 1, 1, 1, 24, 17, 9),  # D = 24; fewer queries than a block's 32
    (2, 4, 1, 3, 128, 64, 5),  # D = 128: exactly one block of keys
    (11, 3, 2, 2, 32, 200, 30),  # 44 queries a head: two blocks of queries, one part-filled
    (9, 2, 4, 2, 64, 300, 20),  # 72: three blocks of 32, the last with 8
])
def test_the_prefix_and_a_querys_own_keys_give_flash_attention_over_both(n, kv, group, m, d,
                                                                        shared, own, isa):
    q, prefix_k, prefix_v, keys, values, last = _case(n, kv, group, m, d, shared, own)
    rest_out, rest_lse = _rest(q, keys, values, last, shared, group)
    got = _kernel(q, prefix_k, prefix_v, rest_out, rest_lse, isa)
    assert got.shape == (n, kv, group * m, d)
    torch.testing.assert_close(got, _whole(q, prefix_k, prefix_v, keys, values, last, shared,
                                           group), rtol=1e-5, atol=2e-6)


def test_scores_beyond_exps_float32_range_come_out_finite_and_right(isa):
    """Queries 40 times larger: scores of several hundred, whose exp overflows float32 unless
    each block's running maximum is taken out first (and the running sums rescaled)."""
    q, prefix_k, prefix_v, keys, values, last = _case(4, 2, 2, 1, 64, 300, 20, seed=5,
                                                      scale=40.0)
    rest_out, rest_lse = _rest(q, keys, values, last, 300, 2)
    got = _kernel(q, prefix_k, prefix_v, rest_out, rest_lse, isa)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _whole(q, prefix_k, prefix_v, keys, values, last, 300, 2),
                               rtol=1e-5, atol=2e-5)


def test_a_query_with_no_keys_of_its_own_gets_the_prefix_alone(isa):
    """A padded query of a pooled window (a slot not in the pass) has no rest: zeros and a
    log-sum-exp of -inf from the rests' kernel. It must get the prefix's attention, a number,
    and no NaN from exp(-inf - -inf)."""
    q, prefix_k, prefix_v, keys, values, last = _case(2, 2, 1, 1, 32, 100, 10, seed=2)
    rest_out, rest_lse = _rest(q, keys, values, last, 100, 1)
    rest_out[0], rest_lse[0] = 0.0, float("-inf")
    got = _kernel(q, prefix_k, prefix_v, rest_out, rest_lse, isa)
    alone = _flash(q[:1], prefix_k[None], prefix_v[None], None)[0]
    torch.testing.assert_close(got[:1], alone, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got[1:], _whole(q, prefix_k, prefix_v, keys, values, last, 100,
                                               1)[1:], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("rows", [8, 10])
def test_a_querys_floats_do_not_depend_on_its_batch_or_the_threads(isa, rows):
    """Each query's sums run in its own lane in a fixed order: a row's outputs are the same
    floats alone (8 queries a key head: a block of 16) as among 8 rows (64 queries: blocks
    of 32) or 10 (80: blocks of 16, which spread two key heads' tasks over the threads
    more evenly than three blocks of 32 each), on one thread or two. A verifier's answer
    must not change with who else is in the pass."""
    q, prefix_k, prefix_v, keys, values, last = _case(rows, 2, 4, 2, 64, 300, 40, seed=7)
    rest_out, rest_lse = _rest(q, keys, values, last, 300, 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [_kernel(q[i:i + 1], prefix_k, prefix_v, rest_out[i:i + 1], rest_lse[i:i + 1],
                         isa)[0] for i in range(rows)]
        for count in (1, 2):
            torch.set_num_threads(count)
            together = _kernel(q, prefix_k, prefix_v, rest_out, rest_lse, isa)
            for i in range(rows):
                assert torch.equal(alone[i], together[i])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "q": a["q"].double()}, "float32"),
    (lambda a: {**a, "rest_out": a["rest_out"][:1]}, "the same shape"),
    (lambda a: {**a, "rest_lse": a["rest_lse"][:1]}, "rest_lse must be [n, KV, R]"),
    (lambda a: {**a, "keys": a["keys"][..., :16], "values": a["values"][..., :16]},
     "[KV, P, D]"),
    (lambda a: {**a, "keys": a["keys"].transpose(1, 2).contiguous().transpose(1, 2)},
     "unit stride"),
])
def test_bad_arguments_are_refused_with_what_to_fix(change, message, isa):
    q, prefix_k, prefix_v, keys, values, last = _case(2, 2, 1, 1, 32, 40, 8)
    rest_out, rest_lse = _rest(q, keys, values, last, 40, 1)
    args = change({"q": q, "keys": prefix_k, "values": prefix_v, "rest_out": rest_out,
                   "rest_lse": rest_lse})
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _kernel(args["q"], args["keys"], args["values"], args["rest_out"], args["rest_lse"],
                isa)


@pytest.mark.parametrize("d", [20, 264])
def test_head_sizes_the_kernel_does_not_take_are_refused(d, isa):
    q = torch.zeros(1, 1, 1, d)
    with pytest.raises(RuntimeError, match="multiple of 8, at most 256, got " + str(d)):
        _kernel(q, torch.zeros(1, 4, d), torch.zeros(1, 4, d), q, torch.zeros(1, 1, 1), isa)


@pytest.mark.parametrize("n, kv, group, m, d, shared, own", [
    (8, 3, 2, 1, 64, 800, 150),  # the demo target's 8 decode rows behind 800
    (5, 2, 3, 4, 64, 130, 40),  # verify rows; blocks and tiles with tails
    (11, 3, 2, 2, 32, 200, 30),  # two blocks of 32 queries, one part-filled
    (3, 1, 1, 1, 24, 17, 9),  # D = 24; a block of 16
])
def test_the_avx2_path_gives_the_avx512_paths_floats(n, kv, group, m, d, shared, own):
    """The AVX2 path runs each query's sums in the same order and its exponentials by the
    same steps as the AVX-512 one, so a verifier's answer is the same on either CPU."""
    if torch.ops.specmesh_cpu.prefix_attention_isa() != "avx512":
        pytest.skip("compares with the AVX-512 path; this CPU has no AVX-512")
    q, prefix_k, prefix_v, keys, values, last = _case(n, kv, group, m, d, shared, own, seed=3)
    rest_out, rest_lse = _rest(q, keys, values, last, shared, group)
    assert torch.equal(_kernel(q, prefix_k, prefix_v, rest_out, rest_lse, "avx2"),
                       _kernel(q, prefix_k, prefix_v, rest_out, rest_lse))


def test_an_isa_the_cpu_does_not_run_is_refused():
    q, prefix_k, prefix_v, keys, values, last = _case(2, 2, 1, 1, 32, 40, 8)
    rest_out, rest_lse = _rest(q, keys, values, last, 40, 1)
    with pytest.raises(RuntimeError, match="isa must be"):
        _kernel(q, prefix_k, prefix_v, rest_out, rest_lse, "sse2")
