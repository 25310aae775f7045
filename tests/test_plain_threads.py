"""A verifier's threads for its decode passes (services/plain_threads.py): the choice by
measured throughput (pure logic on a simulated clock), and which passes it applies to (a
real verifier engine and model runner on a table model, recording the torch threads each
pass ran on)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from services.batching import Row, StepJob, run_step
from services.hashing import token_hash
from services.kv_cache import SessionCaches
from services.messages import CacheDelta, VerifyCall
from services.model_runner import ModelRunner
from services.params import SamplingParams
from services.plain_threads import PlainThreads
from tests.round_harness import TableLM, _meta, greedy_chain, tables
from verifier_svc.engine import VerifierEngine


def _serve(pt: PlainThreads, cycle_ms, passes: int = 400, rows: int = 8) -> list[int]:
    """``passes`` plain passes back to back, each taking ``cycle_ms(threads)`` to the next;
    the threads of each."""
    now, chosen = 0.0, []
    for _ in range(passes):
        threads = pt.plain(now, rows)
        chosen.append(threads)
        now += cycle_ms(threads) / 1000.0
    return chosen


def test_wide_passes_are_kept_where_they_serve_more(caplog):
    caplog.set_level(logging.INFO, logger="services.plain_threads")
    pt = PlainThreads(1, 2, epoch_s=0.05, min_passes=4)
    chosen = _serve(pt, lambda threads: 10.0 if threads == 2 else 14.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["passes without drafts of 8-15 sessions now run on 2 torch threads "
                     "(session-tokens per second: 800 on 2, 571 on 1)"]  # once, as kept
    assert pt.kept(PlainThreads.level(8)) == 2
    assert chosen[-100:].count(2) >= 85  # the narrow mode is only re-tried now and then
    assert pt.switch(8).rate[True] == pytest.approx(800.0)  # 8 session-tokens per 10 ms
    assert pt.switch(8).rate[False] == pytest.approx(8 / 0.014)


def test_narrow_passes_are_kept_where_wide_ones_serve_less_or_the_same():
    """A machine where the second thread does not help (the cycle includes what it took
    from the gateway): the process's own threads; on a tie too (they cost less CPU)."""
    slower = PlainThreads(1, 2, epoch_s=0.05, min_passes=4)
    chosen = _serve(slower, lambda threads: 16.0 if threads == 2 else 12.0)
    assert slower.kept(PlainThreads.level(8)) == 1
    assert chosen[-100:].count(1) >= 85
    tie = PlainThreads(1, 2, epoch_s=0.05, min_passes=4)
    _serve(tie, lambda threads: 12.0)
    assert tie.kept(PlainThreads.level(8)) == 1


def test_a_pass_with_drafts_breaks_the_chain_of_cycles():
    """The cycle of a plain pass runs to the next plain pass only when no other pass came
    between: after one with drafts (``other``) the gap is not counted against the mode."""
    pt = PlainThreads(1, 2, epoch_s=10.0, min_passes=2)
    assert [pt.plain(0.0, 8)] == [2]  # the first epoch explores: the counts take turns
    pt.other()
    chosen = [pt.plain(now, 8) for now in (0.5, 0.51, 0.52, 0.53)]  # 10 ms cycles
    assert chosen == [1, 1, 2, 1]  # (the Thue-Morse order: 2 1 1 2 1 2 2 1 ...)
    pt.switch(8).mode(10.2)  # the epoch ends: each count's rate is of its 10 ms cycles
    # (the first pass's 500 ms to the next would have rated two threads at 31)
    assert pt.switch(8).rate == {True: pytest.approx(800.0), False: pytest.approx(800.0)}


def test_each_batch_size_level_has_its_own_choice():
    """Two threads pay for passes of 16 sessions and not for passes of one: alternating
    bursts of each, each level keeps its own (rates of a 16-session pass are not compared
    with a lone session's)."""
    pt = PlainThreads(1, 2, epoch_s=0.05, min_passes=4)
    cost = {(16, 2): 10.0, (16, 1): 14.0, (1, 2): 6.0, (1, 1): 5.0}
    now = 0.0
    for burst in range(40):
        rows = 16 if burst % 2 else 1
        for _ in range(30):
            threads = pt.plain(now, rows)
            now += cost[(rows, threads)] / 1000.0
        pt.other()
    assert pt.switch(16).incumbent is True
    assert pt.switch(1).incumbent is False
    assert pt.switch(16).rate[True] == pytest.approx(1600.0)


