"""The gateway's choice of k per round (gateway/draft_length.py), driven the way the round
loop drives it (choose, then learn the round, then the cycle at the next round's start),
with round times and acceptance from a fixed-seed simulation: no replica is called (the
pool's one drafter has no channel)."""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest

from gateway.chunks import TargetLimits
from gateway.draft_length import DraftLength
from gateway.load_switch import LoadSwitch
from gateway.replicas import Replica, ReplicaPool
from gateway.requests import GenerationSpec
from gateway.round_result import RoundResult
from gateway.session_rounds import SessionRounds
from services.config import GatewayConfig, ServerConfig
from services.params import SamplingParams
from services.session_store import SessionHandle

GREEDY = GenerationSpec(prompt="", prompt_ids=(), params=SamplingParams(), max_new_tokens=4096,
                        stop=(), seed=None, num_draft_tokens=0, speculate=True,
                        drafter_kind="model", session_id="", keep_session=False)


@dataclass
class _Req:
    """The fields of the engine's per-request state that DraftLength reads and writes."""

    spec: GenerationSpec
    handle: SessionHandle
    generated: int = 0
    rounds: SessionRounds = None  # the handle's, as the engine's request holds it

    def __post_init__(self) -> None:
        self.rounds = SessionRounds(self.handle)


def _draft_length(inflight, clock=None, **config) -> DraftLength:
    """A gateway's DraftLength with one model drafter (never called: it has no channel)."""
    cfg = GatewayConfig(server=ServerConfig(port=1), redis_url="redis://x",
                        verifiers=("127.0.0.1:2",), **config)
    pool = ReplicaPool("drafter", (), 1.0, [])
    pool.replicas["drafter"] = Replica("drafter", None, None)
    limits = TargetLimits(vocab_size=100, max_context=1 << 20, eos_token_ids=frozenset(),
                          fingerprint="f", max_draft_tokens=8)
    if clock is None:
        return DraftLength(cfg, limits, pool, inflight=inflight)
    return DraftLength(cfg, limits, pool, inflight=inflight, clock=clock)


def _run(spec: GenerationSpec, alpha: float, cycle_ms, rounds: int = 200, context: int = 900,
         **config) -> list[int]:
    """k of each of ``rounds`` rounds of one request whose drafts are accepted per token at
    ``alpha`` and whose round with k drafts takes ``cycle_ms(k)`` from start to next start."""
    dl = _draft_length(lambda: 1, **config)
    req = _Req(spec, SessionHandle(session_id="s", version=0, tokens=[5] * context))
    return _rounds(dl, req, alpha, cycle_ms, rounds, [0.0])


def _rounds(dl: DraftLength, req: _Req, alpha: float, cycle_ms, rounds: int,
            now: list[float]) -> list[int]:
    """``rounds`` rounds of ``req`` alone from ``now[0]`` (advanced); each one's k."""
    rng, ks = random.Random(7), []
    for _ in range(rounds):
        dl.learn_cycle(req, "model", now[0])
        k = dl.choose(req, "model")
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        r = RoundResult(drafted=(9,) * k, drafter_tail=(9,) * k, num_accepted=accepted,
                        extra_token=3, draft_ms=1.0 if k else 0.0, verify_ms=8.0,
                        draft_compute_ms=0.5 if k else 0.0, verify_compute_ms=7.0)
        dl.learn(req, "model", r)
        req.rounds.last = (now[0], r)
        now[0] += cycle_ms(k) / 1000.0
        ks.append(k)
    return ks


def bad(k):  # a drafter past its training length behind an 800-token context
    return 14.5 + 3.5 * k


def test_the_gateway_k_falls_back_to_none_while_drafts_do_not_pay():
    """Acceptance 0.15, a round with 3 drafts 25 ms against 14.5 without: 1.18 tokens per
    25 ms is less than 1 per 14.5, so after learning, only the probes draft."""
    ks = _run(GREEDY, 0.15, bad)
    tail = ks[-64:]
    assert tail.count(0) >= 52 and set(tail) <= {0, 3}, tail


