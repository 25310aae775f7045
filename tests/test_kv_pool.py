"""KV caches as slots of one pool (services/kv_slab.py KVPool) and the pass that attends over
many of them with one call per layer (services/ragged_attention.py).

Real models (the tiny target built by the fixtures, the committed demo target with grouped
queries), each row checked against transformers' own forward on its own DynamicCache.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from services import cpu_kernels, ragged_attention
from services.batching import Row, forward_one, forward_rows
from services.kv_slab import AHEAD, POOL_MAX_SLOTS, KVPool, SlabCache, pool_slots
from services.lean_llama import POOL_ROW_MAX, LeanLlama

TOL = dict(atol=2e-5, rtol=1e-5)


def _pool(slot_len: int = 64, segment: int = 4, max_slots: int = 6) -> KVPool:
    return KVPool(num_layers=2, kv_heads=1, head_dim=2, slot_len=slot_len, segment=segment,
                  max_slots=max_slots)


def test_a_pool_takes_half_an_accelerators_free_memory_at_most_and_any_cpus_address_space():
    """On a CPU a slot costs the pages its session wrote, so the pool has every slot; on a
    GPU a segment's memory is taken at once, so the slots fit in half the memory free after
    the weights (a GPU cannot run here: the sizing is a pure function of the free bytes)."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert pool_slots(cpu, 10**9, None) == POOL_MAX_SLOTS
    mb = 1 << 20
    assert pool_slots(gpu, 9 * mb, 100 * mb) == 5  # 50 MB hold 5 slots of 9 MB, not 11
    assert pool_slots(gpu, 9 * mb, 17 * mb) == 0  # not one slot: the caches of their own
    assert pool_slots(gpu, mb, 10**6 * mb) == POOL_MAX_SLOTS
    assert pool_slots(gpu, mb, None) == 0  # free memory unknown: no pool


def test_a_bound_lowers_the_slots_and_shrinks_a_segment_no_session_uses():
    """A replica bounds its pool after the model's warm-up pass: a segment larger than the
    bound shrinks to it (a GPU replica with CUDA graphs holds one segment of all its slots,
    whose memory is taken at once), keeping its scratch row last; once a slot is in use
    the segment stays as it is and only the bound moves."""
    pool = KVPool(2, 1, 4, slot_len=8, segment=256, max_slots=256, scratch=True)
    warm = pool.acquire()
    pool.release(warm)  # the warm-up's cache is gone
    pool.bound(20)
    assert (pool.max_slots, pool.segment, pool.scratch, pool.segments) == (20, 20, 20, [])
    assert pool.acquire() == 0 and pool.segments[0][0][0].shape[0] == 21
    pool.bound(10)
    assert (pool.max_slots, pool.segment) == (10, 20)  # a slot is in use: only the bound


def test_slots_go_lowest_first_come_back_when_the_cache_is_garbage_and_are_bounded():
    pool = _pool()
    caches = [SlabCache(2, pool=pool) for _ in range(6)]
    assert [c.slot for c in caches] == list(range(6)) and len(pool.segments) == 2
    extra = SlabCache(2, pool=pool)  # all 6 in use: a buffer of its own
    assert extra.slot is None and extra.pool is None and pool.in_use == 6
    del caches[4], caches[1]
    gc.collect()
    assert pool.in_use == 4
    assert SlabCache(2, pool=pool).slot == 1  # lowest free first (garbage again at once)
    again = SlabCache(2, pool=pool), SlabCache(2, pool=pool)
    assert sorted(c.slot for c in again) == [1, 4] and len(pool.segments) == 2



