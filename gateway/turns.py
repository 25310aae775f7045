"""A session's current turn, as the session handle records it: the request's settings and
its progress, so that a stream cut by a dead gateway continues as the same request.

DESIGN's failure model: "the client continues with its session_id and resume_from on any
gateway, and the continuation is the original request: same sampling settings, seed, stop
strings and remaining token budget". The record is written with every commit (one Lua
script, so settings, progress and tokens never disagree) and read back on resume.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.chunks import Chunk, Finish, Usage
from gateway.requests import GRPC, GenerationSpec
from gateway.turn_text import TurnText
from services.errors import InvalidArgument
from services.params import SamplingParams


@dataclass
class TurnRecord:
    """One turn of a session: where its generation started, what it asked for, how far it got."""

    start: int  # committed tokens before the first generated one (the prompt included)
    prompt_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int  # resolved: a random seed drawn at the start when the request gave none
    max_new_tokens: int
    stop: tuple[str, ...]
    num_draft_tokens: int  # as requested (0 = the gateway's choice)
    speculate: bool
    drafter_kind: str
    seeded: bool = False  # the request gave the seed (seeded sampling fixes k)
    rounds: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    finish: str = ""  # Finish name once the turn has ended

    @classmethod
    def begin(cls, spec: GenerationSpec, start: int, prompt_tokens: int, seed: int) -> TurnRecord:
        p = spec.params
        return cls(start=start, prompt_tokens=prompt_tokens, temperature=p.temperature,
                   top_k=p.top_k, top_p=p.top_p, seed=seed, max_new_tokens=spec.max_new_tokens,
                   stop=tuple(spec.stop), num_draft_tokens=spec.num_draft_tokens,
                   speculate=spec.speculate, drafter_kind=spec.drafter_kind,
                   seeded=spec.seed is not None)

    def to_dict(self) -> dict:
        # (every round: a shallow read of the fields, not dataclasses.asdict's deep copy,
        # which took 4% of a gateway's event loop at 16 streams)
        d = {name: getattr(self, name) for name in _FIELDS}
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TurnRecord:
        return cls(**{k: (tuple(v) if k == "stop" else v) for k, v in d.items() if k in _FIELDS})


_FIELDS = tuple(f.name for f in dataclasses.fields(TurnRecord))


def resumed_spec(spec: GenerationSpec, turn: TurnRecord) -> GenerationSpec:
    """The spec of the turn a resume request continues: every setting from ``turn``. A
    setting the resume request gives explicitly must equal the turn's, else INVALID_ARGUMENT
    naming it (a resume cannot change the request it continues)."""
    recorded = {
        "temperature": turn.temperature, "top_k": turn.top_k, "top_p": turn.top_p,
        "max_new_tokens": turn.max_new_tokens, "stop": turn.stop,
        "seed": turn.seed if turn.seeded else None, "num_draft_tokens": turn.num_draft_tokens,
        "disable_speculation": not turn.speculate, "drafter": turn.drafter_kind,
    }
    given = {
        "temperature": spec.params.temperature, "top_k": spec.params.top_k,
        "top_p": spec.params.top_p, "max_new_tokens": spec.max_new_tokens,
        "stop": tuple(spec.stop), "seed": spec.seed, "num_draft_tokens": spec.num_draft_tokens,
        "disable_speculation": not spec.speculate, "drafter": spec.drafter_kind,
    }
    for name in sorted(spec.explicit):
        if name in recorded and given[name] != recorded[name]:
            door = GRPC(name)  # resuming is the gRPC API's
            raise InvalidArgument(
                f"{door} is {given[name]!r} but the stream being resumed was started with "
                f"{recorded[name]!r}: a resume continues the original request; leave "
                f"{door} unset (or equal)", field=name)
    return dataclasses.replace(
        spec, params=SamplingParams(temperature=turn.temperature, top_k=turn.top_k,
                                    top_p=turn.top_p),
        max_new_tokens=turn.max_new_tokens, stop=turn.stop,
        seed=turn.seed if turn.seeded else None, num_draft_tokens=turn.num_draft_tokens,
        speculate=turn.speculate, drafter_kind=turn.drafter_kind)


def turn_to_resume(session_id: str, recorded: dict, committed: int,
                   resume_from: int) -> TurnRecord:
    """The turn a resume continues (the session's recorded turn, ``committed`` tokens long),
    or INVALID_ARGUMENT when there is none or ``resume_from`` lies outside it."""
    if not recorded:
        raise InvalidArgument(f"session {session_id!r} has no recorded turn to resume: "
                              "send a prompt to start one", field="resume_from")
    turn = TurnRecord.from_dict(recorded)
    if not turn.start <= resume_from <= committed:
        raise InvalidArgument(
            f"resume_from {resume_from} is outside the turn being resumed: it must lie "
            f"in {turn.start}..{committed} (from the turn's first generated token to "
            f"past the session's {committed} committed tokens)", field="resume_from")
    return turn


def resume_chunk(session_id: str, tokens: list[int], turn: TurnRecord, start: int,
                 text: TurnText, usage: Usage) -> Chunk:
    """The tokens a cut stream's client has not received (committed from ``start`` on) and
    their text, replayed through the turn's detokenizer and stop matcher so that the text
    equals the uninterrupted stream's (a suffix held back before the cut included); the last
    chunk (finish, usage) when the turn had already ended."""
    shown, finish = text.replay(tokens[turn.start:start], tokens[start:],
                                Finish[turn.finish] if turn.finish else None)
    return Chunk(text=shown, token_ids=tokens[start:], session_id=session_id, offset=start,
                 finish=finish, usage=usage if finish else None)