def test_plain_threads_must_be_more_than_the_process_threads():
    with pytest.raises(ValueError, match="must be more"):
        PlainThreads(2, 2)


class _ThreadsLM(TableLM):
    """A table model that records the torch threads each forward pass ran on and whether it
    verified drafts (more than one logit kept)."""

    def __init__(self, a, b) -> None:
        super().__init__(a, b)
        self.passes: list[tuple[int, bool]] = []

    def forward(self, input_ids, *args, logits_to_keep=0, **kwargs):
        self.passes.append((torch.get_num_threads(), (logits_to_keep or 1) > 1))
        return super().forward(input_ids, *args, logits_to_keep=logits_to_keep, **kwargs)


def _call(prefix, base: int, drafts=(), max_tokens: int = 1) -> VerifyCall:
    return VerifyCall(cache=CacheDelta(session_id="s", base_len=base,
                                       base_hash=token_hash(list(prefix[:base])),
                                       new_tokens=tuple(prefix[base:])),
                      draft_ids=tuple(drafts), q_ids=(), q_probs=(), params=SamplingParams(),
                      seed=1, max_tokens=max_tokens)


class _Chosen(PlainThreads):
    """Plain passes on the process's threads, passes with drafts on one more (as if each
    kind's switch had measured that), recording what each pass was asked as."""

    def __init__(self, narrow: int) -> None:
        super().__init__(narrow, narrow + 1)
        self.asked: list[tuple[int, bool]] = []

    def plain(self, now: float, rows: int, drafts: bool = False) -> int:
        self.asked.append((rows, drafts))
        return self.wide if drafts else self.narrow


def test_passes_with_drafts_and_without_each_run_on_their_own_choice():
    """A verifier whose choice for passes with drafts is wide and for passes without is
    narrow: the pass with drafts runs on the wider count, the four passes of a call of four
    plain tokens on the process's; the tokens are the target's chain either way."""
    target, _ = tables(vocab=48, seed=3, noise=1.5)
    lm = _ThreadsLM(target.a, target.b)
    narrow = torch.get_num_threads()
    pt = _Chosen(narrow)
    runner = ModelRunner(lm, _meta(lm, "target"), torch.device("cpu"), max_queue=8,
                         max_batch=4, plain=pt)
    engine = VerifierEngine(runner, SessionCaches(8, runner.new_kv), max_draft_tokens=8)
    prompt = [1, 2, 3, 4, 5]
    chain = greedy_chain(target, prompt, 12)

    async def main():
        warm = await engine.verify(_call(prompt, 0))  # the prompt's pass: neither kind
        held = [*prompt, warm.extra_token]
        first = await engine.verify(_call(held, len(held) - 1, drafts=chain[1:4]))
        held = [*held, *chain[1:1 + first.num_accepted], first.extra_token]
        plain = await engine.verify(_call(held, len(held) - 1, max_tokens=4))
        return warm, first, plain

    warm, first, plain = asyncio.run(main())
    got = [warm.extra_token, *chain[1:1 + first.num_accepted], first.extra_token,
           plain.extra_token, *plain.more]
    assert len(got) > 6 and got == chain[:len(got)]
    assert pt.asked == [(1, False), (1, True), *[(1, False)] * 4]
    drafted = [threads for threads, drafts in lm.passes if drafts]
    undrafted = [threads for threads, drafts in lm.passes[1:] if not drafts]
    assert drafted == [narrow + 1]
    assert undrafted == [narrow] * 4
    assert torch.get_num_threads() == narrow  # put back after each pass


