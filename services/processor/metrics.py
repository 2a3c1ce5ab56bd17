"""The processor's metrics: its tokenizer's and detokenizer's time (kvmesh_processor_*), and the
vLLM metrics that only the processor can count right. It splits a request of n choices into n
engine requests: vllm:request_params_n and vllm:request_max_num_generation_tokens (the most tokens
any choice generated) describe the whole request. It matches stop strings, which the engine never
sees: vllm:request_success counts each choice once, by the finish reason the client sees, as vLLM's
frontend counts it. Their labels are vLLM's less `engine`: a request's choices may run on different
engines.

The router's (kvmesh_router_*, RouterMetrics), by model: its decisions by policy and reason, its
latency, and how right it was: the cached tokens the engine reported in a request's first output minus
the tokens the router predicted it would find cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import Counter, Histogram

from services.common.metrics import COMPONENT, ServiceMetrics, build_1_2_5_buckets

PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's
# vllm:request_success's finished_reason values (vLLM's FinishReason), each exported from the start.
FINISH_REASONS = ("stop", "length", "abort", "error")
# Tokenizing a prompt or detokenizing a step's tokens: 10 us to 1 s.
TOKENIZER_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                     0.05, 0.1, 0.25, 1.0)

# One routing decision: 50 us (the in-memory index, or none) to 1 s (an index at its timeout).
ROUTING_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0)
# Actual minus predicted cached tokens: 0 is a right prediction; whole blocks either way.
_ERROR_STEPS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PREDICTION_ERROR_BUCKETS = (*(-s for s in reversed(_ERROR_STEPS)), 0, *_ERROR_STEPS)


class RouterMetrics:
    """The router's metric families in one registry, labelled by model (each pool routes its own
    model's requests); `of(model_name)` is one model's view, what a pool's router records through."""

    def __init__(self, service: ServiceMetrics, policy: str | None = None, reasons: Sequence[str] = (),
                 models: Sequence[str] = ()) -> None:
        """`policy` and its `reasons` (services/processor/router.py REASONS) are exported at 0 for each
        of `models` from the start, so that dashboards and alerts see the series before the first decision."""
        registry, self.component = service.registry, service.grpc.component
        labels = [COMPONENT, "model_name"]
        self.decisions = Counter("kvmesh_router_decisions", "Engines chosen, by policy and reason",
                                 [*labels, "policy", "reason"], registry=registry)
        self.seconds = Histogram("kvmesh_router_seconds", "Time to choose an engine for one engine request "
                                 "(prefix-index lookup included)", labels, buckets=ROUTING_BUCKETS, registry=registry)
        self.prediction_error = Histogram(
            "kvmesh_router_prediction_error_tokens", "Cached tokens the engine reported for a request minus those "
            "the router predicted", labels, buckets=PREDICTION_ERROR_BUCKETS, registry=registry)
        self.mispredictions = Counter(
            "kvmesh_router_mispredictions", "Requests whose reported cached tokens differed from the router's "
            "prediction by more than one block", labels, registry=registry)
        for model in models:
            self.of(model)
            for reason in reasons:
                self.decisions.labels(self.component, model, policy, reason)

    def of(self, model_name: str) -> ModelRouterMetrics:
        return ModelRouterMetrics(self, model_name)


class ModelRouterMetrics:
    """One model's router metrics."""

    def __init__(self, families: RouterMetrics, model_name: str) -> None:
        labels = (families.component, model_name)
        self.decisions, self._labels = families.decisions, labels  # the family: policy and reason vary
        self.seconds = families.seconds.labels(*labels)
        self.prediction_error = families.prediction_error.labels(*labels)
        self.mispredictions = families.mispredictions.labels(*labels)

    def observe_decision(self, policy: str, reason: str, seconds: float) -> None:
        self.decisions.labels(*self._labels, policy, reason).inc()
        self.seconds.observe(seconds)

    def observe_prediction(self, predicted: int, actual: int, block_size: int) -> None:
        self.prediction_error.observe(actual - predicted)
        if abs(actual - predicted) > block_size:
            self.mispredictions.inc()


class ProcessorMetrics:
    """One model's view of the processor's metrics; a processor of several models makes one per model
    over the same families (for_models)."""

    def __init__(self, service: ServiceMetrics, model_name: str, max_model_len: int,
                 families: ProcessorFamilies | None = None) -> None:
        families = families if families is not None else ProcessorFamilies(service, max_model_len)
        self.service = service
        self.tokenize_seconds = families.tokenize_seconds
        self.detokenize_seconds = families.detokenize_seconds
        self.params_n = families.params_n.labels(model_name)
        self.max_num_generation_tokens = families.max_num_generation_tokens.labels(model_name)
        self.request_success = {reason: families.request_success.labels(model_name, reason)
                                for reason in FINISH_REASONS}

    @classmethod
    def for_models(cls, service: ServiceMetrics, max_model_lens: Mapping[str, int]) -> dict[str, ProcessorMetrics]:
        """Each model's metrics by its name; the token buckets reach the longest context of them."""
        families = ProcessorFamilies(service, max(max_model_lens.values()))
        return {name: cls(service, name, length, families) for name, length in max_model_lens.items()}

    def observe_finished(self, num_generation_tokens: Sequence[int]) -> None:
        """A request whose choices all finished, with the tokens each generated."""
        self.params_n.observe(len(num_generation_tokens))
        self.max_num_generation_tokens.observe(max(num_generation_tokens))

    def count_finished(self, finish_reasons: Iterable[str]) -> None:
        """Engine requests (choices, beam search steps) that ended, each by its reason."""
        for reason in finish_reasons:
            self.request_success[reason].inc()


class ProcessorFamilies:
    """The processor's metric families, registered once per registry; vLLM's are labelled by model_name."""

    def __init__(self, service: ServiceMetrics, max_model_len: int) -> None:
        registry, component = service.registry, service.grpc.component
        self.tokenize_seconds = Histogram("kvmesh_processor_tokenize_seconds",
                                          "Chat template and tokenization of one prompt", [COMPONENT],
                                          buckets=TOKENIZER_BUCKETS, registry=registry).labels(component)
        self.detokenize_seconds = Histogram("kvmesh_processor_detokenize_seconds",
                                            "Incremental detokenization and stop strings, per engine output",
                                            [COMPONENT], buckets=TOKENIZER_BUCKETS, registry=registry).labels(component)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", ["model_name"],
                                  buckets=PARAMS_N_BUCKETS, registry=registry)
        self.max_num_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            ["model_name"], buckets=build_1_2_5_buckets(max_model_len), registry=registry)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["model_name", "finished_reason"], registry=registry)


class DeciderMetrics:
    """The prefill decider's outcomes (services/processor/prefill_decider.py), all exported at 0."""

    def __init__(self, service: ServiceMetrics, outcomes: Sequence[str]) -> None:
        decisions = Counter("kvmesh_pd_decisions", "Disaggregation decisions by outcome: short (prompt at most the "
                            "threshold), cached (its uncached part at most the threshold) or remote (prefilled on "
                            "a prefill engine)", [COMPONENT, "outcome"], registry=service.registry)
        self.decisions = {o: decisions.labels(service.grpc.component, o) for o in outcomes}
