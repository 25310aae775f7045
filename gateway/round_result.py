"""What a round yields and how it moves a session: the round's result, the drafts it
prepared for the next round (the speculation cache, gateway/rounds.py), and the one function
that commits a round's tokens to the session handle and advances each replica's cursor."""

from __future__ import annotations

from dataclasses import dataclass

from services.messages import DraftResult, TokenLogprobs
from services.session_store import SessionHandle


@dataclass(frozen=True)
class SpecCache:
    """Round r+1's drafts prepared during round r's verify (see the module docstring)."""

    base: int  # committed tokens when they were prepared
    branches: dict[tuple[int, ...], DraftResult]  # tokens committed after base -> drafts

    def lookup(self, tokens: list[int]) -> DraftResult | None:
        """The drafts prepared for exactly what was committed since ``base``, if any."""
        return self.branches.get(tuple(tokens[self.base:]))


@dataclass(frozen=True)
class RoundResult:
    drafted: tuple[int, ...]
    drafter_tail: tuple[int, ...] | None  # what the drafter holds past the old tokens (None:
    #                                       no drafter call involved this round)
    num_accepted: int
    extra_token: int
    draft_ms: float  # wall time of the draft call on the round's critical path (0: none)
    verify_ms: float
    draft_compute_ms: float  # its model compute (0 when the drafts were prefetched)
    verify_compute_ms: float
    pipeline: str = ""  # speculation cache: "used" (hit), "dropped" (miss) or "none"
    #                     (nothing prepared); "" without drafts
    warm: bool = True  # both calls found their caches and the drafter had at most k + 1
    #                    tokens to catch up with (no prefill, resync or catch-up in the timings)
    prefetch: SpecCache | None = None  # drafts for the next round, if prepared
    waited_ms: float = 0.0  # time spent awaiting replicas (the rest of the round is the gateway's)
    logprobs: tuple[TokenLogprobs, ...] = ()  # of ``proposed``, when the request asked for them
    more: tuple[int, ...] = ()  # a round without drafts: the verifier's tokens after extra_token
    asked: int = 1  # a round without drafts: the tokens it asked for (fewer came: ``cut``)

    @property
    def proposed(self) -> list[int]:
        """The tokens this round yields: the accepted drafts, then the verifier's own
        token(s)."""
        return [*self.drafted[: self.num_accepted], self.extra_token, *self.more]

    @property
    def cut(self) -> bool:
        """A round without drafts that got fewer tokens than it asked for, short of an end of
        sequence: its Verify step also fed a prompt or verified drafts, and so asked each of
        its calls for one token (gateway/replicas.py ``fit_verify_step``)."""
        return not self.drafted and 1 + len(self.more) < self.asked


def commit_round(h: SessionHandle, r: RoundResult, kept: list[int]) -> None:
    """Appends the round's ``kept`` tokens (its proposed ones, possibly cut by a stop) to the
    handle and moves each replica's cursor: how many committed tokens its cache holds. The
    verifier holds the old tokens and the accepted drafts; the drafter the old tokens and its
    tail (the drafts, and after a speculation call its guess and the next drafts), each valid
    as far as it matches what was kept; after a round of several tokens without drafts the
    verifier holds all but the last. The one place these cursors advance."""
    old = len(h.tokens)
    h.verifier.length = old + min(r.num_accepted + len(r.more), len(kept))
    if r.drafter_tail is not None:
        h.drafter.length = old + _common_prefix(r.drafter_tail, kept)
    h.tokens.extend(kept)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