def test_passes_with_drafts_keep_their_own_choice_and_their_own_cycles():
    """Wide threads pay for passes with drafts and not for plain ones of the same batch
    size: alternating bursts of each, each kind keeps its own choice, and a burst's first
    cycle is not measured from the other kind's last pass."""
    pt = PlainThreads(1, 2, epoch_s=0.05, min_passes=4)
    cost = {(True, 2): 20.0, (True, 1): 30.0, (False, 2): 6.0, (False, 1): 5.0}
    now = 0.0
    for burst in range(40):
        drafts = bool(burst % 2)
        for _ in range(30):
            threads = pt.plain(now, 1, drafts=drafts)
            now += cost[(drafts, threads)] / 1000.0
    assert pt.kept(1, drafts=True) == 2
    assert pt.kept(1) == 1
    assert pt.switch(1, drafts=True).rate[True] == pytest.approx(50.0)  # one row per 20 ms
    assert pt.draft_passes[2] > pt.draft_passes[1] and pt.passes[1] > pt.passes[2]


def test_a_verifier_exports_its_choice_and_its_plain_passes():
    """What an operator reads to see which way the verifier runs passes without drafts:
    per batch level the threads kept, and the passes run on each count."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.metrics import ModelServiceMetrics

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    pt = PlainThreads(1, 2, epoch_s=0.05, min_passes=4)
    ModelServiceMetrics(meter, "verifier", queue_depth=lambda: 0, sessions=lambda: 0,
                        kv_bytes=lambda: 0, kv_capacity_bytes=lambda: 0, plain=pt)
    chosen = _serve(pt, lambda threads: 10.0 if threads == 2 else 14.0, rows=8)

    def read(name: str) -> dict[str, float]:
        return {next(iter(p.attributes.values())): p.value
                for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics if m.name == name
                for p in m.data.data_points}

    assert read("specmesh.verifier.plain_threads") == {4: 2}  # 8 sessions: level 4
    assert read("specmesh.verifier.plain_passes") == {1: chosen.count(1), 2: chosen.count(2)}


def test_wide_passes_must_serve_ten_percent_more_to_be_taken():
    """Two threads cost a pass nearly twice the CPU: 5% more throughput does not keep them."""
    pt = PlainThreads(1, 2, epoch_s=0.05, min_passes=4)
    _serve(pt, lambda threads: 10.0 / 1.05 if threads == 2 else 10.0)
    assert pt.kept(PlainThreads.level(8)) == 1


class _Steps(StepJob):
    """A job of one-token passes on a session's cache."""

    def __init__(self, kv) -> None:
        self.kv, self.fed = kv, 0

    def next_row(self) -> Row:
        return Row(tokens=[1 + self.fed % 7], kv=self.kv, start=self.fed, keep=1)

    def take(self, logits: torch.Tensor) -> None:
        self.fed += 1


class _LocalDrafts:
    """A verifier's own draft model as run_step sees it: told of the steps whose pass runs
    on threads their kind does not keep."""

    def __init__(self) -> None:
        self.prepared = self.other = self.finished = 0

    def prepare(self, jobs, now: float) -> None:
        self.prepared += 1

    def other_threads(self) -> None:
        self.other += 1

    def finish(self, now: float, failed: bool = False) -> None:
        self.finished += 1


def test_a_step_on_threads_not_kept_is_told_to_the_local_drafter():
    """While the thread switch explores, the local drafter (verifier_svc/local_drafts.py)
    hears of each step run on the count its kind does not keep, and only of those: its own
    switch leaves them out of its rates."""
    target, _ = tables(vocab=48, seed=3, noise=1.5)
    lm = TableLM(target.a, target.b)
    narrow = torch.get_num_threads()
    pt = PlainThreads(narrow, narrow + 1, epoch_s=10.0, min_passes=2)  # explores first
    runner = ModelRunner(lm, _meta(lm, "target"), torch.device("cpu"), max_queue=8,
                         max_batch=4, plain=pt)
    job, local = _Steps(runner.new_kv()), _LocalDrafts()
    for _ in range(8):
        run_step(lm, [job], torch.device("cpu"), runner.new_kv, plain=pt, drafter=local)
    # (Thue-Morse: the exploration's units 0-7 are wide, narrow, narrow, wide, narrow, wide,
    # wide, narrow; the kept count until it ends is the narrow one)
    assert local.prepared == local.finished == 8 and pt.passes == {narrow: 4, narrow + 1: 4}
    assert local.other == 4
