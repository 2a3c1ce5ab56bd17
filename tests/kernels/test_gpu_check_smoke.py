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


@pytest.mark.slow  # a fresh process that imports the GPU check (torch, Triton, the model code)
def test_a_difference_over_the_tolerance_fails_its_section() -> None:
    # In a process of its own: importing the script decides compiled or interpreted for Triton.
    code = ("import sys; sys.argv = ['gpu_check', '--smoke']; sys.path.insert(0, 'scripts'); import gpu_check as g\n"
            "assert g.check_differences(['row'], [0.0, g.MAX_ABS_DIFF]) == ['row']\n"
            "for bad in (2 * g.MAX_ABS_DIFF, float('nan')):\n"
            "    try:\n"
            "        g.check_differences(['row'], [0.0, bad])\n"
            "    except AssertionError as e:\n"
            "        assert 'row' in str(e) and 'over' in str(e)\n"
            "    else:\n"
            "        raise SystemExit(f'{bad} passed')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
