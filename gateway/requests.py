"""One request model for both doors: a generate request as the gRPC API or the HTTP API
received it (RequestFields, in neutral names; None = not given) is validated once into the
engine's GenerationSpec. A rejected request gets INVALID_ARGUMENT (HTTP 400) from either door
for the same field, with the field named as that door's clients know it (Door.names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.config import GatewayConfig
from services.errors import InvalidArgument
from services.messages import MAX_TOP_LOGPROBS
from services.params import SamplingParams

MAX_PROMPT_CHARS = 1_000_000
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 2.0  # OpenAI's range; beyond it the distribution is all but uniform
MAX_SESSION_ID_CHARS = 128
MAX_DRAFT_TOKENS = 64
DRAFTER_KINDS = ("", "model", "ngram")


@dataclass(frozen=True)
class GenerationSpec:
    prompt: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    num_draft_tokens: int  # 0 = the gateway's choice
    speculate: bool
    drafter_kind: str  # "" = the gateway's default
    session_id: str  # "" = a new session
    keep_session: bool
    resume_from: int = 0  # re-send the session's tokens from this position first
    explicit: frozenset[str] = frozenset()  # RequestFields names the request gave
    logprobs: int = -1  # -1: none; n >= 0: each token's logprob and the top n alternatives


@dataclass(frozen=True)
class RequestFields:
    """A generate request in neutral names, as a door received it. None: not given."""

    prompt: str = ""
    prompt_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    num_draft_tokens: int = 0  # 0 = the gateway's choice
    disable_speculation: bool = False
    drafter: str = ""
    session_id: str = ""
    keep_session: bool = False
    resume_from: int = 0
    logprobs: bool = False
    top_logprobs: int | None = None


# Fields that, given explicitly, a resume must leave equal to the turn it continues; those in
# OPTIONAL count as given when not None, the others when not empty (0, False, "", ()).
SETTINGS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed",
            "num_draft_tokens", "disable_speculation", "drafter")
OPTIONAL = ("temperature", "top_p", "top_k", "max_new_tokens", "seed")


@dataclass(frozen=True)
class Door:
    """How one API names the request's fields (neutral name -> its name) and its defaults."""

    name: str
    names: dict[str, str] = field(default_factory=dict)
    default_temperature: float = 0.0
    top_logprobs_needs: str = "logprobs = true"  # the wording of the rule, in this API

    def __call__(self, neutral: str) -> str:
        return self.names.get(neutral, neutral)


GRPC = Door("grpc", {
    "prompt_ids": "prompt_token_ids", "temperature": "sampling.temperature",
    "top_p": "sampling.top_p", "top_k": "sampling.top_k",
    "max_new_tokens": "sampling.max_new_tokens", "stop": "sampling.stop",
    "seed": "sampling.seed", "num_draft_tokens": "speculation.num_draft_tokens",
    "disable_speculation": "speculation.disable", "drafter": "speculation.drafter"})


def _bad(door: Door, neutral: str, message: str) -> InvalidArgument:
    """``message`` with ``{}`` standing for the field's name in the door's API."""
    return InvalidArgument(message.format(door(neutral)), field=neutral)


