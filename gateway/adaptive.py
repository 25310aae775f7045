"""Adaptive draft length: pick k to maximise expected tokens per second.

With per-token acceptance rate α, a round that drafts k tokens yields
E(k) = (1 − α^(k+1)) / (1 − α) tokens on average (Leviathan et al. 2023, eq. 1) and
costs T(k): the wall time from one round's start to the next (drafting k tokens, one
verifier forward over the pending token plus k drafts, the network round trips, the
gateway's commit and streaming, and whatever pipelining hides or contention adds). The
best k maximises E(k) / T(k); k = 0 (no speculation) wins when
drafts are rarely accepted or drafting costs as much as verifying.

All costs are measured, not assumed. T(k) is a running average (EWMA) of the observed
round cycle at each k used; between two measured k it is interpolated along the shape of
a component model (linearly until that is known), beyond them extrapolated with its
per-token costs. The component model (draft time per token, verify time with and without
drafts, network time per call) is fitted from the replicas' reported compute times.
Only rounds whose caches were warm count (a prefill or a resync would pass for a slow
round). Because the cycle is measured end to end, the
gateway's own work per round, pipelined drafting and a verifier slowed by a large batch
all enter the choice.

α is estimated from counts, not per round: a round that drafted k and accepted a stops
at its first rejection, so it contributes a successes and one failure (none when a = k);
the maximum-likelihood per-token rate is Σ successes / (Σ successes + Σ failures). Each
request keeps its own counts, decayed so that recent rounds weigh most, starting from the
gateway-wide counts for that drafter kind (a prior worth a few rounds), so that one
unlucky round does not switch speculation off.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.acceptance import AcceptanceCounts, expected_tokens


def _ewma(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class CostModel:
    """Running estimates of what a round costs, in milliseconds (shared by a gateway's
    requests: they run on the same replicas)."""

    draft_ms_per_token: float | None = None
    verify_ms_base: float | None = None  # verify with no drafts
    verify_ms_per_draft: float | None = None  # extra verify time per draft token
    rtt_ms: float | None = None  # network + RPC overhead of one call
    cycle_ms: dict[int, float] = field(default_factory=dict)  # observed round cycle per k
    weight: float = 0.1
    max_weight: float = 0.5  # of one cycle seen after many rounds at other k
    window: int = 3  # the average takes in the median of a k's last this many cycles
    # every request's rounds, to seed new requests' α (the engine shares one per drafter kind)
    acceptance: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts(decay=0.98))
    # The probes of a controller while k = 0 wins (AdaptiveK): rounds without drafts since the
    # last drafting round, and how far the probes' interval has backed off. They live here,
    # with the costs the probes refresh, so that one lone request after another at this load
    # and context goes on with the schedule instead of probing from its 8th round again.
    since_draft: int = 0
    probe_backoff: int = 0
    _clock: int = 0  # cycles observed, any k
    _seen: dict[int, int] = field(default_factory=dict)  # k -> _clock when last observed
    _recent: dict[int, deque[float]] = field(default_factory=dict)  # k -> its last cycles

    def observe(self, k: int, draft_ms: float, verify_ms: float, draft_compute_ms: float,
                verify_compute_ms: float) -> None:
        calls = 2 if k else 1
        overhead = max(0.0, (draft_ms - draft_compute_ms) + (verify_ms - verify_compute_ms))
        self.rtt_ms = _ewma(self.rtt_ms, overhead / calls, self.weight)
        if k == 0:
            self.verify_ms_base = _ewma(self.verify_ms_base, verify_compute_ms, self.weight)
            return
        self.draft_ms_per_token = _ewma(self.draft_ms_per_token, draft_compute_ms / k,
                                        self.weight)
        if self.verify_ms_base is not None:
            extra = max(0.0, verify_compute_ms - self.verify_ms_base) / k
            self.verify_ms_per_draft = _ewma(self.verify_ms_per_draft, extra, self.weight)

    def observe_cycle(self, k: int, ms: float) -> None:
        """The wall time from the start of a round that drafted k to the next round's start.
        The average forgets with the rounds that passed, whatever k they drafted: a k seen
        again after g rounds weighs its new cycle 1 − (1 − weight)^g (at most a half), so
        the rarely run k of the probes follow a change within a few probes, not dozens.

        What it takes in is the median of the last ``window`` cycles at k (the lower middle
        one of two), not each cycle: a round's cycle is heavy-tailed (plain rounds at one
        stream on a Zen 4 EPYC: a median 2.1-2.3 ms a token, p90 3.3-3.7, max 9.5-14.5), and
        one slow plain round, weighed at a half after a drafting streak, held the plain
        estimate at 3.31 ms a token for the next request's 30 rounds, 28 of which drafted
        where drafting did not pay (docs/performance.md). A change that lasts counts from
        its second cycle."""
        recent = self._recent.setdefault(k, deque(maxlen=self.window))
        recent.append(ms)
        ms = sorted(recent)[(len(recent) - 1) // 2]
        self._clock += 1
        gap = self._clock - self._seen.get(k, self._clock - 1)
        self._seen[k] = self._clock
        weight = min(self.max_weight, 1.0 - (1.0 - self.weight) ** gap)
        self.cycle_ms[k] = _ewma(self.cycle_ms.get(k), ms, max(self.weight, weight))

    @property
    def known(self) -> bool:
        return self._components_known() or (
            0 in self.cycle_ms and any(k > 0 for k in self.cycle_ms))

    def _components_known(self) -> bool:
        return None not in (self.draft_ms_per_token, self.verify_ms_base,
                            self.verify_ms_per_draft, self.rtt_ms)

    def _component_ms(self, k: int) -> float:
        if k == 0:
            return self.verify_ms_base + self.rtt_ms
        return (k * self.draft_ms_per_token + self.verify_ms_base
                + k * self.verify_ms_per_draft + 2 * self.rtt_ms)

    def _per_draft_ms(self) -> float:
        if self.draft_ms_per_token is None or self.verify_ms_per_draft is None:
            return 0.0
        return self.draft_ms_per_token + self.verify_ms_per_draft

    def round_ms(self, k: int) -> float:
        seen = self.cycle_ms
        if k in seen:
            return seen[k]
        lower = max((j for j in seen if j < k), default=None)
        upper = min((j for j in seen if j > k), default=None)
        if lower is not None and upper is not None:
            # Between two measured k, follow the component model's shape (it knows that the
            # first draft adds a call as well as a token); linearly when it is not known yet.
            w = (k - lower) / (upper - lower)
            if self._components_known():
                span = self._component_ms(upper) - self._component_ms(lower)
                if span > 0:
                    w = (self._component_ms(k) - self._component_ms(lower)) / span
            return (1 - w) * seen[lower] + w * seen[upper]
        if (lower is not None and lower > 0) or upper is not None:
            near = lower if lower is not None else upper
            return max(1e-3, seen[near] + (k - near) * self._per_draft_ms())
        if lower == 0 and self._components_known():
            return seen[0] + self._component_ms(k) - self._component_ms(0)
        return self._component_ms(k)


def load_level(inflight: int) -> int:
    """Requests in flight on a gateway, in buckets of doubling size: 1, 2–3, 4–7, 8–15, ...
    Round costs are learned per bucket (a batched, busy verifier makes drafts dearer)."""
    return max(1, inflight).bit_length() - 1


def context_level(tokens: int) -> int:
    """A session's length in buckets of doubling size: under 256 tokens, 256–511, 512–1023,
    ... Round costs are learned per bucket too: attention grows with the context (a verify
    at 900 tokens costs about twice one at 100 on the demo pair), and so does a tree of
    drafts over it, so costs learned on short prompts misjudge long ones."""
    return (max(0, tokens) >> 8).bit_length()


def best_k(alpha: float, costs: CostModel, k_max: int, only: int = 0) -> int:
    """The k in 0..k_max with the most expected tokens per millisecond (``only`` > 0: of 0
    and ``only``); the smaller k on a tie."""
    candidates = (0, only) if only else range(k_max + 1)
    return max(candidates, key=lambda k: (expected_tokens(alpha, k) / costs.round_ms(k), -k))


@dataclass
class AdaptiveK:
    """One request's draft-length controller: any k in 0..k_max, or with ``only`` = K just
    K or 0 (a fixed k that stops speculating while drafts do not pay for themselves, and
    probes K again every ``probe_every`` rounds)."""

    costs: CostModel
    k_max: int
    only: int = 0
    prior_alpha: float = 0.6  # before anything was drafted with this kind
    prior_rounds: float = 4.0  # how many rounds' worth the gateway-wide α counts as
    decay: float = 0.9
    probe_every: int = 8  # while k = 0 wins, draft 1 token (``only``: that k) for
    #                       ``probe_rounds`` rounds after this many tokens decoded without
    #                       drafts, then after twice, 4 and 8 times as many while k = 0 keeps
    #                       winning (a probe that does not pay costs a few rounds' worth),
    #                       and with rounds of n plain tokens (``next_k(plain=n)``) on up to
    #                       n times that, so that the cap stays at 64 rounds; a probe that
    #                       drafting loses by r >= 2 (``_loss_bits``) backs off log2(r) times
    #                       more, and raises the cap as much; counted over
    #                       the requests that share ``costs`` (CostModel.since_draft);
    #                       while k > 0 wins, try k − 1, k + 1, k − 1 and k = 0 in turn every
    #                       this many rounds
    max_backoff: int = 3
    max_loss_bits: int = 3  # the most a loss adds to a back-off step and to its cap (8x)
    probe_rounds: int = 3  # a probe from k = 0 drafts this many rounds in a row: the first
    #                        pays the drafter's catch-up on the undrafted rounds and is not
    #                        measured (gateway/draft_length.py counts only warm rounds), the
    #                        next ones measure what drafting costs, pipelining included. A
    #                        lone probe round was never measured, so one slow drafting cycle
    #                        seen early (a busy machine) kept k = 0 winning for good.
    _burst: int = 0  # rounds of the current probe still to draft
    _rounds: int = 0
    _counts: AcceptanceCounts = field(init=False)

    def __post_init__(self) -> None:
        shared = self.costs.acceptance.alpha(self.prior_alpha)
        # A prior of prior_rounds rounds at the shared α, as if each had accepted α/(1-α)
        # drafts before one rejection: s/(s+f) = α.
        self._counts = AcceptanceCounts(successes=self.prior_rounds * shared,
                                        failures=self.prior_rounds * (1 - shared),
                                        decay=self.decay)

    @property
    def alpha(self) -> float:
        return min(0.99, self._counts.alpha(self.prior_alpha))

    def next_k(self, plain: int = 1) -> int:
        """The next round's k; ``plain``: the tokens the round would decode without drafts
        (--plain-tokens). The probes' schedule counts those tokens, not rounds: counted in
        rounds of 8 tokens, one unlucky start (a request's α fell to 0.56 after two rejected
        drafts, on a pair whose drafts pay at 0.7) kept a lone request plain for 64 tokens,
        where 8 would have told (docs/performance.md)."""
        plain = max(1, plain)
        if self.costs.verify_ms_base is None:
            k = 0  # measure a plain verify first
        elif not self.costs.known:
            k = self.only or self.k_max  # then a full draft
        elif self._burst:
            self._burst -= 1
            k = self.only or 1
        else:
            k = best_k(self.alpha, self.costs, self.k_max, self.only)
            costs = self.costs  # (the probes' schedule is shared: CostModel.since_draft)
            if k == 0:
                if costs.since_draft + 1 >= self.probe_every << costs.probe_backoff:
                    # keep α and the drafting cycle fresh: acceptance and costs may have changed
                    k = self.only or 1
                    self._burst = self.probe_rounds - 1
                    loss = self._loss_bits()
                    top = self.max_backoff + plain.bit_length() - 1 + loss
                    costs.probe_backoff = min(top, costs.probe_backoff + 1 + loss)
            else:
                costs.probe_backoff = 0
                if self._rounds % self.probe_every == self.probe_every - 1:
                    # Keep the neighbours' measured costs fresh, and the cost of not
                    # speculating at all: every k is weighed against it, and a cycle
                    # measured once (when the context was short, the drafter accurate, the
                    # machine idle) would otherwise keep speculation on after it stopped
                    # paying.
                    probe = (self._rounds // self.probe_every) % 4
                    if probe == 3:
                        k = 0
                    elif not self.only:
                        k = min(self.k_max, max(0, k + (1 if probe % 2 else -1)))
        self._rounds += 1
        self.costs.since_draft = 0 if k else self.costs.since_draft + plain
        return k

    def drafts_next(self, warm: bool = True) -> bool:
        """Whether the round after one without drafts (``next_k`` returned 0) will draft, as
        far as the schedule tells: a probe is due, or drafting won and that round was the
        probe of not drafting. Such a round does not decode its successor ahead
        (gateway/engine.py): the drafting round would stop that job and wait for its pass.
        At one stream on a 2-core CPU the first round of a probe took 21 ms for 4 tokens
        against 8.3 in steady drafting, its verify 12.8 ms against 7.4 beside a job stopped
        in vain (docs/performance.md). ``warm``: whether that round is measured (a prefill
        is not)."""
        costs = self.costs
        if costs.verify_ms_base is None:  # a plain verify is measured first: this one?
            return warm
        if not costs.known:  # a full draft is measured next
            return True
        if costs.since_draft + 1 >= self.probe_every << costs.probe_backoff:
            return True  # a probe is due
        # (nothing the choice weighs has changed since it chose none: its best k, if not 0,
        # means that round was the probe of not drafting)
        return best_k(self.alpha, costs, self.k_max, self.only) > 0

    def _loss_bits(self) -> int:
        """log2 of how many times more tokens a millisecond gives without drafts than with
        the best k the probes may draft, floored, from 0 (drafting loses by less than 2x)
        to ``max_loss_bits``. A probe costs its rounds' loss, so one that loses by r is worth
        r times fewer: on an H200, where the demo drafter on the CPU is slower than a
        replayed verify, drafting rounds cost 2.8 ms a token against 0.58 without, and
        probes at 8, 16, ... 512 tokens cost the defaults ~9% of a 2,048-token cell
        (docs/performance.md)."""
        plain = self.costs.round_ms(0)  # a token's (a plain round's share)
        ks = (self.only,) if self.only else range(1, self.k_max + 1)
        best = max(expected_tokens(self.alpha, k) / self.costs.round_ms(k) for k in ks)
        ratio = 1.0 / (plain * best) if plain > 0 and best > 0 else 1.0
        return min(self.max_loss_bits, max(0, int(ratio).bit_length() - 1))

    def observe(self, k: int, accepted: int) -> None:
        """Acceptance of one round: accepted of k drafts (stops at the first rejection)."""
        self._counts.observe(k, accepted)
        self.costs.acceptance.observe(k, accepted)
