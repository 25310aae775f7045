"""Decode and verify passes of fixed shape (services/cuda_graphs.py), the passes a GPU
replica replays as CUDA graphs.

On this CPU the same fixed-shape pass runs eagerly (``capture=False``): every index, mask,
padded row and scratch write is the code a graph records, so these tests check it against
transformers' forward of each row alone. The capture and replay themselves need a CUDA
device; ``test_captured_graphs_replay_the_eager_pass_on_a_gpu`` runs them where one exists
(the device machine) and is skipped elsewhere: it is not counted as coverage here.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from services import cuda_graphs
from services.batching import Row, forward_one, forward_rows
from services.cuda_graphs import KEY_BUCKET, DecodeGraphs
from services.kv_slab import KVPool, SlabCache
from services.lean_llama import POOL_ROW_MAX, LeanLlama, lean_forward
from services.rotary import static_rope

TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=["tiny-target", "demo-target"])
def models(request, tiny_pair):
    """(HF model, lean twin with fixed-shape passes run eagerly)."""
    path = {"tiny-target": tiny_pair[0], "demo-target": "models/demo-target"}[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    twin = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lean = LeanLlama(twin, pack=False, graphs=True)
    assert lean.graphs is not None and not lean.graphs.capture  # a CPU: no capture
    assert lean.pool.segment == lean.pool.max_slots  # one segment: any rows make one graph
    return hf, lean


def _ids(model, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist()


def _small_pool(lean, monkeypatch, slot_len: int = 300, segment: int = 8) -> KVPool:
    """A pool of two segments whose never-written memory is NaN (as it may be)."""
    c = lean.config
    pool = KVPool(c.num_hidden_layers, lean._kv_heads, lean._head_dim, slot_len=slot_len,
                  segment=segment, max_slots=2 * segment, scratch=True)
    monkeypatch.setattr(lean, "pool", pool)
    return pool


def _nan(pool: KVPool) -> None:
    for segment in pool.segments:
        for keys, values in segment:
            keys.fill_(float("nan"))
            values.fill_(float("nan"))


def _sessions(hf, lean, plan, slots, seed: int = 0):
    """Per (past, new, keep) of ``plan``: an HF row on a DynamicCache and a lean row whose
    cache is pool slot ``slots[b]``, both holding the same ``past`` tokens."""
    caches = {s: lean.new_cache() for s in range(max(slots) + 1)}  # slots 0.. in order
    hf_rows, lean_rows = [], []
    for b, (past, new, keep) in enumerate(plan):
        kv_hf, kv_lean = DynamicCache(config=hf.config), caches[slots[b]]
        assert kv_lean.slot == slots[b]
        prefix, step = _ids(hf, past, seed + 10 + b), _ids(hf, new, seed + 20 + b)
        if past:
            forward_one(hf, Row(tokens=prefix, kv=kv_hf, start=0, keep=1), "cpu")
            forward_one(lean, Row(tokens=prefix, kv=kv_lean, start=0, keep=1), "cpu")
        hf_rows.append(Row(tokens=step, kv=kv_hf, start=past, keep=keep))
        lean_rows.append(Row(tokens=step, kv=kv_lean, start=past, keep=keep))
    return hf_rows, lean_rows, caches


def _same(hf, hf_rows, lean_rows, got) -> None:
    """Each lean row's logits and cache equal its HF twin's run alone."""
    refs = [forward_one(hf, row, "cpu") for row in hf_rows]
    for ref, out, row, hf_row in zip(refs, got, lean_rows, hf_rows, strict=True):
        torch.testing.assert_close(out, ref, **TOL)
        assert row.kv.get_seq_length() == hf_row.start + len(hf_row.tokens)
        for ref_layer, layer in zip(hf_row.kv.layers, row.kv.layers, strict=True):
            torch.testing.assert_close(layer.keys, ref_layer.keys, **TOL)
            torch.testing.assert_close(layer.values, ref_layer.values, **TOL)


def test_fixed_shape_passes_match_each_row_alone_through_hf(models, monkeypatch):
    """Three rows of 1-4 new tokens (verify rows keep all of theirs, a decode row one) in
    slots out of order, padded to B = 4 with a fourth row, M = 4 and L = 256 keys, over
    pasts of 0-252 positions on memory that was NaN: each row's logits equal that row run
    alone through HF, and its cache holds HF's keys. Then the first row drops two rejected
    drafts and verifies three more while the others decode one, which crosses into the next
    key bucket (L = 300, the slot's end). A wrong index, position, mask, padding or key
    bucket shows here, and so does a masked key never written (NaN reaches a softmax
    through a mask)."""
    hf, lean = models
    pool = _small_pool(lean, monkeypatch)
    lean.new_cache()  # (the pool's first segment exists before it is filled with NaN)
    _nan(pool)
    plan = [(252, 4, 4), (0, 3, 3), (131, 1, 1)]
    hf_rows, lean_rows, _ = _sessions(hf, lean, plan, slots=[5, 2, 6])
    before = lean.graphs.replays
    assert lean.graphs.shape(lean_rows) == (0, 4, 4, KEY_BUCKET)
    got = forward_rows(lean, lean_rows, "cpu", lambda: None)
    assert lean.graphs.replays == before + 1  # this pass ran the fixed shape
    _same(hf, hf_rows, lean_rows, got)

    hf_rows[0].kv.crop(-2)
    lean_rows[0].kv.crop(-2)
    for b, (hf_row, row) in enumerate(zip(hf_rows, lean_rows, strict=True)):
        width = 3 if b == 0 else 1
        hf_row.tokens = row.tokens = _ids(hf, width, 50 + b)
        hf_row.start = row.start = row.kv.get_seq_length()
        hf_row.keep = row.keep = width
    assert lean.graphs.shape(lean_rows) == (0, 4, 3, 300)  # 257 keys: the slot's 300
    got = forward_rows(lean, lean_rows, "cpu", lambda: None)
    assert lean.graphs.replays == before + 2
    _same(hf, hf_rows, lean_rows, got)


def test_a_row_far_longer_than_the_others_stays_in_the_fixed_shape_pass(models, monkeypatch):
    """One long document among short chats: the eager pass would let it attend alone
    (every row would otherwise read its length), but a graph's rows all gather L keys
    anyway, and a second pass would cost a GPU more launches than the gather. So the pass
    keeps its fixed shape (B = 4, L = 300), and each row still matches HF. (On a GPU this
    row, 36 tokens longer than the next among 16 rows, sent every pass of the bench's
    16-stream cell to the eager path.)"""
    hf, lean = models
    _small_pool(lean, monkeypatch)
    plan = [(290, 1, 1), (3, 1, 1), (4, 2, 2)]
    hf_rows, lean_rows, _ = _sessions(hf, lean, plan, slots=[0, 1, 2], seed=5)
    assert lean.graphs.shape(lean_rows) == (0, 4, 2, 300)
    before = lean.graphs.replays
    got = forward_rows(lean, lean_rows, "cpu", lambda: None)
    assert lean.graphs.replays == before + 1
    _same(hf, hf_rows, lean_rows, got)


def test_padding_writes_the_scratch_row_and_no_sessions_slot(models, monkeypatch):
    """The padded tokens (a decode row's three past M = 4, and the row added to reach
    B = 2) write their keys somewhere: into the segment's scratch row, never into another
    session's slot (slot 3 rests beside the pass) or a pass row's own positions other than
    its new tokens' (the pool only zeroes those past its length, ``KVPool.ready``)."""
    hf, lean = models
    pool = _small_pool(lean, monkeypatch)
    plan = [(40, 4, 4), (20, 1, 1), (30, 2, 2)]  # row 2 rests: it is not in the pass
    _, lean_rows, _ = _sessions(hf, lean, plan, slots=[0, 1, 3])
    snapshot = [(k.clone(), v.clone()) for k, v in pool.segments[0]]
    got = forward_rows(lean, lean_rows[:2], "cpu", lambda: None)
    assert len(got) == 2 and lean.graphs.replays >= 1
    new = {0: range(40, 44), 1: range(20, 21)}  # slot: the positions the pass writes
    for (keys, values), (k0, v0) in zip(pool.segments[0], snapshot, strict=True):
        for tensor, old in ((keys, k0), (values, v0)):
            moved = (tensor != old) & ~(tensor.isnan() & old.isnan())  # [S + 1, KV, len, D]
            where = {tuple(ix) for ix in moved.any(dim=1).any(dim=-1).nonzero().tolist()}
            assert {s for s, _ in where} <= {0, 1, pool.scratch}
            assert any(s == pool.scratch for s, _ in where)  # the padding went there
            for slot, positions in new.items():
                mine = sorted(p for s, p in where if s == slot)
                assert mine[:len(positions)] == list(positions)
                assert all((tensor[slot, :, p] == 0).all() for p in mine[len(positions):])


def test_passes_a_graph_cannot_hold_run_eagerly_and_give_the_same_logits(models, monkeypatch):
    """Rows in two segments, a prompt row (more than POOL_ROW_MAX tokens) and a row without
    a slot: no fixed shape, the ragged pass runs, and every row still matches HF."""
    hf, lean = models
    cases = {
        "two segments": ([(10, 1, 1), (12, 2, 2)], [1, 5]),
        "a prompt": ([(0, POOL_ROW_MAX + 1, 1), (12, 1, 1)], [0, 1]),
    }
    for name, (plan, slots) in cases.items():
        _small_pool(lean, monkeypatch, segment=4)
        hf_rows, lean_rows, _ = _sessions(hf, lean, plan, slots, seed=len(name))
        assert lean.graphs.shape(lean_rows) is None, name
        before = lean.graphs.replays
        got = forward_rows(lean, lean_rows, "cpu", lambda: None)
        assert lean.graphs.replays == before, name
        _same(hf, hf_rows, lean_rows, got)
    own = Row(tokens=[3], kv=SlabCache(lean.config.num_hidden_layers), start=0, keep=1)
    assert lean.graphs.shape([own]) is None  # a cache of its own, not a pool slot


def test_a_capture_cuda_refuses_turns_graphs_off_and_the_pass_runs_eagerly(models,
                                                                           monkeypatch):
    """A capture that raises (CUDA refused an operator in it) costs no request: the pass
    runs eagerly, with the same logits, and so does every later pass of the replica."""
    hf, lean = models
    _small_pool(lean, monkeypatch)
    graphs = lean.graphs
    monkeypatch.setattr(graphs, "capture", True)  # as on a GPU, with the capture failing
    monkeypatch.setattr(graphs, "_capture", lambda g: (_ for _ in ()).throw(
        RuntimeError("operation not permitted when stream is capturing")))
    monkeypatch.setattr(graphs, "enabled", True)
    hf_rows, lean_rows, _ = _sessions(hf, lean, [(12, 2, 2), (7, 1, 1)], slots=[0, 1])
    before = graphs.replays
    got = forward_rows(lean, lean_rows, "cpu", lambda: None)
    assert not graphs.enabled and graphs.replays == before and graphs.shape(lean_rows) is None
    _same(hf, hf_rows, lean_rows, got)


def test_shapes_round_rows_up_to_powers_of_two_and_keys_up_to_buckets(models, monkeypatch):
    """B: the rows' count rounded up to a power of two; M: the most new tokens of a row; L:
    the most keys rounded up to KEY_BUCKET, at most the slot's length."""
    hf, lean = models
    pool = _small_pool(lean, monkeypatch, slot_len=600, segment=8)
    caches = [lean.new_cache() for _ in range(8)]

    def rows(*spec):  # (slot, start, new tokens)
        return [Row(tokens=[1] * m, kv=caches[s], start=start, keep=1) for s, start, m in spec]

    assert lean.graphs.shape(rows((3, 0, 1))) == (0, 1, 1, KEY_BUCKET)
    assert lean.graphs.shape(rows((0, 255, 1), (1, 200, 5), (2, 9, 2))) == (0, 4, 5, 256)
    assert lean.graphs.shape(rows((0, 256, 1), *((s, 200, 1) for s in range(1, 5)))) \
        == (0, 8, 1, 512)
    assert lean.graphs.shape(rows((0, 590, 8))) == (0, 1, 8, 600)  # the slot's end
    assert lean.graphs.shape(rows((0, 595, 8))) is None  # past the slot
    assert pool.scratch == 8 and pool.segments[0][0][0].shape[0] == 9


def test_graphs_are_made_for_cuda_devices_and_static_rotary_embeddings_only(tiny_pair):
    """``lean_forward`` "auto" records passes as graphs only on a CUDA device (on a CPU its
    pool has no scratch row and ``graphs`` is None), and never for a rotary embedding that
    recomputes its frequencies from the positions it is given (a read back to the host)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    lean, why_not = lean_forward(model, "auto")
    assert not why_not and lean.graphs is None and lean.pool.scratch is None
    assert static_rope(model)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert not static_rope(LlamaForCausalLM(config))
    with pytest.raises(ValueError, match="scratch row"):
        DecodeGraphs(lean, capture=False, row_max=POOL_ROW_MAX)


def test_graphs_logits_are_views_of_one_buffer_that_grows_at_least_twofold(models):
    """The graphs' outputs share one buffer (a capture copies its pass's logits there): a
    pass of fewer rows than the buffer holds gets a view of it, a larger one a new buffer
    of at least twice the rows, so that the buffers held stay about twice the largest."""
    _, lean = models
    graphs, V = lean.graphs, lean.config.vocab_size
    a = graphs._logits(torch.empty(4, V))
    b = graphs._logits(torch.empty(2, V))
    assert a.shape == (4, V) and b.shape == (2, V) and b.data_ptr() == a.data_ptr()
    c = graphs._logits(torch.empty(6, V))  # more than 4: max(6, 2 * 4) rows
    assert c.shape == (6, V) and c.data_ptr() != a.data_ptr() and len(graphs._out) == 8
    assert graphs._logits(torch.empty(8, V)).data_ptr() == c.data_ptr()
    assert len(graphs._logits(torch.empty(20, V)).untyped_storage()) == 20 * V * 4  # 20 > 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_replay_the_eager_pass_on_a_gpu(monkeypatch):
    """On a CUDA device: the demo target with graphs (``auto``) and its twin without
    (``lean``) run the same sessions through decode and verify passes of several shapes;
    every pass's logits agree with the eager pass's and pick the same tokens, a shape seen
    before replays its graph without a new capture, and the least recently used graph goes
    when more than MAX_GRAPHS are kept."""
    dev = torch.device("cuda")
    models = [lean_forward(AutoModelForCausalLM.from_pretrained(
        "models/demo-target", dtype=torch.float32).to(dev).eval(), mode)[0]
        for mode in ("auto", "lean")]
    graphed, eager = models
    assert graphed.graphs is not None and graphed.graphs.capture and eager.graphs is None
    sessions = [[m.new_cache() for _ in range(6)] for m in models]
    prompt = [_ids(graphed, 20 + 7 * s, s) for s in range(6)]
    for m, caches in zip(models, sessions, strict=True):
        for kv, ids in zip(caches, prompt, strict=True):
            forward_one(m, Row(tokens=ids, kv=kv, start=0, keep=1), dev)
    lengths = [len(p) for p in prompt]
    widths = [1, 4, 1, 1, 3, 1, 8, 1]
    for step, width in enumerate(widths):
        members = list(range(6)) if step % 2 == 0 else [4, 1, 3]
        tokens = {s: _ids(graphed, width, 100 * step + s) for s in members}
        outs = []
        for m, caches in zip(models, sessions, strict=True):
            rows = [Row(tokens=tokens[s], kv=caches[s], start=lengths[s], keep=width)
                    for s in members]
            outs.append(forward_rows(m, rows, dev, lambda: None))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        for s in members:
            lengths[s] += width
    assert graphed.graphs.replays == len(widths)
    shapes = {(6, w) if i % 2 == 0 else (3, w) for i, w in enumerate(widths)}
    assert graphed.graphs.captures == len(shapes)  # (6, 1) and (3, 1) came twice
    # every graph's logits are a view of a shared buffer: T = 8, 16, 4, 24, 64 rows made
    # buffers of 8, 16, 32 and 64 rows, not one [T, V] tensor per graph
    held = {g.out.untyped_storage().data_ptr(): len(g.out.untyped_storage())
            for g in graphed.graphs._graphs.values()}
    assert sum(held.values()) <= 2 * len(graphed.graphs._out.untyped_storage())
    assert len(held) < len(shapes)
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 2)
    rows = [Row(tokens=[5], kv=sessions[0][0], start=lengths[0], keep=1)]
    forward_rows(graphed, rows, dev, lambda: None)
    assert len(graphed.graphs._graphs) == 2
