"""OpenAI request bodies (pydantic) and their translation to a GenerationSpec, validated
with messages that name the HTTP field and its range (docs/api.md lists every field)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.errors import bad_request
from gateway.requests import MAX_PROMPT_CHARS, MAX_STOP_CHARS, GenerationSpec
from services.config import GatewayConfig
from services.messages import MAX_TOP_LOGPROBS
from services.params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class Speculation(BaseModel):
    """Extension: how to speculate (the gRPC API's SpeculationParams)."""

    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: int = Field(0, ge=0, le=64)
    disable: bool = False
    drafter: str = Field("", pattern="^(|model|ngram)$")


class _Common(BaseModel):
    """Fields both endpoints take. Unknown fields are ignored, as OpenAI's own server and
    vLLM do; known ones this server cannot honour get a 400 (see _unsupported)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (as vLLM's top_k; the rest as the gRPC API's GenerateRequest).
    top_k: int | None = None
    session_id: str | None = None
    keep_session: bool = False
    speculation: Speculation | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Common):
    messages: list = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None


def _unsupported(body: _Common) -> None:
    """400 for OpenAI features with a non-default value that this server does not offer."""
    if body.n not in (None, 1):
        raise bad_request(f"n must be 1 (one choice per request), got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            raise bad_request(f"{name} is not supported: leave it unset or 0 (the output "
                              "follows the target's distribution exactly)", name)
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise bad_request("echo is not supported", "echo")
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {body.best_of}", "best_of")
    if isinstance(body, ChatCompletionRequest):
        if body.tools:
            raise bad_request("tools are not supported", "tools")
        if body.response_format and body.response_format.get("type") not in (None, "text"):
            raise bad_request("response_format must be {\"type\": \"text\"}", "response_format")


def prompt_of(body: CompletionRequest) -> tuple[str, tuple[int, ...]]:
    """(text, token ids) of /v1/completions' prompt: one string or one list of token ids."""
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request(f"prompt holds {len(p)} prompts: send one prompt per request",
                              "prompt")
        p = p[0]
    if isinstance(p, list):
        if any(isinstance(t, bool) or t < 0 for t in p):
            raise bad_request("prompt token ids must be integers >= 0", "prompt")
        return "", tuple(p)
    if not p and not body.session_id:
        raise bad_request("prompt is required: a string or a list of token ids", "prompt")
    if len(p or "") > MAX_PROMPT_CHARS:
        raise bad_request(f"prompt has {len(p)} characters; the limit is {MAX_PROMPT_CHARS}",
                          "prompt")
    return p or "", ()


def spec_of(body: _Common, config: GatewayConfig, prompt: str, prompt_ids: tuple[int, ...],
            max_tokens: int | None, logprobs: int) -> GenerationSpec:
    """The engine's request. Defaults follow OpenAI's API: temperature 1, top_p 1."""
    _unsupported(body)
    temperature = 1.0 if body.temperature is None else body.temperature
    if not math.isfinite(temperature) or not 0 <= temperature <= 2:
        raise bad_request(f"temperature must be in [0, 2] (0 = greedy), got {temperature}",
                          "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = body.top_k if body.top_k not in (None, -1) else 0
    if top_k < 0:
        raise bad_request(f"top_k must be >= 0 (0 or -1 = off), got {body.top_k}", "top_k")
    cap = config.max_new_tokens_cap
    max_new = config.default_max_new_tokens if max_tokens is None else max_tokens
    if not 1 <= max_new <= cap:
        raise bad_request(f"max_tokens must be in 1..{cap}, got {max_new}", "max_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > config.max_stop_strings:
        raise bad_request(f"stop holds {len(stop)} strings; at most {config.max_stop_strings}",
                          "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise bad_request(f"stop strings must be 1..{MAX_STOP_CHARS} characters", "stop")
    if body.seed is not None and not 0 <= body.seed < 2**64:
        raise bad_request(f"seed must be in 0..2^64-1, got {body.seed}", "seed")
    session = body.session_id or ""
    if session and (len(session) > 128 or not session.isprintable()):
        raise bad_request("session_id must be at most 128 printable characters", "session_id")
    spec = body.speculation or Speculation()
    return GenerationSpec(
        prompt=prompt, prompt_ids=prompt_ids,
        params=SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p)),
        max_new_tokens=max_new, stop=stop, seed=body.seed,
        num_draft_tokens=spec.num_draft_tokens, speculate=not spec.disable,
        drafter_kind=spec.drafter, session_id=session,
        keep_session=body.keep_session or bool(session), logprobs=logprobs)


def completion_logprobs(body: CompletionRequest) -> int:
    """/v1/completions' logprobs (an int: top alternatives, 0 = the token's only)."""
    if body.logprobs is None:
        return -1
    if not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {body.logprobs}",
                          "logprobs")
    return body.logprobs


def chat_logprobs(body: ChatCompletionRequest) -> int:
    """/v1/chat/completions' logprobs (bool) and top_logprobs (0..20)."""
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top}",
                          "top_logprobs")
    if top and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if body.logprobs else -1
