"""One session's rounds within a request: the one state object the round loop reads and
moves (gpt-fast's ``speculative_decode`` keeps the same things in locals).

    handle    the committed tokens, and per tier a Cursor (services/session_store.py):
              the replica holding the session's cache and how many committed tokens it holds
    index     rounds run in the turn (a round's seeds are drawn from it)
    prefetch  the next round's drafts, prepared during this round's verify (SpecCache)
    last      when the latest round started, and its result (the next round's cycle is
              measured from it)
    adaptive  the request's own adaptive k, when it has one

A round moves it once, in ``advance``: the round's kept tokens are appended and each tier's
cursor moves to what that tier's cache now holds. A call that lands on another replica
moves the cursor's replica (gateway/rounds.py); a replica that lost the session resets it.

``RequestState`` is the request around it in the gateway's engine: its settings, its owner
and deadline, and what it has generated and used so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.adaptive import AdaptiveK
from gateway.chunks import Usage
from gateway.requests import GenerationSpec
from gateway.round_result import RoundResult, SpecCache
from gateway.turns import TurnRecord
from services.session_store import SessionHandle


@dataclass
class SessionRounds:
    handle: SessionHandle
    index: int = 0
    prefetch: SpecCache | None = None
    last: tuple[float, RoundResult] | None = None
    adaptive: AdaptiveK | None = None
    stolen_at: tuple[int, int] | None = None  # the host's steal clock at the last round's start

    @property
    def tokens(self) -> list[int]:
        return self.handle.tokens

    def advance(self, r: RoundResult, kept: list[int], started: float) -> None:
        """Commits the round that started at ``started`` with its ``kept`` tokens (its
        proposed ones, possibly cut by a stop or the budget). The verifier holds the old
        tokens and the accepted drafts, after a round of several tokens without drafts all
        but the last; the drafter the old tokens and its tail (the drafts, and after a
        speculation call its guess and the next drafts), each as far as it matches what was
        kept. The one place the cursors advance."""
        h = self.handle
        old = len(h.tokens)
        h.verifier.advance(old + min(r.num_accepted + len(r.more), len(kept)))
        if r.drafter_tail is not None:
            h.drafter.advance(old + _common_prefix(r.drafter_tail, kept))
        h.tokens.extend(kept)
        self.index += 1
        self.prefetch = r.prefetch
        self.last = (started, r)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class RequestState:
    """A request's state in the gateway's engine (gateway/engine.py): its settings, its
    session's rounds, and what it has generated and used so far."""

    spec: GenerationSpec
    rounds: SessionRounds  # the session's tokens, cursors and round state
    owner: str
    seed: int
    deadline: Callable[[], float | None]
    turn: TurnRecord  # settings and progress, saved with every commit (resume reads it)
    usage: Usage = field(default_factory=Usage)
    generated: int = 0
    started: float = field(default_factory=time.perf_counter)  # (the engine: the arrival)
    first_token_at: float = 0.0
    pending: int = 0  # the last tokens of handle.tokens not yet in Redis (it was unreachable)

    @property
    def handle(self) -> SessionHandle:
        return self.rounds.handle
