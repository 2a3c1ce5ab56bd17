"""OpenAI's request and response bodies (completions, chat completions, models, errors), with the
vLLM extras the gateway supports. Unknown request fields are ignored, as vLLM does; the fields vLLM
knows and kvmesh does not implement are refused (services/gateway/unsupported.py, docs/serving/vllm_api.md)."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from services.gateway.unsupported import UnsupportedChat, UnsupportedCompletion, UnsupportedSampling


class OpenAIRequest(BaseModel):
    # Lax, as vLLM's models (pydantic's default): a compatible JSON type is coerced ("3" is n=3,
    # "true" is true, 2.0 is 2); anything else is a 400. NaN and infinities (Python's json reads
    # `NaN`) are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- requests


# The integers the wire carries: vLLM's bounds for a seed, the narrower int32 of kvmesh's protos for
# the others. A value beyond them is pydantic's greater_than_equal / less_than_equal 400.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


class StreamOptions(OpenAIRequest):
    include_usage: bool | None = False  # OpenAI's default, and vLLM's
    continuous_usage_stats: bool | None = False  # vLLM's: usage on every chunk, when include_usage is on


class JsonSchemaFormat(OpenAIRequest):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # the output always keeps to the schema here


class ResponseFormat(OpenAIRequest):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]  # structural_tag: refused
    json_schema: JsonSchemaFormat | None = None  # with type json_schema


class StructuredOutputsRequest(OpenAIRequest):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None
    # The output's JSON is always compact here (disable_any_whitespace true, whatever sent); a
    # constraint that cannot compile always fails the request (there is no fallback to disable).
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False  # honoured: additionalProperties false where unset
    whitespace_pattern: str | None = None  # refused
    structural_tag: str | None = None  # refused


class SamplingRequest(OpenAIRequest, UnsupportedSampling):
    """The fields completions and chat completions share."""

    model: str | None = None  # None: the served model
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None  # None: 1.0
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    user: str | None = None
    # vLLM's extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    use_beam_search: bool = False  # n is the beam width; the processor refuses what beam search cannot do
    length_penalty: float = 1.0  # weighs beam search's final ranking
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # Keep the prompt's last k tokens (-1: the context length).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # "right": keep the first k tokens instead
    priority: Int32 = 0  # lower runs first, under the engine's priority policy
    request_id: str | None = None  # names the request, unless X-Request-Id does
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests of one salt
    structured_outputs: StructuredOutputsRequest | None = None  # and vLLM's older guided_* fields:
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: ResponseFormat | None = None  # text, json_object, json_schema (services/gateway/structured.py)
    session_id: str | None = None  # routing affinity, as the session header (which wins)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    logprob_token_ids: list[int] | None = None  # logprobs of these tokens in place of the top-N
    return_token_ids: bool | None = None  # prompt_token_ids and each choice's token_ids in the answer
    return_tokens_as_token_ids: bool | None = None  # logprob tokens as "token_id:N"; None: the server's flag

    @field_validator("request_id")
    @classmethod
    def _printable_request_id(cls, value: str | None) -> str | None:
        # It names the request in every log line: a newline there would forge lines of its own.
        if value is not None and not value.isprintable():
            raise ValueError("must be printable: no newlines or other control characters")
        return value

    @model_validator(mode="after")
    def _check_sampling_request(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string if given")
        if self.request_id is not None and not self.request_id:
            raise ValueError("request_id must be a non-empty string if given")
        for name in ("allowed_token_ids", "logprob_token_ids"):
            if getattr(self, name) == []:
                raise ValueError(f"{name} must not be an empty list if given")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        """vLLM's rule: usage on every chunk only when the final usage chunk is asked for too."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest, UnsupportedCompletion):
    prompt: Prompt | None = Field(default=None, validate_default=True)  # missing: vLLM's empty-prompt 400
    max_tokens: int | None = 16  # 0 with echo: score the prompt only
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # refused (services/gateway/unsupported.py)
    add_special_tokens: bool = True  # vLLM's extra

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompt(cls, prompt: Prompt | None, info: ValidationInfo) -> Prompt | None:
        # None, "" or []: vLLM's words, which its clients match. With prompt_embeds (validated
        # before: a field of the base class), the 400 that refuses them says more.
        if not prompt and not info.data.get("prompt_embeds"):
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return prompt

    @model_validator(mode="after")
    def _check_completion_request(self) -> CompletionRequest:
        if self.logprob_token_ids is not None and self.logprobs is None:
            raise ValueError("logprob_token_ids can only be set when logprobs is set")
        if self.logprob_token_ids is not None and self.echo_only:
            raise ValueError("logprob_token_ids needs generated tokens: not with echo and max_tokens 0")
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) only, nothing generated."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        prompt = self.prompt
        assert prompt, "validated non-empty"
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class ContentPart(OpenAIRequest):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(OpenAIRequest):
    """One message; fields other than role and content (name, tool_calls, ...) go to the chat
    template as they are."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined into one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content parts of type {part.type!r} are not supported; send text")
                parts.append(part.text)
            message["content"] = "\n".join(parts)
        if self.role == "assistant" and isinstance(message.get("tool_calls"), list):
            _arguments_as_objects(message)
        return message


def _arguments_as_objects(message: dict[str, Any]) -> None:
    """vLLM's rule for the template: an assistant's calls carry their arguments as objects (OpenAI
    sends JSON text), since tool-use templates write them out themselves; no calls is no tool_calls."""
    if not message["tool_calls"]:
        del message["tool_calls"]
    for call in message.get("tool_calls", ()):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("arguments") or "", str):
            continue
        try:
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        except (ValueError, RecursionError):
            raise ValueError(f"a tool call's arguments are not JSON: {function['arguments'][:80]!r}") from None


class ChatCompletionRequest(SamplingRequest, UnsupportedChat):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens; None: the rest of the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extras
    echo: bool = False  # the answer starts with the last message's content when it has the answer's role
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat_request(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs can only be set when logprobs is true")
        if self.logprob_token_ids is not None and not self.logprobs:
            raise ValueError("logprob_token_ids can only be set when logprobs is true")
        return self

    @property
    def role(self) -> str:
        """The answer's role: the assistant's, or, continuing a conversation as it is, the last speaker's."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role


