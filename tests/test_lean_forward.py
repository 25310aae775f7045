"""The lean Llama forward (services/lean_llama.py) against transformers' own forward.

Real models: the tiny pair built by the fixtures and the committed demo target, loaded with
``from_pretrained`` twice (one copy wrapped, one left as HF made it). Every comparison runs
the HF model on its own cache, so an error in the lean path cannot hide in a shared one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache

from drafter_svc.tree import tree_visibility
from services import rotary
from services.batching import Row, forward_one, forward_rows, shared_prefixes
from services.kv_slab import KVPool, SlabCache, pool_segment
from services.lean_llama import (
    LeanLlama,
    lean_forward,
    packing_unavailable,
    unsupported_reason,
)
from services.models import fingerprint

DEMO_TARGET = "models/demo-target"
TOL = dict(atol=2e-5, rtol=1e-5)


def _pair(path: str, pack: bool, half: bool = False):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    twin = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if half:  # both models' weights become float16 numbers (the demo pair's already are)
        for model in (hf, twin):
            for p in model.parameters():
                p.data = p.data.half().float()
    return hf, LeanLlama(twin, pack=pack, half=half)


@pytest.fixture(scope="module", params=[(model, pack) for model in ("tiny-target", "tiny-draft",
                                                                     "demo-target")
                                        for pack in ("lean", "packed", "half")],
                ids=lambda p: "-".join(p))
def models(request, tiny_pair):
    """(HF model, lean twin): "lean" runs PyTorch's linear, "packed" oneDNN's prepacked one,
    "half" that and, for calls of up to 32 rows, the 16-bit kernel (services/half_linear.py)
    on weights rounded to float16 in both models."""
    name, pack = request.param
    path = {"tiny-target": tiny_pair[0], "tiny-draft": tiny_pair[1],
            "demo-target": DEMO_TARGET}[name]
    hf, lean = _pair(path, pack != "lean", half=pack == "half")
    assert lean.packed == (pack != "lean")  # packing is available on these CPU machines
    if pack == "half":  # every weight has its copy: the kernel builds and runs on these CPUs
        assert lean.half_weights.startswith(f"{4 * len(lean.layers) + 1} of ")
    return hf, lean


def _ids(model, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist()


def test_rotary_embedding_gives_transformers_floats_exactly():
    """The lean forward rotates the queries' and keys' heads in one go with the sine's first
    half negated (services/rotary.py ``rope``); each element is the same products as transformers'
    apply_rotary_pos_emb, so the floats are equal, not merely close: a greedy argmax could
    otherwise flip between the lean and HF forwards."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    B, H, KV, m, D = 2, 6, 3, 5, 64
    q, k = torch.randn(B, H, m, D, generator=g), torch.randn(B, KV, m, D, generator=g)
    cos, sin = torch.randn(B, m, D, generator=g), torch.randn(B, m, D, generator=g)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    qk = torch.cat([q, k], dim=1).transpose(1, 2)  # [B, m, H + KV, D], as the pass holds them
    got = rotary.rope(qk, cos[:, :, None], rotary.signed(sin)[:, :, None])
    assert torch.equal(got[:, :, :H].transpose(1, 2), want_q)
    assert torch.equal(got[:, :, H:].transpose(1, 2), want_k)


def _norm_case(path: str, rows: int, half: bool):
    """A lean twin (``half``: with the project's kernels), its first layer's input norm with
    weights away from 1, and float32 activations [1, rows, h]."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lean = LeanLlama(model, half=half)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape,
                                                generator=torch.Generator().manual_seed(1)))
    x = 3 * torch.randn(1, rows, norm.weight.shape[0], generator=torch.Generator().manual_seed(rows))
    return lean, norm, x


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_rms_norm_gives_transformers_floats_exactly(tiny_pair, rows):
    """The lean forward norms float32 activations with PyTorch's rms_norm, one operator
    where transformers' LlamaRMSNorm runs six: on the CPU the floats must be its own."""
    lean, norm, x = _norm_case(tiny_pair[0], rows, half=False)
    assert not lean.kernel_norm
    with torch.inference_mode():
        assert torch.equal(lean._rms(x, norm.weight), norm(x))


@pytest.mark.parametrize("rows", [1, 16, 37])
def test_the_norm_kernel_gives_transformers_floats_within_float32_rounding(tiny_pair, rows):
    """With the project's kernels (``half``, on a CPU) the lean forward norms float32
    activations in ``specmesh_cpu::rms_norm``: transformers' products in transformers' order,
    the squares summed in another, so within float32 rounding of LlamaRMSNorm."""
    lean, norm, x = _norm_case(tiny_pair[0], rows, half=True)
    assert lean.kernel_norm
    with torch.inference_mode():
        got, want = lean._rms(x, norm.weight), norm(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("h", [1, 13, 40, 77, 384])
def test_the_norm_kernel_handles_any_width_and_strided_rows(h):
    """Widths with and without whole vectors of 8 and blocks of 32 (the kernel's tails), rows
    given as a non-contiguous view, against the formula in float64."""
    from services import cpu_kernels

    assert cpu_kernels.kernel() == ""
    g = torch.Generator().manual_seed(h)
    x = torch.randn(5, 2 * h, generator=g)[:, ::2]  # [5, h], not contiguous
    w = torch.randn(h, generator=g)
    got = torch.ops.specmesh_cpu.rms_norm(x, w, 1e-5)
    x64 = x.double()
    want = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()).float()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specmesh_cpu.rms_norm(x.double(), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"\[h\]"):
        torch.ops.specmesh_cpu.rms_norm(x, torch.randn(h + 1), 1e-5)


