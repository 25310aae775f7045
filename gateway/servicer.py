"""The gateway's gRPC edge: GenerateRequest -> GenerationEngine -> chunks and responses."""

from __future__ import annotations

from gateway.auth import Authenticator
from gateway.chunks import Chunk, Finish, Usage, collect
from gateway.engine import GenerationEngine
from gateway.requests import GRPC, GenerationSpec, RequestFields, validate
from services.config import GatewayConfig
from services.errors import grpc_errors
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc

_FINISH = {
    None: gateway_pb2.FINISH_REASON_UNSPECIFIED,
    Finish.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    Finish.EOS: gateway_pb2.FINISH_REASON_EOS,
    Finish.STOP: gateway_pb2.FINISH_REASON_STOP,
    Finish.CONTEXT: gateway_pb2.FINISH_REASON_CONTEXT,
}


def _usage(u: Usage | None) -> gateway_pb2.Usage | None:
    if u is None:
        return None
    return gateway_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                             rounds=u.rounds, draft_tokens=u.draft_tokens,
                             accepted_draft_tokens=u.accepted_draft_tokens)


def _logprobs(items) -> list[gateway_pb2.TokenLogprob]:
    return [gateway_pb2.TokenLogprob(
        token_id=t.token_id, logprob=t.logprob,
        top_logprobs=[gateway_pb2.TopLogprob(token_id=i, logprob=lp)
                      for i, lp in zip(t.top_ids, t.top_logprobs, strict=True)])
        for t in items]


def _chunk(c: Chunk) -> gateway_pb2.GenerateChunk:
    return gateway_pb2.GenerateChunk(text=c.text, token_ids=c.token_ids,
                                     finish_reason=_FINISH[c.finish], session_id=c.session_id,
                                     usage=_usage(c.usage), offset=c.offset,
                                     logprobs=_logprobs(c.logprobs))


def request_fields(req: gateway_pb2.GenerateRequest) -> RequestFields:
    """The neutral request of a GenerateRequest (a field not set in the message: None)."""
    s, spec = req.sampling, req.speculation
    given = lambda name: getattr(s, name) if s.HasField(name) else None  # noqa: E731
    return RequestFields(
        prompt=req.prompt, prompt_ids=tuple(req.prompt_token_ids),
        temperature=given("temperature"), top_p=given("top_p"), top_k=given("top_k"),
        max_new_tokens=given("max_new_tokens"), stop=tuple(s.stop), seed=given("seed"),
        num_draft_tokens=spec.num_draft_tokens, disable_speculation=spec.disable,
        drafter=spec.drafter, session_id=req.session_id, keep_session=req.keep_session,
        resume_from=req.resume_from, logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or None)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Every RPC authenticates first (API key, rate limit), then validates, then runs."""

    def __init__(self, engine: GenerationEngine, config: GatewayConfig,
                 auth: Authenticator) -> None:
        self.engine = engine
        self.config = config
        self.auth = auth

    def _spec(self, request: gateway_pb2.GenerateRequest) -> GenerationSpec:
        return validate(request_fields(request), self.config, GRPC,
                        self.engine.limits.vocab_size)

    @grpc_errors
    async def GenerateStream(self, request, context):
        tenant = await self.auth.authenticate(context.invocation_metadata())
        spec = self._spec(request)
        async for chunk in self.engine.generate(spec, context.time_remaining, tenant):
            yield _chunk(chunk)

    @grpc_errors
    async def Generate(self, request, context):
        tenant = await self.auth.authenticate(context.invocation_metadata())
        spec = self._spec(request)
        whole = await collect(self.engine.generate(spec, context.time_remaining, tenant))
        return gateway_pb2.GenerateResponse(
            text=whole.text, token_ids=whole.token_ids, finish_reason=_FINISH[whole.finish],
            session_id=whole.session_id, usage=_usage(whole.usage),
            logprobs=_logprobs(whole.logprobs))

    @grpc_errors
    async def CloseSession(self, request, context):
        tenant = await self.auth.authenticate(context.invocation_metadata())
        count = await self.engine.close_session(request.session_id, tenant)
        return gateway_pb2.CloseSessionResponse(committed_tokens=count)
