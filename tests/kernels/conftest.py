"""Kernel tests: on the CPU under Triton's interpreter, on a CUDA device for real.

`@triton.jit` chooses compiled or interpreted when a kernel's module is imported, so the choice
is made in tests/conftest.py, before anything imports the kernels: without a CUDA device,
TRITON_INTERPRET=1 (unless the environment already says otherwise).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from kvmesh_kernels import native


def kernels_device() -> torch.device:
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    return torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")


@pytest.fixture(params=list(native.ISA_FLAGS))
def isa(request: pytest.FixtureRequest) -> str:
    """Each code path of the native CPU kernels that this CPU can run (native.ISA_FLAGS): the build
    for this CPU, the AVX2 + FMA path (built explicitly, also on an AVX-512 host) and the scalar C."""
    if not native.runs_here(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build of the native kernels")
    return request.param


@pytest.fixture
def device() -> torch.device:
    return kernels_device()


@pytest.fixture
def gen(request: pytest.FixtureRequest, device: torch.device) -> torch.Generator:
    """Fresh random inputs in every case, the same on every run: seeded by the test's id."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(request.node.nodeid.encode()))
