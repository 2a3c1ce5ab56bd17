"""Metrics of `kvmesh serve` after real traffic from the `openai` client: every name the chart's
dashboards and vLLM's example dashboard query is exported, the counters and histograms agree with
what was sent, the gateway's page merges the local services' into one valid page, and a real
Prometheus (Debian's package, started here on loopback) scrapes every service.

On the session's shared stack (`serve`): other tests' traffic came before, so every count is an
increase over a scrape taken once the engine is idle."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.deploy.dashboards import dashboard_metric_names
from tests.services.procs import SHARED_MAX_MODEL_LEN, Serve, client_for, free_port
from tests.unit.test_metrics import assert_valid_exposition, samples

# The series vLLM's example Grafana dashboard queries (../shared/reference/vllm-metrics.md).
VLLM_DASHBOARD_NAMES = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}
IGNORE_EOS = {"extra_body": {"ignore_eos": True}}  # every choice generates exactly max_tokens
PROMPT = "Count with me: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,"
COMPONENTS = ("worker", "engine", "processor", "gateway")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def total(values: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in values.items() if n == name and labels.items() <= dict(ls).items())


@pytest.fixture(scope="module")
def traffic(serve: Serve) -> dict[str, float]:
    """Ten engine requests (seven completions, a streamed chat, one completion of n=2) and what the
    metrics must have counted for them, as increases over a scrape taken before."""
    client, model = client_for(serve)
    serve.wait_until_engine_idle()
    before = quiet(serve.services["gateway"]["metrics"])
    prompt_tokens = 0
    for _ in range(7):
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, **IGNORE_EOS)
        prompt_tokens += reply.usage.prompt_tokens
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}, **IGNORE_EOS)
    prompt_tokens += [chunk for chunk in stream][-1].usage.prompt_tokens
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=2, temperature=1.0, **IGNORE_EOS)
    prompt_tokens += 2 * reply.usage.prompt_tokens  # the engine sees each choice as a request
    serve.wait_until_engine_idle()
    return {"before": before, "prompt_tokens": prompt_tokens}


def quiet(url: str, timeout: float = 10.0) -> Samples:
    """The page once kvmesh's and vLLM's series stand still: on the shared stack, a test before
    may still be counting its last request. The last page otherwise."""
    def ours(values: Samples) -> Samples:
        return {key: value for key, value in values.items() if key[0].startswith(("vllm:", "kvmesh_"))}
    deadline = time.monotonic() + timeout
    page = samples(fetch(url))
    while True:
        time.sleep(0.3)
        previous, page = page, samples(fetch(url))
        if ours(previous) == ours(page) or time.monotonic() > deadline:
            return page


def settled(url: str, before: Samples, expected: dict[tuple[str, frozenset], float], timeout: float = 10.0) -> Samples:
    """The page once every expected increase is there (the gateway counts a request after its
    last byte, which the client may see first); the last page otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        now = samples(fetch(url))
        increases = {key: total(now, key[0], **dict(key[1])) - total(before, key[0], **dict(key[1]))
                     for key in expected}
        if increases == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def expect(name: str, value: float, **labels: str) -> tuple[tuple[str, frozenset], float]:
    return (name, frozenset(labels.items())), value