def test_prefill_then_steps_match_hf(models):
    """A prompt, then 1-token and 4-token steps on a growing cache: same logits as HF."""
    hf, lean = models
    caches = DynamicCache(config=hf.config), SlabCache(hf.config.num_hidden_layers, chunk=16)
    start = 0
    for n, seed in ((37, 0), (1, 1), (4, 2), (1, 3), (5, 4), (30, 5)):  # grows past 48
        row_ids = _ids(hf, n, seed)
        ref = forward_one(hf, Row(tokens=row_ids, kv=caches[0], start=start, keep=n), "cpu")
        got = forward_one(lean, Row(tokens=row_ids, kv=caches[1], start=start, keep=n), "cpu")
        assert got.shape == ref.shape == (n, hf.config.vocab_size)
        torch.testing.assert_close(got, ref, **TOL)
        start += n
        if n == 4:  # a verify's rollback: both drop the last 3 positions
            caches[0].crop(-3)
            caches[1].crop(-3)
            start -= 3
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == start
    for ref_layer, layer in zip(caches[0].layers, caches[1].layers, strict=True):
        torch.testing.assert_close(layer.keys, ref_layer.keys, **TOL)
        torch.testing.assert_close(layer.values, ref_layer.values, **TOL)


def _no_batch_cache():
    raise AssertionError("the lean forward's batched pass must not build a stacked cache")


def test_batched_rows_match_each_row_alone(models):
    """forward_rows on the lean model is its ragged pass: rows of any past and any number of
    new tokens, each on its own cache, read in place (no stacked batch cache is built), and
    each row's logits equal that row run alone through HF."""
    hf, lean = models
    plan = [(23, 3), (5, 1), (0, 4), (40, 2)]  # (past tokens, new tokens) per row
    hf_rows, lean_rows = [], []
    for b, (past, new) in enumerate(plan):
        prefix, step = _ids(hf, past, 10 + b), _ids(hf, new, 20 + b)
        kv_hf, kv_lean = DynamicCache(config=hf.config), lean.new_cache()
        if past:
            forward_one(hf, Row(tokens=prefix, kv=kv_hf, start=0, keep=1), "cpu")
            forward_one(lean, Row(tokens=prefix, kv=kv_lean, start=0, keep=1), "cpu")
        hf_rows.append(Row(tokens=step, kv=kv_hf, start=past, keep=new))
        lean_rows.append(Row(tokens=step, kv=kv_lean, start=past, keep=new))
    refs = [forward_one(hf, row, "cpu") for row in hf_rows]
    got = forward_rows(lean, lean_rows, "cpu", _no_batch_cache)
    for (past, new), ref, out, row in zip(plan, refs, got, lean_rows, strict=True):
        torch.testing.assert_close(out, ref, **TOL)
        assert row.kv.get_seq_length() == past + new  # each session's cache got its tokens


@pytest.mark.parametrize("plan, order", [
    ([(23, 3), (5, 1), (0, 4), (40, 2)], None),  # several new tokens: padded
    ([(30, 1)], None),  # one stream's decode: the whole pass is one dense call
    ([(30, 1), (12, 1), (47, 1)], None),  # decode rows in slot order: dense
    ([(30, 1), (12, 1), (47, 1)], [2, 0, 1]),  # decode rows out of slot order: gathered
], ids=["padded", "one-stream", "slot-order", "out-of-order"])
@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa", "cpu-kernel"])
def test_pooled_passes_shortcuts_give_the_general_paths_floats(tiny_pair, monkeypatch, plan,
                                                                order, kernel):
    """A pooled pass's mask is additive (0 / -inf), made once a pass, where SDPA turned a bool
    mask into it in every layer's call; and a decode pass whose rows fill their slots in
    order attends on views of the pass's queries, keys and values, without padding or
    gathering. Neither may change a float: the logits must equal the general path's (bool
    masks, padded queries, gathered outputs); with the CPU kernel, which takes no mask,
    padded queries and gathered outputs."""
    from services import cpu_kernels, ragged_attention

    _, lean = _pair(tiny_pair[0], pack=False)
    lean.kernel_attention = kernel and cpu_kernels.kernel() == ""
    assert lean.kernel_attention == kernel

    def run():
        kvs = [lean.new_cache() for _ in plan]  # slots in this order
        rows = []
        for b in order or range(len(plan)):
            past, new = plan[b]
            if past:
                forward_one(lean, Row(tokens=_ids(lean, past, 10 + b), kv=kvs[b], start=0,
                                      keep=1), "cpu")
            rows.append(Row(tokens=_ids(lean, new, 20 + b), kv=kvs[b], start=past, keep=new))
        assert all(kv.slot is not None for kv in kvs)  # the pass attends in pool slots
        return lean.forward_ragged(rows)

    fast = run()
    made = ragged_attention.plan

    def general(*args, **kwargs):  # the plans without their shortcuts; True = may attend
        return [dataclasses.replace(p, mask=None if p.mask is None else p.mask == 0,
                                    span=None, aligned=False)
                for p in made(*args, **kwargs)]

    monkeypatch.setattr(ragged_attention, "plan", general)
    for got, want in zip(fast, run(), strict=True):
        assert torch.equal(got, want)


