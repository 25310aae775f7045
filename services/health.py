"""Waiting for a gRPC server to report SERVING on grpc.health.v1."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, timeout: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


POLL_S = 0.05  # a check costs ~1 ms (a refused connection fails at once)


def wait_serving(address: str, timeout: float, alive=lambda: True) -> bool:
    """Polls until ``address`` is SERVING, ``alive()`` turns false, or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            return False
        if is_serving(address):
            return True
        time.sleep(POLL_S)
    return False
