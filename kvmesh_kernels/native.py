"""Builds the small C kernels under kvmesh_kernels/cpu/ once with the system's C compiler and loads them
with ctypes. A library is cached under the cache dir its caller passes (kvmesh_kernels/ imports nothing
from services/), under `native/`, keyed by its source and the headers beside it, compiler, flags
and the CPU's features (it is built with -march=native, and a cache dir may be shared by nodes
with other CPUs), so a changed source is rebuilt, concurrent builds never see half a file, and
one process compiles while the others wait.

The kernels choose their code path when compiled (`#if defined(__AVX512F__)`, `__AVX2__`...), so
the serving build (`build`, -march=native) runs the best path of the CPU it is built on. Tests also
`load` the other paths this CPU can run (`ISA_FLAGS`, `runs_here`): the AVX2 path on an AVX-512 host,
the portable C path everywhere; a variant is kept beside the served library, never in its place."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
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


# The code paths a kernel can be compiled for: the flags that select each (added to the kernel's
# own). `native` is what serving uses; `avx2` is AVX2 + FMA + F16C without AVX-512 (most cloud x86
# VMs); `scalar` is the compiler's baseline for the architecture (the portable C code).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": ("-march=native",),
    "avx2": ("-mavx2", "-mfma", "-mf16c", "-mno-avx512f"),
    "scalar": (),
}
# The /proc/cpuinfo flags a variant needs to run.
_ISA_NEEDS = {"native": (), "avx2": ("avx2", "fma", "f16c"), "scalar": ()}
# The served builds' instruction set: this CPU's (native), or an older CPU's as far as kvmesh goes
# (KVMESH_CPU_ISA=avx2: the kernels' AVX2 paths, and `cpu_has` denies AVX-512, AMX and VNNI, so that
# what chooses by them, `--dtype auto` included, chooses as on an AVX2-only CPU), to measure that
# CPU's paths on this one (docs/benchmarks/index.md; torch's own: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA).
SERVED_ISA = os.environ.get("KVMESH_CPU_ISA", "native")
if SERVED_ISA not in ISA_FLAGS:
    raise ValueError(f"KVMESH_CPU_ISA must be one of {', '.join(ISA_FLAGS)}, got {SERVED_ISA!r}")
_DENIED = {"native": (), "avx2": ("avx512", "amx", "avx_vnni", "avx10"),
           "scalar": ("avx", "fma", "f16c", "amx")}[SERVED_ISA]

# name -> the library `build` loaded for serving. Written once per kernel at start-up, read on the
# hot path; a kernel nobody built is simply not used (`is_built`).
_libraries: dict[str, ctypes.CDLL] = {}
# (name, flags) -> every library loaded, the served ones and the test variants.
_loaded: dict[tuple[str, tuple[str, ...]], ctypes.CDLL] = {}


def runs_here(isa: str) -> bool:
    """Whether this CPU can run the kernels compiled for `isa` (a key of ISA_FLAGS)."""
    return cpu_has(*_ISA_NEEDS[isa])


def cpu_has(*features: str) -> bool:
    """Whether /proc/cpuinfo lists every one of `features` (e.g. "avx2", "avx512f") for this CPU."""
    flags = {flag for flag in _cpu_features().partition("flags")[2].split() if not flag.startswith(_DENIED)}
    return all(feature in flags for feature in features)


def build(name: str, flags: tuple[str, ...], cache_dir: Path) -> ctypes.CDLL:
    """kvmesh_kernels/cpu/{name}.c compiled with `flags` (plus -shared -fPIC) into `cache_dir`/native, loaded
    as the process's `name` kernel (`library(name)`). A name is served with one set of flags."""
    if name in _libraries and _loaded.get((name, flags)) is not _libraries[name]:
        raise ValueError(f"the native kernel {name} is already served with other flags; load() a variant")
    if name not in _libraries:
        _libraries[name] = load(name, flags, cache_dir)
    return _libraries[name]


