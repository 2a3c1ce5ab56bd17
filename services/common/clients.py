"""The interfaces between services. Each has an in-process implementation (the core itself, or a
thin async wrapper of it) and a gRPC implementation (a client of the next service's server), so
the offline API, the tests and the pods run the same cores. Both raise the same exceptions for the
same faults (services/common/errors.py; tests/unit/test_client_contract.py).

    gateway --ProcessorClient--> processor --EngineClient--> engine --WorkerClient--> worker
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.model_runner_output import ModelRunnerOutput, TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput


# ----------------------------------------------------------------------------- engine <- worker

@dataclass(frozen=True, slots=True)
class WorkerInfo:
    model_id: str
    model_path: str
    vocab_size: int
    max_model_len: int
    block_size: int
    rank: int = 0  # in the worker's tensor-parallel group; only rank 0's steps carry tokens
    world_size: int = 1
    kv_transfer_endpoint: str = ""  # its KV-transfer endpoint id; "": it takes no part
    step_port: int = 0  # its step channel's port, on its gRPC address's host; 0: none (in this process)


class WorkerClient(Protocol):
    """Blocking: the engine calls it from its engine-loop thread (services/engine/async_engine.py)."""

    def get_info(self) -> WorkerInfo: ...
    def initialize_cache(self, max_num_reqs: int) -> int:
        """Size the KV cache from the worker's memory budget, allocate it; returns num_blocks."""
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """No deadline: a slow step is not a failure. The gRPC client fails it (ConnectionError)
        as soon as the worker is gone, or stops answering its liveness checks meanwhile."""
    def check_alive(self) -> None:
        """ConnectionError unless the worker answers (its health service) within its liveness timeout."""
    def close(self) -> None: ...


class KVTransferWorker(Protocol):
    """A worker that moves KV blocks to / from a worker of another engine. Blocking, like
    WorkerClient, and safe to call from another thread while a step runs. Both return the bytes
    moved; KVTransferError (a ConnectionError) when the transfer failed or timed out."""

    def send_kv(self, peer: str, block_ids: Sequence[int], tag: int) -> int: ...
    def receive_kv(self, peer: str, block_ids: Sequence[int], tag: int) -> int: ...


# ----------------------------------------------------------------------------- processor <- engine

@dataclass(frozen=True, slots=True)
class LoRAState:
    """An engine's LoRA adapters by name: those it serves, those its running and waiting requests
    run with, and those its workers hold in their `max_loras` slots (what a router's adapter affinity
    and vLLM's vllm:lora_requests_info read). Names sorted."""

    adapters: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    loaded: tuple[str, ...] = ()
    max_loras: int = 0
    num_deferred: int = 0  # waiting requests held back only because their adapter has no slot free

    @property
    def active(self) -> frozenset[str]:
        """Adapters a request would find in place: in a slot, or run or queued by a request."""
        return frozenset(self.running) | frozenset(self.waiting) | frozenset(self.loaded)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    lora: LoRAState | None = None  # None: LoRA off


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_id: str
    model_path: str
    max_model_len: int
    block_size: int
    # This engine in the prefix index: the address processors reach it at, and its epoch (grows with
    # every start). "" / 0 for an engine that is not part of a fleet (in-process, offline).
    engine_id: str = ""
    epoch: int = 0
    role: str = "both"  # prefill, decode or both
    kv_transfer_endpoints: tuple[str, ...] = ()  # its workers' KV-transfer endpoint ids, rank order
    model_name: str = ""  # what clients call its model (a processor of several models routes by it)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """An engine's answer to "how much of this hash chain do you hold?", with its load then."""

    num_matched_blocks: int  # leading blocks of the chain held in its prefix cache
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_cache_usage: float  # 0..1


