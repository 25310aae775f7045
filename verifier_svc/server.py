"""The verifier's gRPC edge: protobuf in, VerifierEngine, protobuf out."""

from __future__ import annotations

import asyncio
import logging

from services.config import ModelServiceConfig
from services.convert import meta_to_pb, verify_call_from_pb, verify_result_to_pb
from services.errors import grpc_errors
from services.kv_cache import SessionCaches
from services.model_runner import ModelRunner
from services.models import load_for_serving
from services.server import serve
from specmesh.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_svc.engine import VerifierEngine

log = logging.getLogger(__name__)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine) -> None:
        self.engine = engine

    @grpc_errors
    async def Verify(self, request, context):
        result = await self.engine.verify(verify_call_from_pb(request))
        return verify_result_to_pb(result)

    @grpc_errors
    async def Release(self, request, context):
        return common_pb2.ReleaseResponse(released=self.engine.caches.release(request.session_id))

    @grpc_errors
    async def GetModelInfo(self, request, context):
        return meta_to_pb(self.engine.runner.meta, "model", self.engine.max_draft_tokens)


def build_engine(config: ModelServiceConfig) -> VerifierEngine:
    model, meta, device = load_for_serving(config.model, config.device, config.dtype,
                                           config.threads)
    runner = ModelRunner(model, meta, device, config.max_queue)
    caches = SessionCaches(config.max_sessions, runner.new_kv)
    return VerifierEngine(runner, caches, config.max_draft_tokens)


def run(config: ModelServiceConfig) -> None:
    engine = build_engine(config)

    def register(server) -> None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(engine), server)

    async def on_stop() -> None:
        engine.runner.close()

    name = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    asyncio.run(serve(config.server, register, [name], on_stop=on_stop))