class Kernel:
    """One C file under kvmesh_kernels/cpu/ as its Python module serves it: compiled with the module's flags
    for this CPU (`build`, the served library) or for another instruction set (`variant`, for tests),
    each library given its functions' signatures by `declare`."""

    def __init__(self, name: str, base_flags: tuple[str, ...],
                 declare: Callable[[ctypes.CDLL], ctypes.CDLL]) -> None:
        self.name, self.base_flags, self.declare = name, base_flags, declare

    def build(self, cache_dir: Path) -> None:
        """Compile (or find the cached build of) the kernel under `cache_dir` for this CPU, to serve;
        raises NativeKernelUnavailable."""
        self.declare(build(self.name, (*self.base_flags, *ISA_FLAGS[SERVED_ISA]), cache_dir))

    def available(self, cache_dir: Path) -> bool:
        """`build`, and whether it could (False without a compiler, or where the source does not build)."""
        try:
            self.build(cache_dir)
        except NativeKernelUnavailable:
            return False
        return True

    def compile_ahead(self, cache_dir: Path) -> threading.Thread:
        """Start compiling the served build in a thread of its own (returned, started) and return at
        once. The compiler is a process, so kernels compile side by side, and beside whatever the
        caller does next (a model's conversion, on a first start); `build` then finds the library or
        waits for its compile (the file lock). A failure is left for `build` to raise."""
        flags = (*self.base_flags, *ISA_FLAGS[SERVED_ISA])
        thread = threading.Thread(target=_compile_quietly, args=(self.name, flags, cache_dir), daemon=True,
                                  name=f"compile-{self.name}")
        thread.start()
        return thread

    def variant(self, isa: str, cache_dir: Path) -> ctypes.CDLL:
        """The kernel compiled for `isa` (a key of ISA_FLAGS), beside the served one: pass it as `lib`
        to run that code path."""
        return self.declare(load(self.name, (*self.base_flags, *ISA_FLAGS[isa]), cache_dir))


def load(name: str, flags: tuple[str, ...], cache_dir: Path, source: str | None = None) -> ctypes.CDLL:
    """kvmesh_kernels/cpu/{name}.c compiled with `flags` and loaded, without serving it: a variant for tests.
    `source` is a text to compile in place of the file, with the file's headers (the tests' rewritten builds)."""
    if (name, flags) in _loaded:
        return _loaded[(name, flags)]
    return _loaded.setdefault((name, flags), ctypes.CDLL(str(compiled(name, flags, cache_dir, source))))


def compiled(name: str, flags: tuple[str, ...], cache_dir: Path, source: str | None = None) -> Path:
    """The shared library of kvmesh_kernels/cpu/{name}.c (or `source`) compiled with `flags`, from the
    cache or compiled now; `load` without loading it."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise NativeKernelUnavailable(f"no C compiler (gcc or cc) on PATH for the CPU kernels ({name}.c)")
    source_path = SOURCES / f"{name}.c"
    text = source_path.read_bytes() if source is None else source.encode()
    includes = () if source is None else ("-I", str(SOURCES))
    command = [compiler, *flags, *includes, "-shared", "-fPIC"]
    key_text = " ".join([*command, *_LIBS, _cpu_features()])
    # The headers beside the sources (half.h) are part of every kernel's text.
    headers = b"".join(path.read_bytes() for path in sorted(SOURCES.glob("*.h")))
    key = hashlib.sha256(text + headers + key_text.encode()).hexdigest()[:16]
    target = Path(cache_dir) / "native" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # One compile for processes that ask at once (pytest's workers, a node's workers).
        with open(target.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                _compile(command, source_path, source, target)
    return target


def _compile_quietly(name: str, flags: tuple[str, ...], cache_dir: Path) -> None:
    try:
        compiled(name, flags, cache_dir)
    except (NativeKernelUnavailable, OSError):
        pass


def _compile(command: list[str], source_path: Path, source: str | None, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        if source is not None:
            source_path = Path(tmp) / source_path.name
            source_path.write_text(source)
        built = Path(tmp) / target.name
        result = subprocess.run([*command, "-o", str(built), str(source_path), *_LIBS], capture_output=True, text=True)
        if result.returncode != 0:
            raise NativeKernelUnavailable(f"compiling {source_path.name} failed:\n{result.stderr}")
        os.replace(built, target)  # atomic


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