def test_counters_and_histograms_agree_with_the_traffic(serve: Serve, traffic: dict):
    # 10 engine requests generating 7*4 + 3 + 2*2 = 35 tokens; 9 HTTP requests, n summing to 10.
    expected = dict([
        expect("vllm:time_to_first_token_seconds_count", 10),
        expect("vllm:e2e_request_latency_seconds_count", 10),
        expect("vllm:request_queue_time_seconds_count", 10),
        expect("vllm:request_prefill_time_seconds_count", 10),
        expect("vllm:request_decode_time_seconds_count", 10),
        expect("vllm:request_inference_time_seconds_count", 10),
        expect("vllm:request_time_per_output_token_seconds_count", 10),
        expect("vllm:request_success_total", 10, finished_reason="length"),
        expect("vllm:request_success_total", 10),
        expect("vllm:generation_tokens_total", 35),
        expect("vllm:request_generation_tokens_sum", 35),
        expect("vllm:request_params_max_tokens_sum", 35),
        expect("vllm:inter_token_latency_seconds_count", 35 - 10),  # every token after the first
        expect("vllm:prompt_tokens_total", traffic["prompt_tokens"]),
        expect("vllm:request_prompt_tokens_sum", traffic["prompt_tokens"]),
        # vLLM's count: each request's whole prompt at its first token, plus every token generated (a
        # prompt of 9 and 10 tokens generated: 19), not the tokens computed (cache hits left out, 18).
        expect("vllm:iteration_tokens_total_sum", traffic["prompt_tokens"] + 35),
        expect("vllm:request_params_n_count", 9),
        expect("vllm:request_params_n_sum", 10),
        expect("vllm:request_max_num_generation_tokens_sum", 7 * 4 + 3 + 2),
        expect("kvmesh_http_requests_total", 8, route="/v1/completions", method="POST", code="200"),
        expect("kvmesh_http_requests_total", 1, route="/v1/chat/completions", method="POST", code="200"),
        expect("kvmesh_http_stream_duration_seconds_count", 1, route="/v1/chat/completions"),
        expect("kvmesh_http_streams_active", 0),
        expect("kvmesh_grpc_client_handled_total", 9, component="gateway", grpc_method="Generate", grpc_code="OK"),
        expect("kvmesh_grpc_server_handled_total", 9, component="processor", grpc_method="Generate",
               grpc_code="OK"),
        expect("kvmesh_grpc_server_handled_total", 10, component="engine", grpc_method="Generate"),
        expect("kvmesh_processor_tokenize_seconds_count", 9),
    ])
    before = traffic["before"]
    after = settled(serve.services["gateway"]["metrics"], before, expected)
    increases = {key: total(after, key[0], **dict(key[1])) - total(before, key[0], **dict(key[1])) for key in expected}
    assert increases == expected

    def increase(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)
    # Every step the engine timed is one round trip on the step channel, served once by the worker.
    steps = increase("kvmesh_engine_step_seconds_count")
    assert steps >= 35 - 10 + 1
    assert increase("kvmesh_engine_step_rpc_seconds_count") == steps
    assert increase("kvmesh_worker_step_seconds_count", outcome="ok") == steps
    assert increase("kvmesh_worker_step_seconds_count", outcome="error") == 0
    assert increase("kvmesh_worker_execute_seconds_count") == steps
    assert 0 < increase("kvmesh_worker_forward_seconds_count") <= steps
    # The same prompt seven times: all but the first hit the prefix cache.
    assert increase("vllm:prefix_cache_hits_total") >= 6 * 16
    assert total(after, "vllm:num_requests_running") == total(after, "vllm:num_requests_waiting") == 0


def test_every_dashboard_name_is_exported_in_one_valid_page(serve: Serve, traffic: dict):
    page = fetch(serve.services["gateway"]["metrics"])
    assert_valid_exposition(page)
    names = {name for name, _ in samples(page)}
    missing = (dashboard_metric_names() | VLLM_DASHBOARD_NAMES) - names
    assert not missing, f"not exported: {sorted(missing)}"
    # Each process once, told apart by component; vLLM's series carry vLLM's labels only.
    values = samples(page)
    assert {dict(labels)["component"] for name, labels in values if name == "process_resident_memory_bytes"} == \
        set(COMPONENTS)
    ttft = [dict(labels) for name, labels in values if name == "vllm:time_to_first_token_seconds_count"]
    assert ttft == [{"model_name": client_for(serve)[1], "engine": "0"}]


