"""The drafter's gRPC edge: protobuf in, DrafterEngine, protobuf out."""

from __future__ import annotations

import asyncio

from drafter_svc.engine import DrafterEngine
from services.config import ModelServiceConfig
from services.convert import draft_call_from_pb, draft_result_to_pb, meta_to_pb
from services.errors import grpc_errors
from services.kv_cache import SessionCaches
from services.model_runner import ModelRunner
from services.models import load_for_serving
from services.server import serve
from specmesh.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DrafterEngine) -> None:
        self.engine = engine

    @grpc_errors
    async def Draft(self, request, context):
        result = await self.engine.draft(draft_call_from_pb(request))
        return draft_result_to_pb(result)

    @grpc_errors
    async def Release(self, request, context):
        return common_pb2.ReleaseResponse(released=self.engine.caches.release(request.session_id))

    @grpc_errors
    async def GetModelInfo(self, request, context):
        return meta_to_pb(self.engine.runner.meta, "model", self.engine.max_draft_tokens)


def build_engine(config: ModelServiceConfig) -> DrafterEngine:
    model, meta, device = load_for_serving(config.model, config.device, config.dtype,
                                           config.threads)
    runner = ModelRunner(model, meta, device, config.max_queue)
    caches = SessionCaches(config.max_sessions, runner.new_kv)
    return DrafterEngine(runner, caches, config.max_draft_tokens)


def run(config: ModelServiceConfig) -> None:
    engine = build_engine(config)

    def register(server) -> None:
        drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(engine), server)

    async def on_stop() -> None:
        engine.runner.close()

    name = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
    asyncio.run(serve(config.server, register, [name], on_stop=on_stop))
