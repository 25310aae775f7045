"""gRPC server bootstrap shared by the three services: health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.call_stream import Drain
from services.config import ServerConfig
from services.decode_guard import DecodeGuard
from services.errors import StartupError
from services.tls import server_credentials

log = logging.getLogger(__name__)


async def serve(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    on_started: Callable[[int], None] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    interceptors: list | None = None,
    require_client_cert: bool = False,
    on_health: Callable[[HealthServicer], None] | None = None,
    drain: Drain | None = None,
) -> None:
    """Runs a server until SIGTERM/SIGINT; reports SERVING once it listens.

    Callers load and warm their models *before* calling this, so SERVING means
    ready. On a signal: health goes NOT_SERVING, in-flight calls get
    ``config.grace_s`` to finish, then ``on_stop`` closes clients. ``drain`` starts with the
    stop, so calls on open call streams are refused like new RPCs (services/call_stream.py).

    With ``config.tls`` the port speaks only TLS (mTLS when ``require_client_cert`` and a
    CA is configured); ``config.health_port`` adds a plaintext port that serves nothing but
    grpc.health.v1, for probes that cannot speak TLS. With ``config.parent_pid`` the server
    stops the same way once that process is no longer its parent (``_orphaned``).
    """
    dump_stacks_on(signal.SIGUSR1)
    # DecodeGuard innermost: bytes that are not a valid request get INVALID_ARGUMENT.
    server = grpc.aio.server(options=config.grpc_options,
                             interceptors=[*(interceptors or ()), DecodeGuard()])
    register(server)
    health = HealthServicer()
    if on_health is not None:  # e.g. the gateway's HTTP readiness follows this status
        on_health(health)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    if config.tls.enabled:
        port = _bound(lambda: server.add_secure_port(
            config.address, server_credentials(config.tls, require_client_cert)),
            config.address, "--port")
    else:
        port = _bound(lambda: server.add_insecure_port(config.address), config.address, "--port")
    probe = None
    if config.health_port:
        probe = grpc.aio.server(options=config.grpc_options)
        health_pb2_grpc.add_HealthServicer_to_server(health, probe)
        address = f"{config.host}:{config.health_port}"
        _bound(lambda: probe.add_insecure_port(address), address, "--health-port")
        await probe.start()
    await server.start()
    for name in ["", *service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on port %d (%s)", ", ".join(service_names), port,
             ("mTLS" if require_client_cert and config.tls.mutual else "TLS")
             if config.tls.enabled else "plaintext")
    if on_started is not None:
        on_started(port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_orphaned(config.parent_pid, stop)) if config.parent_pid else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    log.info("shutting down: draining for %.1f s", config.grace_s)
    if drain is not None:
        drain.start()
    await health.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    if probe is not None:
        await probe.stop(0)
    if on_stop is not None:
        await on_stop()


def dump_stacks_on(sig: signal.Signals) -> None:
    """``kill -USR1 <pid>`` writes every thread's Python stack and then every asyncio task's
    to stderr (the service's log) and the service runs on: how to see where a service that
    stopped answering waits, in a thread or in the event loop (the tasks are written once
    the loop runs again). A fatal signal (SIGSEGV, SIGABRT, ...) writes the threads' stacks
    too before the process dies. Called from the running event loop."""
    asyncio.get_running_loop().add_signal_handler(sig, _print_tasks)
    faulthandler.enable()
    faulthandler.register(sig, all_threads=True, chain=True)  # then the loop's handler


def _print_tasks() -> None:
    """One line a task: its name, the chain of coroutines it is in (outermost first), and
    what the innermost awaits; gRPC's own tasks that wait for the next call are counted."""
    lines, idle = [], 0
    for task in asyncio.all_tasks():
        where, awaited = [], task.get_coro()
        while awaited is not None and len(where) < 16:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                break
            where.append(f"{frame.f_code.co_name} ({Path(frame.f_code.co_filename).name}:"
                         f"{frame.f_lineno})")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        if where and where[0].startswith(("_request_registered_call ", "_request_call ")):
            idle += 1
        else:
            lines.append(f"  {task.get_name()}: {' > '.join(where)} awaits {awaited!r:.120}")
    print(f"{len(lines)} asyncio tasks (and {idle} of gRPC's waiting for calls):",
          *lines, sep="\n", file=sys.stderr)
    sys.stderr.flush()


PARENT_POLL_S = 1.0


async def _orphaned(parent_pid: int, stop: asyncio.Event) -> None:
    """Sets ``stop`` once this process's parent is no longer ``parent_pid``: the parent
    died and the process was handed to init (or a subreaper). A process the local mesh
    started then stops as on SIGTERM, where it would otherwise serve on, unseen, beside
    whatever runs next on the machine. Polled: no signal reaches a child when its parent is
    SIGKILLed, and PR_SET_PDEATHSIG would fire when the parent's spawning *thread* ends."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent process %d is gone: stopping", parent_pid)
    stop.set()


def check_listenable(host: str, port: int, option: str) -> None:
    """Raises StartupError when ``host:port`` cannot be listened on now (another process
    holds it, or the host is not this machine's), naming ``option`` to change. A replica
    checks its ports before it loads its model, so a taken port fails in a second instead
    of after the load; the server's own bind still decides (the port can be taken
    meanwhile). Port 0 (any free port) always passes."""
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                           "(check --host)") from exc
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        # as a server binds: a port whose old connections linger in TIME_WAIT is free
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                               f"(pick another {option})") from exc


def check_server_ports(config: ServerConfig) -> None:
    """check_listenable for a service's gRPC port and its health port, if any."""
    check_listenable(config.host, config.port, "--port")
    check_listenable(config.host, config.health_port, "--health-port")


def _bound(bind: Callable[[], int], address: str, option: str) -> int:
    """The port ``bind`` (a grpc server's add_*_port) listens on; StartupError naming
    ``option`` when it cannot (grpcio raises where older releases returned 0)."""
    try:
        port = bind()
    except RuntimeError:
        port = 0
    if port == 0:
        raise StartupError(f"cannot listen on {address}: the port is taken or the host is not "
                           f"this machine's (pick another {option})")
    return port
