"""The verifier's gRPC edge: protobuf in, VerifierEngine, protobuf out."""

from __future__ import annotations

from opentelemetry import trace

from services.call_stream import DRAINING, Drain, batch_replies, check_batch, serve_calls
from services.config import ModelServiceConfig
from services.convert import verify_call_from_pb, verify_result_to_pb
from services.errors import grpc_errors
from services.model_service import ModelServiceRpcs, build_metrics, build_parts, run_service
from services.server import check_server_ports
from services.telemetry import TelemetryConfig, setup
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_svc.engine import VerifierEngine
from verifier_svc.local_drafts import build_local_drafter, share_budget


class VerifierServicer(ModelServiceRpcs, verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, metrics, drain: Drain | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.drain = drain  # set once the server stops: calls on open streams are refused

    @grpc_errors
    async def Verify(self, request, context):
        call = verify_call_from_pb(request)
        result = await self.observed(call.cache, lambda: self.engine.verify(call))
        span = trace.get_current_span()
        span.set_attribute("specmesh.draft_tokens", len(call.draft_ids))
        span.set_attribute("specmesh.accepted", result.num_accepted)
        self._count([call], [result])
        return verify_result_to_pb(result)

    def _count(self, calls, outcomes) -> None:
        """The token counters of the calls answered (an outcome that is an error: none)."""
        done = [(c, r) for c, r in zip(calls, outcomes, strict=True)
                if not isinstance(r, BaseException)]
        m = self.metrics
        m.draft_tokens.add(sum(len(c.draft_ids) for c, _ in done))
        m.accepted_tokens.add(sum(r.num_accepted for _, r in done))
        m.fed_tokens.add(sum(len(r.more) for _, r in done))  # (the calls' plain tokens fed)
        m.local_draft_tokens.add(sum(r.local_drafted for _, r in done))
        m.local_accepted_tokens.add(sum(r.local_accepted for _, r in done))

    async def VerifyStream(self, requests, context):
        """Verify calls over one stream (services/call_stream.py)."""
        await serve_calls(requests, context, self._run_call, _reply, self.drain)

    @grpc_errors
    async def VerifyBatch(self, request, context):
        """A gateway's step: Verify calls of many sessions, in one forward pass, handled as
        a whole (VerifierEngine.verify_many). Each call answers what its unary Verify would."""
        check_batch(request.calls)
        if self.drain is not None and self.drain.draining:
            return verifier_pb2.VerifyBatchResponse(
                outcomes=[_reply(r.id, None, DRAINING) for r in request.calls])
        calls = [verify_call_from_pb(r.call) for r in request.calls]
        outcomes = await self.observed_many([c.cache for c in calls],
                                            lambda: self.engine.verify_many(calls))
        self._count(calls, outcomes)
        return verifier_pb2.VerifyBatchResponse(outcomes=batch_replies(
            request.calls, outcomes, verify_result_to_pb, _reply, "VerifyBatch"))

    def _run_call(self, request, call_context):
        return self.Verify(request.call, call_context)


def _reply(call_id, result, error) -> verifier_pb2.VerifyStreamResponse:
    if error is not None:
        return verifier_pb2.VerifyStreamResponse(id=call_id, error=error)
    return verifier_pb2.VerifyStreamResponse(id=call_id, result=result)


def run(config: ModelServiceConfig, telemetry_config: TelemetryConfig) -> None:
    check_server_ports(config.server)  # before the model loads: a taken port fails at once
    telemetry = setup(telemetry_config)
    runner, caches = build_parts(config)
    local = build_local_drafter(config, runner.meta)
    share_budget(config, runner, caches, local)
    engine = VerifierEngine(runner, caches, config.max_draft_tokens, config.prefill_chunk,
                            local=local)
    drain = Drain()
    servicer = VerifierServicer(engine, build_metrics(telemetry, "verifier", engine, config),
                                drain)
    name = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    run_service(config, telemetry, engine,
                lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server),
                name, "verifier", drain)