def test_the_gateway_k_stays_while_drafts_pay():
    """Acceptance 0.8, 3 drafts 14.5 ms against 10: 2.95 tokens per 14.5 ms; one round in
    32 checks that not drafting is still dearer."""
    ks = _run(GREEDY, 0.8, lambda k: 10.0 + 1.5 * k)
    tail = ks[-64:]
    assert tail.count(3) >= 60 and set(tail) <= {0, 3}, tail


def test_a_k_the_request_set_seeded_sampling_and_no_fallback_keep_the_k():
    own = _run(replace(GREEDY, num_draft_tokens=3), 0.15, bad)
    assert own == [3] * len(own)  # the request's own k: never changed
    seeded = replace(GREEDY, seed=1, params=SamplingParams(temperature=0.8))
    assert set(_run(seeded, 0.15, bad)) == {3}  # same k every run, so the same sample
    assert set(_run(GREEDY, 0.15, bad, spec_fallback=False)) == {3}


def _population(alpha: float, plain_ms: float, spec_ms: float, seconds: float = 20.0,
                streams: int = 8, dl_out: list | None = None,
                alone_ms=None, plain_tokens: int = 1,
                config: dict | None = None) -> list[tuple[float, int]]:
    """``streams`` requests at once on a simulated clock, whose rounds all take
    ``plain_ms`` while none drafts and ``spec_ms`` while all do (in between by the share
    that drafts), as batched passes do; returns (start time, k) of every round. With
    ``alone_ms`` (k -> ms), one request first runs 200 rounds alone on the same gateway.
    ``plain_tokens``: what a round without drafts yields while no other request's round
    drafts; beside one that does, one token (a Verify step with drafts asks each of its
    calls for one: gateway/replicas.py ``fit_verify_step``)."""
    now = [0.0]
    dips = random.Random(12)
    alone = [alone_ms is not None]

    def inflight() -> int:  # one call in ten sees a request that ended before the next began
        if alone[0]:
            return 1
        # (drawn, not every tenth call: how many calls a round makes would decide which
        # of them see the dip, and a change in that count moved every dip into ``choose``)
        return streams - 1 if dips.random() < 0.1 else streams

    dl = _draft_length(inflight, clock=lambda: now[0], **(config or {}))
    if dl_out is not None:
        dl_out.append(dl)
    if alone[0]:
        _rounds(dl, _Req(GREEDY, SessionHandle(session_id="a", version=0, tokens=[5] * 900)),
                alpha, alone_ms, 200, now)
        assert not dl.switches
        alone[0], now[0] = False, 0.0
    reqs = [_Req(GREEDY, SessionHandle(session_id=f"s{i}", version=0, tokens=[5] * 900))
            for i in range(streams)]
    ks = [3] * streams
    due = [i * 0.001 for i in range(streams)]
    rng, log = random.Random(11), []
    while min(due) < seconds:
        i = min(range(streams), key=due.__getitem__)
        now[0] = due[i]
        dl.learn_cycle(reqs[i], "model", now[0])
        ks[i] = k = dl.choose(reqs[i], "model")
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        mixed = any(ks[j] for j in range(streams) if j != i)
        more = (3,) * (plain_tokens - 1) if not k and not mixed else ()
        r = RoundResult(drafted=(9,) * k, drafter_tail=(9,) * k, num_accepted=accepted,
                        extra_token=3, draft_ms=0.0, verify_ms=8.0, draft_compute_ms=0.0,
                        verify_compute_ms=7.0, more=more, asked=1 if k else plain_tokens)
        dl.learn(reqs[i], "model", r)
        reqs[i].rounds.last = (now[0], r)
        share = sum(1 for j in ks if j) / streams
        due[i] = now[0] + (plain_ms + share * (spec_ms - plain_ms)) / 1000.0
        log.append((now[0], k))
    return log


def _drafting_share(log, after: float) -> float:
    late = [k for t, k in log if t >= after]
    return sum(1 for k in late if k) / len(late)


