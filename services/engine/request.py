"""A request as the engine sees it: token ids, how many of them have KV computed, and a status.

There are no prefill and decode phases: `num_computed_tokens` trails `num_tokens`, and the
scheduler spends its token budget to close the gap.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from services.common.hashing import BlockHash, hash_token_blocks
from services.common.lora import LoRARequest
from services.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.structured_output import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        block_size: int,
        eos_token_ids: Sequence[int] = (),
        model_id: str = "",
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        group_id: str | None = None,
        tenant_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # already clamped to the context by the caller
        self.eos_token_ids = frozenset(eos_token_ids)
        self.priority = priority
        # The client request this sequence is part of (None: its own); the waiting queue is fair between groups.
        self.group_id = request_id if group_id is None else group_id
        # Whose request it is (a hash of the client's API key; "" for none): the waiting queue takes
        # turns between tenants.
        self.tenant_id = tenant_id or ""
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Structured outputs: the matcher of its constraint, set once compiled (None: unconstrained).
        self.grammar: RequestGrammar | None = None
        # Speculative decoding: the moving average of its drafts' acceptance and the backoff when that
        # is too low to pay (services/engine/speculator.py). It starts at an even chance: one stream
        # drafts in full from the first match, a large batch probes first.
        self.spec_acceptance = 0.5
        self.spec_backoff = 0
        self.spec_skip_steps = 0
        # all_token_ids as int64, for the n-gram proposer: grown by doubling and filled with the tokens
        # appended since the last read, so a step copies its new tokens, not the whole context.
        self._token_array: np.ndarray | None = None
        self._num_in_token_array = 0

        self._block_size = block_size
        self._model_id = model_id
        self._cache_salt = cache_salt
        self.lora_request = lora_request  # its adapter (None: the base model); its name is in the block hashes
        self._lora_name = None if lora_request is None else lora_request.lora_name
        # Hashes of the full blocks of all_token_ids, kept up to date as tokens are appended.
        self.block_hashes: list[BlockHash] = hash_token_blocks(
            self.all_token_ids, block_size, model_id, cache_salt, lora_name=self._lora_name
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        num_full = len(self.all_token_ids) // self._block_size
        if num_full > len(self.block_hashes):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(hash_token_blocks(
                self.all_token_ids, self._block_size, self._model_id, self._cache_salt,
                parent=parent, start_block=len(self.block_hashes), lora_name=self._lora_name,
            ))

    def token_array(self) -> np.ndarray:
        """all_token_ids as an int64 array [num_tokens]: a view, valid until the next append."""
        num_tokens, num_in = len(self.all_token_ids), self._num_in_token_array
        if self._token_array is None or num_tokens > len(self._token_array):
            grown = np.empty(max(num_tokens, 2 * num_in, 64), dtype=np.int64)
            if self._token_array is not None:
                grown[:num_in] = self._token_array[:num_in]
            self._token_array = grown
        if num_tokens > num_in:
            self._token_array[num_in:num_tokens] = self.all_token_ids[num_in:]
            self._num_in_token_array = num_tokens
        return self._token_array[:num_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}, "
                f"tokens={self.num_tokens})")
