"""Acceptance of drafts, counted: what the gateway's adaptive k (gateway/adaptive.py) and a
verifier's gate on its own drafts (verifier_svc/draft_gate.py) weigh drafts by."""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """E(k) = (1 − α^(k+1)) / (1 − α): tokens one round yields (accepted drafts + 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class AcceptanceCounts:
    """Decayed counts of accepted drafts and first rejections; α = s / (s + f)."""

    successes: float = 0.0
    failures: float = 0.0
    decay: float = 0.9  # per round

    def observe(self, k: int, accepted: int) -> None:
        if k == 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (0 if accepted == k else 1)

    def alpha(self, default: float) -> float:
        total = self.successes + self.failures
        return self.successes / total if total > 0 else default