class EngineClient(Protocol):
    async def info(self) -> EngineInfo: ...
    def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Outputs of one engine request until it finishes. Closing the iterator early (the
        caller was cancelled) aborts the request in the engine."""
    async def abort(self, request_ids: Sequence[str]) -> None:
        """Idempotent; unknown or finished ids are ignored."""
    async def stats(self) -> EngineStats: ...
    async def is_healthy(self) -> bool: ...
    async def match_prefix(self, block_hashes: Sequence[bytes]) -> PrefixMatch:
        """How many leading blocks of `block_hashes` (services/common/hashing.py) the engine's
        prefix cache holds now, and its load. ValueError for a malformed chain."""
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve the PEFT folder `lora_path` as `lora_name` from now on. ValueError for a bad
        folder, a name in use, or an engine without LoRA."""
    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Refuse new requests naming `lora_name` from now on; those in flight finish with it, then
        its slot and host memory are freed. ModelNotFoundError for a name not served."""


# ----------------------------------------------------------------------------- gateway <- processor

@dataclass(slots=True)
class GenerateRequest:
    """One OpenAI request as the processor takes it: exactly one of prompt / prompt_token_ids /
    messages is set."""

    request_id: str
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[Mapping[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    truncate_right: bool = False  # truncate_prompt_tokens keeps the first k tokens instead
    echo: bool = False  # the first delta carries the prompt's text
    group_id: str | None = None  # the client request this is part of (a completion's prompts); None: request_id
    session_id: str | None = None  # routing affinity (the `session` policy): same key, same engine
    tenant_id: str | None = None  # a hash of the client's API key: the engine's queue takes turns between tenants
    model: str = ""  # the served model name it is for; "": the processor's first model
    # The LoRA adapter it runs with (None: the base model): set by the processor when `model` names an
    # adapter, or by the offline LLM's lora_request; never on the gateway's wire (`model` is).
    lora_name: str | None = None
    # Beam search over params.n beams (vLLM's use_beam_search; services/processor/beam_search.py); its
    # final ranking divides each beam's cumulative logprob by its length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0


@dataclass(slots=True)
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The text of each logprobs entry's token ids (aligned with `logprobs`): the gateway has no tokenizer.
    logprob_tokens: list[list[str]] = field(default_factory=list)


@dataclass(slots=True)
class GenerateDelta:
    """What one step added to a request's choices. The first delta carries the prompt's token
    count (and the prompt ids); usage counters are cumulative."""

    choices: list[ChoiceDelta]
    prompt_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    prompt_text: str | None = None  # in the first delta, when the request asked for echo
    # When the request asked for prompt logprobs, once (with the first token): one entry per prompt
    # token, None for the first (nothing precedes it), as vLLM's RequestOutput.prompt_logprobs.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprob_tokens: list[list[str]] = field(default_factory=list)  # their texts; [first token] first


@dataclass(slots=True)
class TokenizeRequest:
    """A prompt to tokenize only: text or chat messages (exactly one)."""

    prompt: str | None = None
    messages: list[Mapping[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    return_token_strs: bool = False
    model: str = ""  # the served model name whose tokenizer to use; "": the processor's first model


@dataclass(slots=True)
class Tokenized:
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] | None = None  # the vocabulary's strings of the ids, when asked for


class ProcessorClient(Protocol):
    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateDelta]:
        """Deltas until every choice finished. Closing early aborts the engine request(s).
        Invalid input raises ValueError, the engine's errors pass on (services/common/errors.py)."""
    async def tokenize(self, request: TokenizeRequest) -> Tokenized: ...
    async def detokenize(self, token_ids: Sequence[int], model: str = "") -> str: ...
    async def tokenizer_info(self, model: str = "") -> dict[str, Any]:
        """The tokenizer's configuration as a JSON object (vLLM's /tokenizer_info)."""
    async def model_info(self, model: str = "") -> EngineInfo:
        """`model`'s engine info (a served model name; "": the first). ModelNotFoundError for one
        the processor does not serve."""
    async def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str = "") -> None:
        """Serve a LoRA adapter on every engine of `base_model_name` ("": the first model), named as
        a model from now on. ValueError for a bad folder or a name in use."""
    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving the adapter everywhere (requests in flight finish). ModelNotFoundError for
        one not served."""
    async def is_healthy(self) -> bool: ...
