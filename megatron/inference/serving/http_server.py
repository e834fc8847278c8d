"""An aiohttp application served from a thread of its own, with its own event loop: rank 0's main thread runs the
model's loop, and the requests (many at once, kept alive, streamed) only wait on it."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

# A burst of clients beyond the listen backlog has its connections reset (the standard library's 5 reset 18 of 64 at
# once on a CPU server). The kernel caps it at its somaxconn.
LISTEN_BACKLOG = 4096
KEEPALIVE_SECONDS = 75  # an idle kept-alive connection closes after this (aiohttp's web.run_app default)
SHUTDOWN_SECONDS = 2.0  # at stop, how long the requests in flight have to finish their answers


class _MalformedRequestInOneLine(logging.Filter):
    """aiohttp answers a request it cannot parse (a bad Content-Length, chunk size or Transfer-Encoding) with a 400
    and logs it with a traceback; the mistake is the client's: one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            reason = error.message.splitlines()[0].rstrip(":") if error.message else error.__class__.__name__
            record.msg, record.args, record.exc_info = f"{record.getMessage()}: {reason}", (), None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


log = logging.getLogger("megatron.inference.http")
log.addFilter(_MalformedRequestInOneLine())


class HttpServer:
    """``app`` served at ``host``:``port`` (0: a free port; ``port`` then says which) on a daemon thread.
    Binding happens here, so a port that cannot be bound is the caller's OSError. ``stop()`` closes the listening
    socket and the connections, after the answers in flight (``SHUTDOWN_SECONDS`` at most)."""

    def __init__(self, app: web.Application, host: str, port: int):
        self._socket = _listening_socket(host, port)
        self.port: int = self._socket.getsockname()[1]
        # handler_cancellation: a client that closes its connection cancels its handler, which ends its generation
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None,
                                     logger=log, keepalive_timeout=KEEPALIVE_SECONDS,
                                     shutdown_timeout=SHUTDOWN_SECONDS)
        self._loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, self._socket, backlog=LISTEN_BACKLOG).start()
        await self._stopping.wait()
        await self._runner.cleanup()


def _listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening, so that clients that come before the loop serves wait in the backlog. (Not
    socket.create_server: its OSError adds the address to the system's message, which the caller's one line says.)"""
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server binds its port at once
        listening.bind((host, port))
        listening.listen(LISTEN_BACKLOG)
    except OSError:
        listening.close()
        raise
    return listening