def test_wrapping_keeps_weights_state_dict_and_fingerprint(tiny_pair):
    """Fused projections are views of one tensor: the HF modules still hold the same
    values, the state dict is unchanged, so replicas agree on the target's fingerprint."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    twin = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    before = fingerprint(twin)
    lean = LeanLlama(twin)
    assert fingerprint(twin) == before == fingerprint(plain)
    q_proj = twin.model.layers[0].self_attn.q_proj.weight
    assert q_proj.data_ptr() == lean.layers[0].qkv.weight.data_ptr()  # a view, not a copy
    torch.testing.assert_close(q_proj, plain.model.layers[0].self_attn.q_proj.weight)
    assert sum(p.numel() for p in lean.parameters()) == sum(p.numel() for p in plain.parameters())


def test_unsupported_models_keep_the_hf_forward(tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    assert unsupported_reason(model) == ""
    model.config.attention_bias = True  # e.g. Qwen2-style q/k/v biases
    kept, reason = lean_forward(model, "auto")
    assert kept is model and "bias" in reason
    with pytest.raises(ValueError, match="bias"):
        LeanLlama(model)
    model.config.attention_bias = False
    assert isinstance(lean_forward(model, "auto")[0], LeanLlama)
    assert lean_forward(model, "hf")[0] is model
    with pytest.raises(ValueError, match="auto, packed, lean, hf"):
        lean_forward(model, "fast")


def test_auto_prepacks_float32_cpu_weights_and_lean_does_not(tiny_pair):
    """--forward auto packs where oneDNN can take the weights (float32 on a CPU), lean never;
    half-precision weights keep PyTorch's linear, with the reason."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32).eval()
    assert packing_unavailable(model.lm_head.weight) == ""
    assert lean_forward(model, "auto")[0].packed
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32).eval()
    assert not lean_forward(model, "lean")[0].packed
    half = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float16).eval()
    assert "float16" in packing_unavailable(half.lm_head.weight)
    assert not lean_forward(half, "auto")[0].packed


def test_auto_keeps_16_bit_copies_of_exactly_16_bit_weights_only(tiny_pair):
    """--forward auto gives every weight of the demo target (a float16 checkpoint) a float16
    copy, --forward packed none; the tiny pair's random float32 weights are not 16-bit
    numbers, so they get none and run as before."""
    def linears(lean):
        return [lean._lm_head] + [getattr(layer, name) for layer in lean.layers
                                  for name in ("qkv", "o", "gate_up", "down")]

    demo = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    lean = lean_forward(demo, "auto")[0]
    assert lean.half_weights == "25 of 25 weights as float16"
    # a 16-bit copy replaces the packed one (prompts' calls run PyTorch's linear)
    assert all(lin.half is not None and lin.packed is None for lin in linears(lean))
    demo = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    lean = lean_forward(demo, "packed")[0]
    assert lean.half_weights == "none (not asked for)"
    assert all(lin.half is None and lin.packed is not None for lin in linears(lean))
    tiny = AutoModelForCausalLM.from_pretrained(tiny_pair[1], dtype=torch.float32).eval()
    lean = lean_forward(tiny, "auto")[0]
    total = 4 * lean.config.num_hidden_layers + 1
    assert lean.half_weights == f"none of {total} weights is exactly 16-bit"
    assert all(lin.half is None and lin.packed is not None for lin in linears(lean))


