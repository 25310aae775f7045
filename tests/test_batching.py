"""Micro-batching: calls of several sessions in one forward pass give what each gives alone.

References come from the HF model itself: a plain forward over the whole sequence, without
any cache, for logits; HF greedy generate for the verifier's answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid

import grpc
import pytest
import torch

from services.batching import Row, StepJob, forward_rows
from services.errors import Busy, InvalidArgument, ResyncRequired
from services.hashing import token_hash
from services.kv_cache import SessionCaches
from services.messages import CacheDelta, VerifyCall
from services.model_runner import ModelRunner
from services.models import describe
from services.sampling import SamplingParams
from specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.conftest import hf_greedy
from verifier_svc.engine import VerifierEngine


def _new_kv(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def _full_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the model on the whole sequence, no cache."""
    return model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_forward_rows_matches_uncached_forward_of_each_session(target_model):
    """Four sessions with caches of 0, 5, 17 and 30 tokens and 1 to 6 new tokens each, run as
    one padded pass, twice in a row (the second pass reads the caches the first appended)."""
    model, _ = target_model
    vocab = model.config.vocab_size
    past_lens, new_lens = [0, 5, 17, 30], [3, 1, 6, 2]
    seqs = [_tokens(i, p, vocab) for i, p in enumerate(past_lens)]
    kvs = []
    for seq in seqs:  # prefill each session alone
        kv = _new_kv(model)
        if seq:
            with torch.inference_mode():
                model(input_ids=torch.tensor([seq]), past_key_values=kv, use_cache=True)
        kvs.append(kv)
    for step in range(2):
        news = [_tokens(100 + 10 * step + i, n, vocab) for i, n in enumerate(new_lens)]
        rows = [Row(tokens=new, kv=kv, start=len(seq), keep=len(new))
                for seq, new, kv in zip(seqs, news, kvs, strict=True)]
        logits = forward_rows(model, rows, torch.device("cpu"), lambda: _new_kv(model))
        for b, (seq, new) in enumerate(zip(seqs, news, strict=True)):
            want = _full_logits(model, seq + new)[len(seq):]  # [m, V]
            assert logits[b].shape == want.shape
            torch.testing.assert_close(logits[b], want, atol=1e-4, rtol=1e-4)
            assert torch.equal(logits[b].argmax(-1), want.argmax(-1))
            seq.extend(new)
            assert kvs[b].get_seq_length() == len(seq), "the cache holds exactly its tokens"
        new_lens = [1, 2, 1, 4]


class _Steps(StepJob):
    """Feeds one token per step on its own cache, ``steps`` times. ``hold``: its first
    step waits (on the model thread) until the test sets it."""

    def __init__(self, model, steps: int, name: str, hold: threading.Event | None = None):
        self.kv, self.fed, self.left, self.name = _new_kv(model), 0, steps, name
        self.hold, self.started = hold, threading.Event()

    def next_row(self) -> Row:
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(10), "the test never let the first step go on"
            self.hold = None
        return Row(tokens=[5 + self.fed], kv=self.kv, start=self.fed, keep=1)

    def take(self, logits: torch.Tensor) -> None:
        self.fed += 1
        self.left -= 1

    @property
    def done(self) -> bool:
        return self.left == 0

    def result(self) -> str:
        return self.name


def test_a_call_joins_the_running_batch_at_its_next_step(target_model, tiny_pair):
    """Continuous batching: a 1-step call that arrives during a 5-step call's first pass
    runs in that call's second pass and is answered at once, before the long call ends;
    the two need 5 passes together, not 6 one after the other."""
    model, tokenizer = target_model
    runner = ModelRunner(model, describe(tiny_pair[0], model, tokenizer), torch.device("cpu"),
                         max_queue=8, max_batch=4)
    hold = threading.Event()
    long, short = _Steps(model, 5, "long", hold), _Steps(model, 1, "short")

    async def run():
        finished = []

        async def call(job):
            result, _ms, batch = await runner.submit(job)
            finished.append((result, batch))

        first = asyncio.create_task(call(long))
        while not long.started.is_set():  # the long call's first pass is under way
            await asyncio.sleep(0.001)
        second = asyncio.create_task(call(short))
        await asyncio.sleep(0.01)  # the short call is queued while that pass runs
        hold.set()
        await asyncio.gather(first, second)
        return finished

    try:
        finished = asyncio.run(run())
    finally:
        runner.close()
    assert finished == [("short", 2), ("long", 2)]
    assert runner.stats.forward_passes == 5
    assert long.fed == 5 and short.fed == 1


