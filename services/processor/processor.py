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
from services.processor.tokenizer import TokenizerInfo, apply_chat_template, chat_template_variables

Prompt = str | Sequence[int]

# Our own arguments of the template call (or of how it is rendered): a request may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask",
})
# apply_chat_template's own inputs that reach the template as variables of the same name.
TEMPLATE_INPUTS = frozenset({"tools", "documents"})


class Processor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, info: TokenizerInfo, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.max_model_len = max_model_len
        # The chat_template_kwargs a request may set: the variables the template reads, and nothing
        # of ours (vLLM's rule too; it keeps a template from being fed arguments it never declared).
        variables = chat_template_variables(tokenizer) if info.has_chat_template else frozenset()
        self.template_kwargs = (variables | TEMPLATE_INPUTS) - RESERVED_TEMPLATE_KWARGS

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
                                   **self.template_kwargs_of(chat_template_kwargs or {}))

    def template_kwargs_of(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The kwargs the template reads; a reserved key is an error, any other is dropped (as vLLM
        does: a client may send `enable_thinking` to every model, whether its template reads it or not)."""
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}; "
                             f"this model's template reads {sorted(self.template_kwargs) or 'none'}")
        return {k: v for k, v in kwargs.items() if k in self.template_kwargs}

    def truncate(self, prompt_token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last `truncate_prompt_tokens` ids (all of them for None; -1 means the context length)."""
        if truncate_prompt_tokens is None:
            return prompt_token_ids
        k = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if not 1 <= k <= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] (the maximum "
                             f"context length), got {truncate_prompt_tokens}")
        return prompt_token_ids[-k:]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included; ValueError for ids out of the vocabulary."""
        self.check_vocabulary(token_ids)
        return self.tokenizer.decode(list(token_ids))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's string of each id (byte-level pieces such as `Ġworld`, not decoded text)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(token_ids))]

    def check_vocabulary(self, token_ids: Sequence[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (size {self.info.vocab_size})")

    def validate(self, prompt_token_ids: Sequence[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, and at least one must be left to generate"
            )
        self.check_vocabulary(prompt_token_ids)

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