def test_under_load_drafting_stops_for_all_when_it_does_not_pay():
    """8 streams behind a long context, acceptance 0.15: rounds take 53 ms while all draft
    (1.18 tokens each) and 31 ms while none does (1 token): not drafting is 1.5x the
    throughput. Each request's own rounds take about as long either way while the others
    draft, so only a choice for all of them finds it."""
    dls = []
    log = _population(0.15, plain_ms=31.0, spec_ms=53.0, dl_out=dls)
    assert _drafting_share(log, 10.0) < 0.15  # the exploring epochs only
    # one switch: the brief dips to 7 requests in flight (level 4-7) do not hand rounds to
    # another level's switch, whose epochs would never complete
    assert set(dls[0].switches) == {("model", 3)}


def test_under_load_drafting_stays_when_it_pays():
    """Acceptance 0.65 (2.35 tokens a round), 38 ms with drafts against 28 without."""
    log = _population(0.65, plain_ms=28.0, spec_ms=38.0)
    assert _drafting_share(log, 10.0) > 0.85


def test_loaded_epochs_begin_with_what_lone_requests_found():
    """With one-token plain rounds (--plain-tokens 1): a gateway whose lone requests behind a
    long context found that drafts do not pay starts its first loaded epochs without them
    and measures drafting on the usual schedule (after 2 epochs of 0.5 s), instead of
    beginning with an epoch of drafting; one whose lone requests found that drafts pay
    begins drafting, as a switch without evidence does."""
    dls = []
    one = {"plain_tokens": 1}
    log = _population(0.15, plain_ms=31.0, spec_ms=53.0, seconds=4.0, alone_ms=bad,
                      dl_out=dls, config=one)
    first = min(t for t, k in log if k)
    assert 1.0 <= first < 2.5, first  # two plain epochs, then drafting is measured
    assert all(switch.patient for switch in dls[0].switches.values())
    cold = _population(0.15, plain_ms=31.0, spec_ms=53.0, seconds=4.0, config=one)
    assert _drafting_share(cold, 0.0) > _drafting_share(log, 0.0)
    assert min(t for t, k in cold if k) < 0.01  # no evidence: the first epoch drafts
    paying = _population(0.65, plain_ms=28.0, spec_ms=38.0, seconds=1.0,
                         alone_ms=lambda k: 10.0 + 1.5 * k, config=one)
    assert _drafting_share(paying, 0.0) > 0.9


def test_with_plain_rounds_of_several_tokens_loaded_epochs_begin_without_drafts():
    """--plain-tokens above 1 (8 by default): the first loaded epochs go without drafts even where
    lone requests found that drafts pay (their plain rounds were one-token probes), and
    drafting is measured after 2 epochs; where it pays, it is then kept (confirmed by a
    second epoch; not drafting is tried again 2 epochs later, then less often)."""
    dls = []
    paying = _population(0.65, plain_ms=28.0, spec_ms=38.0, seconds=8.0,
                         alone_ms=lambda k: 10.0 + 1.5 * k, dl_out=dls)
    assert all(switch.patient for switch in dls[0].switches.values())
    first = min(t for t, k in paying if k)
    assert 1.0 <= first < 1.6, first  # two epochs without drafts, then drafting measured
    assert _drafting_share(paying, 4.0) > 0.85


def test_under_load_plain_rounds_of_several_tokens_win_when_they_yield_more():
    """Plain rounds of 4 tokens in 50 ms (80 tokens per request-second) against drafted ones
    of 2.95 tokens in 40 ms (74): not drafting is 1.08x. The first plain round of each
    request in an epoch yields one token (it runs beside the others' last drafted rounds);
    counted, it would put plain at about 0.8 of its rate and keep drafting."""
    log = _population(0.8, plain_ms=50.0, spec_ms=40.0, plain_tokens=4)
    assert _drafting_share(log, 10.0) < 0.2