class TokenizeRequest(OpenAIRequest):
    """vLLM's /tokenize: a completion prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt; False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIRequest):
    """vLLM's /v1/load_lora_adapter: serve the PEFT folder `lora_path` (on the engines' disks) as a
    model named `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIRequest):
    """vLLM's /v1/unload_lora_adapter (its `lora_int_id` is accepted and ignored: names are unique)."""

    lora_name: str
    lora_int_id: int | None = None


# ----------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class PromptTokensDetails(OpenAIResponse):
    cached_tokens: int = 0


class Usage(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(OpenAIResponse):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class Logprob(OpenAIResponse):
    """vLLM's prompt logprob of one token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, Logprob] | None]  # per prompt token: token id -> logprob; None for the first


class CompletionChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's, with return_token_ids: the prompt's ids (streamed: in the choice's first chunk) and the
    # choice's generated ids (streamed: each chunk's new ones)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIResponse):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIResponse):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIResponse):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIResponse):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIResponse):
    """A streamed piece of tool call `index`: its id, type and name come once, in its first delta."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class AssistantMessage(OpenAIResponse):
    role: str = "assistant"  # the last speaker's when continuing without a generation prompt
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # the calls the answer makes (tool_choice required, named, auto)

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        """tool_calls only when there are some: an answer without calls is as it always was."""
        message = handler(self)
        if message.get("tool_calls") is None:
            message.pop("tool_calls", None)
        return message


class ChatCompletionChoice(OpenAIResponse):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's, with return_token_ids


class DeltaMessage(OpenAIResponse):
    """A streamed message piece: only the fields it carries are sent ({} for the last one)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


def _without_unset(model: BaseModel, data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`data` without those of `names` that `model` was built without: vLLM writes its chat chunks
    with exclude_unset, so a chunk either carries one of its extras (null included) or lacks the key."""
    for name in names:
        if name not in model.model_fields_set:
            data.pop(name, None)
    return data


class ChatStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: on each delta chunk (this chunk's new ids with return_token_ids, else null); the role
    # and echo chunks have none, not even null
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _without_unset(self, handler(self), ("token_ids",))


class ChatCompletionChunk(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    # vLLM's: on each choice's role chunk (the prompt's ids with return_token_ids, else null); the
    # chunks after it have none, not even null
    prompt_token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return _without_unset(self, handler(self), ("prompt_token_ids",))


class CompletionChunk(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIResponse):
    prompt: str


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvmesh"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ServerLoad(OpenAIResponse):
    """GET /load (vLLM's): the requests the server has in flight, as routers poll it."""

    server_load: int


class ErrorInfo(OpenAIResponse):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIResponse):
    error: ErrorInfo
