"""The Grafana dashboards: valid JSON templated on datasource and model, PromQL that promtool
accepts, and only metric names kvmesh exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.chart import example_values, objects, render
from tests.deploy.dashboards import (DASHBOARD_DIR, SYNTHETIC_METRICS, dashboard_metric_names, dashboards,
                                     known_metric_names, metric_names, panels, queries, substitute_variables)

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
# Metrics carrying a model_name label (vLLM's, and the engine's and worker's timings): every
# selector of theirs must follow the dashboard's model variable.
MODEL_LABELLED = re.compile(r"^(vllm:|kvmesh_engine_|kvmesh_worker_)")


def promtool_check(tmp_path: Path, exprs: list[str]) -> subprocess.CompletedProcess:
    """`promtool check rules` over the expressions written as recording rules."""
    rules = {"groups": [{"name": "dashboards", "rules": [{"record": f"dashboard:query_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_the_dashboards_are_there() -> None:
    assert set(dashboards()) == {"kvmesh-overview.json", "kvmesh-kv-cache.json", "kvmesh-services.json"}
    assert len({d["uid"] for d in dashboards().values()}) == 3


@pytest.mark.parametrize("name", ["kvmesh-overview.json", "kvmesh-kv-cache.json", "kvmesh-services.json"])
def test_dashboard_is_templated_on_datasource_and_model(name: str) -> None:
    dashboard = dashboards()[name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    assert "label_values(" in variables["model_name"]["query"]["query"]
    assert variables["model_name"]["query"]["query"].endswith(", model_name)")
    content = [p for p in panels(dashboard) if p["type"] != "row"]
    assert content
    for panel in content:
        # Every panel and query reads the chosen data source, none a fixed one.
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(t["datasource"] == panel["datasource"] for t in panel["targets"]), panel["title"]
    assert_no_overlap(content)


def assert_no_overlap(content: list[dict]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in content:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_model_labelled_selectors_follow_the_model_variable() -> None:
    for query in queries():
        if query.where.startswith("$"):
            continue  # the variables' own queries: they list the models
        for name, matchers in re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", query.expr):
            if MODEL_LABELLED.match(name):
                assert 'model_name=~"$model_name"' in matchers, f"{query.dashboard}: {query.where}: {name}"


AGGREGATION = re.compile(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(")


def test_panels_split_by_model() -> None:
    """With several models served, each graph and stat shows one series per model: every aggregation
    over a model-labelled metric keeps model_name, and its legend names the model."""
    checked = 0
    for name, dashboard in dashboards().items():
        for panel in panels(dashboard):
            if panel["type"] not in ("timeseries", "stat"):
                continue
            for target in panel["targets"]:
                if not any(MODEL_LABELLED.match(n) for n in metric_names(target["expr"])):
                    continue
                for _, labels in AGGREGATION.findall(target["expr"]):
                    assert "model_name" in [label.strip() for label in labels.split(",")], (name, panel["title"])
                assert "{{model_name}}" in target["legendFormat"], (name, panel["title"])
                checked += 1
    assert checked > 50


def test_promtool_accepts_every_expression(tmp_path: Path) -> None:
    exprs = [substitute_variables(q.expr) for q in queries()]
    assert len(exprs) > 50 and not any("$" in e for e in exprs)
    result = promtool_check(tmp_path, exprs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout


def test_promtool_check_catches_a_broken_expression(tmp_path: Path) -> None:
    """The check above can fail: promtool rejects a mistake of the kind a dashboard edit makes."""
    result = promtool_check(tmp_path, ["sum by (le (rate(vllm:e2e_request_latency_seconds_bucket[1m]))"])
    assert result.returncode != 0


def test_dashboards_use_only_exported_metric_names() -> None:
    used = dashboard_metric_names()
    unknown = used - known_metric_names()
    assert not unknown, f"not in docs/serving/metrics.md nor vLLM's names: {sorted(unknown)}"
    # The dashboards cover what the issue asks for.
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "kvmesh_grpc_server_handling_seconds_bucket",
                 "kvmesh_engine_step_rpc_seconds_bucket", "process_resident_memory_bytes"):
        assert name in used, name


def test_metric_names_are_extracted_from_promql() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{x="y{z}", code=~"5.."}[$__rate_interval])))'
            ' / ignoring(code) group_left sum without (pod) (b:c_total offset 5m) - on(job) up{job="x"} or vector(0)')
    assert metric_names(expr) == {"a_bucket", "b:c_total", "up"}
    assert SYNTHETIC_METRICS == {"up"}


def test_the_configmaps_carry_the_dashboards_unchanged() -> None:
    objs = objects(render(example_values("gpu")))
    shipped = {key: value for o in objs if o["kind"] == "ConfigMap" for key, value in o["data"].items()}
    files = {p.name: p.read_text() for p in DASHBOARD_DIR.glob("*.json")}
    assert {k: v.strip() for k, v in shipped.items()} == {k: v.strip() for k, v in files.items()}
    for o in objs:
        if o["kind"] == "ConfigMap":
            assert o["metadata"]["labels"]["grafana_dashboard"] == "1"  # the Grafana sidecar's label
