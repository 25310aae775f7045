"""Every service of the mesh answers grpc.health.v1 and server reflection."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

HEALTH = "grpc.health.v1.Health"

ROLES = [("gateway", "specmesh.v1.Gateway"), ("drafter", "specmesh.v1.Drafter"),
         ("verifier", "specmesh.v1.Verifier")]


def _address(mesh, role: str) -> str:
    if role == "gateway":
        return mesh.gateway_address
    if role == "drafter":
        return mesh.drafter_addresses[0]
    return mesh.verifier_addresses[0]


@pytest.fixture(scope="module")
def channels(mesh):
    chans = {role: grpc.insecure_channel(_address(mesh, role)) for role, _ in ROLES}
    yield chans
    for c in chans.values():
        c.close()


def _reflect(channel, **request) -> list[reflection_pb2.ServerReflectionResponse]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return list(stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10))


@pytest.mark.parametrize("role,service", ROLES)
def test_health_serving_overall_and_for_service(channels, role, service):
    stub = health_pb2_grpc.HealthStub(channels[role])
    for name in ("", service):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, (role, name)


@pytest.mark.parametrize("role,service", ROLES)
def test_health_unknown_service_is_not_found(channels, role, service):
    stub = health_pb2_grpc.HealthStub(channels[role])
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service=service + "Nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("role,service", ROLES)
def test_health_does_not_report_other_tiers(channels, role, service):
    """A drafter must not claim to serve the Verifier (or the gateway the Drafter)."""
    stub = health_pb2_grpc.HealthStub(channels[role])
    for other_role, other in ROLES:
        if other_role == role:
            continue
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service=other), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, (role, other)


@pytest.mark.parametrize("role,service", ROLES)
def test_reflection_lists_service_and_health(channels, role, service):
    (reply,) = _reflect(channels[role], list_services="")
    assert reply.WhichOneof("message_response") == "list_services_response"
    names = {s.name for s in reply.list_services_response.service}
    assert service in names
    assert HEALTH in names
    other_specmesh = {n for n in names if n.startswith("specmesh.") and n != service}
    assert not other_specmesh, f"{role} advertises services it does not serve: {other_specmesh}"


@pytest.mark.parametrize("role,service", ROLES)
def test_reflection_file_containing_symbol(channels, role, service):
    (reply,) = _reflect(channels[role], file_containing_symbol=service)
    assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in reply.file_descriptor_response.file_descriptor_proto]
    assert files
    short = service.rsplit(".", 1)[1]
    owner = [f for f in files if any(s.name == short for s in f.service)]
    assert owner, [f.name for f in files]
    (fdp,) = owner
    assert fdp.package == "specmesh.v1"
    (svc,) = [s for s in fdp.service if s.name == short]
    assert len(svc.method) >= 3
    # The descriptor set is self-contained enough to resolve the request types.
    for method in svc.method:
        assert method.input_type.startswith(".specmesh.v1."), method.input_type


@pytest.mark.parametrize("role,service", ROLES)
def test_reflection_unknown_symbol_is_an_error_response(channels, role, service):
    (reply,) = _reflect(channels[role], file_containing_symbol="specmesh.v1.NoSuchThing")
    assert reply.WhichOneof("message_response") == "error_response"
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.parametrize("role", ["gateway", "verifier"])
def test_sigusr1_writes_threads_and_tasks_to_the_log_and_the_service_serves_on(mesh, channels,
                                                                                role):
    """How an operator sees where a service that stopped answering waits: every thread's
    stack and one line per asyncio task, in its log."""
    proc = mesh.proc("gateway" if role == "gateway" else "verifier-0")
    before = proc.log_path.stat().st_size
    proc.popen.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while "asyncio tasks" not in (text := proc.log_path.read_bytes()[before:].decode()):
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.1)
    assert "Current thread" in text and "Thread 0x" in text, text[-2000:]
    assert "serve (server.py:" in text, text[-2000:]  # the task that runs the server
    assert proc.popen.poll() is None
    reply = health_pb2_grpc.HealthStub(channels[role]).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
