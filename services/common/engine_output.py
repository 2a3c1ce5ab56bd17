"""What the engine streams back per request per step (to the processor or the offline LLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.model_runner_output import TokenLogprobs
from services.common.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop token id (None for EOS) or, later, the stop string
    num_cached_tokens: int = 0
    # With finish_reason "error": why this request alone failed (its worker refused its data). The
    # engine service raises it to the request's stream as ValueError; it never crosses the wire.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None
    # The client request this one is part of (its choices, its prompts); None: its own request id.
    # The engine's waiting queue shares the engine fairly between groups.
    group_id: str | None = None
    # Whose request it is (a hash of the client's API key, never the key; None: nobody's): the
    # waiting queue takes turns between tenants before groups.
    tenant_id: str | None = None
    # Routing affinity (the processor's `session` policy); stays in the processor, never on the wire.
    session_id: str | None = None
    # Disaggregation: the prefill engine the processor's decider chose for this prompt.
    prefill_engine_address: str | None = None
    # The LoRA adapter it runs with, by the name the engine registered it under (None: the base model).
    lora_name: str | None = None



@dataclass(slots=True)
class PrefillTask:
    """A decode engine's request to a prefill engine (disaggregation): compute `request`'s
    prompt, sample its first token, and send its blocks first_block .. first_block + len(block_ids)
    - 1 to the decode engine's workers (`receiver_endpoints`, rank order) with `tag`."""

    request: EngineCoreRequest
    receiver_endpoints: tuple[str, ...]
    first_block: int
    block_ids: list[int]
    tag: int


@dataclass(slots=True)
class PrefillProgress:
    """What a prefill engine streams back: first the sampled token (the prompt is computed), then,
    once its workers have sent the blocks, `sent` with the bytes."""

    first_token_id: int | None = None
    first_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    sent: bool = False
    bytes_sent: int = 0
