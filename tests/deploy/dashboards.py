"""The chart's Grafana dashboards, their PromQL, and the metric names they may use.

`dashboard_metric_names()` is the one list of series names the dashboards query; a test that
scrapes a running kvmesh imports it to check every name is really exported."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from tests.deploy.chart import CHART_DIR, REPO_ROOT

DASHBOARD_DIR = CHART_DIR / "dashboards"
METRICS_DOC = REPO_ROOT / "docs" / "serving" / "metrics.md"

# vLLM's names that operators' tools depend on, by type (vLLM's metrics reference; docs/serving/metrics.md
# points there). Counters are named as scraped, with `_total`.
VLLM_METRICS: dict[str, str] = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_params_n": "histogram",
}
# Made by Prometheus for each target, never scraped.
SYNTHETIC_METRICS = frozenset({"up"})
# Grafana's own variables, with a value that makes the PromQL valid.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "1m", "__range": "1h", "__range_s": "3600"}
# What stands in for the dashboards' variables when the PromQL is checked.
VARIABLE_SAMPLES = {"datasource": "prometheus", "namespace": "kvmesh", "model_name": "smollm2"}

_PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                           "unless", "offset", "inf", "nan"})
_LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$")


class Query(NamedTuple):
    dashboard: str  # file name
    where: str  # panel title or variable name
    expr: str  # PromQL, with the dashboard's variables in it


@cache
def dashboards() -> dict[str, dict[str, Any]]:
    """File name -> parsed dashboard."""
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # the panels of a collapsed row


def queries() -> list[Query]:
    """Every PromQL expression: the panels' targets and the selectors inside the template
    variables' label_values(...)."""
    found = []
    for name, dashboard in dashboards().items():
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                found.append(Query(name, panel["title"], target["expr"]))
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = _LABEL_VALUES.match(variable["query"]["query"].strip())
            assert match, f"{name}: variable {variable['name']}: only label_values(selector, label) is supported"
            if match.group(1):
                found.append(Query(name, f"${variable['name']}", match.group(1)))
    return found


def substitute_variables(expr: str) -> str:
    """`expr` with Grafana's and the dashboards' variables ($x, ${x}, [[x]]) replaced by sample values."""
    values = GRAFANA_VARIABLES | VARIABLE_SAMPLES

    def value(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name not in values:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return values[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", value, expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"(?<![\w:])\d[\w.]*", " ", text)  # numbers and durations (0.99, 5m, 1e-9)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[match.end():].lstrip()
        word = match.group()
        if rest.startswith("(") or word.lower() in _PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(word)
    return names


def dashboard_metric_names() -> set[str]:
    """Every series name the dashboards query, as scraped (histograms as `_bucket`/`_sum`/`_count`,
    counters with `_total`), without Prometheus' synthetic `up`: what a running kvmesh must export."""
    names = set().union(*(metric_names(q.expr) for q in queries()))
    return names - SYNTHETIC_METRICS


def known_metric_names() -> set[str]:
    """The series names kvmesh exports: vLLM's (VLLM_METRICS) and kvmesh's own and the process_*
    series (docs/serving/metrics.md), expanded to what a scrape shows."""
    doc = METRICS_DOC.read_text()
    typed = dict(VLLM_METRICS)
    for name, kind in re.findall(r"^\|\s*(kvmesh_\w+)\s*\|\s*(counter|gauge|histogram)\b", doc, re.MULTILINE):
        typed[name] = kind
    assert any(n.startswith("kvmesh_") for n in typed), f"no kvmesh_* table rows found in {METRICS_DOC}"
    series = set(re.findall(r"`(process_\w+)`", doc))
    for name, kind in typed.items():
        series |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" else {name}
    return series
