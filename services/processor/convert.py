"""Proto <-> core conversions of the gateway <-> processor contract (proto/kvmesh/v1/processor.proto),
in the style of services/common/rpc/convert.py, whose common conversions they reuse."""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2

from services.common.clients import ChoiceDelta, GenerateDelta, GenerateRequest
from services.common.rpc.convert import (
    sampling_params_from_proto,
    sampling_params_to_proto,
    token_logprobs_from_proto,
    token_logprobs_to_proto,
)
from services.common.rpc.kvmesh.v1 import processor_pb2


def _struct(value: dict) -> struct_pb2.Struct:
    msg = struct_pb2.Struct()
    msg.update(value)
    return msg


def generate_request_to_proto(r: GenerateRequest) -> processor_pb2.GenerateRequest:
    msg = processor_pb2.GenerateRequest(
        request_id=r.request_id, params=sampling_params_to_proto(r.params),
        add_generation_prompt=r.add_generation_prompt, continue_final_message=r.continue_final_message,
        add_special_tokens=r.add_special_tokens, priority=r.priority, cache_salt=r.cache_salt,
    )
    if r.prompt is not None:
        msg.text = r.prompt
    elif r.prompt_token_ids is not None:
        msg.token_ids.ids.extend(r.prompt_token_ids)
    elif r.messages is not None:
        msg.chat.messages.extend(_struct(dict(m)) for m in r.messages)
    if r.chat_template_kwargs:
        msg.chat_template_kwargs.update(r.chat_template_kwargs)
    return msg


def generate_request_from_proto(m: processor_pb2.GenerateRequest) -> GenerateRequest:
    """Raises ValueError for a message that is not a request (the server answers INVALID_ARGUMENT)."""
    if not m.request_id:
        raise ValueError("request_id is empty")
    if not m.HasField("params"):
        raise ValueError("params is missing")
    which = m.WhichOneof("prompt")
    if which is None:
        raise ValueError("the request has no prompt: set text, token_ids or chat")
    return GenerateRequest(
        request_id=m.request_id,
        params=sampling_params_from_proto(m.params),
        prompt=m.text if which == "text" else None,
        prompt_token_ids=list(m.token_ids.ids) if which == "token_ids" else None,
        messages=[json_format.MessageToDict(s) for s in m.chat.messages] if which == "chat" else None,
        add_generation_prompt=m.add_generation_prompt,
        continue_final_message=m.continue_final_message,
        chat_template_kwargs=json_format.MessageToDict(m.chat_template_kwargs),
        add_special_tokens=m.add_special_tokens,
        priority=m.priority,
        cache_salt=m.cache_salt if m.HasField("cache_salt") else None,
    )


def choice_delta_to_proto(c: ChoiceDelta) -> processor_pb2.ChoiceDelta:
    msg = processor_pb2.ChoiceDelta(
        index=c.index, text=c.text, token_ids=c.token_ids,
        logprobs=[token_logprobs_to_proto(lp) for lp in c.logprobs],
        logprob_tokens=[processor_pb2.TokenTexts(texts=t) for t in c.logprob_tokens],
        finish_reason=c.finish_reason,
    )
    if isinstance(c.stop_reason, str):
        msg.stop_string = c.stop_reason
    elif c.stop_reason is not None:
        msg.stop_token_id = c.stop_reason
    return msg


def choice_delta_from_proto(m: processor_pb2.ChoiceDelta) -> ChoiceDelta:
    which = m.WhichOneof("stop_reason")
    return ChoiceDelta(
        index=m.index, text=m.text, token_ids=list(m.token_ids),
        logprobs=[token_logprobs_from_proto(lp) for lp in m.logprobs],
        finish_reason=m.finish_reason if m.HasField("finish_reason") else None,
        stop_reason=getattr(m, which) if which is not None else None,
        logprob_tokens=[list(t.texts) for t in m.logprob_tokens],
    )


def generate_delta_to_proto(d: GenerateDelta) -> processor_pb2.GenerateResponse:
    return processor_pb2.GenerateResponse(
        choices=[choice_delta_to_proto(c) for c in d.choices], prompt_token_ids=d.prompt_token_ids,
        num_prompt_tokens=d.num_prompt_tokens, num_cached_tokens=d.num_cached_tokens,
        num_generated_tokens=d.num_generated_tokens,
    )


def generate_delta_from_proto(m: processor_pb2.GenerateResponse) -> GenerateDelta:
    # A prompt is never empty (the processor refuses one), so no ids means "not the first delta".
    return GenerateDelta(
        choices=[choice_delta_from_proto(c) for c in m.choices],
        prompt_token_ids=list(m.prompt_token_ids) or None,
        num_prompt_tokens=m.num_prompt_tokens, num_cached_tokens=m.num_cached_tokens,
        num_generated_tokens=m.num_generated_tokens,
    )
