"""The request fields vLLM knows and kvmesh does not implement. Each is a typed field of the request
models (so a wrong type is a 400, as in vLLM), and a request that asks for something with one (a
value other than the one that asks for nothing) is a 400 naming every such field: never an answer
that silently ignores what was asked. docs/serving/vllm_api.md lists every vLLM request field and what
kvmesh does with it.

    SamplingRequest(OpenAIRequest, UnsupportedSampling)            completions and chat
    CompletionRequest(..., UnsupportedCompletion)                  prompt_embeds
    ChatCompletionRequest(..., UnsupportedChat)                    tools (tool_choice "auto" needs the
                                                                   server's parser), reasoning, templates, media
    unsupported_asks(body, auto_tools) -> [Asked(field, message)]  what is asked (the app answers 400)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel


class Unsupported(NamedTuple):
    why: str
    asks: Callable[[Any], bool] = bool  # whether a value asks for the feature (default: any truthy value)
    shown: Callable[[Any], str] | None = None  # what of the value the message names, if anything


REASONING = Unsupported("reasoning models' controls are not implemented")
UNSUPPORTED: dict[str, Unsupported] = {
    "best_of": Unsupported("every choice is sampled on its own; ask for n instead", lambda v: v is not None and v > 1),
    "bad_words": Unsupported("bad words are not implemented; logit_bias of -100 bans single tokens"),
    # Structured outputs are supported (services/gateway/structured.py) but for these of vLLM's fields.
    "guided_decoding_backend": Unsupported("the engine's one backend (llguidance) compiles every constraint"),
    "guided_whitespace_pattern": Unsupported("JSON outputs are always compact"),
    "structural_tag": Unsupported("structural tags are not implemented"),
    "response_format": Unsupported("structural tags are not implemented",
                                   lambda v: v is not None and v.type == "structural_tag", lambda v: f"type {v.type!r}"),
    "logits_processors": Unsupported("custom logits processors are not supported"),
    "kv_transfer_params": Unsupported("KV transfer between servers is not driven by the client here: kvmesh "
                                      "moves KV blocks between its own engines"),
    "ec_transfer_params": Unsupported("encoder-cache transfer is not implemented"),
    "vllm_xargs": Unsupported("custom extensions are not supported"),
    "repetition_detection": Unsupported("repetition detection is not implemented"),
    "thinking_token_budget": REASONING,
    "stream_interval": Unsupported("every step's tokens are streamed as they come", lambda v: v not in (None, 1)),
    "watermarking": Unsupported("watermarking is not implemented"),
    "routed_experts_prompt_start": Unsupported("routed-expert data is not returned"),
    "prompt_embeds": Unsupported("prompt embeddings are not accepted; send text or token ids",
                                 lambda v: v is not None and len(v) > 0),
    "reasoning_effort": REASONING,
    "chat_template": Unsupported("a request may not bring its own chat template: the model's is used"),
    "mm_processor_kwargs": Unsupported("multimodal inputs are not supported"),
    "media_io_kwargs": Unsupported("multimodal inputs are not supported"),
    "return_prompt_text": Unsupported("the rendered prompt is not returned; /tokenize shows its tokens"),
    "suffix": Unsupported("no text is inserted after a suffix", lambda v: v is not None),
}
# Fields whose meaning differs between the endpoints: refused on chat only.
UNSUPPORTED_CHAT: dict[str, Unsupported] = {
    "add_special_tokens": Unsupported("the chat template writes the special tokens itself"),
}
class Asked(NamedTuple):
    field: str
    message: str  # "<field> is not supported: <why>"


AUTO_TOOLS = ("tool_choice 'auto' needs the server started with --enable-auto-tool-choice and --tool-call-parser; "
              "tool_choice 'required' or a named function works with any model")


class UnsupportedSampling(BaseModel):
    """vLLM's fields of both endpoints that kvmesh refuses (types as vLLM's; see UNSUPPORTED)."""

    best_of: int | None = None
    bad_words: list[str] | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    logits_processors: list[str | dict[str, Any]] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    watermarking: bool | None = None
    routed_experts_prompt_start: int = 0


class UnsupportedCompletion(BaseModel):
    prompt_embeds: str | list[str] | None = None  # base64 tensors in vLLM


class UnsupportedChat(BaseModel):
    tools: list[dict[str, Any]] | None = None  # to the chat template; called as tool_choice says
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None  # None: vLLM's default
    parallel_tool_calls: bool | None = True  # false: at most one call
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # read only by a reasoning parser, which kvmesh has not: no effect in vLLM either
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None  # to the chat template
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None
    add_special_tokens: bool = False


def unsupported_asks(body: BaseModel, auto_tools: bool = False) -> list[Asked]:
    """Every field of `body` that asks for what kvmesh does not implement (or this server was not
    started for: `auto_tools`, --enable-auto-tool-choice), and why it cannot."""
    rules = {**UNSUPPORTED, **(UNSUPPORTED_CHAT if isinstance(body, UnsupportedChat) else {})}
    asked = [_asked(name, rule, getattr(body, name)) for name, rule in rules.items()
             if name in type(body).model_fields and rule.asks(getattr(body, name))]
    tools = _tools_problem(body, auto_tools)
    return asked if tools is None else [*asked, Asked(tools[0], f"{tools[0]} is not supported: {tools[1]}")]


def _asked(name: str, rule: Unsupported, value: Any) -> Asked:
    what = name if rule.shown is None else f"{name} ({rule.shown(value)})"
    return Asked(name, f"{what} is not supported: {rule.why}")


def _tools_problem(body: BaseModel, auto_tools: bool) -> tuple[str, str] | None:
    """vLLM's rules: tool_choice defaults to 'auto' when tools are given; 'none' needs nothing; any
    other tool_choice needs tools; 'auto' needs the server's tool-call parser."""
    if "tools" not in type(body).model_fields:
        return None
    tools, choice = getattr(body, "tools"), getattr(body, "tool_choice")
    if tools == []:
        return "tools", "tools must not be an empty array; omit the field instead"
    field = "tool_choice"
    if choice is None:
        choice, field = ("auto", "tools") if tools else ("none", field)
    if choice == "none":
        return None
    if not tools:
        return "tool_choice", "tool_choice other than 'none' needs tools"
    if choice == "auto" and not auto_tools:
        return field, AUTO_TOOLS + (" (tool_choice defaults to 'auto' when tools are given)" if field == "tools" else "")
    return None
