"""Clients that hold the gateway's connections without finishing a request, against `kvmesh serve`:
slowloris sockets (headers one byte at a time) are closed after --header-timeout while /health
answers throughout and the gateway's descriptors come back down; a body that trickles is cut after
--body-timeout; connections over --max-connections are refused at once; headers too large or too
many are a 431; none of it fills the log."""

from __future__ import annotations

import http.client
import os
import socket
import time
from collections.abc import Iterator

import pytest

from tests.services.procs import Serve, gateway_over

pytestmark = pytest.mark.slow

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0
MAX_CONNECTIONS = 400
SLOWLORIS = 300


@pytest.fixture(scope="module")
def serve(serve: Serve) -> Iterator[Serve]:
    # Every socket here comes from 127.0.0.1: the cap per client address (tests/faults/test_fairness.py)
    # is lifted to the global one, so that these deadlines and that cap are what meet them.
    with gateway_over(serve, ["--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                              "--max-connections", str(MAX_CONNECTIONS),
                              "--max-connections-per-client", str(MAX_CONNECTIONS)]) as gateway:
        yield gateway


def _fds(serve: Serve) -> int:
    return len(os.listdir(f"/proc/{serve.services['gateway']['pid']}/fd"))


def _health(serve: Serve) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=5)
    conn.request("GET", "/health")
    status = conn.getresponse().status
    conn.close()
    return status


def _answer_before_close(sock: socket.socket, timeout: float = 1.0) -> bytes | None:
    """What the server sent on `sock` before it closed it; None while it stays open."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return data


def _closed_by_server(sock: socket.socket, timeout: float = 1.0) -> bool:
    return _answer_before_close(sock, timeout) is not None


def test_slowloris_sockets_are_closed_and_health_answers_throughout(serve: Serve):
    baseline = _fds(serve)
    sockets = []
    for _ in range(SLOWLORIS):
        sock = socket.create_connection(("127.0.0.1", serve.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        sockets.append(sock)
    try:
        deadline = time.monotonic() + HEADER_TIMEOUT + 10
        peak = fds = _fds(serve)
        while fds > baseline + 5 or peak < baseline + SLOWLORIS / 2:
            assert _health(serve) == 200
            for sock in sockets:  # one more byte each: the slowloris keeps its sockets "active"
                try:
                    sock.sendall(b"X")
                except OSError:
                    pass
            assert time.monotonic() < deadline, f"{_fds(serve)} descriptors open, {baseline} before"
            time.sleep(0.5)
            fds = _fds(serve)
            peak = max(peak, fds)
        answers = [_answer_before_close(sock) for sock in sockets]
        assert all(a is not None and (a == b"" or a.startswith(b"HTTP/1.1 408")) for a in answers)
        assert _health(serve) == 200
    finally:
        for sock in sockets:
            sock.close()


def test_a_trickling_body_is_cut_after_the_body_timeout(serve: Serve):
    with socket.create_connection(("127.0.0.1", serve.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        start = time.monotonic()
        while not _closed_by_server(sock, timeout=0.5):
            sock.sendall(b" ")
            assert time.monotonic() - start < BODY_TIMEOUT + 10, "the trickling body is still being read"
        assert time.monotonic() - start >= BODY_TIMEOUT - 0.5


def test_connections_over_the_cap_are_refused_at_once(serve: Serve):
    sockets = [socket.create_connection(("127.0.0.1", serve.port)) for _ in range(MAX_CONNECTIONS + 20)]
    try:
        answers = [_answer_before_close(s, timeout=2.0) for s in sockets[-20:]]
        assert all(a is not None and a.startswith(b"HTTP/1.1 503") for a in answers), answers
        assert _fds(serve) < MAX_CONNECTIONS + 40
    finally:
        for sock in sockets:
            sock.close()
    deadline = time.monotonic() + HEADER_TIMEOUT + 10
    while _health(serve) != 200:
        assert time.monotonic() < deadline


@pytest.mark.parametrize("headers", [{"X-Big": "a" * 20_000}, {f"X-{i}": "a" for i in range(150)}],
                         ids=["one huge header", "150 headers"])
def test_headers_too_large_or_too_many_are_a_431(serve: Serve, headers: dict[str, str]):
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=5)
    conn.request("GET", "/health", headers=headers)
    assert conn.getresponse().status == 431


def test_none_of_it_filled_the_log(serve: Serve):
    log = serve.log(10_000_000)
    assert "Traceback" not in log
    assert len(log.splitlines()) < 200
