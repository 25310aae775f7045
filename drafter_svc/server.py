"""The drafter's gRPC edge: protobuf in, DrafterEngine, protobuf out."""

from __future__ import annotations

from drafter_svc.engine import DrafterEngine
from services.config import ModelServiceConfig
from services.convert import draft_call_from_pb, draft_result_to_pb
from services.errors import grpc_errors
from services.model_service import ModelServiceRpcs, build_parts, run_service
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc


class DrafterServicer(ModelServiceRpcs, drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DrafterEngine) -> None:
        self.engine = engine

    @grpc_errors
    async def Draft(self, request, context):
        result = await self.engine.draft(draft_call_from_pb(request))
        return draft_result_to_pb(result)


def run(config: ModelServiceConfig) -> None:
    runner, caches = build_parts(config)
    engine = DrafterEngine(runner, caches, config.max_draft_tokens)
    name = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
    run_service(config, engine, lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(
        DrafterServicer(engine), server), name)
