"""Sampling settings as a plain dataclass, without torch: the gateway imports this (it
routes and streams, it never samples), the drafter and verifier use it through
services.sampling, which re-exports it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1.0 => off; valid range (0, 1]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError describing what to fix if any field is invalid."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables top-k), got {k!r}")
        p = self.top_p
        if (isinstance(p, bool) or not isinstance(p, (int, float))
                or not (math.isfinite(p) and 0.0 < p <= 1.0)):
            raise ValueError(f"top_p must be a finite number in (0, 1] (1.0 disables top-p), got {p!r}")
