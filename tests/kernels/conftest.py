"""Kernel tests: on the CPU under Triton's interpreter, on a CUDA device for real.

`@triton.jit` chooses compiled or interpreted when a kernel's module is imported, so the choice
is made in tests/conftest.py, before anything imports the kernels: without a CUDA device,
TRITON_INTERPRET=1 (unless the environment already says otherwise).
"""

from __future__ import annotations

import ctypes
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvmesh_kernels import cpu_fused_ops, cpu_lora, cpu_paged_attention, cpu_quant_matmul, native
from tests.kernels import avx512_emulation
from tests.kernels.avx512_emulation import EMULATED

# The kernels that give their builds for other instruction sets (`variant`).
KERNEL_MODULES = (cpu_fused_ops, cpu_lora, cpu_paged_attention, cpu_quant_matmul)


def kernels_device() -> torch.device:
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The emulated builds take about 20 s to compile on a fresh cache: `make test`, not test-fast.
    for item in items:
        if getattr(item, "callspec", None) and item.callspec.params.get("isa") == EMULATED:
            item.add_marker(pytest.mark.slow)


def emulating(kernel: native.Kernel, served: Callable[[str, Path], ctypes.CDLL]) -> Callable[[str, Path], ctypes.CDLL]:
    """A kernel module's `variant` that also gives the emulated AVX-512 build."""
    def variant(isa: str, cache_dir: Path) -> ctypes.CDLL:
        return avx512_emulation.variant(kernel, cache_dir) if isa == EMULATED else served(isa, cache_dir)
    return variant


@pytest.fixture(params=[*native.ISA_FLAGS, EMULATED])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each code path of the native CPU kernels that this CPU can run (native.ISA_FLAGS): the build
    for this CPU, the AVX2 + FMA path (built explicitly, also on an AVX-512 host) and the scalar C;
    on a CPU without AVX-512, also the AVX-512 paths emulated (tests/kernels/avx512_emulation.py),
    which each kernel module's `variant` then gives for `avx512-emulated`."""
    if request.param == EMULATED:
        if native.cpu_has("avx512f"):
            pytest.skip("this CPU runs the AVX-512 paths for real: they are its native build")
        for module in KERNEL_MODULES:
            monkeypatch.setattr(module, "variant", emulating(module._KERNEL, module.variant))
    elif not native.runs_here(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build of the native kernels")
    return request.param


@pytest.fixture
def device() -> torch.device:
    return kernels_device()


@pytest.fixture
def gen(request: pytest.FixtureRequest, device: torch.device) -> torch.Generator:
    """Fresh random inputs in every case, the same on every run: seeded by the test's id."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(request.node.nodeid.encode()))
