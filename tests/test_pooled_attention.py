"""The CPU kernel that attends a pass's pooled rows (``specmesh_cpu::attention``,
services/csrc/cpu_kernels.cpp; services/ragged_attention.py uses it): against PyTorch's own
CPU flash kernel with the mask the plan would have made, what it must never read, and the
independence of a row's floats from its batch; and a cascade's shared prefix attended as
matrix products (``dense_lse``) against the same flash kernel. The passes through the lean forward with it
are tested beside SDPA's in tests/test_kv_pool.py and tests/test_lean_forward.py.
"""

from __future__ import annotations

import pytest
import torch

from services import cpu_kernels
from services.ragged_attention import additive_mask


@pytest.fixture(scope="module", autouse=True)
def kernel_ready():
    assert cpu_kernels.kernel() == ""


def _case(n: int, kv: int, group: int, m: int, d: int, length: int, since: int, seed: int = 0):
    """Padded queries [n, KV, G M, D] of rows whose M queries see keys since..last[i, j]
    (ascending, as a row's new tokens do), over views of slot buffers [n, KV, L - since, D]
    laid out as a pool segment's (positions far apart between heads)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n + 3, kv, 512, d, generator=g)[3:, :, since:length]
    values = torch.randn(n + 3, kv, 512, d, generator=g)[3:, :, since:length]
    q = torch.randn(n, kv, group * m, d, generator=g)
    last = torch.randint(since, length, (n, m), generator=g).sort(dim=1).values
    return q, keys, values, last


def _flash(q, keys, values, last, since, group):
    mask = additive_mask(last, since, since + keys.shape[2], group, torch.float32)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, False, attn_mask=mask)[:2]
    return out, lse


@pytest.mark.parametrize("n, kv, group, m, d, length, since", [
    (16, 6, 1, 1, 64, 220, 0),  # the demo target's decode pass at 16 streams
    (5, 2, 3, 4, 64, 300, 0),  # grouped queries, verify rows of 4 tokens
    (4, 2, 2, 8, 32, 100, 40),  # a cascade's rests: keys from position 40 on
    (3, 1, 1, 1, 24, 17, 0),  # D = 24: three vectors a row, an odd count
    (3, 4, 1, 3, 128, 33, 5),
])
def test_the_kernel_gives_pytorchs_flash_attention_with_the_plans_mask(n, kv, group, m, d,
                                                                        length, since):
    q, keys, values, last = _case(n, kv, group, m, d, length, since)
    want, want_lse = _flash(q, keys, values, last, since, group)
    got, lse = torch.ops.specmesh_cpu.attention(q, keys, values, last, since, d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=2e-6)


def test_keys_past_a_querys_last_are_never_read():
    """The pool does not promise numbers past a row's live positions to this kernel: NaN
    there must not reach any output (a masked NaN would, through SDPA's softmax)."""
    q, keys, values, last = _case(6, 2, 2, 3, 64, 90, 0, seed=1)
    want, want_lse = torch.ops.specmesh_cpu.attention(q, keys, values, last, 0, 0.125)
    for i in range(6):
        keys[i, :, last[i, -1] + 1:] = float("nan")
        values[i, :, last[i, -1] + 1:] = float("nan")
    got, lse = torch.ops.specmesh_cpu.attention(q, keys, values, last, 0, 0.125)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)


def test_a_rows_floats_do_not_depend_on_its_batch_or_the_threads():
    """A row alone, in a batch of rows twice as long, and on two threads: the same floats,
    so a session's logits do not depend on who shares its pass (nor do target-only's)."""
    q, keys, values, last = _case(8, 2, 1, 2, 64, 400, 0, seed=2)
    last[3] = torch.tensor([20, 21])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        batch, _ = torch.ops.specmesh_cpu.attention(q, keys, values, last, 0, 0.125)
        torch.set_num_threads(2)
        wide, _ = torch.ops.specmesh_cpu.attention(q, keys, values, last, 0, 0.125)
    finally:
        torch.set_num_threads(threads)
    alone, _ = torch.ops.specmesh_cpu.attention(q[3:4], keys[3:4, :, :22], values[3:4, :, :22],
                                                last[3:4], 0, 0.125)
    assert torch.equal(batch[3], alone[0]) and torch.equal(wide, batch)