def test_a_job_of_several_steps_is_told_the_compute_of_all_of_them(target_model, tiny_pair):
    """A verifier's plain tokens and a drafter's k drafts are one job of several passes, run
    back to back on the model thread. Its caller is told their compute together (the
    gateway's cost model splits a plain round into passes and overhead with it): once, it
    was told the first pass's alone, and a plain round of 8 passes counted 7 of them as the
    round's overhead."""
    model, tokenizer = target_model
    runner = ModelRunner(model, describe(tiny_pair[0], model, tokenizer), torch.device("cpu"),
                         max_queue=8, max_batch=4)

    async def run():
        return await runner.submit(_Steps(model, 5, "five"))

    try:
        result, ms, batch = asyncio.run(run())
    finally:
        runner.close()
    assert (result, batch, runner.stats.forward_passes) == ("five", 1, 5)
    assert ms == pytest.approx(runner.stats.forward_ms, rel=1e-9)


def _engine(target_model, tiny_pair, max_batch: int) -> VerifierEngine:
    model, tokenizer = target_model
    meta = describe(tiny_pair[0], model, tokenizer)
    runner = ModelRunner(model, meta, torch.device("cpu"), max_queue=64, max_batch=max_batch)
    caches = SessionCaches(64, runner.new_kv)
    return VerifierEngine(runner, caches, max_draft_tokens=16)


def _calls(vocab: int, params: SamplingParams, n: int) -> list[VerifyCall]:
    calls = []
    for i in range(n):
        prefix = _tokens(1000 + i, 4 + 3 * i, vocab)
        drafts = _tokens(2000 + i, 1 + i % 5, vocab)
        k = len(drafts)
        q_ids = tuple((d, (d + 1) % vocab) for d in drafts) if not params.greedy else ()
        q_probs = tuple((0.7, 0.3) for _ in drafts) if not params.greedy else ()
        calls.append(VerifyCall(
            cache=CacheDelta(session_id=f"s{i}", base_len=0, base_hash=token_hash([]),
                             new_tokens=tuple(prefix)),
            draft_ids=tuple(drafts), q_ids=q_ids, q_probs=q_probs, params=params,
            seed=7 * i + 1))
        assert k >= 1
    return calls


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50)],
                         ids=["greedy", "sampled"])
def test_a_batch_answers_what_the_calls_answer_one_by_one(target_model, tiny_pair, params):
    """Greedy: the same accepted counts and tokens. Sampling: the same seeded draws, hence
    the same distribution (the batch changes nothing but float summation order)."""
    vocab = target_model[0].config.vocab_size
    calls = _calls(vocab, params, 12)

    async def one_by_one():
        engine = _engine(target_model, tiny_pair, max_batch=1)
        out = [await engine.verify(c) for c in calls]
        return out, engine.stats

    async def together():
        engine = _engine(target_model, tiny_pair, max_batch=16)
        out = await asyncio.gather(*(engine.verify(c) for c in calls))
        return out, engine.stats

    alone, alone_stats = asyncio.run(one_by_one())
    batched, stats = asyncio.run(together())
    assert alone_stats.batched_calls == 0 and alone_stats.forward_passes == len(calls)
    assert stats.forward_passes < len(calls), "the concurrent calls shared forward passes"
    assert stats.batched_calls >= len(calls) - 1
    assert max(r.batch_size for r in batched) > 1
    for a, b in zip(alone, batched, strict=True):
        assert (a.num_accepted, a.extra_token, a.cached_len) == \
            (b.num_accepted, b.extra_token, b.cached_len)


