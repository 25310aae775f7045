"""What a round yields: the round's result and the drafts it prepared for the next round
(the speculation cache, gateway/rounds.py). How a result moves the session:
gateway/session_rounds.py."""

from __future__ import annotations

from dataclasses import dataclass

from services.messages import DraftResult, TokenLogprobs


@dataclass(frozen=True)
class SpecCache:
    """Round r+1's drafts prepared during round r's verify (see the module docstring)."""

    base: int  # committed tokens when they were prepared
    branches: dict[tuple[int, ...], DraftResult]  # tokens committed after base -> drafts
    width: int = 0  # the branches asked for (gateway/tree_width.py; 0: not a tree call)

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
    trees: bool | None = None  # the tree switch's mode for this round (None: not asked)

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
