"""Adaptive draft length: pick k to maximise expected tokens per second.

With per-token acceptance rate α, a round that drafts k tokens yields
E(k) = (1 − α^(k+1)) / (1 − α) tokens on average (Leviathan et al. 2023, eq. 1) and
costs T(k) = k·t_draft + t_verify(k) + rtt(k): drafting k tokens, one verifier forward
over the pending token plus k drafts, and the network round trips (two calls, or one
without drafts). The best k maximises E(k) / T(k); k = 0 (no speculation) wins when
drafts are rarely accepted or drafting costs as much as verifying.

All costs are measured, not assumed: the gateway keeps running estimates (EWMA) of the
draft time per token, the verify time with and without drafts, and the network time;
each request keeps its own α.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """E(k) = (1 − α^(k+1)) / (1 − α): tokens one round yields (accepted drafts + 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


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
    weight: float = 0.1

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

    @property
    def known(self) -> bool:
        return None not in (self.draft_ms_per_token, self.verify_ms_base,
                            self.verify_ms_per_draft, self.rtt_ms)

    def round_ms(self, k: int) -> float:
        if k == 0:
            return self.verify_ms_base + self.rtt_ms
        return (k * self.draft_ms_per_token + self.verify_ms_base
                + k * self.verify_ms_per_draft + 2 * self.rtt_ms)


def best_k(alpha: float, costs: CostModel, k_max: int) -> int:
    """The k in 0..k_max with the most expected tokens per millisecond."""
    return max(range(k_max + 1),
               key=lambda k: (expected_tokens(alpha, k) / costs.round_ms(k), -k))


@dataclass
class AdaptiveK:
    """One request's draft-length controller."""

    costs: CostModel
    k_max: int
    alpha: float = 0.6  # prior until the request has drafted
    weight: float = 0.3
    probe_every: int = 8  # while k = 0 wins, draft 1 token every this many rounds
    _since_draft: int = 0

    def next_k(self) -> int:
        if self.costs.verify_ms_base is None:
            k = 0  # measure a plain verify first
        elif not self.costs.known:
            k = self.k_max  # then a full draft
        else:
            k = best_k(self.alpha, self.costs, self.k_max)
            if k == 0 and self._since_draft + 1 >= self.probe_every:
                k = 1  # keep α fresh: acceptance may have changed
        self._since_draft = 0 if k else self._since_draft + 1
        return k

    def observe(self, k: int, accepted: int) -> None:
        """Acceptance of one round: accepted of k drafts (stops at the first rejection)."""
        if k == 0:
            return
        # MLE of a per-token rate from a truncated run: accepted / (accepted + rejections).
        rejected = 0 if accepted == k else 1
        sample = accepted / (accepted + rejected) if accepted + rejected else self.alpha
        self.alpha = min(0.99, max(0.0, _ewma(self.alpha, sample, self.weight)))