def test_a_cache_collected_while_the_pool_allocates_gives_its_slot_back_without_deadlock(
        monkeypatch):
    """The cyclic garbage collector runs at whatever allocation starts a collection, on that
    thread: a pooled cache in a reference cycle (a failed call's traceback holding the frame
    that held it) can be finalized inside acquire() while it allocates a segment under its
    lock. The finalizer gives the slot back, and must not wait for that lock: it did, which
    would hang that thread (a replica's model thread) for good. Here the allocation collects
    on purpose, with automatic collections off so that nothing frees the cache earlier."""
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=4, slot_len=8, segment=1, max_slots=4)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        cycle = {"cache": SlabCache(1, pool=pool)}
        cycle["self"] = cycle
        del cycle  # slot 0 is held by garbage only the cyclic collector frees
        empty = torch.empty

        def collecting_empty(*args, **kwargs):
            gc.collect()
            return empty(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", collecting_empty)
        got = []
        thread = threading.Thread(target=lambda: got.append(pool.acquire()), daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "acquire() deadlocked in a collected cache's finalizer"
    finally:
        if was_enabled:
            gc.enable()
    assert got == [1]  # a new segment's slot: slot 0 came back during the allocation
    assert pool.in_use == 1
    assert pool.acquire() == 0  # and is handed out next


def test_a_pooled_cache_writes_its_slot_in_place_and_leaves_it_when_outgrown():
    pool = _pool(slot_len=4)
    cache = SlabCache(2, chunk=4, pool=pool)
    step = [torch.full((1, 1, 1, 2), float(i)) for i in range(6)]  # [B, KV, 1, D]
    for i in range(3):
        cache.update(step[i], step[i] * 10, 0)
    buffer_keys, _ = pool.buffers(cache.slot, 0)
    assert buffer_keys[0, 0, :3, 0].tolist() == [0.0, 1.0, 2.0]  # the slot itself
    cache.crop(-1)
    keys, values = cache.update(step[5], step[5] * 10, 0)
    assert keys[0, 0, :, 0].tolist() == [0.0, 1.0, 5.0] and values[0, 0, -1, 0] == 50.0
    for i in (3, 4):  # 4 positions fill the slot, the 5th moves layer 0 to its own buffer
        keys, _ = cache.update(step[i], step[i], 0)
    assert cache.slot is None and not cache.layers[0].pooled and cache.layers[1].pooled
    assert keys[0, 0, :, 0].tolist() == [0.0, 1.0, 5.0, 3.0, 4.0]


@pytest.fixture(scope="module", params=["tiny-target", "demo-target"])
def models(request, tiny_pair):
    path = {"tiny-target": tiny_pair[0], "demo-target": "models/demo-target"}[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    twin = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, LeanLlama(twin, pack=True)


def _ids(model, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, model.config.vocab_size, (n,), generator=g).tolist()


def test_positions_past_a_slots_live_ones_are_zeroed_once_and_ahead():
    """A pass pads its rows to the longest, so a shorter row's slot must hold numbers up to
    that length (masked NaN still poisons a softmax). Zeroing only the one position a
    growing pass added cost two operators per layer and row in every pass; the pool zeroes
    AHEAD positions at once, never a position again, never the positions the pass writes
    itself (``live`` counts them), and never past the slot."""
    pool = _pool(slot_len=200, segment=1, max_slots=1)
    slot = pool.acquire()
    for keys, values in pool.segments[0]:
        keys.fill_(float("nan"))
        values.fill_(float("nan"))

    def numbers(layer: int = 1) -> list[bool]:  # per position: holds a number
        keys, values = pool.buffers(slot, layer)
        return [not (keys[0, :, p].isnan().any() or values[0, :, p].isnan().any())
                for p in range(pool.slot_len)]

    pool.ready(slot, live=5, length=20)  # positions 0-4 are the cache's own (NaN here)
    assert numbers() == [False] * 5 + [True] * AHEAD + [False] * (200 - 5 - AHEAD)
    for keys, values in pool.segments[0]:
        keys[:, :, 30] = values[:, :, 30] = 7.0  # as a cache's write would
    pool.ready(slot, live=21, length=40)  # within what was zeroed: nothing is touched
    assert all(bool((keys[0, :, 30] == 7.0).all()) for keys, _ in pool.segments[0])
    pool.ready(slot, live=150, length=160)  # from the live positions on, up to the slot's end
    assert numbers()[150:] == [True] * 50 and numbers()[5 + AHEAD:150] == [False] * (145 - AHEAD)
    assert numbers(0) == numbers(1)


@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa", "cpu-kernel"])
def test_rows_in_slots_attend_per_segment_and_match_each_row_alone(models, monkeypatch, kernel):
    """Rows in two pool segments, with free slots between them, of 1-4 new tokens and pasts
    of 0-60 positions, beside a row whose cache has no slot, a prompt row (more than
    POOL_ROW_MAX tokens) and a row that outgrows its slot in this pass: each row's logits
    equal that row run alone through HF, its cache holds HF's keys, and the pooled rows
    were attended with one call per segment and layer, the rows of one new token in one
    and those of several in another. A wrong slot, position, padding or
    mask shows here, and so does a masked position never written (NaN reaches a softmax
    through a mask). With PyTorch's SDPA and with the project's CPU kernel."""
    hf, lean = models
    monkeypatch.setattr(lean, "kernel_attention", kernel and cpu_kernels.kernel() == "")
    assert lean.kernel_attention == kernel
    c = hf.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    monkeypatch.setattr(lean, "pool", KVPool(c.num_hidden_layers, kv_heads, head_dim,
                                             slot_len=64, segment=4, max_slots=8))
    plan = [(23, 3), (5, 1), (0, 4), (60, 2), (40, 1), (33, POOL_ROW_MAX + 4), (61, 4),
            (12, 1)]  # (past, new): row 6 outgrows its 64-position slot
    spare = [lean.new_cache() for _ in range(8)]  # slots 0-7, two segments
    for segment in lean.pool.segments:  # memory never written may hold anything, even NaN
        for keys, values in segment:
            keys.fill_(float("nan"))
            values.fill_(float("nan"))
    held = {0: 2, 1: 3, 2: 5, 3: 7, 4: 1, 5: 6, 6: 4}  # row -> slot; 0 stays free
    hf_rows, lean_rows = [], []
    for b, (past, new) in enumerate(plan):
        kv_hf = DynamicCache(config=hf.config)
        kv_lean = spare[held[b]] if b in held else SlabCache(c.num_hidden_layers)
        prefix, step = _ids(hf, past, 10 + b), _ids(hf, new, 20 + b)
        if past:
            forward_one(hf, Row(tokens=prefix, kv=kv_hf, start=0, keep=1), "cpu")
            forward_one(lean, Row(tokens=prefix, kv=kv_lean, start=0, keep=1), "cpu")
        hf_rows.append(Row(tokens=step, kv=kv_hf, start=past, keep=new))
        lean_rows.append(Row(tokens=step, kv=kv_lean, start=past, keep=new))
    assert lean_rows[7].kv.slot is None and lean_rows[3].kv.slot == 7
    calls = []
    attend = ragged_attention.attend
    monkeypatch.setattr(ragged_attention, "attend",
                        lambda p, *a: calls.append((p.segment, p.rows)) or attend(p, *a))
    refs = [forward_one(hf, row, "cpu") for row in hf_rows]
    got = forward_rows(lean, lean_rows, "cpu", lambda: None)
    # in the order of their first tokens: slot 2, then slots 3, 1 (one token each), then 5,
    # 7; rows 5 (prompt), 6, 7 attend alone
    per_layer = [(0, [0]), (0, [1, 4]), (1, [2, 3])]
    assert calls == per_layer * c.num_hidden_layers
    assert lean_rows[6].kv.slot is None  # outgrown: now a buffer of its own
    for (past, new), ref, out, row, hf_row in zip(plan, refs, got, lean_rows, hf_rows,
                                                  strict=True):
        torch.testing.assert_close(out, ref, **TOL)
        assert row.kv.get_seq_length() == past + new
        for ref_layer, layer in zip(hf_row.kv.layers, row.kv.layers, strict=True):
            torch.testing.assert_close(layer.keys, ref_layer.keys, **TOL)
            torch.testing.assert_close(layer.values, ref_layer.values, **TOL)


@pytest.mark.parametrize("budget_mb, max_sessions", [(0, 256), (0, 20), (1, 256)])
def test_a_replica_holds_its_pool_within_max_sessions_and_the_kv_budget(tiny_pair, budget_mb,
                                                                        max_sessions):
    """A written slot's pages stay with the process, so a replica's pool has no more slots
    than it may hold sessions, and with --kv-budget-mb no more than the budget holds full
    slots of (the tiny target: 1 MB is a few slots of its full context)."""
    from services.config import ModelServiceConfig, ServerConfig
    from services.model_service import build_parts
    from services.models import kv_bytes_per_token

    runner, _ = build_parts(ModelServiceConfig(
        server=ServerConfig(port=0), model=tiny_pair[0], kv_budget_mb=budget_mb,
        max_sessions=max_sessions))
    pool = runner.model.pool
    assert pool is not None and pool.slot_len == runner.meta.max_context
    slot_bytes = pool.slot_len * kv_bytes_per_token(runner.model)
    if budget_mb:
        assert 1 <= pool.max_slots <= budget_mb * 1024 * 1024 // slot_bytes < max_sessions
    else:
        assert pool.max_slots == min(256, max_sessions)
    runner.close()


@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa", "cpu-kernel"])
def test_a_row_far_longer_than_the_others_attends_alone(models, monkeypatch, kernel):
    """The pooled call pads every row to the longest: one row of 400 cached positions beside
    three of about 10 would make each of them read 400, so it attends alone (and still
    matches HF); rows of similar lengths stay together. The CPU kernel reads each row's own
    keys only, pads nothing, and attends all of them in one call."""
    hf, lean = models
    monkeypatch.setattr(lean, "kernel_attention", kernel and cpu_kernels.kernel() == "")
    assert lean.kernel_attention == kernel
    c = hf.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    monkeypatch.setattr(lean, "pool", KVPool(c.num_hidden_layers, kv_heads, head_dim,
                                             slot_len=512))
    calls = []
    attend = ragged_attention.attend
    monkeypatch.setattr(ragged_attention, "attend",
                        lambda p, *a: calls.append(p.rows) or attend(p, *a))
    for plan, together in (([8, 400, 12, 10], [0, 2, 3]), ([300, 340, 320], [0, 1, 2])):
        calls.clear()
        hf_rows, lean_rows = [], []
        for b, past in enumerate(plan):
            kv_hf, kv_lean = DynamicCache(config=c), lean.new_cache()
            prefix, step = _ids(hf, past, 30 + b), _ids(hf, 1, 40 + b)
            forward_one(hf, Row(tokens=prefix, kv=kv_hf, start=0, keep=1), "cpu")
            forward_one(lean, Row(tokens=prefix, kv=kv_lean, start=0, keep=1), "cpu")
            hf_rows.append(Row(tokens=step, kv=kv_hf, start=past, keep=1))
            lean_rows.append(Row(tokens=step, kv=kv_lean, start=past, keep=1))
        refs = [forward_one(hf, row, "cpu") for row in hf_rows]
        got = forward_rows(lean, lean_rows, "cpu", lambda: None)
        assert calls == [list(range(len(plan))) if kernel else together] * c.num_hidden_layers
        for ref, out in zip(refs, got, strict=True):
            torch.testing.assert_close(out, ref, **TOL)


def test_a_replica_exports_its_pool_slots_in_use_and_at_most():
    """The metrics an operator watches for the pool running out (then sessions attend one by
    one): slots held now, slots at most."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.metrics import ModelServiceMetrics

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    pool = _pool(max_slots=5)
    ModelServiceMetrics(meter, "verifier", queue_depth=lambda: 0, sessions=lambda: 0,
                        kv_bytes=lambda: 0, kv_capacity_bytes=lambda: 0, pool=pool)
    held = [SlabCache(2, pool=pool) for _ in range(3)]

    def read() -> dict[str, float]:
        return {m.name: m.data.data_points[0].value
                for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics if "kv_pool" in m.name}

    assert read() == {"specmesh.verifier.kv_pool.slots": 3,
                      "specmesh.verifier.kv_pool.capacity": 5}
    del held[0]
    gc.collect()
    assert read()["specmesh.verifier.kv_pool.slots"] == 2


def test_a_new_session_takes_the_slot_of_the_least_recently_used_resting_one():
    """With every slot held, a new session's cache would attend alone: the least recently
    used session at rest moves its cache out of its slot (same keys and values, now in a
    buffer of its own) and the new session takes the slot. Sessions in use keep theirs."""
    from services.hashing import token_hash
    from services.kv_cache import SessionCaches

    pool = _pool(max_slots=2)
    caches = SessionCaches(max_sessions=10, new_kv=lambda: SlabCache(2, pool=pool))
    step = torch.arange(6, dtype=torch.float32).view(1, 1, 3, 2)  # [B, KV, 3 positions, D]

    def fill(sid: str, scale: float) -> SlabCache:
        with caches.checkout(sid, 0, token_hash([])) as entry:
            for layer in range(2):
                entry.kv.update(step * scale, -step * scale, layer)
            entry.tokens.extend([1, 2, 3])
            return entry.kv

    a, b = fill("a", 1.0), fill("b", 2.0)
    assert (a.slot, b.slot) == (0, 1) and pool.in_use == 2
    c = fill("c", 3.0)  # "a" rests longest: its slot goes to "c"
    assert c.slot == 0 and a.slot is None and b.slot == 1 and pool.in_use == 2
    for layer in a.layers:  # "a" kept its positions
        assert torch.equal(layer.keys, step) and torch.equal(layer.values, -step)
    with caches.checkout("b", 3, token_hash([1, 2, 3])) as busy:  # "b" busy: keeps its slot
        with caches.checkout("d", 0, token_hash([])) as d:  # "c" is the one at rest in a slot
            assert busy.kv.slot == 1 and c.slot is None and d.kv.slot == 0
            with caches.checkout("e", 0, token_hash([])) as e:  # none at rest holds one
                assert e.kv.slot is None and e.kv.missed_slot
