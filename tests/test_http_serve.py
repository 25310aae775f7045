"""The gateway's HTTP listener (gateway/http/serve.py) on a real socket: uvicorn serving a
minimal ASGI app on a running loop, and a client connecting over TCP."""

from __future__ import annotations

import asyncio
import socket

from gateway.http.serve import HttpServer, listening_socket
from services.config import ServerConfig


async def _hello(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def _get(port: int) -> tuple[bytes, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return head + await reader.readexactly(5), writer


def test_accepted_connections_send_small_writes_at_once():
    """Every connection the API accepts has Nagle's algorithm off (TCP_NODELAY). With it on
    (``socket.create_server``'s socket, which asyncio does not set it for), a response's body,
    written after its head, waited for the client's delayed ACK: 40 ms more on each
    non-streamed response and on a stream's first chunk over keep-alive connections."""
    async def run() -> list[int]:
        server = HttpServer(_hello, ServerConfig(port=0, host="127.0.0.1"), 0)
        server.start()
        try:
            while not server.server.started:
                await asyncio.sleep(0.01)
            response, writer = await _get(server.port)
            assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"hello")
            flags = [c.transport.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for c in server.server.server_state.connections]
            writer.close()
            return flags
        finally:
            await server.stop()

    flags = asyncio.run(run())
    assert flags and all(flags), flags


def test_the_listening_socket_is_tcp_and_takes_an_ipv6_host():
    """The listener says IPPROTO_TCP (what asyncio reads before it sets TCP_NODELAY on an
    accepted connection) for an IPv4 and an IPv6 host, and listens on the port it was given
    (0: a free one)."""
    for host, family in (("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)):
        with listening_socket(host, 0) as sock:
            assert (sock.family, sock.type, sock.proto) == (family, socket.SOCK_STREAM,
                                                           socket.IPPROTO_TCP)
            port = sock.getsockname()[1]
            assert port > 0
            with socket.create_connection((host, port), timeout=5):
                conn, _ = sock.accept()
                conn.close()
