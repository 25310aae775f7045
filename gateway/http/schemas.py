"""OpenAI request bodies (pydantic) and their translation to the neutral request
(gateway/requests.py), validated by the same rules as the gRPC API's, with messages and
``param`` in this API's field names (docs/api.md lists every field)."""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field

from gateway.http.errors import ApiError, bad_request
from gateway.requests import Door, GenerationSpec, RequestFields, validate
from services.config import GatewayConfig
from services.errors import InvalidArgument

_SPECULATION = {"num_draft_tokens": "speculation.num_draft_tokens",
                "disable_speculation": "speculation.disable", "drafter": "speculation.drafter"}
COMPLETIONS = Door("completions", {"prompt_ids": "prompt", "max_new_tokens": "max_tokens",
                                   "top_logprobs": "logprobs", **_SPECULATION},
                   default_temperature=1.0, top_logprobs_needs="logprobs")
CHAT = Door("chat", {"prompt": "messages", "prompt_ids": "messages",
                     "max_new_tokens": "max_tokens", **_SPECULATION},
            default_temperature=1.0, top_logprobs_needs="logprobs: true")


class StreamOptions(BaseModel):
    include_usage: bool = False


class Speculation(BaseModel):
    """Extension: how to speculate (the gRPC API's SpeculationParams)."""

    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: int = 0
    disable: bool = False
    drafter: str = ""


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


def prompts_of(body: CompletionRequest) -> list[tuple[str, tuple[int, ...]]]:
    """(text, token ids) of each prompt of /v1/completions' ``prompt``: a string, a list of
    token ids, or a list of either (one choice each, specmesh's gateway/http/choices.py)."""
    p = body.prompt
    many = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    out = []
    for one in many:
        if isinstance(one, list):
            if any(isinstance(t, bool) for t in one):
                raise bad_request("prompt token ids must be integers, not booleans", "prompt")
            out.append(("", tuple(one)))
        else:
            out.append((one or "", ()))
    return out


def param_error(exc: InvalidArgument, door: Door) -> ApiError:
    """A 400 naming the field at fault in this API's words."""
    return bad_request(str(exc), door(exc.field) if exc.field else None)


def spec_of(body: _Common, config: GatewayConfig, vocab_size: int, prompt: str,
            prompt_ids: tuple[int, ...], door: Door, logprobs: bool,
            top_logprobs: int | None) -> GenerationSpec:
    """The engine's request, by the rules both doors share; OpenAI's defaults (temperature 1)."""
    _unsupported(body)
    spec = body.speculation or Speculation()
    fields = RequestFields(
        prompt=prompt, prompt_ids=prompt_ids, temperature=body.temperature, top_p=body.top_p,
        top_k=None if body.top_k == -1 else body.top_k,  # -1 = off, as vLLM's
        max_new_tokens=max_tokens_of(body),
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        seed=body.seed, num_draft_tokens=spec.num_draft_tokens,
        disable_speculation=spec.disable, drafter=spec.drafter,
        session_id=body.session_id or "", keep_session=body.keep_session,
        logprobs=logprobs, top_logprobs=top_logprobs)
    try:
        return validate(fields, config, door, vocab_size)
    except InvalidArgument as exc:
        raise param_error(exc, door) from None


def max_tokens_of(body: _Common) -> int | None:
    chat_max = getattr(body, "max_completion_tokens", None)
    return chat_max if chat_max is not None else body.max_tokens


def chat_door(body: ChatCompletionRequest) -> Door:
    """Chat's names, with the length field the request used."""
    if body.max_completion_tokens is None:
        return CHAT
    return replace(CHAT, names={**CHAT.names, "max_new_tokens": "max_completion_tokens"})
