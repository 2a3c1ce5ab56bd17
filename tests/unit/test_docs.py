"""The documentation site: the generated configuration page is current, the site builds strictly
(every link resolves, every page is in the nav), and the README's links lead to files that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import gen_config_docs

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVMESH_")}
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


def test_configuration_page_is_current() -> None:
    """docs/configuration.md is what scripts/gen_config_docs.py makes of the commands' parsers
    (rendered in process: the parsers' modules are loaded already, a subprocess took seconds)."""
    assert gen_config_docs.PAGE.read_text() == gen_config_docs.render(), \
        "docs/configuration.md is stale; regenerate: .venv/bin/python -m scripts.gen_config_docs"


def test_configuration_page_lists_every_command() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    for command in ("serve", "worker", "engine", "processor", "gateway"):
        assert f"## kvmesh {command}\n" in page
    assert "`KVMESH_ENGINE_MAX_NUM_SEQS`" in page
    assert "`--tensor-parallel-size`" in page


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (make setup installs it)")
def test_site_builds_strictly(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                             "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert targets
    missing = [t for t in targets if not t.startswith(("http://", "https://")) and not (REPO / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
