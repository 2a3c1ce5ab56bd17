"""scripts/gpu_check.py --smoke: the GPU check runs end to end on the CPU (tiny shapes, Triton's
interpreter), so the script that only runs for real on a lent GPU cannot rot unnoticed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the GPU check end to end in a fresh process, every kernel under the interpreter
def test_gpu_check_smoke_runs_every_section(tmp_path: Path) -> None:
    report = tmp_path / "gpu_check.md"
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(report)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    text = report.read_text()
    for heading in ("## Environment", "## Kernel tests", "## Copy bandwidth", "## Decode attention",
                    "## Prefill attention", "## Engine end to end"):
        assert heading in text, f"{heading} missing from the report"
    assert "all sections passed" in text and "FAILED" not in text