def test_a_plain_round_cut_short_by_its_step_is_not_counted():
    """A round without drafts that asked for 4 tokens and got one, because its step also
    verified the others' drafts (after a drafting epoch) or fed a prompt, shows neither
    mode's rate: not counted. A round that got what it asked for, a drafted round and a
    one-token round that asked for one are."""
    def plain(asked, got):
        return RoundResult(drafted=(), drafter_tail=None, num_accepted=0, extra_token=3,
                           draft_ms=0.0, verify_ms=8.0, draft_compute_ms=0.0,
                           verify_compute_ms=7.0, more=(3,) * (got - 1), asked=asked)
    assert plain(4, 1).cut and plain(4, 3).cut
    assert not plain(4, 4).cut and not plain(1, 1).cut
    drafted = replace(plain(1, 1), drafted=(9, 9, 9), num_accepted=0)
    assert not drafted.cut
    switch = LoadSwitch(min_rounds=2)
    assert switch.mode(0.0) is True
    for _ in range(2):
        switch.observe(0.0, 0.02, 1, cut=True)  # 50 tokens/s: not counted
        switch.observe(0.1, 0.05, 4)  # 80 tokens/s
    switch.mode(0.3)
    assert switch.mode(0.6) is False  # the epoch ended; the other mode is measured next
    assert switch.rate == {True: 80.0}


def _switch_modes(rate: dict[bool, float], seconds: float = 60.0,
                  step: float = 0.05) -> list[bool]:
    """The mode of each round, one every ``step`` seconds, on a switch whose modes yield
    ``rate`` tokens per request-second."""
    switch, t, modes = LoadSwitch(), 0.0, []
    while t < seconds:
        mode = switch.mode(t)
        modes.append(mode)
        switch.observe(t, step, rate[mode] * step)
        t += step
    assert switch.rate[True] > switch.rate[False]
    return modes


def _runs(modes: list[bool]) -> list[int]:
    """Lengths of the runs of the better mode (True) between explorations, after each mode's
    first epoch (an explored epoch that loses widely may end after half an epoch)."""
    first = modes.index(False)
    runs, run = [], 0
    for m in modes[first + modes[first:].index(True):]:
        if m:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    return runs


