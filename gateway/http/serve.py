"""Runs the HTTP API with uvicorn on the gateway's own event loop, beside the gRPC server:
the socket is bound (and listening) before the gRPC server starts, so a client that sees
the gateway SERVING can connect at once; signals stay with services/server.serve, which
stops this server on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from services.config import ServerConfig

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the gateway's serve() owns SIGTERM/SIGINT
        yield


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``:``port`` whose connections send small writes at once.

    asyncio turns Nagle's algorithm off (TCP_NODELAY) on the connections it accepts only when
    the listening socket's protocol reads IPPROTO_TCP, as a socket from getaddrinfo does;
    ``socket.create_server`` leaves it 0. With Nagle on, a response's body, written after its
    head, waited for the client's delayed ACK: 40 ms more on every non-streamed response and
    on a stream's first chunk, seen from aiohttp and the openai package on keep-alive
    connections (docs/performance.md)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    made = socket.create_server((host, port), family=family, backlog=1024)
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=made.detach())


class HttpServer:
    def __init__(self, app, server: ServerConfig, port: int) -> None:
        self.sock = listening_socket(server.host, port)
        self.port = self.sock.getsockname()[1]
        tls = server.tls
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                ssl_certfile=tls.cert or None, ssl_keyfile=tls.key or None,
                                timeout_graceful_shutdown=server.grace_s)
        self.scheme = "https" if tls.enabled else "http"
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Serves on the running loop (called once the gRPC server is up)."""
        self.task = asyncio.get_running_loop().create_task(self.server.serve([self.sock]))
        log.info("serving the OpenAI-compatible HTTP API on port %d (%s)", self.port,
                 self.scheme)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()
