"""What a client's connection may cost the gateway: read deadlines, connection caps (all clients
together and each one), header limits, a memory budget for request bodies.

uvicorn bounds some of it itself (`timeout_keep_alive` for idle keep-alive connections,
`h11_max_incomplete_event_size` for the request line and headers), but it has no deadline for a
request's headers or body: a client that sends one byte every few seconds (slowloris) holds its
socket, and a file descriptor, for ever; and it checks the header size only of headers still
incomplete. uvicorn does take its HTTP protocol as a class (`http=`), so the gateway keeps uvicorn
(and its shutdown handling, services/gateway/server.py) and runs uvicorn's own h11 protocol with
these additions, about a hundred lines, rather than move to another server or put a proxy in
front of every gateway (GuardedH11Protocol, one instance per connection):

    connection made ── over --max-connections? ──▶ 503, closed at once (its fd freed)
        │            └─ its address over --max-connections-per-client? ──▶ 429, closed at once
        │ header deadline (--header-timeout), armed at the connection and at a request's first byte
        ▼
    headers in ── more than --max-headers, or over --max-header-bytes? ──▶ 431, closed
        │      └─ from a --trusted-proxy: X-Forwarded-For's client over its cap? ──▶ 429, closed
        │ body deadline (--body-timeout)
        ▼
    body in ── all bodies held together over --max-buffered-body-bytes? ──▶ 503, closed
        │       (a body's bytes count from its arrival until its response is complete)
        ▼
    the app answers ── its writes unread for --send-timeout (the client's socket full)? ──▶ aborted
        │
        ▼
    keep-alive (uvicorn's --keep-alive-timeout) ── next request ...

A client is the peer's address: X-Forwarded-For is anyone's to write, so it names the client only
on connections from a trusted proxy (the last address it names that is not one). Refusals of a
request carry the OpenAI error body naming the flag and its bound.

A deadline that passes closes the connection: a 408 if no request was read yet, else the app sees
the client gone (http.disconnect) and aborts what it started. Neither is logged per connection.

A client that stops reading fills its socket's buffers (the kernel's send buffer is fixed at
SEND_BUFFER_BYTES: autotuned, it would grow to megabytes per connection), then asyncio's write
buffer past its high water mark: uvicorn then pauses the app's writes (back-pressure reaches the processor's stream
through gRPC's flow control). If the client has not drained it --send-timeout later, the
connection is reset (dropping what is buffered, the kernel's too; a close would wait to flush it).

When the process runs out of file descriptors anyway, asyncio's accept loop reports each failure
with a traceback; `quiet_accept_errors` turns that into one warning line every ACCEPT_WARNING_INTERVAL.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Sequence
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
# A connection's kernel send buffer (Linux doubles it): ~5 MB/s on a 100 ms path, far above what
# a model writes to one client, and bounded where autotuning would allow 4 MB a connection.
SEND_BUFFER_BYTES = 256 * 1024
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
TOO_MANY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
REASONS = {400: b"Bad Request", 429: b"Too Many Requests", 431: b"Request Header Fields Too Large",
           503: b"Service Unavailable"}


class TrustedProxies:
    """The addresses and networks (10.0.0.0/8) of the proxies whose X-Forwarded-For is believed."""

    def __init__(self, networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> None:
        self.networks = tuple(networks)

    @classmethod
    def of(cls, specs: Sequence[str]) -> TrustedProxies:
        """ValueError for what is neither an address nor a network."""
        return cls([ipaddress.ip_network(spec.strip(), strict=False) for spec in specs])

    def __contains__(self, address: str) -> bool:
        if not self.networks:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:  # a port, a name, garbage: not an address of ours
            return False
        return any(ip in network for network in self.networks)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    max_connections: int
    max_header_bytes: int
    max_headers: int
    max_connections_per_client: int = 2**31
    max_buffered_body_bytes: int = 2**62
    trusted_proxies: TrustedProxies = TrustedProxies(())
    send_timeout: float = 60.0

    @classmethod
    def of(cls, gateway: GatewayConfig) -> ConnectionLimits:
        """The gateway's limits, the connection cap lowered to fit this process's descriptor limit."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        cap = gateway.max_connections
        if soft != resource.RLIM_INFINITY and cap > soft - FD_RESERVE:
            cap = max(1, soft - FD_RESERVE)
            logger.warning("--max-connections %d lowered to %d: this process may open %d files",
                           gateway.max_connections, cap, soft)
        return cls(gateway.header_timeout, gateway.body_timeout, cap, gateway.max_header_bytes, gateway.max_headers,
                   gateway.max_connections_per_client, gateway.max_buffered_body_bytes,
                   TrustedProxies.of(gateway.trusted_proxy), gateway.send_timeout)