def test_concurrent_verify_rpcs_share_a_pass_and_match_hf(mesh, target_model):
    """Real verifier process: 6 sessions' Verify calls sent at once. Each draft is the HF
    greedy continuation up to a planted mistake at position j: the verifier must accept
    exactly j and answer HF's token there, batched or not."""
    model, tokenizer = target_model
    vocab = model.config.vocab_size
    prompts = [_tokens(3000 + i, 5 + 4 * i, vocab) for i in range(6)]
    expected = []
    requests = []
    for i, prompt in enumerate(prompts):
        cont = hf_greedy(model, prompt, 6)
        j = i % 5
        drafts = cont[:j] + [(cont[j] + 1) % vocab] + cont[j + 1:5]
        expected.append((j, cont[j]))
        requests.append((prompt, drafts))
    with grpc.insecure_channel(mesh.verifier_addresses[0]) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        before = stub.GetStats(common_pb2.StatsRequest(), timeout=10).batched_calls
        for _attempt in range(5):
            futures = [stub.Verify.future(verifier_pb2.VerifyRequest(
                cache=common_pb2.CacheDelta(session_id=f"batch-{uuid.uuid4().hex}", base_len=0,
                                            base_hash=token_hash([]), new_tokens=prompt),
                draft_token_ids=drafts, warp=common_pb2.WarpParams()), timeout=30)
                for prompt, drafts in requests]
            answers = [f.result() for f in futures]
            for answer, (j, token) in zip(answers, expected, strict=True):
                assert (answer.num_accepted, answer.extra_token_id) == (j, token)
            if max(a.batch_size for a in answers) > 1:
                break
        after = stub.GetStats(common_pb2.StatsRequest(), timeout=10)
    assert max(a.batch_size for a in answers) > 1, "no two calls ever shared a pass"
    assert after.batched_calls > before
    assert after.forward_passes > 0 and after.forward_ms > 0


def test_a_long_prompt_is_fed_in_chunks_and_calls_run_between_them(target_model, tiny_pair):
    """Chunked prefill: a 100-token prompt with chunks of 16 takes 7 passes (6 chunks, then
    the last 4 tokens with the drafts) and answers what one pass answers; a short call that
    arrives meanwhile is answered from a pass between two chunks, before the long one."""
    vocab = target_model[0].config.vocab_size
    long_call = VerifyCall(
        cache=CacheDelta(session_id="long", base_len=0, base_hash=token_hash([]),
                         new_tokens=tuple(_tokens(5000, 100, vocab))),
        draft_ids=tuple(_tokens(5001, 3, vocab)), q_ids=(), q_probs=(), params=SamplingParams(),
        seed=1)
    short_call = _calls(vocab, SamplingParams(), 1)[0]

    async def run(chunk: int):
        engine = _engine(target_model, tiny_pair, max_batch=16)
        engine.prefill_chunk = chunk
        order = []

        async def verify(name, call):
            result = await engine.verify(call)
            order.append(name)
            return result

        long_task = asyncio.create_task(verify("long", long_call))
        await asyncio.sleep(0)  # the long call is submitted first
        short = await verify("short", short_call)
        return await long_task, short, order, engine.stats.forward_passes, engine.stats.fed_tokens

    whole, _, whole_order, whole_passes, whole_fed = asyncio.run(run(0))
    chunked, short, order, passes, fed = asyncio.run(run(16))
    # every prompt token counts as fed, however many passes it took
    assert fed == whole_fed == 100 + len(short_call.cache.new_tokens)
    assert (chunked.num_accepted, chunked.extra_token, chunked.cached_len) == (
        whole.num_accepted, whole.extra_token, whole.cached_len)
    assert chunked.cached_len >= 100
    assert whole_passes == 1 and whole_order == ["long", "short"]  # one pass held both
    assert order == ["short", "long"] and passes == 7
    assert short.batch_size == 2  # it shared a pass with one of the long prompt's chunks


class _Feed(StepJob):
    """One pass over ``n`` new tokens on a fresh cache; keeps the logits."""

    def __init__(self, model, n: int) -> None:
        self.kv, self.n, self.logits = _new_kv(model), n, None

    def next_row(self) -> Row:
        return Row(tokens=list(range(5, 5 + self.n)), kv=self.kv, start=0, keep=1)

    def take(self, logits: torch.Tensor) -> None:
        self.logits = logits

    @property
    def done(self) -> bool:
        return self.logits is not None


def test_a_pass_that_computes_a_prompt_runs_on_the_prefill_threads(target_model):
    """run_step's ``prefill_threads``: a pass with a row of PREFILL_ROW tokens or more (a
    prompt) runs on that many torch threads, a pass of short rows (decode, drafts) on the
    process's own, and the process's number is back after either; a number not above the
    process's own changes nothing. The logits do not depend on it beyond float order."""
    from services.batching import PREFILL_ROW, run_step

    model, _ = target_model
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = [([PREFILL_ROW], 3, 3), ([PREFILL_ROW - 1, 2], 3, 1), ([1, PREFILL_ROW + 4], 2, 2),
                 ([PREFILL_ROW], 1, 1), ([PREFILL_ROW], 0, 1)]
        for sizes, threads, expected in cases:
            seen.clear()
            jobs = [_Feed(model, n) for n in sizes]
            errors, _ = run_step(model, jobs, torch.device("cpu"), lambda: _new_kv(model),
                                 prefill_threads=threads)
            assert errors == [None] * len(jobs)
            assert seen and set(seen) == {expected}, (sizes, threads, seen)
            assert torch.get_num_threads() == 1  # put back
        wide, narrow = _Feed(model, 24), _Feed(model, 24)
        run_step(model, [wide], torch.device("cpu"), lambda: _new_kv(model), prefill_threads=2)
        run_step(model, [narrow], torch.device("cpu"), lambda: _new_kv(model))
        assert torch.allclose(wide.logits, narrow.logits, atol=1e-4)
        assert wide.logits.argmax() == narrow.logits.argmax()
    finally:
        hook.remove()
        torch.set_num_threads(before)


