"""A replica whose model thread stops making progress says so on its health service.

The gRPC server runs on the event loop and the forward passes on one model thread
(services/model_runner.py), so a model thread that hangs (a deadlock in native code, a lock
its own thread holds) leaves a replica that answers health checks as SERVING and every call
with nothing until the caller's deadline: gateways wait 30 s a call, and Kubernetes sees a
healthy pod. While one pass has run for longer than ``stall_s`` the watch reports
NOT_SERVING (a liveness probe then restarts the pod, a readiness probe takes it out of the
Service) and writes every thread's stack to the log once; a pass that ends after all brings
SERVING back. ``stall_s`` must exceed the longest pass a replica runs legitimately: a prompt
is fed ``--prefill-chunk`` tokens a pass, so the longest is one chunk's on the slowest
hardware it runs on.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys
import time
from collections.abc import Callable

from grpc_health.v1 import health_pb2

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StallWatch:
    """Polls ``pass_started()`` (the monotonic time the model thread's current pass began,
    None while it runs none) every ``poll_s`` and sets ``services`` (with "") on ``health``."""

    def __init__(self, pass_started: Callable[[], float | None], health, services: list[str],
                 stall_s: float, poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._started, self._health = pass_started, health
        self._services = ["", *services]
        self.stall_s = stall_s
        self.poll_s = poll_s if poll_s is not None else min(5.0, stall_s / 4)
        self._clock = clock
        self.stalled = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.check()

    async def check(self) -> bool:
        """Looks once; sets the health status when the state changed. Returns ``stalled``."""
        started = self._started()
        running = 0.0 if started is None else self._clock() - started
        stalled = running > self.stall_s
        if stalled == self.stalled:
            return stalled
        self.stalled = stalled
        if stalled:
            log.error("the model thread has run one pass for %.0f s (--stall-s %.0f): "
                      "reporting NOT_SERVING until it ends; every thread's stack follows",
                      running, self.stall_s)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        else:
            log.warning("the model thread's stalled pass ended: SERVING again")
        for name in self._services:
            await self._health.set(name, NOT_SERVING if stalled else SERVING)
        return stalled
