"""The processor core: prompts in (text, token ids or chat messages) → validated engine requests;
engine outputs → text deltas with stop strings applied. The gRPC processor service and the
offline `LLM` both use this class."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.common.clients import GenerateRequest, TokenizeRequest
from services.common.config import GrammarLimits
from services.common.grammar import check_grammar
from services.common.engine_output import EngineCoreRequest
from services.common.prompt_size import PromptSize, check_prompt_size, prompt_size
from services.common.sampling_params import SamplingParams
from services.common.validation import check_params_token_ids, check_prompt, check_token_ids, resolved_logprobs
from services.processor.output_processor import RequestOutputState
from services.processor.tokenizer import TokenizerInfo, apply_chat_template, chat_template_variables, load_tokenizer

Prompt = str | Sequence[int]

# Our own arguments of the template call (or of how it is rendered): a request may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize",
    "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask",
})
# apply_chat_template's own inputs that reach the template as variables of the same name.
TEMPLATE_INPUTS = frozenset({"tools", "documents"})


def _json_ready(value: Any) -> Any:
    """`value` as JSON can carry it: an added token (tokenizers' AddedToken) as its text."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)


class Processor:
    @classmethod
    def load(cls, model_path: str | os.PathLike[str], max_model_len: int,
             chat_template: str | None = None) -> Processor:
        """The processor of a local model folder (its tokenizer, chat template and eos ids);
        `chat_template` (`--chat-template`) in place of the model's own."""
        return cls.for_tokenizer(load_tokenizer(model_path, chat_template), model_path, max_model_len)

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, model_path: str | os.PathLike[str],
                      max_model_len: int, grammar_limits: GrammarLimits = GrammarLimits()) -> Processor:
        return cls(tokenizer, TokenizerInfo.from_tokenizer(tokenizer, model_path), max_model_len, grammar_limits)

    def __init__(self, tokenizer: PreTrainedTokenizerBase, info: TokenizerInfo, max_model_len: int,
                 grammar_limits: GrammarLimits = GrammarLimits()) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.max_model_len = max_model_len
        self.grammar_limits = grammar_limits  # what a request's constraint may hold (make_requests)
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
            raise ValueError("messages need a chat template and this model has none (a base model): send a prompt "
                             "to /v1/completions instead, or serve the model with --chat-template")
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

    def truncate(self, prompt_token_ids: list[int], truncate_prompt_tokens: int | None,
                 right: bool = False) -> list[int]:
        """The last `truncate_prompt_tokens` ids, or with `right` the first (all of them for None; -1
        means the context length): vLLM's truncation_side "left" and "right"."""
        if truncate_prompt_tokens is None:
            return prompt_token_ids
        k = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if not 1 <= k <= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] (the maximum "
                             f"context length), got {truncate_prompt_tokens}")
        return prompt_token_ids[:k] if right else prompt_token_ids[-k:]

    def tokenizer_config(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's configuration as loaded (tokenizer_config.json, chat
        template included) less its vocabulary files' paths, added tokens as their text, and its class."""
        kwargs = getattr(self.tokenizer, "init_kwargs", None) or {}
        config = {k: _json_ready(v) for k, v in kwargs.items() if k not in ("vocab_file", "merges_file")}
        config["tokenizer_class"] = type(self.tokenizer).__name__
        return config

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included; ValueError for ids out of the vocabulary
        or more of them than the context holds (each id may decode to many bytes)."""
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{len(token_ids)} tokens is over the model's context length of "
                             f"{self.max_model_len} tokens")
        self.check_vocabulary(token_ids)
        return self.tokenizer.decode(list(token_ids))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's string of each id (byte-level pieces such as `Ġworld`, not decoded text)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(token_ids))]

    def check_vocabulary(self, token_ids: Sequence[int]) -> None:
        check_token_ids(token_ids, self.info.vocab_size)

    def prompt_of(self, request: GenerateRequest | TokenizeRequest) -> list[int]:
        """The token ids of the one prompt form `request` carries (text, ids or chat messages),
        truncated as it asks; ValueError on bad input."""
        token_ids = request.prompt_token_ids if isinstance(request, GenerateRequest) else None
        forms = [request.prompt is not None, token_ids is not None, request.messages is not None]
        if sum(forms) != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids and messages must be given")
        if token_ids is None:  # nothing is tokenized that cannot fit the context
            inputs = self.template_kwargs_of(request.chat_template_kwargs or {}).values() if request.messages else ()
            self.check_prompt_size(prompt_size(request.prompt, request.messages, inputs))
        if request.messages is not None:
            prompt = self.tokenize_chat(request.messages, request.add_generation_prompt,
                                        request.continue_final_message, request.chat_template_kwargs)
        elif request.prompt is not None:
            prompt = self.tokenize(request.prompt, request.add_special_tokens)
        else:
            prompt = self.tokenize(token_ids)
        if isinstance(request, GenerateRequest):
            return self.truncate(prompt, request.truncate_prompt_tokens, request.truncate_right)
        return prompt

    def prompt_text(self, request: GenerateRequest, prompt_token_ids: Sequence[int]) -> str:
        """`request`'s prompt as the user wrote it, or as its (maybe truncated) token ids read: what echo returns."""
        if request.prompt is not None and request.truncate_prompt_tokens is None:
            return request.prompt
        return self.tokenizer.decode(list(prompt_token_ids))

    def check_prompt_size(self, size: PromptSize) -> None:
        """ValueError for a prompt too long to fit the context, told before tokenizing it."""
        check_prompt_size(size, self.max_model_len, self.info.max_token_chars)

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        group_id: str | None = None,
        session_id: str | None = None,
        tenant_id: str | None = None,
        lora_name: str | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per choice: `{request_id}` for n == 1, else `{request_id}-{i}` with
        seed + i, so that a seeded request is reproducible choice by choice; all of them in the group
        `group_id` (default: `request_id`), with the LoRA adapter `lora_name` (None: the base model).
        ValueError for a prompt or parameters the engine would refuse."""
        check_prompt(prompt_token_ids, self.max_model_len, self.info.vocab_size)
        check_params_token_ids(params, self.info.vocab_size)
        if params.structured_outputs is not None:
            # A bad or too large schema or regex fails here, not in the engine. On the caller's thread:
            # AsyncProcessor builds requests on its tokenizer threads, never on the event loop.
            check_grammar(params.structured_outputs, self.grammar_limits)
        params = resolved_logprobs(params, self.info.vocab_size)
        group_id = group_id or request_id
        if params.n == 1:
            return [EngineCoreRequest(request_id, prompt_token_ids, params, self.info.eos_token_ids,
                                      priority, cache_salt, group_id=group_id, session_id=session_id,
                                      tenant_id=tenant_id, lora_name=lora_name)]
        return [
            EngineCoreRequest(
                f"{request_id}-{i}", prompt_token_ids,
                replace(params, n=1, seed=None if params.seed is None else params.seed + i),
                self.info.eos_token_ids, priority, cache_salt, group_id=group_id, session_id=session_id,
                tenant_id=tenant_id, lora_name=lora_name,
            )
            for i in range(params.n)
        ]

    def output_state(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestOutputState:
        return RequestOutputState(self.tokenizer, prompt_token_ids, params)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
