"""The Helm chart rendered offline with helm-python-sdk (Helm's Go SDK through ctypes: no helm
binary, no cluster, no network), as `helm template` would."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "kvmesh"
GOLDEN_DIR = Path(__file__).resolve().parent / "rendered"
RELEASE = "kvmesh"
NAMESPACE = "kvmesh"
# The example values files, by the name of their golden output (None: the chart's defaults).
EXAMPLES: dict[str, str | None] = {"default": None, "cpu": "values-cpu.yaml", "gpu": "values-gpu.yaml",
                                   "fleet": "values-fleet.yaml", "tp2": "values-tp2.yaml",
                                   "pd": "values-pd.yaml", "models": "values-models.yaml", "lora": "values-lora.yaml"}
# Not a manifest: the install message.
NOTES = "templates/NOTES.txt"


def example_values(example: str) -> dict[str, Any]:
    """An example's values as Helm parses a `-f` file."""
    name = EXAMPLES[example]
    return {} if name is None else helm.values_from_yaml((CHART_DIR / name).read_text())


# Rendered charts by their values' JSON: a render takes about half a second, and the examples are
# rendered by many tests.
_RENDERED: dict[str, dict[str, str]] = {}


def render(values: dict[str, Any] | None = None, *, fresh: bool = False) -> dict[str, str]:
    """Template path (relative to the chart) -> rendered text, for the templates that render
    something. Raises helm.HelmValuesError when the values break the schema, helm.HelmRenderError
    when a template fails. The same values give the first render's output (generated tokens
    included) unless `fresh`."""
    key = json.dumps(values or {}, sort_keys=True)
    if not fresh and key in _RENDERED:
        return dict(_RENDERED[key])
    _RENDERED[key] = _render(values or {})
    return dict(_RENDERED[key])


def _render(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    prefix = f"{chart_name()}/"
    out = {}
    for path, text in rendered.items():
        path = path.removeprefix(prefix)
        if path != NOTES and text.strip():
            out[path] = text
    return out


def manifest(rendered: dict[str, str]) -> str:
    """One YAML stream, as `helm template` prints it."""
    return "".join(f"---\n# Source: {chart_name()}/{path}\n{rendered[path].strip()}\n" for path in sorted(rendered))


# A dashboard in a ConfigMap: its key line, then the JSON indented by four spaces.
_DASHBOARD_DATA = re.compile(r"^(  (\S+\.json): \|-\n)((?:    .*\n|\n)+)", re.MULTILINE)


def golden_manifest(rendered: dict[str, str]) -> str:
    """The manifest with each dashboard's JSON (a file, not a template; test_dashboards checks it
    and that the ConfigMaps carry it unchanged) cut down to its digest, and the generated token
    secrets (tokens, the TLS certificate) replaced by placeholders, so that the golden files show
    the templates' output."""
    def digest(match: re.Match) -> str:
        body = match.group(3)
        return f"{match.group(1)}    <dashboards/{match.group(2)}: sha256 {hashlib.sha256(body.encode()).hexdigest()[:16]}>\n"
    return _hide_generated(_DASHBOARD_DATA.sub(digest, manifest(rendered)))


# The templates whose Secrets' data the chart generates (random on every render).
_GENERATED_SOURCES = ("/internal-token-secret.yaml", "/internal-tls.yaml")


def _hide_generated(text: str) -> str:
    """Each value under `data:` of a generated Secret as <generated, base64>."""
    out, generated, in_data = [], False, False
    for line in text.splitlines(keepends=True):
        if line.startswith("# Source: "):
            generated = line.rstrip().endswith(_GENERATED_SOURCES)
        if in_data and line.startswith("  "):
            line = line[:line.index(": ") + 2] + "<generated, base64>\n"
        else:
            in_data = generated and line == "data:\n"
        out.append(line)
    return "".join(out)


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    return [doc for path in sorted(rendered) for doc in yaml.safe_load_all(rendered[path]) if doc]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def chart_name() -> str:
    return yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["name"]
