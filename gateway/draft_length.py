"""How many tokens a round drafts, and what each round teaches that choice.

The request's k, else the gateway's (``--num-draft-tokens``), else the adaptive choice
(gateway/adaptive.py) from the measured costs at the current load and context length and
the acceptance counts of the request and of its drafter kind; always capped by the
request's remaining budget, the context and the replicas' limit. The gateway's fixed k
falls back to 0 (``--spec-fallback``, on by default) while the same measurements say
drafts cost more than they yield: for a lone request the adaptive choice between 0 and
that k only, under load one choice for all requests from their measured throughput with
and without drafts (gateway/load_switch.py), so that speculation is never slower than
decoding without it. The acceptance counts also weigh the speculation cache's branches
(gateway/rounds.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.adaptive import (
    AcceptanceCounts,
    AdaptiveK,
    CostModel,
    best_k,
    context_level,
    load_level,
)
from gateway.load_switch import LoadSwitch
from gateway.replicas import ReplicaPool
from gateway.round_result import RoundResult
from services import steal as stolen
from services.config import GatewayConfig

log = logging.getLogger(__name__)

SEED_ROUNDS = 4.0  # a new context level's acceptance counts: the nearest level's, as this many rounds


class DraftLength:
    """One per gateway; ``req`` is the engine's per-request state (spec, handle, generated,
    and rounds: gateway/session_rounds.py, whose adaptive k and last round it reads)."""

    def __init__(self, config: GatewayConfig, limits, drafters: ReplicaPool,
                 inflight: Callable[[], int],
                 clock: Callable[[], float] = time.perf_counter,
                 steal: Callable[[], tuple[int, int] | None] | None = None) -> None:
        self.config = config
        self.limits = limits
        self.drafters = drafters
        self._inflight = inflight
        self._clock = clock  # the engine's round start times are on this clock
        self._steal = steal  # services/steal.py ``read``: switches' rates, cycles net of it
        self.switches: dict[tuple[str, int], LoadSwitch] = {}  # per drafter kind, load level
        self._load: float | None = None  # requests in flight, averaged over recent rounds
        # per drafter kind, load level and context level
        self.costs: dict[tuple[str, int, int], CostModel] = {}
        # per drafter kind and context level (``acceptance_of``)
        self.acceptance: dict[tuple[str, int], AcceptanceCounts] = {}
        self._may_draft = 0  # requests in flight that may draft (``running``/``ended``)

    def kind(self, spec) -> str:
        """The request's drafter kind, else the default, else whichever kind there is."""
        kinds = self.drafters.kinds()
        if spec.drafter_kind:
            return spec.drafter_kind
        kind = self.config.default_drafter_kind
        return kind if kind in kinds or not kinds else sorted(kinds)[0]

    def may_draft(self, spec) -> bool:
        """Whether a request of ``spec`` may draft at all (it speculates, drafters exist)."""
        return spec.speculate and len(self.drafters) > 0

    def running(self, spec) -> bool:
        """Counts a request from its start to ``ended(running(spec))``; returns whether it
        may draft."""
        may = self.may_draft(spec)
        self._may_draft += may
        return may

    def ended(self, may_draft: bool) -> None:
        """A request counted by ``running`` ended (``may_draft``: what ``running`` returned)."""
        self._may_draft -= may_draft

    def choose(self, req, kind: str, plain: int = 1) -> int:
        """The request's k, else the gateway's (or none while its drafts do not pay: the
        fallback), else the adaptive choice; capped by the remaining budget and context.
        ``plain``: the tokens the round decodes if it drafts none (what the adaptive choice's
        probes count)."""
        spec = req.spec
        if not self.may_draft(spec):
            return 0
        k = spec.num_draft_tokens or self.config.num_draft_tokens
        seeded = spec.seed is not None and not spec.params.greedy
        if not k and seeded:
            # A seeded sample is reproducible only with the same k in every run: adaptive k
            # depends on timings, so seeded sampling uses a fixed k.
            k = min(4, self.config.max_adaptive_k)
        # The gateway's own fixed k falls back to none while drafts do not pay; a k the
        # request set is its own choice, and a seeded sample needs the same k every run.
        only = k if (not spec.num_draft_tokens and self.config.spec_fallback
                     and not seeded) else 0
        inflight = self._inflight()
        self._load = inflight if self._load is None else self._load + 0.05 * (inflight - self._load)
        if self._switch_decides(only):
            # Under load, whether to draft is decided for all requests together
            # (gateway/load_switch.py): one request's round times cannot tell.
            switch = self._switch(kind, req)
            k = only if switch.mode(self._clock()) else 0
            if switch.kept_changed():
                self._log_kept(kind, switch)
        elif not k or only:
            rounds = req.rounds
            if rounds.adaptive is None:
                rounds.adaptive = AdaptiveK(self._costs(kind, req), self.config.max_adaptive_k,
                                            only=only)
            rounds.adaptive.costs = self._costs(kind, req)  # load and context may have changed
            k = rounds.adaptive.next_k(plain)
        room = self.limits.max_context - len(req.handle.tokens) - 1
        return max(0, min(k, self.limits.max_draft_tokens, spec.max_new_tokens - req.generated - 1,
                          room))

    def drafts_next(self, req) -> bool:
        """Whether the request's round after this one, which drafts none, will draft, as far
        as its adaptive k's schedule tells (AdaptiveK.drafts_next); False where the load
        switch decides (its epochs end by the clock) or the request has no adaptive k. A
        request's first round (its prefill) is never measured."""
        adaptive = req.rounds.adaptive
        if adaptive is None or self._switch_decides(adaptive.only):
            return False
        return adaptive.drafts_next(warm=req.rounds.last is not None)

    def _switch_decides(self, only: int) -> bool:
        """Whether the load switch, not the request's adaptive k, decides its rounds: the
        gateway's fixed k with its fallback (``only``), with requests in flight beside it."""
        return bool(only) and load_level(self._inflight()) > 0

    def learn(self, req, kind: str, r: RoundResult) -> None:
        """Feeds the round's measured costs and acceptance to the adaptive k (the costs only
        of rounds with warm caches that drafted on their critical path: a prefetched draft
        cost nothing there, but only because the previous round's guess held)."""
        k = len(r.drafted)
        if r.pipeline != "used" and r.warm:
            # a plain round of n tokens: n passes, one call (its overhead is the call's)
            n = _plain_share(r)
            per_pass = r.verify_compute_ms / n
            self._costs(kind, req).observe(
                k, r.draft_ms, r.verify_ms - (r.verify_compute_ms - per_pass),
                r.draft_compute_ms, per_pass)
        if req.rounds.adaptive is None:  # (an adaptive k feeds the shared counts itself)
            self.acceptance_of(kind, len(req.handle.tokens)).observe(k, r.num_accepted)
        else:
            req.rounds.adaptive.observe(k, r.num_accepted)
            log.debug("session %s: k=%d tokens=%d accepted=%d pipeline=%s waited=%.2fms "
                      "verify=%.2fms draft=%.2fms alpha=%.2f costs=%s", req.handle.session_id,
                      k, len(r.proposed), r.num_accepted, r.pipeline or "-", r.waited_ms,
                      r.verify_ms, r.draft_ms, req.rounds.adaptive.alpha,
                      self._costs(kind, req))

    def _costs(self, kind: str, req) -> CostModel:
        """The cost model of ``kind`` at the gateway's current load and the request's
        context length: round cycles measured with 8 requests in flight say little about a
        lone request's, those over 100-token contexts little about 900-token ones, and the
        reverse."""
        tokens = len(req.handle.tokens)
        key = (kind, load_level(self._inflight()), context_level(tokens))
        model = self.costs.get(key)
        if model is None:
            model = self.costs[key] = CostModel(acceptance=self.acceptance_of(kind, tokens))
        return model

    def _switch(self, kind: str, req) -> LoadSwitch:
        """The load switch of ``kind`` at the load level of the requests in flight averaged
        over the last rounds (a request that ends and the next that starts would otherwise
        flip 8 streams between the levels of 4-7 and 8-15 at every boundary, handing a few
        rounds to a switch whose epochs never complete); a new level's starts from the
        nearest level's. The first one starts without drafts when rounds without drafts
        decode several tokens (--plain-tokens), and measures drafting after 2 epochs: what a
        lone request measured (its plain rounds are rare one-token probes) says little about
        them, and on the demo pair drafting in every round ran at 0.84x / 0.76x of
        target-only at 8 / 16 streams (docs/performance.md). With one-token plain rounds it
        starts from what lone requests measured (``_pays_alone``)."""
        level = self._level()
        switch = self.switches.get((kind, level))
        if switch is None:
            near = min((key for key in self.switches if key[0] == kind),
                       key=lambda key: abs(key[1] - level), default=None)
            if near is not None:
                switch = self.switches[near].seeded()
            else:
                pays = self._pays_alone(kind, req)
                if self.config.plain_tokens > 1:  # (lone requests' plain probes: one token)
                    pays = False
                switch = (LoadSwitch(steal=self._steal) if pays is None else
                          LoadSwitch(on=pays, patient=True, steal=self._steal))
            self.switches[(kind, level)] = switch
        return switch

    def _log_kept(self, kind: str, switch: LoadSwitch) -> None:
        """Logs what the current load level's switch now keeps: an operator sees when and
        why loaded requests stopped or started drafting."""
        low = 1 << self._level()
        log.info("%s drafter, %d-%d requests in flight: rounds now %s (tokens per "
                 "request-second: %.1f drafting, %.1f not)", kind, low, 2 * low - 1,
                 "draft" if switch.incumbent else "do not draft", switch.rate[True],
                 switch.rate[False])

    def drafting_now(self) -> bool:
        """Whether a load switch at the current load level is in a drafting epoch: then
        cohorts of rounds without drafts must not merge (gateway/step_batch.py)."""
        level = self._level()
        return any(switch.on for (_, at), switch in self.switches.items() if at == level)

    def merge_plain(self) -> bool:
        """Whether cohorts of rounds without drafts may merge (gateway/step_batch.py): not
        while requests that may draft are in flight and the load switch's epoch drafts
        (cohorts that take turns are what drafting wants); always when no request in flight
        may draft (target-only traffic, whatever a switch learned from earlier requests).
        A plain epoch merges even while it only explores: two cohorts taking turns with
        plain rounds of several tokens (--plain-tokens) run two multi-pass steps of half
        the sessions where one of all would do, and the exploration then measured plain at
        a fraction of what it gives (docs/performance.md)."""
        return not (self._may_draft and self.drafting_now())

    def _level(self) -> int:
        """The load level of the requests in flight averaged over the last rounds."""
        return load_level(round(self._load or self._inflight()))

    def _pays_alone(self, kind: str, req) -> bool | None:
        """Whether the gateway's k (the switch's drafting mode) paid for lone requests of
        ``kind`` at ``req``'s context length, by their measured round cycles and acceptance
        (None: not measured)."""
        k = self.config.num_draft_tokens
        costs = self.costs.get((kind, 0, context_level(len(req.handle.tokens))))
        if not k or costs is None or not costs.known:
            return None
        return best_k(costs.acceptance.alpha(0.6), costs, k, only=k) > 0

    def acceptance_of(self, kind: str, tokens: int) -> AcceptanceCounts:
        """The gateway-wide acceptance counts of a drafter kind at the context level of
        ``tokens`` (all requests' rounds there): what a new request's α starts from. Drafts
        are accepted at different rates behind short and long contexts (the demo drafter's
        per token: 0.72-0.86 on the bench's short prompts, 0.17-0.27 on 385-820-token ones,
        docs/performance.md), and one count for all lengths started each long-prompt request
        drafting, a lead round included, on what short prompts had taught. A level's counts
        start from the nearest level's, weighed as ``SEED_ROUNDS`` rounds."""
        level = context_level(tokens)
        found = self.acceptance.get((kind, level))
        if found is None:
            found = self.acceptance[(kind, level)] = AcceptanceCounts(decay=0.98)
            near = min((key for key in self.acceptance if key[0] == kind and key[1] != level),
                       key=lambda key: abs(key[1] - level), default=None)
            if near is not None:
                source = self.acceptance[near]
                total = source.successes + source.failures
                scale = min(1.0, SEED_ROUNDS / total) if total else 0.0
                found.successes = source.successes * scale
                found.failures = source.failures * scale
        return found

    def learn_cycle(self, req, kind: str, now: float) -> None:
        """The previous round's whole cycle (its calls, the gateway's commit and streaming,
        what pipelining hid), measured from its start to this round's: what the adaptive k
        weighs against tokens per round, and under load the switch against the tokens. The
        cost model's is net of the share of the CPUs' time a VM's host stole meanwhile
        (services/steal.py; the switch takes its epochs net of it itself): a plain cycle,
        rare while drafting wins, weighs up to a half, and one timed in a burst of steal
        kept drafting on where it did not pay, or off where it did."""
        rounds = req.rounds
        clock = self._steal() if self._steal is not None else None
        stolen_at, rounds.stolen_at = rounds.stolen_at, clock
        if rounds.last is None or not rounds.last[1].warm:  # (a prefill is slow)
            return
        started, r = rounds.last
        if load_level(self._inflight()) > 0:
            self._switch(kind, req).observe(started, now - started, len(r.proposed), r.cut)
        own = stolen.net(stolen_at, clock)  # (1 without a clock)
        self._costs(kind, req).observe_cycle(len(r.drafted),
                                             (now - started) * 1000.0 * own / _plain_share(r))


def _plain_share(r: RoundResult) -> int:
    """How many one-token rounds a round stands for in the cost model: a round without
    drafts that decoded n tokens (--plain-tokens) counts as n, each costing 1/n of it, so
    that k = 0 is weighed at what a token costs it; any other round as one."""
    return 1 if r.drafted else len(r.proposed)