def test_slab_cache_writes_in_place_and_rolls_back_by_length():
    """Appends land in the same buffer until it is full; crop only moves the length, and
    the next append overwrites the dropped positions; growth keeps the live positions."""
    cache = SlabCache(num_layers=1, chunk=4)
    layer = cache.layers[0]
    step = [torch.full((1, 2, 1, 3), float(i)) for i in range(9)]  # [B, KV, 1, D]
    keys, _ = cache.update(step[0], step[0] * 10, 0)
    buffer = layer._keys.data_ptr()
    for i in range(1, 4):
        keys, values = cache.update(step[i], step[i] * 10, 0)
    assert layer._keys.data_ptr() == buffer and layer.capacity() == 4  # no copy yet
    assert keys[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    cache.crop(-2)  # drop the last two, as DynamicCache.crop(-2) would
    assert cache.get_seq_length() == 2 and layer._keys.data_ptr() == buffer
    keys, values = cache.update(step[7], step[7] * 10, 0)
    assert keys[0, 1, :, 2].tolist() == [0.0, 1.0, 7.0]
    assert values[0, 0, :, 0].tolist() == [0.0, 10.0, 70.0]
    for i in (4, 5):  # 5 positions: the buffer grows by a chunk, keeping what was live
        keys, values = cache.update(step[i], step[i], 0)
    assert layer.capacity() == 8 and layer._keys.data_ptr() != buffer
    assert keys[0, 0, :, 0].tolist() == [0.0, 1.0, 7.0, 4.0, 5.0]
    cache.crop(2)  # a non-negative argument is the length to keep
    assert cache.get_seq_length() == 2 and layer.keys.shape == (1, 2, 2, 3)


def test_tree_visibility_is_each_branch_prefix_and_its_own_tokens():
    """The drafter's tree mask: 5 cached positions (2 committed, 3 drafts), branches after
    0, 3 and 1 accepted drafts, 2 steps: each sees its prefix, then one column per step."""
    visible = tree_visibility([2, 5, 3], held=5, steps=2).int().tolist()
    assert visible == [[1, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0],
                       [1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 0],
                       [1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize("kernel, dense", [
    (False, False), (False, True), (True, False), (True, True), ("prefix", False)],
    ids=["sdpa-per-query", "sdpa-dense", "cpu-kernel-per-query", "cpu-kernel-dense",
         "prefix-kernel"])
@pytest.mark.parametrize("slots", ["pool", "own", "mixed", "segments"])
def test_rows_sharing_a_prefix_attend_to_it_once_and_match_each_row_alone(models, slots,
                                                                         monkeypatch, kernel,
                                                                         dense):
    """Cascade attention: rows whose caches begin with the same 160 tokens (the same chained
    prefix-block hashes, as the verifier's sessions restored from its prefix cache carry)
    are grouped and attend to that prefix once per layer, merged with their own suffix by
    log-sum-exp; each row's logits still equal that row run alone through HF - rows of one
    and of several new tokens, a row whose new tokens start right after the prefix, and a
    row that shares nothing in the same pass; the rows' caches in pool slots (their rests
    attended in one call), in slots of three pool segments (one call each), in buffers of
    their own (one call each), or some of each; the
    pooled rests attended by SDPA or by the CPU kernel, the shared prefix by the same or as
    matrix products (``dense_lse``), or the prefix and the merge by the kernel's
    ``prefix_attention`` (AVX-512 or AVX2), once a layer for all the group's queries. A wrong
    merge, mask or offset shows here."""
    from services import cascade_attention, cpu_kernels

    hf, lean = models
    if slots == "segments":  # a pool of two slots a segment: the group's rows in three
        p = lean.pool
        monkeypatch.setattr(lean, "pool", KVPool(p.num_layers, lean._kv_heads, lean._head_dim,
                                                 p.slot_len, segment=2, max_slots=p.max_slots,
                                                 dtype=p.dtype, device="cpu"))
    monkeypatch.setattr(lean, "kernel_attention", bool(kernel) and cpu_kernels.kernel() == "")
    assert lean.kernel_attention == bool(kernel)
    monkeypatch.setattr(lean, "kernel_prefix", kernel == "prefix")
    prefix_calls = []
    if kernel == "prefix":
        if not torch.ops.specmesh_cpu.prefix_attention_isa():
            pytest.skip("prefix_attention needs AVX-512 or AVX2; this CPU has neither")
        monkeypatch.setattr(torch.ops.specmesh_cpu, "prefix_attention", lambda *a, op=(
            torch.ops.specmesh_cpu.prefix_attention): prefix_calls.append(1) or op(*a))
    monkeypatch.setattr(cascade_attention, "DENSE_MIN", 1 if dense else 10**9)
    dense_lse = cascade_attention.dense_lse
    dense_calls = []
    monkeypatch.setattr(cascade_attention, "dense_lse",
                        lambda *a: dense_calls.append(1) or dense_lse(*a))
    prefix = _ids(hf, 160, 99)
    chain = list(range(1000, 1010))  # 10 blocks of 16: SessionCache.hashes
    other = list(range(5000, 5011))
    plan = [(prefix + _ids(hf, 7, 1), 1, chain), (prefix + _ids(hf, 30, 2), 4, chain),
            (prefix, 3, chain), (_ids(hf, 176, 3), 2, other), (prefix + _ids(hf, 2, 4), 1, chain)]
    hf_rows, lean_rows = [], []
    for b, (past, new, hashes) in enumerate(plan):
        step = _ids(hf, new, 20 + b)
        own = slots == "own" or (slots == "mixed" and b % 2)
        kv_hf = DynamicCache(config=hf.config)
        kv_lean = SlabCache(hf.config.num_hidden_layers) if own else lean.new_cache()
        assert (kv_lean.slot is None) == own
        forward_one(hf, Row(tokens=past, kv=kv_hf, start=0, keep=1), "cpu")
        forward_one(lean, Row(tokens=past, kv=kv_lean, start=0, keep=1), "cpu")
        hf_rows.append(Row(tokens=step, kv=kv_hf, start=len(past), keep=new))
        lean_rows.append(Row(tokens=step, kv=kv_lean, start=len(past), keep=new, chain=hashes,
                             chain_tokens=16 * len(hashes)))
    assert shared_prefixes(lean_rows) == [([0, 1, 2, 4], 160)]
    calls = []
    cascade = cascade_attention.cascade
    monkeypatch.setattr(cascade_attention, "cascade",
                        lambda c, *args: calls.append((c.shared, len(c.pooled))) or cascade(
                            c, *args))
    refs = [forward_one(hf, row, "cpu") for row in hf_rows]
    got = forward_rows(lean, lean_rows, "cpu", _no_batch_cache)
    # One call per pool segment and, in it, for the rows of one new token (0 and 4) apart
    # from those of several (1 and 2): rows 0, 2, 4 in slots when mixed; with two slots a
    # segment 0 beside 1, 2 (3 beside it) and 4 alone.
    plans = {"pool": 2, "own": 0, "mixed": 2, "segments": 4}[slots]
    assert calls == [(160, plans)] * hf.config.num_hidden_layers  # one group, every layer
    assert len(dense_calls) == (hf.config.num_hidden_layers if dense else 0)
    # with the prefix kernel: one call a layer for all the group's queries, wherever their
    # rows' caches lie (the rests attended per plan and per row of its own first)
    assert len(prefix_calls) == (hf.config.num_hidden_layers if kernel == "prefix" else 0)
    for (past, new, _), ref, out, row in zip(plan, refs, got, lean_rows, strict=True):
        torch.testing.assert_close(out, ref, **TOL)
        assert row.kv.get_seq_length() == len(past) + new


def test_attention_outputs_in_a_gpu_kernels_layout_give_the_same_logits(models, monkeypatch):
    """CUDA's flash and memory-efficient SDPA kernels return [B, H, m, D] laid out as
    [B, m, H, D] (not contiguous); PyTorch's CPU kernels return it contiguous. A GPU cannot
    run here, so SDPA is wrapped to hand back its exact values in the GPU's layout, and the
    lean forward must reshape rather than view them (a verifier on a GPU crashed on the
    first pass with grouped-query attention before). Prompt, steps and batched rows against
    HF, which gets the same layout."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gpu_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)  # [B, H, m, D]
        strided = out.transpose(1, 2).contiguous().transpose(1, 2)
        assert out.shape[1] == 1 or out.shape[2] == 1 or not strided.is_contiguous()
        return strided

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", gpu_layout)
    test_prefill_then_steps_match_hf(models)
    test_batched_rows_match_each_row_alone(models)


def _fed(lean, prompts: list[list[int]]) -> list[list]:
    """Each prompt fed to a new cache of ``lean``, one pass each: [cache, its length] per
    prompt."""
    out = []
    for prompt in prompts:
        kv = lean.new_cache()
        forward_rows(lean, [Row(tokens=prompt, kv=kv, start=0, keep=1)], "cpu", _no_batch_cache)
        out.append([kv, len(prompt)])
    return out


def _segments_of(lean: LeanLlama, segment: int) -> None:
    """Gives ``lean`` a new pool of ``segment`` slots a segment (a CPU's has 64: tests of
    passes over several segments make them smaller)."""
    p = lean.pool
    lean.pool = KVPool(p.num_layers, lean._kv_heads, lean._head_dim, p.slot_len,
                       segment=segment, max_slots=p.max_slots, dtype=p.dtype, device="cpu")


def _same_caches(ours: list[list], theirs: list[list]) -> None:
    """Each pair of caches (``_fed``'s [cache, length] lists) holds as many positions and the
    very same keys and values."""
    for (a, _), (b, _) in zip(ours, theirs, strict=True):
        length = a.get_seq_length()
        assert length == b.get_seq_length()
        for la, lb in zip(a.layers, b.layers, strict=True):
            assert torch.equal(la.keys[..., :length, :], lb.keys[..., :length, :])
            assert torch.equal(la.values[..., :length, :], lb.values[..., :length, :])


@pytest.mark.parametrize("rows, shared", [(1, 0), (5, 0), (8, 144)],
                         ids=["one", "five", "eight-sharing-a-prefix"])
def test_a_pass_with_the_fused_rotary_and_cache_writes_gives_the_same_floats(rows, shared,
                                                                             monkeypatch):
    """Decode passes whose tokens all attend in one pooled call run the rotary embedding,
    the split into heads and the cache writes in ``specmesh_cpu::rope_store``: the demo
    target's logits over three steps are the very floats of the operators it replaces, and
    the caches hold the same keys and values after. Rows that share a 144-token prefix
    (one cascade, its shared part in ``prefix_attention`` where the CPU has AVX-512 or AVX2:
    eight rows, whose 16 queries a key head fill one of the kernel's blocks) take the same
    fused path."""
    from services import ragged_attention

    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    assert lean.kernel_rope and lean.kernel_attention
    # layer by layer, where the calls are counted (a dense pass's one operator for all of
    # them: test_a_uniform_pass_runs_its_layers_in_one_operator_with_the_same_floats)
    lean._uniform = lambda tokens: False
    if shared and not lean.kernel_prefix:
        pytest.skip("prefix_attention needs AVX-512 or AVX2; this CPU has neither")
    written = []  # per pooled call: were the keys written before it (the fused path)?
    padded = ragged_attention.written_and_padded
    monkeypatch.setattr(ragged_attention, "written_and_padded", lambda p, b, q, k, v: (
        written.append(k is None) or padded(p, b, q, k, v)))
    prefix_calls = []
    monkeypatch.setattr(torch.ops.specmesh_cpu, "prefix_attention", lambda *a, op=(
        torch.ops.specmesh_cpu.prefix_attention): prefix_calls.append(1) or op(*a))
    chain = list(range(500, 500 + shared // 16))  # the prefix's block hashes

    def sessions():
        g = torch.Generator().manual_seed(rows)
        prefix = torch.randint(0, 8000, (shared,), generator=g).tolist()
        return _fed(lean, [prefix + torch.randint(
            0, 8000, (int(torch.randint(20, 90, (1,), generator=g)),), generator=g).tolist()
            for _ in range(rows)])

    fused, plain = sessions(), sessions()
    for step in range(3):
        got = []
        for caches, on in ((fused, True), (plain, False)):
            lean.kernel_rope = on
            written.clear()
            prefix_calls.clear()
            with torch.inference_mode():
                step_rows = [Row(tokens=[7 + step + b], kv=kv, start=s, keep=1, chain=chain,
                                 chain_tokens=shared) for b, (kv, s) in enumerate(caches)]
                got.append(lean.forward_ragged(step_rows, shared_prefixes(step_rows)))
            # one pooled call a layer, fused or not, and one over the shared prefix where
            # there is one
            assert written == [on] * len(lean.layers)
            assert len(prefix_calls) == (len(lean.layers) if shared else 0)
            for c in caches:
                c[1] += 1
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b)
    _same_caches(fused, plain)


@pytest.mark.parametrize("new", [1, 4], ids=["decode", "verify"])
def test_a_session_alone_gets_the_floats_it_gets_beside_others(new):
    """On a CPU one row runs the lean forward's ragged pass as several do (the pooled
    attention kernel, the fused rotary): a session's logits are the very floats whether it
    has its pass to itself or shares it, so a lone request decodes what it would under
    load (its dense ``forward``, which one row used to take, differed in the last bits).
    Both give HF's logits within float32 rounding."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean, why = lean_forward(model, "auto")
    assert not why

    def session(n: int, seed: int):
        kv = lean.new_cache()
        prompt = torch.randint(0, 8000, (n,), generator=torch.Generator().manual_seed(seed))
        forward_rows(lean, [Row(tokens=prompt.tolist(), kv=kv, start=0, keep=1)], "cpu",
                     _no_batch_cache)
        return kv, n

    (kv, start), (other, other_start) = session(300, 1), session(120, 2)
    step = list(range(11, 11 + new))
    alone = forward_rows(lean, [Row(tokens=step, kv=kv, start=start, keep=new)], "cpu",
                         _no_batch_cache)[0]
    kv.crop(start)
    shared = forward_rows(lean, [Row(tokens=step, kv=kv, start=start, keep=new),
                                 Row(tokens=[5], kv=other, start=other_start, keep=1)], "cpu",
                          _no_batch_cache)[0]
    kv.crop(start)
    assert torch.equal(alone, shared)
    dense = forward_one(lean, Row(tokens=step, kv=kv, start=start, keep=new), "cpu")
    torch.testing.assert_close(dense, alone, **TOL)  # the same maths, other float orders


@pytest.mark.parametrize("rows, new", [(1, 1), (1, 4), (6, 1), (3, 40)],
                         ids=["decode", "verify", "six-rows", "120-tokens"])
def test_a_layers_fused_operators_give_the_floats_of_the_operators_they_replace(rows, new):
    """Over its 16-bit copies a layer's MLP with its output projection and residuals
    (``specmesh_cpu::mlp_tail``) and its norm, fused projection and rotary cache writes
    (``norm_qkv_store``) run as one operator each: the demo target's logits over three steps
    are the very floats of the Python path's operators, and the caches hold the same keys and
    values, over a few tokens and over many (three rows of 40: the projections read their
    copies over any number of rows)."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    assert lean.kernel_layer
    g = torch.Generator().manual_seed(rows * 100 + new)

    def sessions():
        return _fed(lean, [torch.randint(0, 8000, (30 + 17 * b,), generator=torch.Generator()
                                         .manual_seed(b)).tolist() for b in range(rows)])

    fused, plain = sessions(), sessions()
    for _ in range(3):
        step = [torch.randint(0, 8000, (new,), generator=g).tolist() for _ in range(rows)]
        got = []
        for caches, on in ((fused, True), (plain, False)):
            lean.kernel_layer = on
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                got.append(forward_rows(lean, [Row(tokens=step[b], kv=kv, start=s, keep=new)
                                               for b, (kv, s) in enumerate(caches)], "cpu",
                                        _no_batch_cache))
            ops = {e.key: e.count for e in prof.key_averages()}
            # (a uniform pass runs all of its layers' in one: the next test)
            tails = ops.get("specmesh_cpu::mlp_tail", 0) + len(lean.layers) * ops.get(
                "specmesh_cpu::dense_layers", 0)
            assert tails == (len(lean.layers) if on else 0)
            for c in caches:
                c[1] += new
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b)
    _same_caches(fused, plain)


@pytest.mark.parametrize("rows, new, mixed, gap", [
    (1, 1, False, False), (5, 1, False, False), (1, 4, False, False), (3, 4, False, False),
    (5, 1, True, False), (3, 4, True, False), (20, 1, False, False), (20, 1, True, False),
    (5, 1, False, True), (4, 4, True, True), (20, 1, True, True)],
    ids=["one-stream", "five-rows", "one-stream-verify", "three-verifies",
         "five-rows-out-of-slot-order", "three-verifies-out-of-order", "two-segments",
         "two-segments-out-of-order", "five-rows-and-a-gap", "verifies-and-a-gap",
         "two-segments-and-gaps"])
def test_a_uniform_pass_runs_its_layers_in_one_operator_with_the_same_floats(rows, new,
                                                                               mixed, gap):
    """A pass whose rows hold as many new tokens each in slots that line up (every decode
    and verify pass of one stream) runs all of its layers in ``specmesh_cpu::dense_layers``:
    the same operators called from C++, so the demo target's logits over three steps are the
    very floats of the layer-by-layer path and the caches hold the same keys and values. Rows
    that come in another order than their slots' (the order calls joined the batch) run in
    slot order and get their own logits back. Rows in more than one pool segment (more
    sessions than a segment's slots: 16 here, as on a GPU) run one such operator per
    segment. Sessions that hold slots between the pass's rows but are not in it (``gap``:
    between their rounds) keep their caches as they were."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    _segments_of(lean, 16)
    own = lean._uniform
    segments = -(-rows // lean.pool.segment)
    assert segments == (2 if rows == 20 else 1)

    def sessions():
        return _fed(lean, [torch.randint(0, 8000, (30 + 17 * b,), generator=torch.Generator()
                                         .manual_seed(b)).tolist() for b in range(rows)])

    dense, layered = sessions(), sessions()
    idle = []
    if gap:  # sessions between their rounds hold slots 1 and 17, inside the pass's windows
        idle = [c for i, c in enumerate(dense + layered) if i % rows in (1, 17)]
        dense = [c for i, c in enumerate(dense) if i not in (1, 17)]
        layered = [c for i, c in enumerate(layered) if i not in (1, 17)]
        before = [kv.layers[0].keys.clone() for kv, _ in idle]
    if mixed:  # e.g. slots 2, 0, 1: every row's place in the pass is not its slot's
        dense, layered = dense[2:] + dense[:2], layered[2:] + layered[:2]
        assert [kv.slot for kv, _ in dense] != sorted(kv.slot for kv, _ in dense)
    for step in range(3):
        got = []
        for caches, one_op in ((dense, True), (layered, False)):
            lean._uniform = own if one_op else lambda tokens: False
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                got.append(forward_rows(lean, [Row(tokens=list(range(9 + step + b, 9 + step + b
                                                                      + new)),
                                                   kv=kv, start=s, keep=new)
                                               for b, (kv, s) in enumerate(caches)], "cpu",
                                        _no_batch_cache))
            ops = {e.key: e.count for e in prof.key_averages()}
            assert ops.get("specmesh_cpu::dense_layers", 0) == (segments if one_op else 0)
            assert ops.get("specmesh_cpu::mlp_tail", 0) == (0 if one_op else len(lean.layers))
            for c in caches:
                c[1] += new
        for a, b in zip(*got, strict=True):
            assert torch.equal(a, b)
    _same_caches(dense, layered)
    for (kv, _), keys in zip(idle, before if gap else [], strict=True):
        assert torch.equal(kv.layers[0].keys, keys)


@pytest.mark.parametrize("rows, new, gap", [(16, 1, False), (20, 1, True), (5, 4, False),
                                            (4, 4, True)],
                         ids=["a-segment", "two-segments-and-gaps", "five-verifies",
                              "verifies-and-a-gap"])
def test_a_uniform_pass_on_two_threads_runs_groups_of_rows_with_the_same_floats(rows, new,
                                                                                 gap):
    """On more than one torch thread, ``dense_layers`` hands out groups of rows (8 tokens a
    group), each running all of its layers, instead of running each operator of a layer on
    every thread: the threads meet once a pass, not at every operator. Rows do not mix within
    a layer and every output is summed in one order whatever the rows beside it, so the
    logits over three steps and the caches are the one-thread pass's floats. The profiler
    counts each group's operators (its layers' residual adds): one run per group, where a
    run over all rows would count one set. (Segments of 16 slots: 20 rows in two.)"""
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    _segments_of(lean, 16)

    def sessions():
        return _fed(lean, [torch.randint(0, 8000, (25 + 13 * b,), generator=torch.Generator()
                                         .manual_seed(b)).tolist() for b in range(rows)])

    grouped, alone = sessions(), sessions()
    if gap:  # a session between its rounds holds slot 1 of each window
        grouped = [c for i, c in enumerate(grouped) if i != 1]
        alone = [c for i, c in enumerate(alone) if i != 1]
    # groups of each segment's rows (16 slots a segment; 8 tokens a group: 8 // new rows)
    per_segment = [n for n in (sum(1 for kv, _ in grouped if kv.slot // lean.pool.segment == s)
                               for s in range(2)) if n]
    groups = sum(-(-n // (8 // new)) for n in per_segment)
    threads = torch.get_num_threads()
    try:
        for step in range(3):
            got = []
            for caches, count in ((grouped, 2), (alone, 1)):
                torch.set_num_threads(count)
                with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    got.append(forward_rows(lean, [Row(tokens=list(range(7 + step + b,
                                                                         7 + step + b + new)),
                                                       kv=kv, start=s, keep=new)
                                                   for b, (kv, s) in enumerate(caches)],
                                            "cpu", _no_batch_cache))
                adds = {e.key: e.count for e in prof.key_averages()}.get("aten::add", 0)
                runs = groups if count == 2 else len(per_segment)
                assert adds == 2 * len(lean.layers) * runs
                for c in caches:
                    c[1] += new
            for a, b in zip(*got, strict=True):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)
    _same_caches(grouped, alone)


@pytest.mark.parametrize("groups, alone, prefix, wide, cascade", [
    ([2, 2, 2, 2], 0, 160, False, False), ([8], 8, 160, False, True),
    ([8], 0, 400, False, True), ([16], 0, 160, False, True), ([8], 0, 160, True, True),
    ([4], 0, 512, False, True), ([4], 0, 304, False, False), ([4, 4], 0, 512, False, False)],
    ids=["pairs", "eight-beside-eight-sharing-none", "eight-sharing-much",
         "sixteen-sharing-little", "eight-beside-a-verify", "four-sharing-much",
         "four-sharing-little", "two-fours-sharing-much"])
def test_shared_prefixes_are_attended_once_only_where_that_pays(groups, alone, prefix, wide,
                                                                 cascade):
    """With the prefix kernel a group of rows attends its shared prefix once (cascade
    attention) only when its queries fill one of the kernel's 16-lane blocks per key head
    (the demo target has two query heads a key head: eight one-token rows), or, as a pass's
    only group, holding every row, half of one where its rows after the first skip 1,500
    positions of the prefix together (four rows sharing 512 positions skip 1,536; sharing
    304, 912: no group; two such fours: none either): pairs run ``dense_layers`` without
    a prefix; eight sharing 400 keep their group, which as the pass's only rows, in one
    segment, runs as one operator with the prefix attended in it, and so do sixteen sharing
    160 and eight sharing 160 beside eight rows that share nothing (70 positions saved a
    token: in one segment the pass stays one operator, those rows attending their own slots
    from position 0, whatever the group saves); eight sharing 160 keep theirs beside a
    verify row of four tokens, and that pass runs layer by layer with ``prefix_attention``
    called a layer; without the groups that pass runs its one-token rows and its verify row
    as one operator each (two plans: services/ragged_attention.py ``plan``). Either way the
    logits are those of the same rows attending their own copies of the prefix."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    if not lean.kernel_prefix:
        pytest.skip("prefix_attention needs AVX-512 or AVX2; this CPU has neither")
    g = torch.Generator().manual_seed(len(groups) + prefix)
    prompts, shared = [], []
    for size in groups:
        common = torch.randint(0, 8000, (prefix,), generator=g).tolist()
        shared.append((list(range(len(prompts), len(prompts) + size)), prefix))
        prompts += [common + torch.randint(0, 8000, (5 + b,), generator=g).tolist()
                    for b in range(size)]
    prompts += [torch.randint(0, 8000, (prefix + 3,), generator=g).tolist()
                for _ in range(alone + wide)]
    kept, prefixed = [], []  # the groups each pass kept; each one-operator part's prefix
    cascades, run = lean._cascades, lean.uniform_pass.run
    lean._cascades = lambda *a: kept.append(cascades(*a)) or kept[-1]
    lean.uniform_pass.run = lambda *a: prefixed.append(bool(a[5])) or run(*a)
    runs = []
    for sharing in (shared, []):
        caches = _fed(lean, prompts)
        rows = [Row(tokens=[9 + b] * (4 if wide and b == len(caches) - 1 else 1), kv=kv,
                    start=s, keep=1) for b, (kv, s) in enumerate(caches)]
        kept.clear()
        prefixed.clear()
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            runs.append(lean.forward_ragged(rows, sharing))
        ops = {e.key: e.count for e in prof.key_averages()}
        grouped = cascade and bool(sharing)
        assert bool(kept[0]) == grouped
        layer_loop = grouped and wide  # a group beside a row outside it
        assert ops.get("specmesh_cpu::prefix_attention", 0) == (
            len(lean.layers) if layer_loop else 0)
        assert (ops.get("specmesh_cpu::dense_layers", 0) > 0) == (not layer_loop)
        assert prefixed == ([] if layer_loop else [grouped] if grouped else
                            [False] * (1 + wide))
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("verify_at", [0, 4, 8], ids=["first", "between", "last"])
def test_one_token_rows_and_a_verify_row_run_as_one_operator_each(verify_at):
    """A segment's one-token rows and a verify row of four tokens are two plans
    (services/ragged_attention.py ``plan``), put in the order of their tokens: where each
    plan's tokens are consecutive (the verify row first or last) both parts run their
    layers as one operator (``dense_layers``); with the verify row between one-token rows
    the pass runs layer by layer. Either way each row's logits are those of the row alone."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    if not lean.kernel_layer:
        pytest.skip("the layers' fused operators need the project's CPU kernels")
    g = torch.Generator().manual_seed(verify_at)
    prompts = [torch.randint(0, 8000, (40 + 3 * b,), generator=g).tolist() for b in range(9)]
    outs = []
    for together in (True, False):
        caches = _fed(lean, prompts)
        rows = [Row(tokens=[7 + b] * (4 if b == verify_at else 1), kv=kv, start=s,
                    keep=4 if b == verify_at else 1) for b, (kv, s) in enumerate(caches)]
        if together:
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                outs.append(lean.forward_ragged(rows, []))
            ops = {e.key: e.count for e in prof.key_averages()}
            assert (ops.get("specmesh_cpu::dense_layers", 0) > 0) == (verify_at in (0, 8))
        else:
            outs.append([forward_rows(lean, [row], "cpu", _no_batch_cache)[0] for row in rows])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_a_cpu_pool_keeps_the_sessions_of_a_busy_replica_in_one_segment():
    """On a CPU a pool segment holds 64 slots (16 on a GPU, where its memory is taken at
    once): sessions that end give their slots back a little after the next ones began, so
    16 streams held up to 27 slots at times, and with segments of 16 half of a verifier's
    passes straddled two of them (a call per segment, the layer loop). 16 sessions spread
    over slots 0-26 among sessions at rest run as one ``dense_layers`` operator, each row's
    logits those of the row alone."""
    assert pool_segment(torch.device("cpu"), 256) == 64
    assert pool_segment(torch.device("cuda"), 256) == 16
    assert pool_segment(torch.device("cpu"), 10) == 10  # (a bound below a segment)
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    if not lean.kernel_layer:
        pytest.skip("the layers' fused operators need the project's CPU kernels")
    assert lean.pool.segment == 64
    g = torch.Generator().manual_seed(27)
    prompts = [torch.randint(0, 8000, (20 + b,), generator=g).tolist() for b in range(27)]
    live = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 23, 24, 26]
    outs = []
    for together in (True, False):
        caches = _fed(lean, prompts)
        rows = [Row(tokens=[5 + b], kv=caches[i][0], start=caches[i][1], keep=1)
                for b, i in enumerate(live)]
        assert [row.kv.slot for row in rows] == [caches[0][0].slot + i for i in live]
        if together:
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                outs.append(lean.forward_ragged(rows, []))
            ops = {e.key: e.count for e in prof.key_averages()}
            assert ops.get("specmesh_cpu::dense_layers", 0) == 1
        else:
            outs.append([forward_rows(lean, [row], "cpu", _no_batch_cache)[0] for row in rows])
        del caches, rows
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("threads, gap", [(1, False), (2, False), (2, True)],
                         ids=["one-thread", "two-threads", "two-threads-and-a-gap"])
def test_a_pass_of_one_group_sharing_a_prefix_runs_as_one_operator_with_the_same_floats(
        threads, gap):
    """A pass whose rows all share one prefix, in one pool segment (16 streams behind one
    system prompt), runs its layers in ``dense_layers`` with the prefix attended in it
    (``prefix_attention`` per layer from C++): over three decode steps, the very logits and
    cache contents of the layer loop that calls ``prefix_attention`` from Python, on one
    thread and on two (groups of rows, each attending the prefix for its own queries), and
    with a session at rest holding a slot between the rows."""
    model = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32)
    lean = LeanLlama(model, pack=True, half=True)
    if not (lean.kernel_prefix and lean.kernel_layer):
        pytest.skip("prefix_attention needs AVX-512 or AVX2; this CPU has neither")
    own = lean._uniform
    chain = list(range(700, 725))  # the prefix's 25 block hashes: 400 positions

    def sessions():
        g = torch.Generator().manual_seed(11)
        prefix = torch.randint(0, 8000, (400,), generator=g).tolist()
        fed = _fed(lean, [prefix + torch.randint(0, 8000, (5 + 3 * b,), generator=g).tolist()
                          for b in range(13)])
        return [c for i, c in enumerate(fed) if not (gap and i == 4)]

    one, layered = sessions(), sessions()
    count = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for step in range(3):
            got = []
            for caches, one_op in ((one, True), (layered, False)):
                lean._uniform = own if one_op else lambda tokens: False
                rows = [Row(tokens=[3 + step + b], kv=kv, start=s, keep=1, chain=chain,
                            chain_tokens=400) for b, (kv, s) in enumerate(caches)]
                assert shared_prefixes(rows) == [(list(range(len(rows))), 400)]
                with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                    got.append(lean.forward_ragged(rows, shared_prefixes(rows)))
                ops = {e.key: e.count for e in prof.key_averages()}
                assert ops.get("specmesh_cpu::dense_layers", 0) == (1 if one_op else 0)
                assert ops.get("specmesh_cpu::prefix_attention", 0) == (
                    0 if one_op else len(lean.layers))
                for c in caches:
                    c[1] += 1
            for a, b in zip(*got, strict=True):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(count)
    _same_caches(one, layered)
