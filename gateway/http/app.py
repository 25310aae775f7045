"""The OpenAI-compatible HTTP API as a FastAPI app over the gateway's GenerationEngine:
the same engine, Redis sessions, API keys and rate limits as the gRPC API, on the same
event loop (gateway/http/serve.py). docs/api.md documents every field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, format_sse_event
from opentelemetry import metrics as metrics_api
from opentelemetry import trace
from starlette.exceptions import HTTPException

from gateway.auth import Authenticator
from gateway.chunks import Chunk
from gateway.engine import GenerationEngine
from gateway.http.chat import has_template, render_chat, validate_messages
from gateway.http.choices import choice_specs, first_chunks, merged, total_usage, wholes
from gateway.http.errors import ApiError, from_exception
from gateway.http.observe import Observe
from gateway.http.responses import Formatter
from gateway.http.schemas import (
    COMPLETIONS,
    ChatCompletionRequest,
    CompletionRequest,
    chat_door,
    param_error,
    prompts_of,
    spec_of,
)
from gateway.requests import Door, GenerationSpec
from services.config import GatewayConfig
from services.errors import InvalidArgument, SpecMeshError


@dataclass
class HttpContext:
    engine: GenerationEngine
    config: GatewayConfig
    auth: Authenticator
    ready: Callable[[], Awaitable[bool]]  # follows the gRPC health status
    tracer: trace.Tracer | None = None
    meter: metrics_api.Meter | None = None


def model_ids(model: str) -> tuple[str, ...]:
    """The served model's id (a local directory's name, else the hub name) and the name it
    was started with; requests may use either."""
    local = Path(model)
    primary = local.name if model and local.is_dir() else model
    return (primary, model) if primary != model else (primary,)


def _metadata(request: Request) -> list[tuple[str, str]]:
    return [(name, request.headers[name]) for name in ("authorization", "x-api-key")
            if name in request.headers]


class OpenAIApi:
    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.tokenizer = ctx.engine.tokenizer
        self.ids = model_ids(ctx.engine.limits.model)

    def check_model(self, name: str | None) -> None:
        if name and name not in self.ids:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves "
                                f"{self.ids[0]!r} (GET /v1/models)", param="model",
                           code="model_not_found")

    async def models(self, request: Request) -> dict:
        await self.ctx.auth.authenticate(_metadata(request))
        return {"object": "list", "data": [{
            "id": self.ids[0], "object": "model", "created": 0, "owned_by": "specmesh",
            "max_model_len": self.engine.limits.max_context}]}

    async def completions(self, body: CompletionRequest, request: Request):
        tenant = await self.ctx.auth.authenticate(_metadata(request))
        self.check_model(body.model)
        specs = [spec_of(body, self.ctx.config, self.engine.limits.vocab_size, prompt, ids,
                         COMPLETIONS, logprobs=body.logprobs is not None,
                         top_logprobs=body.logprobs) for prompt, ids in prompts_of(body)]
        return await self._respond(specs, body, tenant, COMPLETIONS, chat=False)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        tenant = await self.ctx.auth.authenticate(_metadata(request))
        self.check_model(body.model)
        messages = validate_messages(body.messages)
        continuing = bool(body.session_id)
        text = render_chat(self.tokenizer, messages, continuing)
        door = chat_door(body)
        spec = spec_of(body, self.ctx.config, self.engine.limits.vocab_size, text, (), door,
                       logprobs=body.logprobs, top_logprobs=body.top_logprobs)
        if has_template(self.tokenizer) and not continuing:
            # The template writes the special tokens (BOS) itself: tokenize without adding.
            ids = await asyncio.to_thread(self.tokenizer, text, add_special_tokens=False)
            spec = replace(spec, prompt="", prompt_ids=tuple(ids["input_ids"]))
        return await self._respond([spec], body, tenant, door, chat=True)

    async def close_session(self, session_id: str, request: Request) -> dict:
        tenant = await self.ctx.auth.authenticate(_metadata(request))
        count = await self.engine.close_session(session_id, tenant)
        return {"id": session_id, "object": "session.deleted", "deleted": True,
                "committed_tokens": count}

    async def _respond(self, prompts: list[GenerationSpec], body, tenant, door: Door,
                       chat: bool):
        """Runs the request's choices (each prompt ``n`` times: gateway/http/choices.py)."""
        specs = choice_specs(prompts, body.n, self.ctx.config.max_inflight)
        fmt = Formatter(self.tokenizer, self.ids[0], chat=chat, logprobs=specs[0].logprobs,
                        choices=len(specs))
        span = trace.get_current_span()
        if body.user:
            span.set_attribute("gen_ai.request.user", body.user)
        if len(specs) > 1:
            span.set_attribute("gen_ai.request.choice.count", len(specs))
        streams = [self.engine.generate(spec, lambda: None, tenant) for spec in specs]
        n = len(specs) // len(prompts)
        try:  # errors before the first tokens are the request's HTTP status
            firsts = await first_chunks(streams)
            if body.stream:
                usage = bool(body.stream_options and body.stream_options.include_usage)
                return EventSourceResponse(self._events(streams, firsts, fmt, usage, n))
            collected = await wholes(streams, firsts)
        except InvalidArgument as exc:
            await _close(streams)
            raise param_error(exc, door) from None
        except BaseException:
            await _close(streams)
            raise
        return fmt.whole(collected, total_usage([w.usage for w in collected], n))

    @staticmethod
    async def _events(streams: list[AsyncIterator[Chunk]], firsts: list[Chunk], fmt: Formatter,
                      include_usage: bool, n: int) -> AsyncIterator[bytes]:
        """The SSE stream: a chunk per round of each choice, the usage chunk when asked, then
        [DONE]. An error after the first chunks ends the stream with one error event (the
        status is already sent)."""
        last: dict[int, Chunk] = {}
        try:
            async with aclosing(merged(streams, firsts)) as chunks:
                async for i, chunk in chunks:
                    data = fmt.stream_chunk(chunk, include_usage, first=chunk is firsts[i],
                                            index=i)
                    yield format_sse_event(data_str=json.dumps(data))
                    if chunk.finish is not None:
                        last[i] = chunk
            if include_usage:
                usage = total_usage([last[i].usage for i in range(len(streams))], n)
                yield format_sse_event(data_str=json.dumps(fmt.usage_chunk(usage, last[0])))
            yield format_sse_event(data_str="[DONE]")
        except Exception as exc:  # noqa: BLE001 - reported in the stream itself
            error = from_exception(exc)
            trace.get_current_span().set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            yield format_sse_event(data_str=json.dumps(error.body()))
        finally:
            await _close(streams)


