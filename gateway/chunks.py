"""What a generation yields: its chunks, how it finished, its usage; and the target's limits
the gateway checks requests against."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.messages import TokenLogprobs


class Finish(enum.Enum):
    LENGTH = 1
    EOS = 2
    STOP = 3
    CONTEXT = 4


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    session_id: str
    finish: Finish | None = None
    usage: Usage | None = None
    offset: int = 0  # session position of the first token
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token when the request asked for them


async def collect(chunks: AsyncIterator[Chunk], first: Chunk | None = None) -> Chunk:
    """A generation's chunks (``first`` already taken from them, if given) as one: all the
    text, tokens and logprobs, the last chunk's finish, usage and session, the first's offset.
    Both doors' unary answers are built from it."""
    parts = [first] if first is not None else []
    parts += [chunk async for chunk in chunks]
    if not parts:
        raise RuntimeError("the generation ended without a chunk")
    last = parts[-1]
    return Chunk(text="".join(c.text for c in parts),
                 token_ids=[t for c in parts for t in c.token_ids],
                 session_id=last.session_id, finish=last.finish, usage=last.usage,
                 offset=parts[0].offset, logprobs=tuple(t for c in parts for t in c.logprobs))


@dataclass(frozen=True)
class TargetLimits:
    """What the gateway needs to know of the target, from the verifiers' ModelInfo."""

    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    fingerprint: str
    model: str = ""
    max_draft_tokens: int = 64  # the smallest limit of the drafters and verifiers