def test_the_switch_keeps_the_better_mode_and_explores_less_while_it_holds():
    """Epochs of 0.5 s (10-11 rounds): each mode measured once, then the better one, with the
    other tried after 2, 4, 8 and 16 epochs while it keeps losing narrowly, after 2, 8, 16
    while it loses widely (below 0.8 of the better rate), after 2, 8, 32, 64 while it loses
    by far (below 0.6), each of those tries cut after a quarter of an epoch."""
    narrow = _switch_modes({True: 40.0, False: 36.0})
    epochs = [narrow[0]] + [b for a, b in zip(narrow, narrow[1:], strict=False) if a != b]
    assert epochs[:3] == [True, False, True]  # measure both, keep the better
    assert [r // 10 for r in _runs(narrow)[:4]] == [2, 4, 8, 16]
    wide = _switch_modes({True: 40.0, False: 30.0})
    assert [r // 10 for r in _runs(wide)[:3]] == [2, 8, 16]
    assert wide.count(False) < narrow.count(False) < 0.15 * len(narrow)
    # rounds of 10 ms (8 streams' rounds, one after another): 50 an epoch
    far = _switch_modes({True: 40.0, False: 20.0}, seconds=120.0, step=0.01)
    assert [r // 50 for r in _runs(far)[:5]] == [2, 8, 32, 64, 64]
    # each epoch of the far worse mode, its first too, lasts a quarter of an epoch
    explored = [len(run) for run in "".join("x" if m else "o" for m in far).split("x") if run]
    assert len(explored) == 7 and all(12 <= n <= 14 for n in explored)


def test_a_new_load_level_starts_where_the_nearest_one_is():
    """Its rates, its mode and how long it waits before trying the other mode."""
    switch, t = LoadSwitch(), 0.0
    while t < 20.0:
        mode = switch.mode(t)
        switch.observe(t, 0.05, (2.0 if mode else 1.0) * 0.05 * 20)
        t += 0.05
    seeded = switch.seeded()
    assert seeded.rate == switch.rate and seeded.mode(t) is True
    assert seeded._every == switch._every > switch.first_explore


def test_the_switch_state_is_exported_per_kind_and_load_level():
    """specmesh.load_switch.drafting: the mode kept between explorations (while one runs,
    still the incumbent); specmesh.load_switch.rate: each measured mode's rate."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.metrics import GatewayMetrics

    exploring = LoadSwitch(on=True, rate={True: 30.0, False: 20.0})
    exploring._exploring = True  # plain is the incumbent; this epoch tries drafting
    drafting = LoadSwitch(on=True, rate={True: 40.0})
    switches = [("model", 3, exploring), ("ngram", 1, drafting)]
    reader = InMemoryMetricReader()
    GatewayMetrics(MeterProvider(metric_readers=[reader]).get_meter("t"), lambda: 0,
                   lambda: switches)
    points = {metric.name: {tuple(sorted(p.attributes.items())): p.value
                            for p in metric.data.data_points}
              for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for metric in sm.metrics}
    assert points["specmesh.load_switch.drafting"] == {
        (("drafter_kind", "model"), ("load_level", 3)): 0.0,
        (("drafter_kind", "ngram"), ("load_level", 1)): 1.0}
    assert points["specmesh.load_switch.rate"] == {
        (("drafter_kind", "model"), ("drafting", "true"), ("load_level", 3)): 30.0,
        (("drafter_kind", "model"), ("drafting", "false"), ("load_level", 3)): 20.0,
        (("drafter_kind", "ngram"), ("drafting", "true"), ("load_level", 1)): 40.0}


def test_cohorts_merge_only_while_no_switch_at_the_load_is_in_a_drafting_epoch():
    """DraftLength.drafting_now, read by the verifiers' step batchers: a switch at the
    current load level in a drafting epoch (kept, or explored) stops cohorts without drafts
    from merging; one in a plain epoch (kept, or explored while it keeps drafting: plain
    rounds of several tokens in two cohorts would measure plain at a fraction of its rate),
    or another load level's, does not."""
    dl = _draft_length(lambda: 8)
    assert not dl.drafting_now()  # no switch: target-only traffic merges
    exploring_plain = LoadSwitch(on=False, rate={True: 30.0, False: 20.0})
    exploring_plain._exploring = True
    exploring_drafts = LoadSwitch(on=True, rate={True: 20.0, False: 30.0})
    exploring_drafts._exploring = True
    dl.switches[("model", 2)] = LoadSwitch(on=True)  # another level's
    dl.switches[("model", 3)] = LoadSwitch(on=False, rate={True: 20.0, False: 30.0})
    assert not dl.drafting_now()
    dl.switches[("model", 3)] = exploring_plain
    assert exploring_plain.incumbent and not dl.drafting_now()
    dl.switches[("model", 3)] = exploring_drafts
    assert not exploring_drafts.incumbent and dl.drafting_now()


def test_target_only_requests_merge_whatever_the_switch_keeps():
    """The step batchers read DraftLength.merge_plain: with a switch at the load level that
    keeps drafting, cohorts merge only while no request in flight may draft. Seen in the
    bench: target-only rows after the defaults' rows at the same load split into two
    cohorts (4.0 calls a pass at 8 streams, 378 tokens/s against 514 merged), because the
    switch the defaults left kept drafting."""
    dl = _draft_length(lambda: 8)
    kept = LoadSwitch(on=True)
    dl.switches[("model", 3)] = kept
    assert dl.drafting_now() and dl.merge_plain()  # nothing in flight may draft
    plain = [dl.running(SimpleNamespace(speculate=False)) for _ in range(8)]
    assert plain == [False] * 8 and dl.merge_plain()
    drafting = dl.running(SimpleNamespace(speculate=True))
    assert drafting and not dl.merge_plain()
    dl.ended(drafting)
    assert dl.merge_plain()
    dl.switches[("model", 3)] = LoadSwitch(on=False, rate={True: 20.0, False: 30.0})
    again = dl.running(SimpleNamespace(speculate=True))
    assert dl.merge_plain()  # may draft, but the switch's epoch does not
    for may in (*plain, again):
        dl.ended(may)
    assert dl._may_draft == 0


def test_the_gateway_logs_what_its_load_switch_keeps(caplog):
    """One line when a load level's switch changes what it keeps, with the rates it
    measured: not once a round."""
    caplog.set_level(logging.INFO, logger="gateway.draft_length")
    _population(0.15, plain_ms=31.0, spec_ms=53.0, seconds=6.0)
    lines = [r.getMessage() for r in caplog.records if "rounds now" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("model drafter, 8-15 requests in flight: rounds now do not draft")
    drafting, plain = (float(x) for x in re.findall(r"([0-9.]+) (?:drafting|not)\)?", lines[0]))
    assert drafting < plain  # the rates that chose it
    caplog.clear()
    _population(0.65, plain_ms=28.0, spec_ms=38.0, seconds=6.0)
    lines = [r.getMessage() for r in caplog.records if "rounds now" in r.getMessage()]
    assert len(lines) == 1 and "rounds now draft (" in lines[0], lines


def test_a_cycle_is_learned_net_of_the_cpu_time_the_host_stole_meanwhile():
    """On a VM whose host stole 30% of the CPUs' demanded time during a round, the round's
    20 ms stand for 14 of its own: the cost model learns 14 (a plain cycle weighs up to a
    half, and one timed in a burst of steal decided for or against drafting on the burst).
    Without a steal clock, or with none stolen, it learns the wall time."""
    host = [0, 0]  # stolen, demanded ticks
    dl = DraftLength(GatewayConfig(server=ServerConfig(port=1), redis_url="redis://x",
                                   verifiers=("127.0.0.1:2",)),
                     TargetLimits(vocab_size=100, max_context=1 << 20,
                                  eos_token_ids=frozenset(), fingerprint="f",
                                  max_draft_tokens=8),
                     ReplicaPool("drafter", (), 1.0, []), inflight=lambda: 1,
                     steal=lambda: tuple(host))
    plain = RoundResult(drafted=(), drafter_tail=None, num_accepted=0, extra_token=3,
                        draft_ms=0.0, verify_ms=8.0, draft_compute_ms=0.0,
                        verify_compute_ms=7.0)
    req = _Req(GREEDY, SessionHandle(session_id="s", version=0, tokens=[5] * 10))
    dl.learn_cycle(req, "model", 0.0)  # the first round starts: the clock's first reading
    req.rounds.last = (0.0, plain)
    host[:] = [30, 100]  # 30% of what the CPUs had work for went to other guests
    dl.learn_cycle(req, "model", 0.020)
    costs = dl._costs("model", req)
    assert costs.cycle_ms[0] == pytest.approx(14.0)
    req.rounds.last = (0.020, plain)
    host[:] = [30, 200]  # nothing stolen in the next round: its wall time
    dl.learn_cycle(req, "model", 0.030)
    assert costs.cycle_ms[0] == pytest.approx(0.9 * 14.0 + 0.1 * 10.0)
    dl._steal = None  # no steal clock (not a VM, or no /proc/stat): the wall time
    req.rounds.last = (0.030, plain)
    host[:] = [130, 300]  # (what it would have said: unread)
    dl.learn_cycle(req, "model", 0.050)
    # (the average takes in the median of the last three cycles: 14 of 14, 10 and 20)
    assert costs.cycle_ms[0] == pytest.approx(0.9 * (0.9 * 14.0 + 0.1 * 10.0) + 0.1 * 14.0)


@pytest.mark.parametrize("config", [{}, {"num_draft_tokens": 0}])
@pytest.mark.parametrize(("alpha", "cycle_ms"), [(0.15, bad), (0.8, lambda k: 10.0 + 1.5 * k)])
def test_a_round_without_drafts_knows_whether_the_next_one_drafts(config, alpha, cycle_ms):
    """After each round without drafts (plain rounds of 8 tokens), ``drafts_next`` says
    whether the next round drafts: a probe of a drafter that does not pay (0.15), or the
    drafting rounds after the probe of not drafting while drafts pay (0.8); with the
    gateway's k and its fallback, and with the adaptive k. Such a round does not decode
    its successor ahead (gateway/engine.py): a drafting round would stop that job and wait
    for its pass, in vain."""
    dl = _draft_length(lambda: 1, **config)
    req = _Req(GREEDY, SessionHandle(session_id="s", version=0, tokens=[5] * 900))
    rng, now, said = random.Random(3), 0.0, []
    for _ in range(400):
        dl.learn_cycle(req, "model", now)
        k = dl.choose(req, "model", plain=8)
        if said and said[-1][1] is None:
            said[-1] = (said[-1][0], k > 0)  # what the next round did
        if not k:
            said.append((dl.drafts_next(req), None))
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        r = RoundResult(drafted=(9,) * k, drafter_tail=(9,) * k, num_accepted=accepted,
                        extra_token=3, draft_ms=1.0 if k else 0.0, verify_ms=8.0,
                        draft_compute_ms=0.5 if k else 0.0, verify_compute_ms=7.0,
                        more=() if k else (3,) * 7, warm=req.rounds.last is not None)
        dl.learn(req, "model", r)
        req.rounds.last = (now, r)
        now += (cycle_ms(k) * (1 if k else 8)) / 1000.0
    said = [pair for pair in said if pair[1] is not None]
    assert [p for p, _ in said] == [d for _, d in said]
    assert 5 <= sum(d for _, d in said) < len(said), said  # probes, and plain rounds that stay


def test_under_load_no_round_is_said_to_draft_next():
    """Under load the load switch decides for all requests by epochs that end on the
    clock: nothing tells a request's next round in advance, so its plain rounds decode
    ahead as before."""
    dl = _draft_length(lambda: 8)
    req = _Req(GREEDY, SessionHandle(session_id="s", version=0, tokens=[5] * 900))
    dl.learn_cycle(req, "model", 0.0)
    dl.choose(req, "model", plain=8)
    assert req.rounds.adaptive is None and not dl.drafts_next(req)
    lone = _draft_length(lambda: 1)
    lone.choose(req, "model", plain=8)  # a lone request's adaptive k, measuring plain first
    assert req.rounds.adaptive is not None and not lone.drafts_next(req)


def test_a_request_starts_from_what_requests_at_its_context_length_taught():
    """The gateway-wide acceptance a new request's α starts from is kept per context level:
    after a short-prompt request whose drafts were accepted at 0.8 and a long-prompt one at
    0.15 (a drafter past its training length), the next long-prompt request's first rounds
    do not draft (a first round that drafts is a lead round: the drafter computes the whole
    prompt beside the verifier), while the next short-prompt request's draft at once. With one
    count for all lengths, the long prompt's few probe rounds left it near 0.8 and the next
    long-prompt request started drafting."""
    dl, now = _draft_length(lambda: 1), [0.0]

    def request(name: str, context: int) -> _Req:
        return _Req(GREEDY, SessionHandle(session_id=name, version=0, tokens=[5] * context))

    def good(k):
        return 10.0 + 1.5 * k

    _rounds(dl, request("short", 100), 0.8, good, 200, now)
    _rounds(dl, request("long", 900), 0.15, bad, 200, now)
    long_again = _rounds(dl, request("long again", 900), 0.15, bad, 4, now)
    short_again = _rounds(dl, request("short again", 100), 0.8, good, 4, now)
    assert long_again == [0, 0, 0, 0], long_again
    assert short_again[0] == 3, short_again
    assert dl.acceptance_of("model", 900).alpha(0.6) < 0.4 < 0.7 < dl.acceptance_of(
        "model", 100).alpha(0.6)


def test_a_new_context_level_starts_from_the_nearest_levels_acceptance_as_a_few_rounds():
    """A context level no request reached yet starts from the nearest level's counts, scaled
    to SEED_ROUNDS rounds' worth: it begins where that level is and moves within a few
    rounds of its own."""
    from gateway.draft_length import SEED_ROUNDS

    dl = _draft_length(lambda: 1)
    short = dl.acceptance_of("model", 100)
    for _ in range(100):
        short.observe(4, 3)  # α 0.75
    seeded = dl.acceptance_of("model", 700)
    assert seeded is not short and seeded.alpha(0.0) == pytest.approx(0.75)
    assert seeded.successes + seeded.failures == pytest.approx(SEED_ROUNDS)
    for _ in range(6):
        seeded.observe(4, 0)  # rejected at once: α there is 0
    assert seeded.alpha(0.6) < 0.35 and short.alpha(0.6) == pytest.approx(0.75)
    assert dl.acceptance_of("ngram", 700).alpha(0.6) == 0.6  # another kind: nothing to seed