def error_response(status: int, message: str, param: str | None, code: str) -> bytes:
    """A whole HTTP response closing the connection, with OpenAI's error body."""
    kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nretry-after: 1\r\n"
            b"connection: close\r\n\r\n%s" % (status, REASONS[status], len(body), body))


def forwarded_client(peer: str, forwarded_for: Sequence[bytes], trusted_proxies: TrustedProxies) -> str:
    """The client a request comes from: `peer`, unless `peer` is a trusted proxy; then the last
    address of X-Forwarded-For (each proxy appends the one it heard from) that is not a trusted proxy."""
    if peer not in trusted_proxies:
        return peer
    hops = [hop.strip() for value in forwarded_for for hop in value.decode("latin-1").split(",")]
    for hop in reversed(hops):
        if hop and hop not in trusted_proxies:
            return hop[:64]  # an address, not a way to make the gateway hold long keys
    return peer


class ClientLedger:
    """What all connections of one gateway process hold together: connections per client, and the
    bytes of request bodies taken in and not yet answered (the memory budget)."""

    def __init__(self, max_per_client: int, max_body_bytes: int) -> None:
        self.max_per_client = max_per_client
        self.max_body_bytes = max_body_bytes
        self.connections: Counter[str] = Counter()
        self.body_bytes = 0

    def admit(self, client: str) -> bool:
        """One more connection of `client`, unless it holds its cap already."""
        if self.connections[client] >= self.max_per_client:
            return False
        self.connections[client] += 1
        return True

    def release(self, client: str) -> None:
        self.connections[client] -= 1
        if self.connections[client] <= 0:
            del self.connections[client]

    def reserve_body(self, num_bytes: int) -> bool:
        """`num_bytes` more of a body held, unless that goes over the budget."""
        if self.body_bytes + num_bytes > self.max_body_bytes:
            return False
        self.body_bytes += num_bytes
        return True

    def release_body(self, num_bytes: int) -> None:
        self.body_bytes -= num_bytes
        assert self.body_bytes >= 0, self.body_bytes

    def check_integrity(self) -> None:
        assert self.body_bytes >= 0 and all(n > 0 for n in self.connections.values())


