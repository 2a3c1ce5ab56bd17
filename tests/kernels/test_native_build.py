"""kvmesh_kernels/native.py's builds in a cache of the test's own, with the compiler wrapped to count
its runs: a kernel compiled ahead (as a CPU worker starts) and built at the same time is compiled
once, and a compile that fails ahead fails again, with the compiler's message, where it is built."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvmesh_kernels import cpu_fused_ops, native

KERNEL = cpu_fused_ops._KERNEL  # the smallest kernel: under a second to compile


def wrapped_compiler(tmp_path: Path, body: str) -> tuple[Path, Path]:
    """A compiler script that logs each run to a file, then runs `body`; (script, log)."""
    log = tmp_path / "runs.log"
    script = tmp_path / "cc"
    script.write_text(f"#!/bin/sh\necho run >> {log}\n{body}\n")
    script.chmod(0o755)
    return script, log


def served_flags() -> tuple[str, ...]:
    return (*KERNEL.base_flags, *native.ISA_FLAGS[native.SERVED_ISA])


def test_a_kernel_compiled_ahead_and_built_at_once_is_compiled_once(tmp_path: Path, monkeypatch):
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler here")
    script, log = wrapped_compiler(tmp_path, f'exec {gcc} "$@"')
    monkeypatch.setenv("CC", str(script))
    cache = tmp_path / "cache"
    thread = KERNEL.compile_ahead(cache)
    library = native.compiled(KERNEL.name, served_flags(), cache)  # as `build` asks, while it compiles
    thread.join(60)
    assert library.is_file() and log.read_text().splitlines() == ["run"]
    assert native.compiled(KERNEL.name, served_flags(), cache) == library  # cached: no third run
    assert log.read_text().splitlines() == ["run"]


def test_a_compile_that_fails_ahead_fails_again_where_it_is_built(tmp_path: Path, monkeypatch):
    script, log = wrapped_compiler(tmp_path, 'echo "cc: no such target" >&2\nexit 1')
    monkeypatch.setenv("CC", str(script))
    cache = tmp_path / "cache"
    KERNEL.compile_ahead(cache).join(60)  # quietly: nobody waits for it
    with pytest.raises(native.NativeKernelUnavailable, match="no such target"):
        native.compiled(KERNEL.name, served_flags(), cache)
    assert log.read_text().splitlines() == ["run", "run"]
    assert not list((cache / "native").glob("*.so"))
