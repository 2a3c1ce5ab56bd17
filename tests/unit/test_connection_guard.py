"""The gateway's connection guard, piece by piece (services/gateway/connection_guard.py); the whole
of it against slowloris clients is tests/faults/test_slowloris.py."""

from __future__ import annotations

import asyncio
import errno
import logging

import h11
import pytest

from services.gateway.connection_guard import AcceptErrorReporter, HeaderLimitingConnection


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
