"""The MegaScope WebSocket server, shared by the inference server and the training mode.

It runs in a thread with its own asyncio loop, so the model loop never waits on the network: the model
hands messages and data frames to `Client.send` / `Client.send_data` (thread-safe, non-blocking), and each
client has a bounded queue that drops its oldest data frames (never control messages) when the client
reads slower than the model writes. The server does the protocol's fixed duties (hello, version, token,
Origin, size and rate limits, ping, error frames) and hands every other checked message to a ``Session``
(inference_session.py, training_session.py). See docs/megascope_protocol.md.
"""

import asyncio
import collections
import hmac
import itertools
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import websockets
from websockets.asyncio.server import serve

from megascope.errors import ProtocolError
from megascope.wire import (
    ACCEPTED_PROTOCOLS,
    INFERENCE_TYPES,
    PROTOCOL_VERSION,
    TRAINING_TYPES,
    echo_id,
    encode_message,
    error_from,
    error_message,
    parse_message,
    sent_id,
)
from megatron.inference.limits import Limits
from megatron.training.errors import UserError

log = logging.getLogger("megascope.ws")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
GOODBYE_SECONDS = 5  # at stop with a reason: how long the queued messages may take to reach the clients
_DEFAULT_LIMITS = Limits()  # frozen: one shared default instance
_LOCAL_ORIGIN = re.compile(r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?")


def allowed_origins(host, extra=()):
    """Origins a browser may connect from: localhost pages, pages of the server's own host, and ``extra``.
    None (no Origin header: a non-browser client) is accepted; the token guards non-local hosts."""
    origins = [None, _LOCAL_ORIGIN, *extra]
    if host not in LOCAL_HOSTS and host not in ("0.0.0.0", "::"):
        origins.append(re.compile(r"https?://" + re.escape(host) + r"(:\d+)?"))
    return origins


class RateLimit:
    """Token bucket: ``rate`` messages per second, bursts of ``rate``."""

    def __init__(self, rate):
        self.rate = rate
        self.tokens = float(rate)
        self.last = time.monotonic()

    def allow(self):
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Client:
    """One connection: a send queue fed from any thread, drained by the connection's own task."""

    _numbers = itertools.count(1)

    def __init__(self, server, connection):
        self.number = next(self._numbers)
        self.server = server
        self.connection = connection
        self.welcomed = False
        self.closed = False
        self.dropped_total = 0      # data frames dropped since the connection opened
        self._dropped_unreported = 0
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified as the data queue drains
        self._sequence = itertools.count()
        self._control = collections.deque()   # (sequence, text): never dropped
        self._data = collections.deque()      # (sequence, bytes): bounded, oldest dropped
        self._wake = asyncio.Event()
        self._draining = True  # the drain task is busy; False while it waits for _wake (set under _lock)
        self._goodbye = None                  # (code, reason): close with these once the queue is sent

    def send(self, message):
        """Queue a JSON message (dict); thread-safe, never blocks, never dropped."""
        self._put(self._control, encode_message(message))

    def send_data(self, frame):
        """Queue a binary data frame; thread-safe, never blocks; the oldest data frame goes when full."""
        self._put(self._data, frame)

    def wait_for_room(self, timeout):
        """Block until the data queue has room for more frames without dropping any (or the connection closed);
        False when it had none for ``timeout`` seconds: the client is not reading."""
        with self._room:
            return self._room.wait_for(
                lambda: self.closed or len(self._data) < self.server.limits.send_queue_frames // 2, timeout)

    def mark_closed(self):
        """The connection is gone: nothing more is queued, and a thread waiting for room goes on."""
        with self._room:
            self.closed = True
            self._room.notify_all()

    def _put(self, queue, item):
        if self.closed:
            return
        with self._lock:
            queue.append((next(self._sequence), item))
            while len(self._data) > self.server.limits.send_queue_frames:
                self._data.popleft()
                self.dropped_total += 1
                self._dropped_unreported += 1
            wake, self._draining = not self._draining, True
        if wake:  # a busy drain task takes the item without it: one wake-up per idle spell, not per frame
            self.server.loop.call_soon_threadsafe(self._wake.set)

    def _next(self):
        """The oldest queued item of either kind, a `dropped` report first when frames were dropped."""
        with self._lock:
            if self._dropped_unreported:
                count, self._dropped_unreported = self._dropped_unreported, 0
                return encode_message({"type": "dropped", "frames": count})
            if self._control and (not self._data or self._control[0][0] < self._data[0][0]):
                return self._control.popleft()[1]
            if self._data:
                self._room.notify_all()
                return self._data.popleft()[1]
            self._wake.clear()
            self._draining = False
            return None

    async def drain(self):
        while True:
            item = self._next()
            if item is None:
                if self._goodbye is not None:
                    await self.connection.close(*self._goodbye)
                    return
                await self._wake.wait()
                continue
            await self.connection.send(item)

    def say_goodbye(self, code, reason):
        """On the server's loop: send what is queued, then close with ``code`` and ``reason``."""
        self._goodbye = (code, reason)
        self._wake.set()


# A session's handler of one type of client message (see Session.on_message).
MessageHandler = Callable[[Client, dict], None]


class Session(Protocol):
    """What the server needs of a session; a session names it as its base, so that the type checker holds its
    methods to these signatures."""

    mode: Literal["inference", "training"]  # which message types the server accepts (wire.py) and the welcome names

    def welcome_info(self) -> dict:
        """The welcome's model part: {"model": {...}, "hooks": [...], "reductions": [...], "noise": [...], ...}."""
        ...

    def on_welcome(self, client: Client) -> None:
        """After the welcome: what a new client must learn at once."""
        ...

    def on_message(self, client: Client, message: dict) -> None:
        """A checked message of a type other than hello and ping, on the server thread: it must not block and may
        raise ProtocolError. A session answers it through its table of handlers (message type -> MessageHandler)."""
        ...

    def on_disconnect(self, client: Client) -> None:
        """A welcomed client is gone."""
        ...


class WebSocketServer:
    """``WebSocketServer(session, host, port, token=None, limits=Limits(), origins=(), flags=...).start()``.

    Port 0 picks a free port (``.port`` after start). A host other than 127.0.0.1/localhost/::1 needs a
    token; without one a token is generated and printed. ``flags``: the command-line flags that chose host
    and port, named when they cannot be bound."""

    def __init__(self, session: Session, host: str = "127.0.0.1", port: int = 5001, token: str | None = None,
                 limits: Limits = _DEFAULT_LIMITS, origins: Sequence[str] = (), flags: str = "--ws-host/--ws-port"):
        self.session = session
        self.flags = flags
        self.host = host
        self.limits = limits
        self.port = port
        if token is None and host not in LOCAL_HOSTS:
            token = secrets.token_urlsafe(24)
            print(f"MegaScope WebSocket token (send it in hello): {token}", flush=True)
        self.token = token
        self.origins = allowed_origins(host, origins)
        self.types = TRAINING_TYPES if session.mode == "training" else INFERENCE_TYPES
        self.clients: set[Client] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._failure: str | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._goodbye: str | None = None  # the reason of a normal closure (1000) at stop; None: 1001 going away

    def start(self):
        """Bind and serve on a daemon thread; raises UserError (one line) when the port cannot be bound."""
        self._thread = threading.Thread(target=self._run, name="megascope-ws", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise UserError(f"{self.flags}: cannot listen on {self.host}:{self.port} ({self._failure}); "
                            "pick a free port")
        log.info("MegaScope WebSocket server on ws://%s:%d (protocol %d)", self.host, self.port, PROTOCOL_VERSION)
        return self

    def stop(self, reason=None):
        """Close every connection and stop serving. With ``reason`` (the service has ended, e.g. "training
        ended at iteration 40"), each client first gets what is queued for it, then a normal closure (1000)
        with that reason, so a page shows the end rather than a lost connection it would retry; without,
        1001 (going away: the server may come back)."""
        if self.loop is not None and self._stop is not None:
            self._goodbye = reason
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=10)

    def broadcast(self, message):
        """Send a JSON message to every welcomed client (thread-safe)."""
        for client in list(self.clients):
            if client.welcomed:
                client.send(message)

    def _run(self):
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self):
        self._stop = asyncio.Event()
        try:
            # No permessage-deflate: data frames are floats, which deflate barely shrinks at a high cost in this
            # thread (random float32 frames went out 7x slower than frames of zeros with it on).
            server = await serve(self._handle, self.host, self.port, origins=self.origins, compression=None,
                                 max_size=self.limits.max_message_bytes, ping_interval=20, ping_timeout=60)
        except OSError as error:
            self._failure = error.strerror or str(error)
            self._ready.set()
            return
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            if self._goodbye is not None and self.clients:
                for client in list(self.clients):
                    client.say_goodbye(1000, self._goodbye)
                # a client that does not read within the time left goes with 1001 when the server closes
                closing = [asyncio.create_task(client.connection.wait_closed()) for client in list(self.clients)]
                await asyncio.wait(closing, timeout=GOODBYE_SECONDS)

    async def _handle(self, connection):
        client = Client(self, connection)
        self.clients.add(client)
        sender = asyncio.create_task(client.drain())
        rate = RateLimit(self.limits.max_messages_per_second)
        try:
            async for data in connection:
                if not rate.allow():
                    client.send(error_message("rate_limited", "too many messages; at most "
                                              f"{self.limits.max_messages_per_second} per second",
                                              id=sent_id(data)))
                    continue
                if not await self._dispatch(client, data):
                    break
        except websockets.ConnectionClosed:
            pass
        finally:
            client.mark_closed()
            self.clients.discard(client)
            sender.cancel()
            if client.welcomed:
                self.session.on_disconnect(client)

    async def _dispatch(self, client, data):
        """Answer one frame; False when the connection must close (a token error). Every error frame echoes
        the frame's id, also when the frame failed validation (then ``message`` is None)."""
        message = None
        try:
            message = parse_message(data, self.types)
            if message["type"] == "hello":
                return await self._hello(client, message)
            if not client.welcomed:
                raise ProtocolError("unauthorized", "send hello first", "type")
            if message["type"] == "ping":
                client.send({"type": "pong", **echo_id(message)})
            else:
                self.session.on_message(client, message)
        except ProtocolError as error:
            client.send(error_from(error, sent_id(data)))
        except Exception:  # a server bug: report it, keep serving
            log.exception("MegaScope: failure while handling a %s message", (message or {}).get("type"))
            client.send(error_message("internal", "the server failed on this message; see the server log",
                                      id=sent_id(data)))
        return True

    async def _hello(self, client, message):
        if message["protocol"] not in ACCEPTED_PROTOCOLS:
            older = ", ".join(str(version) for version in ACCEPTED_PROTOCOLS if version != PROTOCOL_VERSION)
            raise ProtocolError("bad_field", f"this server speaks protocol {PROTOCOL_VERSION} (and takes a hello of "
                                f"version {older}), not {message['protocol']}", "protocol")
        if self.token is not None and not hmac.compare_digest(
                (message["token"] or "").encode(), self.token.encode()):
            refusal = error_message("unauthorized", "missing or wrong token; use the token the server printed",
                                    "token", message.get("id"))
            await client.connection.send(encode_message(refusal))  # directly: the close follows at once
            await client.connection.close(1008, "unauthorized")
            return False
        client.welcomed = True
        client.send({"type": "welcome", "protocol": PROTOCOL_VERSION, "mode": self.session.mode,
                     **self.session.welcome_info(), "limits": self.limits.as_json(), **echo_id(message)})
        self.session.on_welcome(client)
        return True
