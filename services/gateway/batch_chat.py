"""/v1/chat/completions/batch (vLLM's): several conversations in one request, one answer each.

The body is a chat completion's, except that `messages` is a list of conversations. Each becomes
its own processor request (`{request_id}-c{i}`, all in the group `request_id`, so the engine shares
itself fairly with other clients), and the response is one `chat.completion` whose choice `i`
answers conversation `i`, with the usage of all of them. As in vLLM: no streaming, and `n` is 1;
each choice's logprobs and `token_ids` are those its conversation's chat completion would have.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from services.common.clients import GenerateRequest
from services.common.sampling_params import SamplingParams
from services.gateway.chat import echoed, generate_request, read_tool_calls, token_logprobs
from services.gateway.generation import Generation
from services.gateway.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
)


class BatchChatCompletionRequest(ChatCompletionRequest):
    messages: list[list[ChatMessage]] = Field(min_length=1)  # type: ignore[assignment]  # conversations

    @model_validator(mode="after")
    def _check_batch_request(self) -> BatchChatCompletionRequest:
        if self.stream:
            raise ValueError("stream is not supported by /v1/chat/completions/batch; send each conversation to "
                             "/v1/chat/completions to stream it")
        if self.n != 1:
            raise ValueError(f"n must be 1 in /v1/chat/completions/batch (one choice per conversation), got {self.n}")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available in /v1/chat/completions/batch")
        for i, conversation in enumerate(self.messages):
            if not conversation:
                raise ValueError(f"messages[{i}] is an empty conversation")
        return self

    @property
    def role(self) -> str:
        return "assistant" if self.add_generation_prompt else self.messages[0][-1].role

    def conversations(self) -> list[ChatCompletionRequest]:
        """Each conversation as a chat completion request of its own (the fields checked already)."""
        return [ChatCompletionRequest.model_construct(**{**dict(self), "messages": conversation})
                for conversation in self.messages]


def generate_requests(body: BatchChatCompletionRequest, request_id: str,
                      params: SamplingParams) -> list[GenerateRequest]:
    requests = []
    for i, conversation in enumerate(body.conversations()):
        request = generate_request(conversation, f"{request_id}-c{i}", params)
        request.group_id = request_id
        requests.append(request)
    return requests


async def batch_chat_response(generation: Generation, body: BatchChatCompletionRequest, response_id: str,
                              model: str, tool_parser: str | None = None) -> ChatCompletionResponse:
    conversations = body.conversations()
    choices = [ChatCompletionChoice(index=i, message=AssistantMessage(role=c.role, content=echoed(c)),
                                    logprobs=ChatChoiceLogprobs(content=[]) if body.logprobs else None,
                                    token_ids=[] if body.return_token_ids else None)
               for i, c in enumerate(conversations)]
    async for i, delta in generation.deltas():
        choice = choices[i]
        for c in delta.choices:  # n is 1: the conversation's one choice
            choice.message.content += c.text
            if choice.token_ids is not None:
                choice.token_ids += c.token_ids
            if choice.logprobs is not None:
                choice.logprobs.content.extend(token_logprobs(body, c))
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    for conversation, choice in zip(conversations, choices):  # tool calls, as /v1/chat/completions reads them
        read_tool_calls(conversation, [choice], tool_parser)
    return ChatCompletionResponse(id=response_id, model=model, choices=choices, usage=generation.usage())
