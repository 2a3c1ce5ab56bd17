"""What a client's connection may cost the gateway: read deadlines, a connection cap, header limits.

uvicorn bounds some of it itself (`timeout_keep_alive` for idle keep-alive connections,
`h11_max_incomplete_event_size` for the request line and headers), but it has no deadline for a
request's headers or body: a client that sends one byte every few seconds (slowloris) holds its
socket, and a file descriptor, for ever; and it checks the header size only of headers still
incomplete. uvicorn does take its HTTP protocol as a class (`http=`), so the gateway keeps uvicorn
(and its shutdown handling, services/gateway/server.py) and runs uvicorn's own h11 protocol with
these additions, about a hundred lines, rather than move to another server or put a proxy in
front of every gateway (GuardedH11Protocol, one instance per connection):

    connection made ── over --max-connections? ──▶ 503, closed at once (its fd freed)
        │ header deadline (--header-timeout), armed at the connection and at a request's first byte
        ▼
    headers in ── more than --max-headers, or over --max-header-bytes? ──▶ 431, closed
        │ body deadline (--body-timeout)
        ▼
    body in ── the app answers ── keep-alive (uvicorn's --keep-alive-timeout) ── next request ...

A deadline that passes closes the connection: a 408 if no request was read yet, else the app sees
the client gone (http.disconnect) and aborts what it started. Neither is logged per connection.

When the process runs out of file descriptors anyway, asyncio's accept loop reports each failure
with a traceback; `quiet_accept_errors` turns that into one warning line every ACCEPT_WARNING_INTERVAL.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from services.common.config import GatewayConfig

logger = logging.getLogger("uvicorn.error")

# File descriptors kept out of the connection cap: the listening socket, the processor's channel,
# logs, /metrics scrapes of the local services.
FD_RESERVE = 64
ACCEPT_WARNING_INTERVAL = 10.0  # seconds between warnings of a failing accept()
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
TOO_MANY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    max_connections: int
    max_header_bytes: int
    max_headers: int

    @classmethod
    def of(cls, gateway: GatewayConfig) -> ConnectionLimits:
        """The gateway's limits, the connection cap lowered to fit this process's descriptor limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        cap = gateway.max_connections
        if soft != resource.RLIM_INFINITY and cap > soft - FD_RESERVE:
            cap = max(1, soft - FD_RESERVE)
            logger.warning("--max-connections %d lowered to %d: this process may open %d files",
                           gateway.max_connections, cap, soft)
        return cls(gateway.header_timeout, gateway.body_timeout, cap, gateway.max_header_bytes, gateway.max_headers)


def uvicorn_options(gateway: GatewayConfig) -> dict[str, Any]:
    """uvicorn.Config's arguments for the gateway's connection limits."""
    limits = ConnectionLimits.of(gateway)

    def protocol(config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> GuardedH11Protocol:
        return GuardedH11Protocol(config, server_state, app_state, _loop, limits=limits)

    return {"http": protocol, "h11_max_incomplete_event_size": gateway.max_header_bytes,
            "timeout_keep_alive": gateway.keep_alive_timeout}


class HeaderLimitingConnection(h11.Connection):
    """h11's server side, refusing a request with more than `max_headers` headers or more than
    `max_header_bytes` of request line and headers (h11 checks the size only of headers still
    incomplete, so headers that arrive whole in one read pass it); remembers the status h11
    suggests for the last protocol error (431 for headers too large)."""

    def __init__(self, max_header_bytes: int, max_headers: int) -> None:
        super().__init__(h11.SERVER, max_header_bytes)
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.error_status = 400

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise
        if isinstance(event, h11.Request):
            size = len(event.target) + sum(len(name) + len(value) + 4 for name, value in event.headers)
            if len(event.headers) > self.max_headers or size > self.max_header_bytes:
                self.error_status = 431
                raise h11.RemoteProtocolError("request headers too large or too many", error_status_hint=431)
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, the connection cap and a header count limit."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None, limits: ConnectionLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.conn = HeaderLimitingConnection(limits.max_header_bytes, limits.max_headers)
        self.deadline: asyncio.TimerHandle | None = None
        self.reading: str | None = None  # "headers" or "body": what the deadline is for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(TOO_MANY)
            transport.close()
            return
        self._expect("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.reading is None and self.conn.their_state is h11.IDLE:
            self._expect("headers")  # a new request on a kept-alive connection
        super().data_received(data)  # which handles the events, and so follows their state

    def handle_events(self) -> None:
        super().handle_events()
        self._follow_state()

    def _follow_state(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._expect("body")
        elif state is not h11.IDLE:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more to read for now
            self._expect(None)

    def _expect(self, reading: str | None) -> None:
        """Arms the deadline for `reading` (None: disarms it); an armed one for the same stays."""
        if reading == self.reading:
            return
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.reading = reading
        if reading is not None and not self.transport.is_closing():
            timeout = self.limits.header_timeout if reading == "headers" else self.limits.body_timeout
            self.deadline = self.loop.call_later(timeout, self._timed_out)

    def _timed_out(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.reading == "headers" and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(TIMED_OUT)  # no response of the app's is under way
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, with h11's status (431: headers too large or many)."""
        status = self.conn.error_status if self.conn.error_status in (400, 431) else 400
        reason = b"Request Header Fields Too Large" if status == 431 else b"Bad Request"
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=reason),
                      h11.Data(data=reason), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class AcceptErrorReporter:
    """A loop exception handler: accept() failing for want of descriptors (EMFILE, ENFILE) is one
    warning line per `interval`, without traceback; anything else goes to the default handler."""

    def __init__(self, interval: float = ACCEPT_WARNING_INTERVAL) -> None:
        self.interval = interval
        self.last = -interval
        self.suppressed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last < self.interval:
            self.suppressed += 1
            return
        logger.warning("cannot accept connections: %s (%d more such failures since the last warning)",
                       context.get("exception"), self.suppressed)
        self.last, self.suppressed = now, 0


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    loop.set_exception_handler(AcceptErrorReporter())