def test_each_service_serves_its_own_metrics(serve: Serve, traffic: dict):
    own = {"worker": "kvmesh_worker_execute_seconds_count", "engine": "vllm:time_to_first_token_seconds_count",
           "processor": "kvmesh_processor_tokenize_seconds_count"}
    for component, name in own.items():
        values = samples(fetch(serve.services[component]["metrics"]))
        builds = [dict(labels)["component"] for n, labels in values if n == "kvmesh_build_info"]
        assert builds == [component]
        assert total(values, name) > 0, component


def test_a_real_prometheus_scrapes_every_service(serve: Serve, traffic: dict, tmp_path: Path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus (Debian's package) is needed; `make setup` installs it"
    jobs = []
    for component in COMPONENTS:
        url = urllib.parse.urlsplit(serve.services[component]["metrics"])
        jobs.append({"job_name": component, "metrics_path": url.path, "scrape_interval": "1s",
                     "static_configs": [{"targets": [url.netloc]}]})
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))  # JSON is YAML
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def query(promql: str) -> list[dict]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            return json.loads(fetch(url))["data"]["result"]
        except OSError:
            return []  # not up yet

    try:
        deadline = time.monotonic() + 60
        while True:
            up = {r["metric"]["job"]: r["value"][1] for r in query("up")}
            ttft = query('vllm:time_to_first_token_seconds_count{job="engine"}')
            if (up == {c: "1" for c in COMPONENTS} and ttft) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert up == {c: "1" for c in COMPONENTS}, (tmp_path / "prometheus.log").read_text()[-3000:]
        assert float(ttft[0]["value"][1]) >= 10
        builds = {(r["metric"]["job"], r["metric"]["component"]) for r in query("kvmesh_build_info")}
        assert {(c, c) for c in COMPONENTS} <= builds
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def test_cache_config_info_and_waiting_by_reason_carry_vllms_labels(serve: Serve, traffic: dict):
    values = samples(fetch(serve.services["gateway"]["metrics"]))
    [info] = [dict(labels) for name, labels in values if name == "vllm:cache_config_info"]
    blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
    # vLLM's: blocks over the blocks one request of the whole context needs, and that many contexts in tokens.
    concurrency = blocks / -(-SHARED_MAX_MODEL_LEN // block_size)
    assert info["kv_cache_max_concurrency"] == str(concurrency) and concurrency > 1
    assert info["kv_cache_size_tokens"] == str(int(concurrency * SHARED_MAX_MODEL_LEN))
    assert info["engine"] == "0" and info["enable_prefix_caching"] == "True"
    model = client_for(serve)[1]
    waiting = {dict(labels)["reason"]: value for (name, labels), value in values.items()
               if name == "vllm:num_requests_waiting_by_reason"}
    assert waiting == {"capacity": 0.0, "deferred": 0.0}  # idle; every waiting request waits for capacity
    assert {dict(labels)["model_name"] for name, labels in values if name == "vllm:num_requests_waiting_by_reason"} \
        == {model}


def test_a_stop_string_counts_as_stop_not_abort(serve: Serve, traffic: dict):
    """Only the processor sees stop strings: it counts vllm:request_success by the finish reason the
    client sees, as vLLM's frontend does, even when the engine finished the request by length before
    the processor's abort reached it."""
    client, model = client_for(serve)
    url = serve.services["gateway"]["metrics"]
    free = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, **IGNORE_EOS)
    stop = free.choices[0].text.strip()[:2]  # greedy: the same text comes again, and meets the stop there
    assert stop, f"the model generated only whitespace: {free.choices[0].text!r}"
    serve.wait_until_engine_idle()
    before = samples(fetch(url))
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                      **IGNORE_EOS)
    assert reply.choices[0].finish_reason == "stop"
    serve.wait_until_engine_idle()
    expected = dict([expect("vllm:request_success_total", 1, finished_reason="stop"),
                     expect("vllm:request_success_total", 0, finished_reason="abort"),
                     expect("vllm:e2e_request_latency_seconds_count", 1)])
    after = settled(url, before, expected)
    assert {key: total(after, key[0], **dict(key[1])) - total(before, key[0], **dict(key[1]))
            for key in expected} == expected
