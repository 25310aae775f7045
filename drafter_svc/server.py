"""The drafter's gRPC edge: protobuf in, DrafterEngine, protobuf out."""

from __future__ import annotations

import asyncio

import grpc
from opentelemetry import trace

from drafter_svc.engine import DrafterEngine
from drafter_svc.ngram import NgramDrafterEngine
from services.call_stream import Drain, batch_replies, check_batch, serve_batch, serve_calls
from services.config import ModelServiceConfig
from services.convert import (
    draft_call_from_pb,
    draft_result_to_pb,
    speculate_call_from_pb,
    speculate_result_to_pb,
)
from services.errors import Unimplemented, grpc_errors
from services.kv_cache import SessionCaches
from services.model_service import ModelServiceRpcs, build_metrics, build_parts, run_service
from services.models import describe_without_weights
from services.server import check_server_ports
from services.telemetry import TelemetryConfig, setup
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc


class DrafterServicer(ModelServiceRpcs, drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DrafterEngine | NgramDrafterEngine, metrics,
                 drain: Drain | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.drain = drain  # set once the server stops: calls on open streams are refused

    @grpc_errors
    async def Draft(self, request, context):
        call = draft_call_from_pb(request)
        result = await self.observed(call.cache, lambda: self.engine.draft(call))
        trace.get_current_span().set_attribute("specmesh.draft_tokens", len(result.token_ids))
        self.metrics.draft_tokens.add(len(result.token_ids))
        return draft_result_to_pb(result)

    @grpc_errors
    async def Speculate(self, request, context):
        if not hasattr(self.engine, "speculate"):
            raise Unimplemented(f"a {self.engine.kind} drafter has no speculation cache: "
                                "use Draft")
        call = speculate_call_from_pb(request)
        result = await self.observed(call.cache, lambda: self.engine.speculate(call))
        trace.get_current_span().set_attribute("specmesh.branches", len(result.branches))
        return speculate_result_to_pb(result)

    async def DraftStream(self, requests, context):
        """Draft and Speculate calls over one stream (services/call_stream.py)."""
        await serve_calls(requests, context, self._run_call, _reply, self.drain)

    @grpc_errors
    async def DraftBatch(self, request, context):
        """A gateway's step: Draft calls of many sessions, batched on the model. A model
        drafter takes the step's Draft calls as a whole (DrafterEngine.draft_many); Speculate
        calls, and every call to an n-gram drafter, are answered one by one as on a stream.
        Each call answers what its unary RPC would."""
        check_batch(request.calls)
        many = getattr(self.engine, "draft_many", None)
        if many is None or (self.drain is not None and self.drain.draining):
            outcomes = await serve_batch(request.calls, context, self._run_call, _reply,
                                         self.drain)
            return drafter_pb2.DraftBatchResponse(outcomes=outcomes)
        drafts = [r for r in request.calls if r.HasField("draft")]
        others = [r for r in request.calls if not r.HasField("draft")]
        calls = [draft_call_from_pb(r.draft) for r in drafts]

        async def one_by_one() -> list:  # (queued in the same turn as the drafts' jobs)
            if not others:
                return []
            return await serve_batch(others, context, self._run_call, _reply, self.drain)

        results, replies = await asyncio.gather(
            self.observed_many([c.cache for c in calls], lambda: many(calls)), one_by_one())
        self.metrics.draft_tokens.add(sum(len(r.token_ids) for r in results
                                          if not isinstance(r, BaseException)))
        replies += batch_replies(drafts, results, draft_result_to_pb, _reply, "DraftBatch")
        return drafter_pb2.DraftBatchResponse(outcomes=replies)

    async def _run_call(self, request, call_context):
        if request.HasField("speculate"):
            return await self.Speculate(request.speculate, call_context)
        if request.HasField("draft"):
            return await self.Draft(request.draft, call_context)
        await call_context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 "a DraftStream request needs a draft or a speculate call")


def _reply(call_id, result, error) -> drafter_pb2.DraftStreamResponse:
    if error is not None:
        return drafter_pb2.DraftStreamResponse(id=call_id, error=error)
    if isinstance(result, drafter_pb2.SpeculateResponse):
        return drafter_pb2.DraftStreamResponse(id=call_id, speculate=result)
    return drafter_pb2.DraftStreamResponse(id=call_id, draft=result)


def build_engine(config: ModelServiceConfig) -> DrafterEngine | NgramDrafterEngine:
    if config.kind == "ngram":
        caches = SessionCaches(config.max_sessions, new_kv=lambda: None)
        return NgramDrafterEngine(describe_without_weights(config.model), caches,
                                  config.max_draft_tokens)
    runner, caches = build_parts(config)
    return DrafterEngine(runner, caches, config.max_draft_tokens, config.prefill_chunk)


def run(config: ModelServiceConfig, telemetry_config: TelemetryConfig) -> None:
    check_server_ports(config.server)  # before the model loads: a taken port fails at once
    telemetry = setup(telemetry_config)
    engine = build_engine(config)
    drain = Drain()
    servicer = DrafterServicer(engine, build_metrics(telemetry, "drafter", engine, config), drain)
    name = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
    run_service(config, telemetry, engine,
                lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server),
                name, "drafter", drain)