def _check_prompt(f: RequestFields, door: Door, vocab_size: int) -> None:
    if f.prompt and f.prompt_ids:
        raise _bad(door, "prompt", f"set either {{}} or {door('prompt_ids')}, not both")
    if f.resume_from:
        if f.resume_from < 0:
            raise _bad(door, "resume_from", f"{{}} must be >= 0, got {f.resume_from}")
        if not f.session_id:
            raise _bad(door, "resume_from", "{} needs the session_id of the stream to resume")
        if f.prompt or f.prompt_ids:
            raise _bad(door, "prompt", "resume_from continues a cut stream: leave {} empty")
    if not f.prompt and not f.prompt_ids and not f.session_id:
        raise _bad(door, "prompt", "{} is empty: send the prompt (text or token ids)")
    if len(f.prompt) > MAX_PROMPT_CHARS:
        raise _bad(door, "prompt", f"{{}} has {len(f.prompt)} characters; the limit is "
                                   f"{MAX_PROMPT_CHARS}")
    bad = [t for t in f.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise _bad(door, "prompt_ids", f"{{}} holds token ids outside the vocabulary "
                                       f"[0, {vocab_size}): {bad[:5]}")
    if f.session_id and (len(f.session_id) > MAX_SESSION_ID_CHARS
                         or not f.session_id.isprintable()):
        raise _bad(door, "session_id",
                   f"{{}} must be at most {MAX_SESSION_ID_CHARS} printable characters")


def _check_sampling(f: RequestFields, door: Door, config: GatewayConfig) -> None:
    t = f.temperature
    if t is not None and (not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE):
        raise _bad(door, "temperature", f"{{}} must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), "
                                        f"got {t:g}")
    if f.top_p is not None and (not math.isfinite(f.top_p) or not 0 < f.top_p <= 1):
        raise _bad(door, "top_p", f"{{}} must be in (0, 1], got {f.top_p:g}")
    if f.top_k is not None and f.top_k < 0:
        raise _bad(door, "top_k", f"{{}} must be >= 0 (0 = off), got {f.top_k}")
    cap = config.max_new_tokens_cap
    if f.max_new_tokens is not None and not 1 <= f.max_new_tokens <= cap:
        raise _bad(door, "max_new_tokens", f"{{}} must be in 1..{cap}, got {f.max_new_tokens}")
    if len(f.stop) > config.max_stop_strings:
        raise _bad(door, "stop", f"{{}} holds {len(f.stop)} strings; at most "
                                 f"{config.max_stop_strings}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in f.stop):
        raise _bad(door, "stop", f"{{}} strings must be 1..{MAX_STOP_CHARS} characters")
    if f.seed is not None and not 0 <= f.seed < 2**64:
        raise _bad(door, "seed", f"{{}} must be in 0..2^64-1, got {f.seed}")
    if f.top_logprobs is not None and not 0 <= f.top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad(door, "top_logprobs",
                   f"{{}} must be in 0..{MAX_TOP_LOGPROBS}, got {f.top_logprobs}")
    if f.top_logprobs and not f.logprobs:
        raise _bad(door, "top_logprobs", f"{{}} needs {door.top_logprobs_needs}")


def _check_speculation(f: RequestFields, door: Door) -> None:
    if not 0 <= f.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise _bad(door, "num_draft_tokens", f"{{}} must be in 0..{MAX_DRAFT_TOKENS} "
                                             f"(0 = automatic), got {f.num_draft_tokens}")
    if f.drafter not in DRAFTER_KINDS:
        raise _bad(door, "drafter", f"{{}} must be \"model\", \"ngram\" or empty (the gateway's "
                                    f"default), got {f.drafter!r}")


def validate(f: RequestFields, config: GatewayConfig, door: Door,
             vocab_size: int) -> GenerationSpec:
    """The engine's request, or InvalidArgument naming the first bad field in ``door``'s
    words (its ``field`` attribute holds the neutral name)."""
    _check_prompt(f, door, vocab_size)
    _check_sampling(f, door, config)
    _check_speculation(f, door)
    given = {name for name in SETTINGS if getattr(f, name) is not None and
             (name in OPTIONAL or getattr(f, name))}
    return GenerationSpec(
        prompt=f.prompt,
        prompt_ids=tuple(f.prompt_ids),
        params=SamplingParams(
            temperature=float(door.default_temperature if f.temperature is None
                              else f.temperature),
            top_k=f.top_k or 0, top_p=float(1.0 if f.top_p is None else f.top_p)),
        max_new_tokens=(config.default_max_new_tokens if f.max_new_tokens is None
                        else f.max_new_tokens),
        stop=tuple(f.stop),
        seed=f.seed,
        num_draft_tokens=f.num_draft_tokens,
        speculate=not f.disable_speculation,
        drafter_kind=f.drafter,
        session_id=f.session_id,
        keep_session=f.keep_session or bool(f.session_id),
        resume_from=f.resume_from,
        explicit=frozenset(given),
        logprobs=(f.top_logprobs or 0) if f.logprobs else -1,
    )
