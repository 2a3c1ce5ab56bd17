"""The engine's metrics under vLLM's names, types, labels and buckets (so that vLLM's dashboards,
KEDA scalers and routers work unchanged), plus kvmesh_engine_step{,_rpc}_seconds.

Fed on the engine-loop thread, one call per event:

    add_request(request)         admitted into the scheduler (arrival: request.arrival_time)
    record_step(out, outputs, step_seconds, rpc_seconds)   after update_from_output()
    record_aborted(request_ids)  aborts applied between steps

Gauges and the scheduler's cumulative counters (running, waiting, KV-cache usage, prefix-cache
queries and hits, preemptions) are read from the core when scraped, never copied.

vllm:request_success is not here: the processor counts it (services/processor/metrics.py), by the
finish reason the client sees, which the engine does not know (it never sees stop strings).

Times are the engine's (time.monotonic): a request arrives when the engine receives it, its first
token is the step that produced it. vLLM's definitions otherwise: TTFT = first token - arrival;
queue = first scheduled - arrival; prefill = first token - first scheduled; decode = last token -
first token; inference = last token - first scheduled; e2e = finish - arrival.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from services.common.clients import EngineStats, LoRAState
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.metrics import COMPONENT, STEP_BUCKETS, build_1_2_5_buckets
from services.common.scheduler_output import SchedulerOutput
from services.engine.engine_core import EngineCore
from services.engine.speculator import SpecDecodingStats
from services.engine.structured_output import StructuredOutputManager

# vLLM's bucket choices (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
GRAMMAR_COMPILE_BUCKETS = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineLabels:
    """vLLM's labels: the served model name and the engine's index (one engine per process: 0)."""

    model_name: str
    engine: str = "0"

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must not be empty")


@dataclass(frozen=True)
class CacheInfo:
    """vllm:cache_config_info's labels."""

    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    max_model_len: int

    @property
    def kv_cache_max_concurrency(self) -> float:
        """Requests of the whole context the cache holds at once (vLLM's: blocks / blocks per
        max_model_len request)."""
        return self.num_gpu_blocks / -(-self.max_model_len // self.block_size)

    @property
    def kv_cache_size_tokens(self) -> int:
        """vLLM's: the concurrency times the context, in tokens."""
        return int(self.kv_cache_max_concurrency * self.max_model_len)


@dataclass(slots=True)
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    max_tokens_param: int | None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0


class EngineMetrics:
    """One engine's metrics in `registry`; `stats` is read at scrape time (EngineCore.stats)."""

    def __init__(self, registry: CollectorRegistry, labels: EngineLabels, max_model_len: int,
                 cache_info: CacheInfo, stats: Callable[[], EngineStats]) -> None:
        self.labels = labels
        self._requests: dict[str, _RequestTimes] = {}
        values = (labels.model_name, labels.engine)
        names = ["model_name", "engine"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(*values)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              ["block_size", "enable_prefix_caching", "num_gpu_blocks", "kv_cache_size_tokens",
               "kv_cache_max_concurrency", "engine"], registry=registry).labels(
            str(cache_info.block_size), str(cache_info.enable_prefix_caching), str(cache_info.num_gpu_blocks),
            str(cache_info.kv_cache_size_tokens), str(cache_info.kv_cache_max_concurrency), labels.engine).set(1)

        step_names, step_values = [COMPONENT, *names], ("engine", *values)
        self.step_seconds = Histogram("kvmesh_engine_step_seconds", "One engine step: schedule, execute, update",
                                      step_names, buckets=STEP_BUCKETS, registry=registry).labels(*step_values)
        self.step_rpc_seconds = Histogram("kvmesh_engine_step_rpc_seconds",
                                          "The step's round trip to the engine's worker(s), over their step channels",
                                          step_names, buckets=STEP_BUCKETS, registry=registry).labels(*step_values)
        registry.register(_SchedulerCollector(labels, stats))

    @classmethod
    def for_core(cls, registry: CollectorRegistry, labels: EngineLabels, core: EngineCore) -> EngineMetrics:
        cache_info = CacheInfo(core.block_size, core.stats().num_total_blocks, core.enable_prefix_caching,
                               core.max_model_len)
        metrics = cls(registry, labels, core.max_model_len, cache_info, core.stats)
        metrics.watch_grammars(registry, core.structured_output)
        if core.scheduler.speculator is not None:
            registry.register(_SpecDecodingCollector(labels, core.scheduler.speculator.stats))
        return metrics

    def watch_grammars(self, registry: CollectorRegistry, manager: StructuredOutputManager) -> None:
        """Structured outputs: each grammar compile's time, and the compiled-grammar cache's hits and misses."""
        histogram = Histogram("kvmesh_engine_grammar_compile_seconds",
                              "Time to compile a structured output's grammar (a cache miss), in seconds",
                              ["model_name", "engine"], buckets=GRAMMAR_COMPILE_BUCKETS, registry=registry)
        manager.compile_observers.append(histogram.labels(self.labels.model_name, self.labels.engine).observe)
        registry.register(_GrammarCacheCollector(self.labels, manager))

    # ------------------------------------------------------------------ fed by the engine-loop thread

    def add_request(self, request: EngineCoreRequest) -> None:
        arrival = request.arrival_time if request.arrival_time is not None else time.monotonic()
        self._requests[request.request_id] = _RequestTimes(arrival, len(request.prompt_token_ids),
                                                           request.sampling_params.max_tokens)

    def add_prefilled_request(self, request: EngineCoreRequest, first: EngineCoreOutput) -> None:
        """A request whose prompt a prefill engine computed (disaggregation), admitted with
        that engine's first token: TTFT and the prefill phase cover the remote prefill and the KV
        transfer (it counts as scheduled on arrival: it waited in no queue of ours)."""
        self.add_request(request)
        times = self._requests[request.request_id]
        times.scheduled = times.arrival
        now = time.monotonic()
        self._record_tokens(times, len(first.new_token_ids), now)
        if first.finish_reason is not None:
            self._record_finished(request.request_id, now)

    def record_step(self, scheduler_output: SchedulerOutput, outputs: Iterable[EngineCoreOutput],
                    step_seconds: float, rpc_seconds: float) -> None:
        now = time.monotonic()
        self.step_seconds.observe(step_seconds)
        self.step_rpc_seconds.observe(rpc_seconds)
        step_start = now - step_seconds
        for new in scheduler_output.scheduled_new_reqs:  # also a request resuming after preemption
            times = self._requests.get(new.req_id)
            if times is not None and times.scheduled is None:
                times.scheduled = step_start
        # vLLM's iteration tokens: each output's new tokens, plus a request's whole prompt at its first
        # token (so a prompt of 9 and 10 tokens generated count 19), observed for steps with outputs.
        iteration_tokens, any_output = 0, False
        for output in outputs:
            times = self._requests.get(output.request_id)
            if times is None:
                continue
            any_output = True
            if output.new_token_ids:
                iteration_tokens += len(output.new_token_ids) + (times.num_prompt_tokens if times.first_token is None
                                                                 else 0)
                self._record_tokens(times, len(output.new_token_ids), now)
            if output.finish_reason is not None:
                self._record_finished(output.request_id, now)
        if any_output:
            self.iteration_tokens.observe(iteration_tokens)

    def record_aborted(self, request_ids: Iterable[str]) -> None:
        now = time.monotonic()
        for request_id in request_ids:
            if request_id in self._requests:
                self._record_finished(request_id, now)

    def _record_tokens(self, times: _RequestTimes, num_tokens: int, now: float) -> None:
        if times.first_token is None:
            times.first_token = now
            self.ttft.observe(now - times.arrival)
            self.prompt_tokens.inc(times.num_prompt_tokens)
        else:
            self.inter_token_latency.observe(now - times.last_token)
        times.last_token = now
        times.num_generation_tokens += num_tokens
        self.generation_tokens.inc(num_tokens)

    def _record_finished(self, request_id: str, now: float) -> None:
        """Every finished request counts in the per-request size histograms and e2e; the phase
        histograms only take requests that got as far as a first token."""
        times = self._requests.pop(request_id)
        self.e2e.observe(now - times.arrival)
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_generation_tokens)
        if times.max_tokens_param is not None:
            self.request_params_max_tokens.observe(times.max_tokens_param)
        if times.first_token is None or times.scheduled is None:
            return
        decode = times.last_token - times.first_token
        self.queue_time.observe(times.scheduled - times.arrival)
        self.prefill_time.observe(times.first_token - times.scheduled)
        self.decode_time.observe(decode)
        self.inference_time.observe(times.last_token - times.scheduled)
        # vLLM observes 0 for a request of a single token (no decode interval to divide).
        num_intervals = times.num_generation_tokens - 1
        self.time_per_output_token.observe(decode / num_intervals if num_intervals > 0 else 0.0)

    @property
    def num_tracked_requests(self) -> int:
        """Requests admitted and not yet finished (0 once the engine is idle: nothing leaks)."""
        return len(self._requests)


