"""/tokenize and /detokenize (vLLM's): the request mapped to what the processor takes."""

from __future__ import annotations

from services.common.clients import TokenizeRequest as ProcessorTokenizeRequest
from services.gateway.errors import bad_request
from services.gateway.protocol import TokenizeRequest


def to_tokenize_request(body: TokenizeRequest) -> ProcessorTokenizeRequest:
    """A prompt gets the tokenizer's special tokens by default; chat messages do not (their template
    writes them), as in vLLM."""
    messages = None
    if body.messages is not None:
        try:
            messages = [m.to_template() for m in body.messages]
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
    add_special_tokens = body.add_special_tokens
    if add_special_tokens is None:
        add_special_tokens = body.prompt is not None
    return ProcessorTokenizeRequest(
        prompt=body.prompt, messages=messages, add_special_tokens=add_special_tokens,
        add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
        chat_template_kwargs=body.chat_template_kwargs or {}, return_token_strs=body.return_token_strs,
    )
