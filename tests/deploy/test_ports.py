"""The chart's values and the images' EXPOSE name the same default ports as the one table in
Python (services/common/ports.py): they cannot import it, so they are read and compared."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.common.ports import DEFAULT_PORTS
from tests.deploy.chart import CHART_DIR, REPO_ROOT

DOCKERFILES = sorted((REPO_ROOT / "docker").glob("*Dockerfile*"))


def test_the_chart_values_name_the_default_ports() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    found = {service: (values[service]["port"], values[service].get("metricsPort")) for service in DEFAULT_PORTS}
    assert found == {service: tuple(ports) for service, ports in DEFAULT_PORTS.items()}
    assert values["gateway"]["service"]["port"] == DEFAULT_PORTS["gateway"].port


def test_there_are_dockerfiles() -> None:
    assert DOCKERFILES, REPO_ROOT / "docker"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda path: path.name)
def test_the_images_expose_the_default_ports(path: Path) -> None:
    exposed = [int(port) for line in re.findall(r"^EXPOSE\s+(.+)$", path.read_text(), re.MULTILINE)
               for port in line.split()]
    expected = {port for ports in DEFAULT_PORTS.values() for port in ports if port is not None}
    assert sorted(exposed) == sorted(expected), f"{path.name}: EXPOSE {exposed}, the default ports are {expected}"
