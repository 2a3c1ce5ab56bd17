"""The ready line `kvmesh serve --print-addresses` prints and every reader parses, and the
supervisor's wait for children started together."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.common.processes import (ChildSpec, ReadyLine, Supervisor, format_ready_line, parse_ready_line,
                                       read_ready_line)

READY = ReadyLine("http://127.0.0.1:8000/v1",
                  {"engine": {"address": "unix:/run/kvmesh/engine.sock", "pid": 42,
                              "metrics": "http://127.0.0.1:9052/metrics"}})


def test_the_ready_line_reads_back_as_written() -> None:
    line = format_ready_line(READY)
    assert line.startswith('{"kvmesh": "ready"') and "\n" not in line
    assert parse_ready_line(line) == READY


def test_other_lines_are_not_the_ready_line() -> None:
    for line in ["kvmesh: serving smollm2 at http://127.0.0.1:8000/v1", '{"kvmesh": "starting"}', '{"kvmesh": "re',
                 "[1, 2]", ""]:
        assert parse_ready_line(line) is None, line


def test_the_first_ready_line_of_a_log_is_found(tmp_path: Path) -> None:
    log = tmp_path / "serve.out"
    log.write_text("kvmesh: serving\n")
    assert read_ready_line(log) is None
    log.write_text(f"kvmesh: serving\n{format_ready_line(READY)}\n")
    assert read_ready_line(log) == READY


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_children_started_together_fail_as_soon_as_any_of_them_exits(capsys: pytest.CaptureFixture[str]) -> None:
    """The first child never becomes ready; the second exits at once (a flag it does not know).
    Waiting for them together notices the exit, instead of waiting out the first one's timeout."""
    supervisor = Supervisor(internal_grace=0.5)
    never_ready = ChildSpec("engine", ["--port", "0"], "unused", lambda: False)
    exits = ChildSpec("processor", ["--no-such-flag"], "unused", lambda: False)
    started = time.monotonic()
    try:
        assert not supervisor.wait_ready(supervisor.launch([never_ready, exits]), timeout=120)
        assert time.monotonic() - started < 60
        assert "the processor exited with code 2 while starting" in capsys.readouterr().err
    finally:
        supervisor.stop()
    assert all(child.proc.poll() is not None for child in supervisor.children)
