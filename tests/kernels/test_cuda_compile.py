"""The kernels compile for a CUDA GPU (sm_90), checked on any machine: see cuda_compile.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # every kernel compiled for sm_90 in a fresh process
def test_kernels_compile_for_sm90() -> None:
    # A fresh process: in this one the kernels were built for the interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns when unset; 1 is its current default
    result = subprocess.run([sys.executable, "-m", "tests.kernels.cuda_compile"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("shared memory") == 10, result.stdout
