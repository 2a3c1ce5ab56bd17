"""The native kernels' AVX-512 paths on a CPU without AVX-512, so that the AVX2 machines most of the
work runs on test the code an AVX-512 CPU serves with.

A kernel's source is compiled as for an AVX-512 CPU with BF16 and VNNI (the `__AVX512*__` macros
its paths are chosen by), its intrinsics renamed to SIMDe's (libsimde-dev: each instruction in
portable C or in this CPU's own vectors), the few SIMDe 0.7 lacks written in avx512_emulation.h.
Its own asm register pins are dropped: they name vector registers this CPU does not have. The
library then takes the same tests against the same references as every other build (the `isa`
fixture's `avx512-emulated`). It shows what the AVX-512 code computes, never how fast it runs."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

from kvmesh_kernels import native

EMULATED = "avx512-emulated"
SIMDE = Path("/usr/include/simde/x86/avx512.h")
SHIM = Path(__file__).with_name("avx512_emulation.h")
# An AVX-512 CPU that has BF16 and VNNI (Zen 4 and later, Sapphire Rapids) also has AVX2, FMA and F16C.
FEATURES = ("AVX512F", "AVX512BW", "AVX512VL", "AVX512BF16", "AVX512VNNI")
FLAGS = ("-mavx2", "-mfma", "-mf16c", "-Wno-psabi", *(f"-DKVMESH_EMULATED_{f}=1" for f in FEATURES))

_RENAMES = [
    (r"__(AVX512(?:F|BW|VL|BF16|VNNI))__", r"KVMESH_EMULATED_\1"),
    (r"#define (in_register|IN_REGISTER)\((\w+)\) __asm__.*", r"#define \1(\2) ((void)0)"),
    (r"#include <immintrin.h>", ""),
    (r"\b(_mm(?:512|256)?_)", r"simde\1"),
    (r"\b(__m(?:512|256|128)(?:bh|d|i)?|__mmask(?:8|16|32|64))\b", r"simde\1"),
    (r"\b(_MM_FROUND_|_CMP_)", r"SIMDE\1"),
]


def rewritten(source: str) -> str:
    for pattern, replacement in _RENAMES:
        source = re.sub(pattern, replacement, source)
    return source


def variant(kernel: native.Kernel, cache_dir: Path) -> ctypes.CDLL:
    """`kernel` built as for an AVX-512 CPU and run through SIMDe, declared as its own variants are."""
    if not SIMDE.exists():
        raise RuntimeError(f"{SIMDE} is missing: the AVX-512 emulation needs libsimde-dev (`make setup` installs it)")
    text = rewritten((native.SOURCES / f"{kernel.name}.c").read_text())
    # Through SIMDe's headers, -O3 takes quant_matmul.c 90 s to compile and -O1 10 s. A kernel without
    # AVX-512 paths keeps its own flags: its build is the AVX2 one.
    level = ("-O1",) if "KVMESH_EMULATED_" in text else ()
    source = f"{SHIM.read_text()}\n{text}"  # the shim in the text, so that its changes rebuild
    return kernel.declare(native.load(kernel.name, (*kernel.base_flags, *level, *FLAGS), cache_dir, source))