async def _close(streams: list[AsyncIterator[Chunk]]) -> None:
    for stream in streams:
        await stream.aclose()


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Pydantic's complaint about a body field, as a 400 naming the field."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON: {reason}").response()
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc)
    if not field:
        return ApiError(400, "the request body must be a JSON object (Content-Type: "
                             "application/json)").response()
    return ApiError(400, f"{field}: {first.get('msg')}", param=field).response()


def build_app(ctx: HttpContext) -> FastAPI:
    api = OpenAIApi(ctx)
    app = FastAPI(title="SpecMesh OpenAI-compatible API", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(Observe, tracer=ctx.tracer or trace.get_tracer("specmesh"),
                       meter=ctx.meter or metrics_api.get_meter("specmesh"))
    app.add_exception_handler(ApiError, lambda _, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, lambda _, exc: ApiError(
        exc.status_code, f"{exc.detail}: see docs/api.md for the routes",
        code="not_found" if exc.status_code == 404 else None).response())
    for domain in (SpecMeshError, ValueError, Exception):  # Exception: a 500, logged
        app.add_exception_handler(domain, lambda _, exc: from_exception(exc).response())
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat)
    app.delete("/v1/sessions/{session_id}")(api.close_session)

    @app.get("/health")
    async def health() -> dict:  # liveness: the process and its event loop answer
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():  # readiness: the gRPC health status of the gateway
        if await ctx.ready():
            return {"status": "serving"}
        return JSONResponse({"status": "not_serving"}, status_code=503)

    return app
