"""The verifier's gRPC edge: protobuf in, VerifierEngine, protobuf out."""

from __future__ import annotations

from services.config import ModelServiceConfig
from services.convert import verify_call_from_pb, verify_result_to_pb
from services.errors import grpc_errors
from services.model_service import ModelServiceRpcs, build_parts, run_service
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_svc.engine import VerifierEngine


class VerifierServicer(ModelServiceRpcs, verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine) -> None:
        self.engine = engine

    @grpc_errors
    async def Verify(self, request, context):
        result = await self.engine.verify(verify_call_from_pb(request))
        return verify_result_to_pb(result)


def run(config: ModelServiceConfig) -> None:
    runner, caches = build_parts(config)
    engine = VerifierEngine(runner, caches, config.max_draft_tokens)
    name = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
    run_service(config, engine, lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(
        VerifierServicer(engine), server), name)
