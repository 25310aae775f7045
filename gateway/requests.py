"""GenerateRequest (protobuf) -> GenerationSpec (dataclass), validated with messages that
say what to fix."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.config import GatewayConfig
from services.errors import InvalidArgument
from services.messages import MAX_TOP_LOGPROBS
from services.params import SamplingParams
from specmesh.v1 import gateway_pb2

MAX_PROMPT_CHARS = 1_000_000
MAX_STOP_CHARS = 256


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
    explicit: frozenset[str] = frozenset()  # settings the request gave ("sampling.top_k", ...)
    logprobs: int = -1  # -1: none; n >= 0: each token's logprob and the top n alternatives


def spec_from_request(req: gateway_pb2.GenerateRequest, config: GatewayConfig) -> GenerationSpec:
    if req.prompt and req.prompt_token_ids:
        raise InvalidArgument("set either prompt or prompt_token_ids, not both")
    if req.resume_from:
        if not req.session_id:
            raise InvalidArgument("resume_from needs the session_id of the stream to resume")
        if req.prompt or req.prompt_token_ids:
            raise InvalidArgument("resume_from continues a cut stream: leave prompt empty")
        if req.resume_from < 0:
            raise InvalidArgument(f"resume_from must be >= 0, got {req.resume_from}")
    if not req.prompt and not req.prompt_token_ids and not req.session_id:
        raise InvalidArgument("prompt is empty: set prompt (text) or prompt_token_ids")
    if len(req.prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"prompt has {len(req.prompt)} characters; the limit is "
                              f"{MAX_PROMPT_CHARS}")
    if req.session_id and (len(req.session_id) > 128 or not req.session_id.isprintable()):
        raise InvalidArgument("session_id must be at most 128 printable characters")

    s = req.sampling
    temperature = s.temperature if s.HasField("temperature") else 0.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    top_k = s.top_k if s.HasField("top_k") else 0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(f"sampling.temperature must be a finite number >= 0 (0 = greedy), "
                              f"got {temperature}")
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise InvalidArgument(f"sampling.top_k must be >= 0 (0 = off), got {top_k}")
    max_new = s.max_new_tokens if s.HasField("max_new_tokens") else config.default_max_new_tokens
    if not 0 < max_new <= config.max_new_tokens_cap:
        raise InvalidArgument(f"sampling.max_new_tokens must be in 1..{config.max_new_tokens_cap}, "
                              f"got {max_new}")
    stop = tuple(s.stop)
    if len(stop) > config.max_stop_strings:
        raise InvalidArgument(f"at most {config.max_stop_strings} stop strings, got {len(stop)}")
    if any(not x or len(x) > MAX_STOP_CHARS for x in stop):
        raise InvalidArgument(f"stop strings must be 1..{MAX_STOP_CHARS} characters")

    spec = req.speculation
    if not 0 <= spec.num_draft_tokens <= 64:
        raise InvalidArgument(f"speculation.num_draft_tokens must be in 0..64 (0 = automatic), "
                              f"got {spec.num_draft_tokens}")
    if spec.drafter not in ("", "model", "ngram"):
        raise InvalidArgument(f"speculation.drafter must be \"model\", \"ngram\" or empty (the "
                              f"gateway's default), got {spec.drafter!r}")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got "
                              f"{req.top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs = true")
    explicit = {f"sampling.{name}" for name in
                ("temperature", "top_p", "top_k", "max_new_tokens", "seed") if s.HasField(name)}
    explicit |= {name for name, given in (("sampling.stop", bool(stop)),
                                          ("speculation.num_draft_tokens", spec.num_draft_tokens),
                                          ("speculation.disable", spec.disable),
                                          ("speculation.drafter", spec.drafter)) if given}
    return GenerationSpec(
        prompt=req.prompt,
        prompt_ids=tuple(req.prompt_token_ids),
        params=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
        max_new_tokens=max_new,
        stop=stop,
        seed=s.seed if s.HasField("seed") else None,
        num_draft_tokens=spec.num_draft_tokens,
        speculate=not spec.disable,
        drafter_kind=spec.drafter,
        session_id=req.session_id,
        keep_session=req.keep_session or bool(req.session_id),
        resume_from=req.resume_from,
        explicit=frozenset(explicit),
        logprobs=req.top_logprobs if req.logprobs else -1,
    )