def uvicorn_options(gateway: GatewayConfig) -> dict[str, Any]:
    """uvicorn.Config's arguments for the gateway's connection limits."""
    limits = ConnectionLimits.of(gateway)
    ledger = ClientLedger(limits.max_connections_per_client, limits.max_buffered_body_bytes)

    def protocol(config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> GuardedH11Protocol:
        return GuardedH11Protocol(config, server_state, app_state, _loop, limits=limits, ledger=ledger)

    return {"http": protocol, "h11_max_incomplete_event_size": gateway.max_header_bytes,
            "timeout_keep_alive": gateway.keep_alive_timeout}


class Refusal(h11.RemoteProtocolError):
    """A request the gateway will not take: the whole response to send before closing."""

    def __init__(self, status: int, response: bytes) -> None:
        super().__init__(response.decode("latin-1"), error_status_hint=status)
        self.response = response


class HeaderLimitingConnection(h11.Connection):
    """h11's server side, refusing a request with more than `max_headers` headers or more than
    `max_header_bytes` of request line and headers (h11 checks the size only of headers still
    incomplete, so headers that arrive whole in one read pass it); remembers the status h11
    suggests for the last protocol error (431 for headers too large). `guard`, when given, sees each
    request and each piece of a body first and may refuse them (Refusal)."""

    def __init__(self, max_header_bytes: int, max_headers: int, guard: GuardedH11Protocol | None = None) -> None:
        super().__init__(h11.SERVER, max_header_bytes)
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.guard = guard
        self.error_status = 400
        self.refusal: Refusal | None = None

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
        try:
            if self.guard is not None and isinstance(event, h11.Request):
                self.guard.admit_request(event)
            elif self.guard is not None and isinstance(event, h11.Data):
                self.guard.admit_body(len(event.data))
        except Refusal as refusal:
            self.error_status, self.refusal = refusal.error_status_hint, refusal
            raise
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, the connection cap and a header count limit."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None, limits: ConnectionLimits,
                 ledger: ClientLedger | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.ledger = ledger or ClientLedger(limits.max_connections_per_client, limits.max_buffered_body_bytes)
        self.conn = HeaderLimitingConnection(limits.max_header_bytes, limits.max_headers, guard=self)
        self.deadline: asyncio.TimerHandle | None = None
        self.reading: str | None = None  # "headers" or "body": what the deadline is for
        self.send_deadline: asyncio.TimerHandle | None = None  # armed while writing is paused
        self.peer = ""  # the address this connection comes from
        self.client_key: str | None = None  # the client it counts for in the ledger, once admitted
        self.body_bytes = 0  # of the current request's body, reserved in the ledger

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        if len(self.connections) > self.limits.max_connections:
            transport.write(TOO_MANY)
            transport.close()
            return
        self.peer = self.client[0] if self.client else "unknown"
        if self.peer not in self.limits.trusted_proxies:  # a proxy's connections count per request's client
            if not self.ledger.admit(self.peer):
                transport.write(self._too_many_from(self.peer))
                transport.close()
                return
            self.client_key = self.peer
        self._expect("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._expect(None)
        self._disarm_send_deadline()
        self._release_body()
        self._release_client()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # uvicorn hands the connection to its websocket protocol, whose end this one never sees.
        self._expect(None)
        self._release_body()
        self._release_client()
        super().handle_websocket_upgrade(event)

    def on_response_complete(self) -> None:
        self._release_body()  # the app is done with the body
        super().on_response_complete()

    def admit_request(self, request: h11.Request) -> None:
        """Behind a trusted proxy, the connection counts for the client this request names."""
        if self.peer not in self.limits.trusted_proxies:
            return
        forwarded = [value for name, value in request.headers if name == b"x-forwarded-for"]
        client = forwarded_client(self.peer, forwarded, self.limits.trusted_proxies)
        if client == self.client_key:
            return
        self._release_client()
        if not self.ledger.admit(client):
            raise Refusal(429, self._too_many_from(client))
        self.client_key = client

    def admit_body(self, num_bytes: int) -> None:
        if self.conn.our_state is h11.DONE:
            return  # answered already: uvicorn drops the rest of the body
        if not self.ledger.reserve_body(num_bytes):
            budget = self.ledger.max_body_bytes
            raise Refusal(503, error_response(
                503, f"the gateway holds as many request bodies as --max-buffered-body-bytes allows ({budget} bytes "
                     "for all requests in flight); retry later", None, "body_budget_exceeded"))
        self.body_bytes += num_bytes

    def _release_client(self) -> None:
        if self.client_key is not None:
            self.ledger.release(self.client_key)
            self.client_key = None

    def _release_body(self) -> None:
        if self.body_bytes:
            self.ledger.release_body(self.body_bytes)
            self.body_bytes = 0

    def _too_many_from(self, client: str) -> bytes:
        cap = self.ledger.max_per_client
        return error_response(429, f"client {client} holds {cap} connections already, as many as "
                                   "--max-connections-per-client allows; close one first", None,
                              "too_many_connections")

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

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_deadline is None and not self.transport.is_closing():
            self.send_deadline = self.loop.call_later(self.limits.send_timeout, self._send_timed_out)

    def resume_writing(self) -> None:
        self._disarm_send_deadline()
        super().resume_writing()

    def _disarm_send_deadline(self) -> None:
        if self.send_deadline is not None:
            self.send_deadline.cancel()
            self.send_deadline = None

    def _send_timed_out(self) -> None:
        self.send_deadline = None
        if self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a FIN: the kernel drops the unsent bytes too, at once
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()  # connection_lost follows: the app sees http.disconnect

    def _timed_out(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.reading == "headers" and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(TIMED_OUT)  # no response of the app's is under way
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, with h11's status (431: headers too large or many),
        or the guard's own answer; nothing when the app has started a response already."""
        refusal, self.conn.refusal = self.conn.refusal, None
        if refusal is not None:
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (self.cycle is None
                                                                       or not self.cycle.response_started):
                self.transport.write(refusal.response)
            self.transport.close()
            return
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
