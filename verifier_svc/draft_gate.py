"""Which sessions of a drafting step draft (verifier_svc/local_drafts.py): one whose own drafts
are accepted too rarely to pay for a drafting step decodes that step without them.

A level's switch (services/paired_switch.py) decides from its steps' rates whether drafting
pays for the level's sessions on the whole. Its epochs take a second or more, and where the
two modes serve within ~10% of each other one epoch cannot tell them apart: behind the
bench's 385-820-token prompts it read drafting at 356 and then 435 tokens/s against 379 and
413 not drafting, while drafting served 0.85-0.90x target-only (docs/performance.md,
2026-11-29). A session's acceptance tells sooner. A drafting step yields E(α, k) =
(1 − α^(k+1)) / (1 − α) of the session's tokens where a step without drafts yields one, and
takes t_draft / t_plain as long (both the level's, averaged over its counted steps); so a
session drafts while E(α, k) ≥ t_draft / t_plain. Its α is its own local drafts' counts with
the level's (all its sessions') as a prior worth ``prior_steps`` steps. Behind those long
prompts the demo drafts were accepted ~0.27 a token (E(3) ≈ 1.37); on the short ones 0.7-0.85
(E(3) ≈ 2.5-3.2).

The gate holds no session back from an exploration's drafting steps (the caller asks only
outside them): those are the switch's measure of drafting, and the steps that go on feeding
the level's α when every session is held back. A session held back ``probe_every`` steps in a
row drafts the next one (a probe), so that one whose drafts start to pay again (prose after a
code block) is seen to within that many steps. A step that feeds a context (a prompt to the
target, a session's context to the draft model) costs what comes once a session and does not
enter the step times.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from services.acceptance import AcceptanceCounts, expected_tokens


@dataclass
class DraftGate:
    max_sessions: int = 1024  # sessions whose counts are kept (the least recent dropped)
    prior_steps: float = 4.0  # the level's α counts as this many of a session's steps
    weight: float = 0.1  # of a step in its kind's average time
    probe_every: int = 16  # a session held back this many steps in a row drafts the next
    _step_s: dict[tuple[int, bool], float] = field(default_factory=dict)  # (level, drafted)
    _levels: dict[int, AcceptanceCounts] = field(default_factory=dict)
    _sessions: OrderedDict[str, AcceptanceCounts] = field(default_factory=OrderedDict)
    _held: dict[str, int] = field(default_factory=dict)  # per session: steps held back in a row

    def allows(self, session_id: str, level: int, k: int) -> bool:
        """Whether ``session_id`` drafts ``k`` tokens in a drafting step of ``level``: yes
        until both kinds of step were timed there and the level has counts."""
        t_draft, t_plain = self._step_s.get((level, True)), self._step_s.get((level, False))
        shared = self._levels.get(level)
        if t_draft is None or t_plain is None or shared is None:
            return True
        if expected_tokens(self.alpha(session_id, level), k) * t_plain >= t_draft:
            self._held.pop(session_id, None)
            return True
        held = self._held.get(session_id, 0) + 1
        if held > self.probe_every:  # the probe
            self._held.pop(session_id, None)
            return True
        self._held[session_id] = held
        while len(self._held) > self.max_sessions:  # (sessions never released)
            del self._held[next(iter(self._held))]
        return False

    def alpha(self, session_id: str, level: int) -> float:
        """The session's α: its counts, with the level's as ``prior_steps`` steps."""
        shared = self._levels.get(level)
        prior = shared.alpha(0.6) if shared is not None else 0.6
        own = self._sessions.get(session_id)
        s, f = (own.successes, own.failures) if own is not None else (0.0, 0.0)
        return min(0.99, (s + self.prior_steps * prior) / (s + f + self.prior_steps))

    def observe_step(self, level: int, drafted: bool, seconds: float) -> None:
        """A counted step of ``level`` took ``seconds``, with drafts or without."""
        old = self._step_s.get((level, drafted))
        self._step_s[(level, drafted)] = (seconds if old is None else
                                          old + self.weight * (seconds - old))

    def observe_drafts(self, session_id: str, level: int, drafted: int, accepted: int) -> None:
        """``session_id``'s step verified ``drafted`` local drafts and accepted ``accepted``."""
        if drafted <= 0:
            return
        shared = self._levels.get(level)
        if shared is None:
            shared = self._levels[level] = AcceptanceCounts(decay=0.98)
        shared.observe(drafted, accepted)
        own = self._sessions.get(session_id)
        if own is None:
            own = self._sessions[session_id] = AcceptanceCounts(decay=0.9)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        own.observe(drafted, accepted)

    def release(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self._held.pop(session_id, None)