def _row(chain, start: int = 1000, block: int = 16) -> Row:
    return Row(tokens=[1], kv=None, start=start, keep=1, chain=chain,
               chain_tokens=block * len(chain))


def test_rows_are_grouped_by_the_deepest_prefix_block_they_all_share():
    """shared_prefixes, by hand (blocks of 16 tokens, groups of at least 32 shared tokens):
    a block's hash covers every block before it, so rows share up to the deepest block
    whose hash they all have; a row alone, one with another first block, one whose shared
    part is too short, and one with no chain go their own way; P is at most a row's cache."""
    from services.batching import shared_prefixes

    rows = [_row([1, 2, 3, 4, 5]), _row([1, 2, 3, 9]), _row([7, 8, 9]), _row([1, 2, 3, 4, 5, 6]),
            _row([]), _row([3, 4]), _row([3, 5]), _row([7, 8, 9, 4], start=40)]
    assert shared_prefixes(rows, min_tokens=32) == [([0, 1, 3], 48), ([2, 7], 40)]
    # rows 5 and 6 share one block (16 tokens): too short for 32, enough for 16
    assert shared_prefixes(rows, min_tokens=16) == [([0, 1, 3], 48), ([2, 7], 40),
                                                    ([5, 6], 16)]
    assert shared_prefixes([_row([1, 2, 3])], min_tokens=16) == []  # alone
    assert shared_prefixes(rows) == []  # the default: at least 128 tokens


def test_verify_many_runs_the_good_calls_in_one_pass_and_fails_the_others_alone(
        target_model, tiny_pair):
    """A gateway step as the verifier takes it (VerifierEngine.verify_many): the good calls
    answer what they answer one by one, in one pass; a second call for a session in the
    same step (Busy), a stale prefix (resync) and a bad draft token fail alone; every
    session is free again afterwards."""
    vocab = target_model[0].config.vocab_size
    calls = _calls(vocab, SamplingParams(), 4)
    busy = calls[1]  # the same session again, in the same step
    stale = VerifyCall(cache=CacheDelta(session_id="stale", base_len=3, base_hash=1,
                                        new_tokens=(5,)), draft_ids=(), q_ids=(), q_probs=(),
                       params=SamplingParams(), seed=0)
    bad = VerifyCall(cache=CacheDelta(session_id="bad", base_len=0, base_hash=token_hash([]),
                                      new_tokens=(5, 6)), draft_ids=(vocab + 3,), q_ids=(),
                     q_probs=(), params=SamplingParams(), seed=0)

    async def alone():
        engine = _engine(target_model, tiny_pair, max_batch=1)
        return [await engine.verify(c) for c in calls]

    async def step():
        engine = _engine(target_model, tiny_pair, max_batch=16)
        out = await engine.verify_many([calls[0], calls[1], busy, stale, calls[2], bad,
                                        calls[3]])
        passes = engine.stats.forward_passes
        again = await engine.verify(calls[1])  # base_len 0: starts the session over
        return out, passes, again

    want = asyncio.run(alone())
    out, passes, again = asyncio.run(step())
    good = [out[0], out[1], out[4], out[6]]
    assert passes == 1
    for a, b in zip(want, good, strict=True):
        assert (a.num_accepted, a.extra_token, a.cached_len) == \
            (b.num_accepted, b.extra_token, b.cached_len)
        assert b.batch_size == 4
    assert isinstance(out[2], Busy)
    assert isinstance(out[3], ResyncRequired)
    assert isinstance(out[5], InvalidArgument) and "vocabulary" in str(out[5])
    assert (again.num_accepted, again.extra_token) == (want[1].num_accepted, want[1].extra_token)


