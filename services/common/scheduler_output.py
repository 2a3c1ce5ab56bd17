"""What the engine tells its workers each step: a diff, not the whole batch.

A request is sent in full once (`NewRequestData`, also when it resumes after preemption);
afterwards only its id, the blocks it gained and its computed-token count. `finished_req_ids`
names every request whose worker state must go (finished, aborted or preempted since the last step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.lora import LoRARequest
from services.common.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]  # eos + stop_token_ids, masked while under min_tokens
    block_ids: list[int]
    num_computed_tokens: int  # before this step (prefix-cache hits)
    lora_request: LoRARequest | None = None  # its adapter (None: the base model); the worker loads it by id


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclass(slots=True)
class GrammarBitmask:
    """The packed token masks of the requests that sample under a grammar this step (vLLM's
    grammar_bitmask): row i, for req_ids[i], is `words_per_row` little-endian int32 words; bit b of word
    w set means token 32 w + b may be sampled. Only constrained requests have rows: one, or 1 + d in a
    row for a request verifying d drafts (row j masks the draw after its first j drafts)."""

    req_ids: list[str]
    bitmask: bytes  # len(req_ids) * words_per_row * 4 bytes

    def __post_init__(self) -> None:
        if self.req_ids and len(self.bitmask) % (4 * len(self.req_ids)):
            raise ValueError(f"grammar bitmask of {len(self.bitmask)} bytes for {len(self.req_ids)} rows")

    @property
    def words_per_row(self) -> int:
        return len(self.bitmask) // (4 * len(self.req_ids))


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    grammar_bitmask: GrammarBitmask | None = None  # None: no request samples under a grammar this step
    # LoRA adapters unloaded since the last step, by id: the worker drops their slots and host memory.
    removed_lora_ids: list[int] = field(default_factory=list)
    # Speculative decoding: request id -> the tokens drafted after its next token. Its
    # num_scheduled_tokens count them (1 + len(drafts)); the worker verifies them in this step.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
