"""What a generation yields: its chunks, how it finished, its usage; and the target's limits
the gateway checks requests against."""

from __future__ import annotations

import enum
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


@dataclass(frozen=True)
class TargetLimits:
    """What the gateway needs to know of the target, from the verifiers' ModelInfo."""

    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]
    fingerprint: str
    model: str = ""
    max_draft_tokens: int = 64  # the smallest limit of the drafters and verifiers