class _SchedulerCollector:
    """The scheduler's state, read when scraped (the event loop's stats() read, which the GIL keeps whole)."""

    def __init__(self, labels: EngineLabels, stats: Callable[[], EngineStats]) -> None:
        self._values = [labels.model_name, labels.engine]
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        names = ["model_name", "engine"]
        usage = stats.num_used_blocks / stats.num_total_blocks if stats.num_total_blocks else 0.0
        # vLLM's `deferred`: waiting requests held back only because their LoRA adapter has no slot
        # this step (the --max-loras budget); every other waiting request waits for capacity.
        deferred = stats.lora.num_deferred if stats.lora is not None else 0
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints. Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*names, "reason"])
        by_reason.add_metric([*self._values, "capacity"], stats.num_waiting - deferred)
        by_reason.add_metric([*self._values, "deferred"], deferred)
        yield by_reason
        if stats.lora is not None:
            yield self._lora_info(stats.lora)
        for family, value in (
            (GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                               labels=names), stats.num_running),
            (GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                               labels=names), stats.num_waiting),
            (GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                               labels=names), usage),
            (CounterMetricFamily("vllm:prefix_cache_queries",
                                 "Prefix cache queries, in terms of number of queried tokens.", labels=names),
             stats.prefix_cache_queries),
            (CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                 labels=names), stats.prefix_cache_hits),
            (CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                 labels=names), stats.num_preemptions),
        ):
            family.add_metric(self._values, value)
            yield family


    def _lora_info(self, lora: LoRAState) -> GaugeMetricFamily:
        """vLLM's vllm:lora_requests_info: the adapters of the running and of the waiting requests
        (comma-separated) and --max-loras as labels, the time of the reading as its value (routers
        such as llm-d read the newest series). One series, the current one: none lingers."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["model_name", "engine", "max_lora", "waiting_lora_adapters",
                                           "running_lora_adapters"])
        family.add_metric([*self._values, str(lora.max_loras), ",".join(lora.waiting), ",".join(lora.running)],
                          time.time())
        return family


class _SpecDecodingCollector:
    """vLLM's vllm:spec_decode_* counters (speculative decoding), read from the speculator's
    cumulative counts when scraped."""

    def __init__(self, labels: EngineLabels, stats: SpecDecodingStats) -> None:
        self._values = [labels.model_name, labels.engine]
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats, names = self._stats, ["model_name", "engine"]
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.num_accepted_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(self._values, value)
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*names, "position"])
        for position, value in enumerate(list(stats.num_accepted_tokens_per_pos)):
            per_pos.add_metric([*self._values, str(position)], value)
        yield per_pos


class _GrammarCacheCollector:
    """The structured-output manager's cache counters, read when scraped."""

    def __init__(self, labels: EngineLabels, manager: StructuredOutputManager) -> None:
        self._values = [labels.model_name, labels.engine]
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        for name, doc, value in (
            ("kvmesh_engine_grammar_cache_hits", "Structured-output requests whose grammar was already compiled",
             self._manager.cache_hits),
            ("kvmesh_engine_grammar_cache_misses", "Structured-output requests whose grammar had to be compiled",
             self._manager.cache_misses),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            family.add_metric(self._values, value)
            yield family


class PublisherMetrics:
    """The prefix-index publisher's counters (services/engine/kv_publisher.py), fed on the event loop."""

    def __init__(self, registry: CollectorRegistry, labels: EngineLabels) -> None:
        names, values = [COMPONENT, "model_name", "engine"], ("engine", labels.model_name, labels.engine)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*values)

        self.events_published = counter("kvmesh_engine_kv_events_published",
                                        "KV-cache events the prefix index applied (a snapshot counts one)")
        self.publish_failures = counter("kvmesh_engine_kv_publish_failures",
                                        "Prefix-index calls that failed (unreachable, slow or refusing)")
        self.resyncs = counter("kvmesh_engine_kv_resyncs",
                               "Full republishes of the prefix cache asked for (overflow, failure, unknown engine)")
        self.queue_overflows = counter("kvmesh_engine_kv_event_queue_overflows",
                                       "Times the KV event queue collapsed to all-cleared (the publisher fell behind)")


TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Why a decode engine computed a remote-prefill request's prompt itself after all.
TRANSFER_FAILURES = ("prefill_error", "prefill_timeout", "transfer_error", "transfer_timeout", "incompatible")


class DisaggregationMetrics:
    """KV transfers (services/engine/disaggregation.py), fed on the event loop: the
    decode side counts transfers received, failures by reason and recomputes; the prefill side
    bytes sent and leases that expired unreleased."""

    def __init__(self, registry: CollectorRegistry, labels: EngineLabels) -> None:
        names, values = [COMPONENT, "model_name", "engine"], ("engine", labels.model_name, labels.engine)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*values)

        transfers = Counter("kvmesh_kv_transfers", "KV transfers completed, by direction (sent: prefill side, "
                            "received: decode side)", [*names, "direction"], registry=registry)
        self.transfers = {d: transfers.labels(*values, d) for d in ("sent", "received")}
        transfer_bytes = Counter("kvmesh_kv_transfer_bytes", "Bytes of KV blocks moved, by direction",
                                 [*names, "direction"], registry=registry)
        self.transfer_bytes = {d: transfer_bytes.labels(*values, d) for d in ("sent", "received")}
        seconds = Histogram("kvmesh_kv_transfer_seconds", "Seconds a KV transfer took on the worker side (sent: "
                            "the send; received: from the prefill engine's first token to the blocks' arrival)",
                            [*names, "direction"], buckets=TRANSFER_SECONDS_BUCKETS, registry=registry)
        self.transfer_seconds = {d: seconds.labels(*values, d) for d in ("sent", "received")}
        failures = Counter("kvmesh_kv_transfer_failures", "Remote prefills that failed, by reason (the decode "
                           "engine recomputed each)", [*names, "reason"], registry=registry)
        self.failures = {reason: failures.labels(*values, reason) for reason in TRANSFER_FAILURES}
        self.recomputes = counter("kvmesh_kv_transfer_recomputes",
                                  "Prompts a decode engine computed itself after a failed remote prefill")
        self.local_prefills = counter("kvmesh_kv_transfer_local_prefills",
                                      "Remote-prefill requests computed here all the same: nothing to transfer "
                                      "(cached here, shorter than a block) or no free blocks for it")
        self.leases_expired = counter("kvmesh_kv_leases_expired",
                                      "Prefill-side leases freed by expiry, not by the decode engine's release")

    def record_transfer(self, direction: str, num_bytes: int, seconds: float) -> None:
        self.transfers[direction].inc()
        self.transfer_bytes[direction].inc(num_bytes)
        self.transfer_seconds[direction].observe(seconds)