@pytest.mark.parametrize("group, m, d", [(2, 1, 64), (3, 4, 64), (4, 2, 128), (2, 3, 24)])
def test_a_querys_floats_do_not_depend_on_the_other_heads_of_its_token(group, m, d):
    """Where the CPU has AVX-512VL, the G query heads of a token attend two at a time (each
    key and value loaded once for both): each query's output and log-sum-exp must be the
    very floats it gets alone (G = 1, one query a row), whatever its heads are paired with.
    Counts that are not multiples of 4 or 8 keys, and a token that sees no key, included."""
    q, keys, values, last = _case(3, 2, group, m, d, 150, 0, seed=5)
    last[0, 0] = 0  # row 0's first token sees one key
    last[2] = torch.arange(m) + 37  # 38.. keys: tails of the four-key blocks
    since = 1  # row 0's first token now sees none
    keys, values = keys[:, :, 1:], values[:, :, 1:]
    got, lse = torch.ops.specmesh_cpu.attention(q, keys, values, last, since, d ** -0.5)
    for r in range(group * m):
        token = r % m
        alone, alone_lse = torch.ops.specmesh_cpu.attention(
            q[:, :, r:r + 1].contiguous(), keys, values, last[:, token:token + 1].contiguous(),
            since, d ** -0.5)
        assert torch.equal(got[:, :, r], alone[:, :, 0]), r
        assert torch.equal(lse[:, :, r], alone_lse[:, :, 0]), r
    assert lse[0, :, 0].eq(float("-inf")).all()  # (the token that sees no key)


def test_a_query_that_sees_no_key_gets_zeros_and_a_log_sum_exp_of_minus_infinity():
    """A padded query of a cascade's window (a slot not in the pass: its last key 0, before
    the shared positions) sees no key: its output is never read, but must be a number."""
    q, keys, values, last = _case(2, 1, 1, 1, 32, 60, 10, seed=3)
    last[0, 0] = 0
    out, lse = torch.ops.specmesh_cpu.attention(q, keys, values, last, 10, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and lse[0].item() == float("-inf")
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "q": a["q"].double()}, "4-D float32"),
    (lambda a: {**a, "keys": a["keys"][..., :16], "values": a["values"][..., :16]}, "[n, KV, L, D]"),
    (lambda a: {**a, "last": a["last"][:, :1].repeat(1, 3)}, "M dividing"),
    (lambda a: {**a, "keys": a["keys"].transpose(2, 3).contiguous().transpose(2, 3)}, "unit stride"),
])
def test_bad_arguments_are_refused_with_what_to_fix(change, message):
    q, keys, values, last = _case(2, 1, 1, 2, 32, 40, 0)
    args = change({"q": q, "keys": keys, "values": values, "last": last})
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torch.ops.specmesh_cpu.attention(args["q"], args["keys"], args["values"], args["last"],
                                         0, 0.125)


@pytest.mark.parametrize("d", [20, 136])
def test_head_sizes_the_kernel_does_not_take_are_refused(d):
    q, keys, values, last = _case(1, 1, 1, 1, d, 10, 0)
    with pytest.raises(RuntimeError, match="multiple of 8, at most 128, got " + str(d)):
        torch.ops.specmesh_cpu.attention(q, keys, values, last, 0, 0.125)


@pytest.mark.parametrize("scale", [1.0, 40.0], ids=["plain", "scores-that-overflow-exp"])
def test_a_shared_prefix_as_matrix_products_gives_pytorchs_flash_attention(scale):
    """``dense_lse`` (a cascade's shared prefix for many queries: every query sees every key)
    against PyTorch's CPU flash kernel with no mask, outputs and log-sum-exps, over views of
    slot buffers as the pool lays them out; scores far beyond exp's float32 range must come
    out finite (the maximum is taken out before exp)."""
    from services.cascade_attention import dense_lse

    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 3, 1024, 64, generator=g)[:, :, :800]
    values = torch.randn(1, 3, 1024, 64, generator=g)[:, :, :800]
    q = torch.randn(1, 3, 32, 64, generator=g) * scale
    want, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, False)[:2]
    got, lse = dense_lse(q, keys, values)
    assert got.shape == (1, 3, 32, 64) and lse.shape == (1, 3, 32) and lse.dtype == torch.float32
    assert torch.isfinite(got).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=2e-5)
