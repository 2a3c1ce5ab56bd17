"""The ready line `kvmesh serve --print-addresses` prints and every reader parses."""

from __future__ import annotations

from pathlib import Path

from services.common.processes import ReadyLine, format_ready_line, parse_ready_line, read_ready_line

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
