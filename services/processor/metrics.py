"""The processor's metrics: its tokenizer's and detokenizer's time (kvmesh_processor_*), and the two
vLLM metrics about a whole request that only the processor sees, since it splits a request of
n choices into n engine requests: vllm:request_params_n and vllm:request_max_num_generation_tokens
(the most tokens any choice generated). Their labels are vLLM's less `engine`: a request's choices
may run on different engines.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Histogram

from services.common.metrics import COMPONENT, ServiceMetrics, build_1_2_5_buckets

PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's
# Tokenizing a prompt or detokenizing a step's tokens: 10 us to 1 s.
TOKENIZER_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                     0.05, 0.1, 0.25, 1.0)


class ProcessorMetrics:
    def __init__(self, service: ServiceMetrics, model_name: str, max_model_len: int) -> None:
        self.service = service
        registry, component = service.registry, service.grpc.component
        self.tokenize_seconds = Histogram("kvmesh_processor_tokenize_seconds",
                                          "Chat template and tokenization of one prompt", [COMPONENT],
                                          buckets=TOKENIZER_BUCKETS, registry=registry).labels(component)
        self.detokenize_seconds = Histogram("kvmesh_processor_detokenize_seconds",
                                            "Incremental detokenization and stop strings, per engine output",
                                            [COMPONENT], buckets=TOKENIZER_BUCKETS, registry=registry).labels(component)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", ["model_name"],
                                  buckets=PARAMS_N_BUCKETS, registry=registry).labels(model_name)
        self.max_num_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            ["model_name"], buckets=build_1_2_5_buckets(max_model_len), registry=registry).labels(model_name)

    def observe_finished(self, num_generation_tokens: Sequence[int]) -> None:
        """A request whose choices all finished, with the tokens each generated."""
        self.params_n.observe(len(num_generation_tokens))
        self.max_num_generation_tokens.observe(max(num_generation_tokens))
