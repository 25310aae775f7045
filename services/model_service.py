"""What the drafter and verifier services share: building the model parts, the
Release / GetModelInfo / GetStats RPCs, and running the server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.config import ModelServiceConfig
from services.convert import meta_to_pb, stats_to_pb
from services.errors import InvalidArgument, grpc_errors
from services.kv_cache import SessionCaches
from services.model_runner import ModelRunner
from services.models import load_for_serving
from services.server import serve
from specmesh.v1 import common_pb2


def build_parts(config: ModelServiceConfig) -> tuple[ModelRunner, SessionCaches]:
    model, meta, device = load_for_serving(config.model, config.device, config.dtype,
                                           config.threads)
    runner = ModelRunner(model, meta, device, config.max_queue)
    return runner, SessionCaches(config.max_sessions, runner.new_kv)


class ModelServiceRpcs:
    """Release, GetModelInfo and GetStats for a servicer whose ``engine`` has
    ``runner``, ``caches``, ``stats``, ``max_draft_tokens``."""

    kind = "model"
    engine = None

    @grpc_errors
    async def Release(self, request, context):
        if not request.session_id:
            raise InvalidArgument("session_id is required")
        return common_pb2.ReleaseResponse(released=self.engine.caches.release(request.session_id))

    @grpc_errors
    async def GetModelInfo(self, request, context):
        return meta_to_pb(self.engine.runner.meta, self.kind, self.engine.max_draft_tokens)

    @grpc_errors
    async def GetStats(self, request, context):
        e = self.engine
        return stats_to_pb(e.stats, e.caches, queue_depth=e.runner.queue_depth)


def run_service(config: ModelServiceConfig, engine, register: Callable, service_name: str) -> None:
    async def on_stop() -> None:
        engine.runner.close()

    asyncio.run(serve(config.server, register, [service_name], on_stop=on_stop))
