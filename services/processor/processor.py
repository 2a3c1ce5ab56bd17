"""The processor core: prompts in (text, token ids or chat messages) → validated engine requests;
engine outputs → text deltas with stop strings applied. The gRPC processor service and the
offline `LLM` both use this class."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.common.engine_output import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.processor.output_processor import RequestOutputState
from services.processor.tokenizer import TokenizerInfo, apply_chat_template

Prompt = str | Sequence[int]


class Processor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, info: TokenizerInfo, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.max_model_len = max_model_len

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        return [int(t) for t in prompt]

    def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if not self.info.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a completion prompt instead")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, continue_final_message,
                                   **(chat_template_kwargs or {}))

    def validate(self, prompt_token_ids: Sequence[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, and at least one must be left to generate"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {self.info.vocab_size})")

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per choice: `{request_id}` for n == 1, else `{request_id}-{i}` with
        seed + i, so that a seeded request is reproducible choice by choice."""
        self.validate(prompt_token_ids)
        if params.n == 1:
            return [EngineCoreRequest(request_id, prompt_token_ids, params, self.info.eos_token_ids,
                                      priority, cache_salt)]
        return [
            EngineCoreRequest(
                f"{request_id}-{i}", prompt_token_ids,
                replace(params, n=1, seed=None if params.seed is None else params.seed + i),
                self.info.eos_token_ids, priority, cache_salt,
            )
            for i in range(params.n)
        ]

    def output_state(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestOutputState:
        return RequestOutputState(self.tokenizer, prompt_token_ids, params)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