def test_a_cancelled_step_frees_its_sessions_and_drops_their_caches(target_model, tiny_pair):
    """A VerifyBatch whose caller goes away while its pass runs: its sessions are not left
    busy, and their half-written caches are dropped (the next call resyncs), as a cancelled
    unary call's are."""
    model, _ = target_model
    vocab = model.config.vocab_size
    calls = _calls(vocab, SamplingParams(), 3)

    async def main():
        engine = _engine(target_model, tiny_pair, max_batch=16)
        task = asyncio.create_task(engine.verify_many(calls))
        while engine.queue_depth < len(calls):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while engine.queue_depth:  # the pass that was under way ends
            await asyncio.sleep(0.005)
        h = calls[0].cache
        follow_up = VerifyCall(cache=CacheDelta(session_id=h.session_id, base_len=len(h.new_tokens),
                                                base_hash=token_hash(list(h.new_tokens)),
                                                new_tokens=(5,)),
                               draft_ids=(), q_ids=(), q_probs=(), params=SamplingParams(),
                               seed=0)
        with pytest.raises(ResyncRequired):
            await engine.verify(follow_up)
        return await engine.verify_many(calls)

    out = asyncio.run(main())
    assert all(not isinstance(o, BaseException) for o in out), out


def test_a_full_queue_refuses_the_calls_past_it_and_runs_the_rest(target_model, tiny_pair):
    """submit_many against a queue with room for two: the third and fourth calls of the
    step answer RESOURCE_EXHAUSTED at once, the first two run; the queue counts only the
    calls that run, and is empty once they are done."""
    model, tokenizer = target_model
    meta = describe(tiny_pair[0], model, tokenizer)
    runner = ModelRunner(model, meta, torch.device("cpu"), max_queue=2, max_batch=16)
    engine = VerifierEngine(runner, SessionCaches(64, runner.new_kv), max_draft_tokens=16)
    calls = _calls(model.config.vocab_size, SamplingParams(), 4)

    async def main():
        out = await engine.verify_many(calls)
        return out, engine.queue_depth

    try:
        out, depth = asyncio.run(main())
    finally:
        runner.close()
    assert [type(o).__name__ for o in out] == ["VerifyResult", "VerifyResult", "Overloaded",
                                               "Overloaded"]
    assert out[2].code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert depth == 0


def test_draft_many_runs_its_calls_k_steps_together_and_fails_the_others_alone(
        target_model, tiny_pair):
    """A gateway's DraftBatch as a model drafter takes it (DrafterEngine.draft_many): the
    good calls draft what they draft one by one, sharing their k passes; a second call for
    a session in the step (Busy) and a call asking for too many tokens fail alone."""
    from drafter_svc.engine import DrafterEngine
    from services.messages import DraftCall

    model, tokenizer = target_model
    vocab = model.config.vocab_size

    def engine(max_batch: int) -> DrafterEngine:
        runner = ModelRunner(model, describe(tiny_pair[0], model, tokenizer),
                             torch.device("cpu"), max_queue=64, max_batch=max_batch)
        return DrafterEngine(runner, SessionCaches(64, runner.new_kv), max_draft_tokens=8)

    params = SamplingParams(temperature=0.8, top_k=20)
    calls = [DraftCall(cache=CacheDelta(session_id=f"d{i}", base_len=0, base_hash=token_hash([]),
                                        new_tokens=tuple(_tokens(300 + i, 5 + 2 * i, vocab))),
                       num_tokens=4, params=params, seed=11 * i + 1, max_support=8)
             for i in range(3)]
    too_many = dataclasses.replace(calls[0], cache=dataclasses.replace(calls[0].cache,
                                                                       session_id="big"),
                                   num_tokens=9)

    async def alone():
        e = engine(1)
        return [await e.draft(c) for c in calls]

    async def step():
        e = engine(16)
        out = await e.draft_many([calls[0], calls[1], calls[1], too_many, calls[2]])
        return out, e.stats.forward_passes

    want = asyncio.run(alone())
    out, passes = asyncio.run(step())
    assert passes == 4, "the three good calls ran their 4 steps together"
    for a, b in zip(want, [out[0], out[1], out[4]], strict=True):
        assert (a.token_ids, a.q_ids, a.cached_len) == (b.token_ids, b.q_ids, b.cached_len)
        torch.testing.assert_close(torch.tensor(a.q_probs), torch.tensor(b.q_probs))
        assert b.batch_size == 3
    assert isinstance(out[2], Busy)
    assert isinstance(out[3], InvalidArgument) and "num_tokens" in str(out[3])
