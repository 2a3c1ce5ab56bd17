"""The gateway's connection guard, piece by piece (services/gateway/connection_guard.py); the whole
of it against slowloris clients is tests/faults/test_slowloris.py."""

from __future__ import annotations

import asyncio
import errno
import logging

import h11
import pytest

from services.gateway.connection_guard import (AcceptErrorReporter, ClientLedger, HeaderLimitingConnection,
                                               TrustedProxies, forwarded_client)


def test_running_out_of_descriptors_is_one_line_per_interval(caplog: pytest.LogCaptureFixture):
    loop = asyncio.new_event_loop()
    try:
        reporter = AcceptErrorReporter(interval=3600)
        context = {"message": "socket.accept() out of system resource",
                   "exception": OSError(errno.EMFILE, "Too many open files")}
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            for _ in range(1000):
                reporter(loop, context)
        assert len(caplog.records) == 1 and caplog.records[0].exc_info is None
        assert reporter.suppressed == 999
    finally:
        loop.close()


@pytest.mark.parametrize("headers, refused", [(b"X-A: 1\r\n" * 10, False), (b"X-A: 1\r\n" * 11, True),
                                              (b"X-A: " + b"a" * 1100 + b"\r\n", True)])
def test_headers_over_the_count_or_size_are_a_431(headers: bytes, refused: bool):
    conn = HeaderLimitingConnection(max_header_bytes=1024, max_headers=11)  # Host is one of them
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    if not refused:
        assert isinstance(conn.next_event(), h11.Request)
        return
    with pytest.raises(h11.RemoteProtocolError):
        conn.next_event()
    assert conn.error_status == 431


@pytest.mark.parametrize("peer, forwarded, client", [
    ("10.0.0.9", [b"1.2.3.4"], "10.0.0.9"),  # not a trusted proxy: its header names nobody
    ("10.0.0.1", [b"1.2.3.4"], "1.2.3.4"),
    ("10.0.0.1", [b"6.6.6.6, 1.2.3.4"], "1.2.3.4"),  # the client may write the first entries, not the last
    ("10.0.0.1", [b"6.6.6.6", b"1.2.3.4, 10.0.0.2"], "1.2.3.4"),  # a chain of trusted proxies
    ("10.0.0.1", [], "10.0.0.1"),  # a proxy's own request
])
def test_x_forwarded_for_names_the_client_only_behind_a_trusted_proxy(peer: str, forwarded: list[bytes], client: str):
    assert forwarded_client(peer, forwarded, TrustedProxies.of(["10.0.0.1", "10.0.0.2/31"])) == client


def test_the_ledger_caps_each_client_and_the_bodies_held_together():
    ledger = ClientLedger(max_per_client=2, max_body_bytes=100)
    assert [ledger.admit("a"), ledger.admit("a"), ledger.admit("a"), ledger.admit("b")] == [True, True, False, True]
    ledger.release("a")
    assert ledger.admit("a") and dict(ledger.connections) == {"a": 2, "b": 1}
    assert [ledger.reserve_body(60), ledger.reserve_body(41), ledger.reserve_body(40)] == [True, False, True]
    ledger.release_body(100)
    for client in ("a", "a", "b"):
        ledger.release(client)
    assert ledger.body_bytes == 0 and not ledger.connections
    ledger.check_integrity()
