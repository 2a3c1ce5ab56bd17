"""Builds the small C kernels under kernels/cpu/ once with the system's C compiler and loads them
with ctypes. A library is cached under the cache dir its caller passes (kernels/ imports nothing
from services/), under `native/`, keyed by its source, compiler, flags
and the CPU's features (it is built with -march=native, and a cache dir may be shared by nodes
with other CPUs), so a changed source is rebuilt and concurrent builds never see half a file."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = Path(__file__).parent / "cpu"
# After the source: vectorized math calls may become glibc's vector versions (libmvec).
_LIBS = ["-lmvec", "-lm"]
# -ffast-math without its two process-wide effects: -ffinite-math-only (the kernels use -inf) and,
# above all, linking crtfastmath.o, whose constructor turns on flush-to-zero and
# denormals-are-zero in MXCSR for the whole process the moment the library loads (torch included).
FAST_MATH = ("-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
             "-freciprocal-math")


class NativeKernelUnavailable(RuntimeError):
    pass


# name -> the library `build` loaded. Written once per kernel at start-up, read on the hot path;
# a kernel nobody built is simply not used (`is_built`).
_libraries: dict[str, ctypes.CDLL] = {}


def build(name: str, flags: tuple[str, ...], cache_dir: Path) -> ctypes.CDLL:
    """kernels/cpu/{name}.c compiled with `flags` (plus -shared -fPIC) into `cache_dir`/native, loaded."""
    if name in _libraries:
        return _libraries[name]
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise NativeKernelUnavailable(f"no C compiler (gcc or cc) on PATH for the CPU kernels ({name}.c)")
    source_path = SOURCES / f"{name}.c"
    command = [compiler, *flags, "-shared", "-fPIC"]
    key_text = " ".join([*command, *_LIBS, _cpu_features()])
    key = hashlib.sha256(source_path.read_bytes() + key_text.encode()).hexdigest()[:16]
    target = Path(cache_dir) / "native" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([*command, "-o", str(built), str(source_path), *_LIBS],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeKernelUnavailable(f"compiling {source_path.name} failed:\n{result.stderr}")
            os.replace(built, target)  # atomic
    return _libraries.setdefault(name, ctypes.CDLL(str(target)))


def is_built(name: str) -> bool:
    return name in _libraries


def library(name: str) -> ctypes.CDLL:
    """The library `build` loaded; a launcher calls this only after checking `is_built`."""
    if name not in _libraries:
        raise NativeKernelUnavailable(f"the native kernel {name} is not built: call its build(cache_dir) first")
    return _libraries[name]


def _cpu_features() -> str:
    """The CPU's model and feature flags (what -march=native compiles for), or "" when unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        return ""
    return "".join(lines)
