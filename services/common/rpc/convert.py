"""Proto <-> core conversions: the one place they live. Servicers and gRPC clients only call these.

Each pair is `<noun>_to_proto(core) -> message` and `<noun>_from_proto(message) -> core`;
`x_from_proto(x_to_proto(v)) == v` for every value the core produces (tests/unit/test_convert.py).
Building a core object from the wire validates it (SamplingParams checks its ranges), so a bad
message raises ValueError, which servers answer with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from typing import TypeVar

from google.protobuf.message import Message

from services.common.clients import (
    ChoiceDelta,
    EngineInfo,
    EngineStats,
    GenerateDelta,
    GenerateRequest,
    LoRAState,
    PrefixMatch,
    Tokenized,
    TokenizeRequest,
    WorkerInfo,
)
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest, PrefillProgress, PrefillTask
from services.common.model_runner_output import ModelRunnerOutput, TokenLogprobs
from services.common.rpc.kvmesh.v1 import common_pb2, engine_pb2, processor_pb2, worker_pb2
from services.common.sampling_params import SamplingParams
from services.common.lora import LoRARequest
from services.common.scheduler_output import CachedRequestData, GrammarBitmask, NewRequestData, SchedulerOutput
from services.common.structured_outputs import StructuredOutputs

T = TypeVar("T")
M = TypeVar("M", bound=Message)
MAX_TENANT_ID_CHARS = 64  # a tenant id is a short hash (services/gateway/auth.py)

# ----------------------------------------------------------------------------- common


def fields_to_proto(value: object, message_type: type[M]) -> M:
    """A message of a dataclass whose every field is a scalar field of the message with the same
    name (the message may not lack one: protobuf refuses an unknown keyword)."""
    return message_type(**{f.name: getattr(value, f.name) for f in dataclasses.fields(value)})


def fields_from_proto(message: Message, cls: type[T]) -> T:
    """The dataclass `cls` of a message, field by name (fields_to_proto's inverse); a repeated field
    becomes a tuple."""
    def value(name: str) -> object:
        v = getattr(message, name)
        return tuple(v) if isinstance(v, Sequence) and not isinstance(v, (str, bytes)) else v
    return cls(**{f.name: value(f.name) for f in dataclasses.fields(cls)})


def sampling_params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, max_tokens=p.max_tokens,
        min_tokens=p.min_tokens, stop=p.stop, stop_token_ids=p.stop_token_ids,
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
        logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens, num_resumed_outputs=p.num_resumed_outputs,
        allowed_token_ids=p.allowed_token_ids, logprob_token_ids=p.logprob_token_ids,
        structured_outputs=None if p.structured_outputs is None else common_pb2.StructuredOutputs(
            kind=p.structured_outputs.kind, spec=p.structured_outputs.spec),
    )


def sampling_params_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        n=m.n, temperature=m.temperature, top_p=m.top_p, top_k=m.top_k, min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty, logit_bias=m.logit_bias or None,
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None, min_tokens=m.min_tokens,
        stop=tuple(m.stop), stop_token_ids=m.stop_token_ids,
        include_stop_str_in_output=m.include_stop_str_in_output, ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        skip_special_tokens=m.skip_special_tokens, spaces_between_special_tokens=m.spaces_between_special_tokens,
        num_resumed_outputs=m.num_resumed_outputs,
        # The id lists as protobuf containers: SamplingParams bounds their length before copying them.
        allowed_token_ids=m.allowed_token_ids or None, logprob_token_ids=m.logprob_token_ids or None,
        structured_outputs=StructuredOutputs(m.structured_outputs.kind, m.structured_outputs.spec)
        if m.HasField("structured_outputs") else None,
    )


def token_logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_ids=lp.token_ids, logprobs=lp.logprobs, rank=lp.rank)


def token_logprobs_from_proto(m: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(token_ids=list(m.token_ids), logprobs=list(m.logprobs), rank=m.rank)


def _logprobs_list_from_proto(items) -> list[TokenLogprobs]:
    return [token_logprobs_from_proto(m) for m in items]


# ----------------------------------------------------------------------------- engine <-> worker


def worker_info_to_proto(info: WorkerInfo) -> worker_pb2.WorkerInfo:
    return fields_to_proto(info, worker_pb2.WorkerInfo)


def worker_info_from_proto(m: worker_pb2.WorkerInfo) -> WorkerInfo:
    return fields_from_proto(m, WorkerInfo)


def scheduler_output_to_proto(out: SchedulerOutput) -> worker_pb2.SchedulerOutput:
    cached = out.scheduled_cached_reqs
    return worker_pb2.SchedulerOutput(
        scheduled_new_reqs=[
            worker_pb2.NewRequestData(
                req_id=r.req_id, prompt_token_ids=r.prompt_token_ids, output_token_ids=r.output_token_ids,
                sampling_params=sampling_params_to_proto(r.sampling_params),
                stop_token_ids=sorted(r.stop_token_ids), block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens, lora_request=_lora_request_to_proto(r.lora_request))
            for r in out.scheduled_new_reqs
        ],
        scheduled_cached_reqs=worker_pb2.CachedRequests(
            req_ids=[r.req_id for r in cached],
            num_computed_tokens=[r.num_computed_tokens for r in cached],
            num_new_blocks=[len(r.new_block_ids) for r in cached],
            new_block_ids=[block_id for r in cached for block_id in r.new_block_ids],
        ),
        scheduled_req_ids=out.num_scheduled_tokens.keys(),
        num_scheduled_tokens=out.num_scheduled_tokens.values(),
        total_num_scheduled_tokens=out.total_num_scheduled_tokens,
        finished_req_ids=sorted(out.finished_req_ids),
        num_preempted=out.num_preempted,
        grammar_req_ids=out.grammar_bitmask.req_ids if out.grammar_bitmask else (),
        grammar_bitmask=out.grammar_bitmask.bitmask if out.grammar_bitmask else b"",
        removed_lora_ids=out.removed_lora_ids,
        spec_req_ids=out.scheduled_spec_decode_tokens.keys(),
        num_spec_tokens=[len(t) for t in out.scheduled_spec_decode_tokens.values()],
        spec_token_ids=[t for tokens in out.scheduled_spec_decode_tokens.values() for t in tokens],
    )


def scheduler_output_from_proto(m: worker_pb2.SchedulerOutput) -> SchedulerOutput:
    cached = m.scheduled_cached_reqs
    new_block_ids = list(cached.new_block_ids)
    ends = list(itertools.accumulate(cached.num_new_blocks))
    if len(cached.num_computed_tokens) != len(cached.req_ids) or len(ends) != len(cached.req_ids):
        raise ValueError("scheduled_cached_reqs: columns of different lengths")
    if (ends[-1] if ends else 0) != len(new_block_ids):
        raise ValueError("scheduled_cached_reqs: num_new_blocks does not add up to new_block_ids")
    if len(m.scheduled_req_ids) != len(m.num_scheduled_tokens):
        raise ValueError("scheduled_req_ids and num_scheduled_tokens differ in length")
    spec_ends = list(itertools.accumulate(m.num_spec_tokens))
    if len(spec_ends) != len(m.spec_req_ids) or (spec_ends[-1] if spec_ends else 0) != len(m.spec_token_ids):
        raise ValueError("spec_req_ids, num_spec_tokens and spec_token_ids do not add up")
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(req_id=r.req_id, prompt_token_ids=list(r.prompt_token_ids),
                           output_token_ids=list(r.output_token_ids),
                           sampling_params=sampling_params_from_proto(r.sampling_params),
                           stop_token_ids=frozenset(r.stop_token_ids), block_ids=list(r.block_ids),
                           num_computed_tokens=r.num_computed_tokens,
                           lora_request=_lora_request_from_proto(r.lora_request) if r.HasField("lora_request")
                           else None)
            for r in m.scheduled_new_reqs
        ],
        scheduled_cached_reqs=[
            CachedRequestData(req_id=req_id, new_block_ids=new_block_ids[end - n:end],
                              num_computed_tokens=num_computed)
            for req_id, num_computed, n, end in zip(cached.req_ids, cached.num_computed_tokens,
                                                    cached.num_new_blocks, ends)
        ],
        num_scheduled_tokens=dict(zip(m.scheduled_req_ids, m.num_scheduled_tokens)),
        total_num_scheduled_tokens=m.total_num_scheduled_tokens,
        finished_req_ids=set(m.finished_req_ids),
        num_preempted=m.num_preempted,
        grammar_bitmask=GrammarBitmask(list(m.grammar_req_ids), m.grammar_bitmask) if m.grammar_req_ids else None,
        removed_lora_ids=list(m.removed_lora_ids),
        scheduled_spec_decode_tokens={req_id: list(m.spec_token_ids[end - n:end])
                                      for req_id, n, end in zip(m.spec_req_ids, m.num_spec_tokens, spec_ends)},
    )


def _lora_request_to_proto(lora: LoRARequest | None) -> worker_pb2.LoRARequest | None:
    if lora is None:
        return None
    return worker_pb2.LoRARequest(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id, lora_path=lora.lora_path)


def _lora_request_from_proto(m: worker_pb2.LoRARequest) -> LoRARequest:
    return LoRARequest(m.lora_name, m.lora_int_id, m.lora_path)  # ValueError for a bad one


def model_runner_output_to_proto(out: ModelRunnerOutput) -> worker_pb2.ModelRunnerOutput:
    return worker_pb2.ModelRunnerOutput(
        req_ids=out.req_ids,
        sampled_token_ids=out.sampled_token_ids,
        logprobs=[token_logprobs_to_proto(lp) for lp in out.logprobs or ()],
        prompt_logprobs={
            req_id: common_pb2.TokenLogprobsList(items=[token_logprobs_to_proto(lp) for lp in lps])
            for req_id, lps in out.prompt_logprobs.items()
        },
        failed=out.failed,
        num_accepted_drafts=out.num_accepted_drafts,
    )


def model_runner_output_from_proto(m: worker_pb2.ModelRunnerOutput) -> ModelRunnerOutput:
    # An empty logprobs list is None: the worker sends logprobs for every row or for none.
    return ModelRunnerOutput(
        req_ids=list(m.req_ids),
        sampled_token_ids=list(m.sampled_token_ids),
        logprobs=_logprobs_list_from_proto(m.logprobs) or None,
        prompt_logprobs={req_id: _logprobs_list_from_proto(lps.items) for req_id, lps in m.prompt_logprobs.items()},
        failed=dict(m.failed),
        num_accepted_drafts=list(m.num_accepted_drafts),
    )


# ----------------------------------------------------------------------------- processor <-> engine


def engine_request_to_proto(r: EngineCoreRequest) -> engine_pb2.EngineRequest:
    """The arrival time stays behind: it is the engine's own monotonic clock, stamped on receipt."""
    return engine_pb2.EngineRequest(
        request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
        sampling_params=sampling_params_to_proto(r.sampling_params), eos_token_ids=r.eos_token_ids,
        priority=r.priority, cache_salt=r.cache_salt, group_id=r.group_id,
        prefill_engine_address=r.prefill_engine_address, tenant_id=r.tenant_id, lora_name=r.lora_name,
    )


def engine_request_from_proto(m: engine_pb2.EngineRequest) -> EngineCoreRequest:
    if not m.request_id:
        raise ValueError("request_id is empty")
    if not m.HasField("sampling_params"):
        raise ValueError("sampling_params is missing")
    return EngineCoreRequest(
        request_id=m.request_id, prompt_token_ids=list(m.prompt_token_ids),
        sampling_params=sampling_params_from_proto(m.sampling_params), eos_token_ids=tuple(m.eos_token_ids),
        priority=m.priority, cache_salt=m.cache_salt if m.HasField("cache_salt") else None,
        group_id=m.group_id if m.HasField("group_id") else None,
        prefill_engine_address=m.prefill_engine_address if m.HasField("prefill_engine_address") else None,
        tenant_id=_tenant_id(m), lora_name=m.lora_name if m.HasField("lora_name") else None,
    )


def prefill_task_to_proto(t: PrefillTask) -> engine_pb2.PrefillRequest:
    return engine_pb2.PrefillRequest(request=engine_request_to_proto(t.request), receiver_endpoints=t.receiver_endpoints,
                                     first_block=t.first_block, block_ids=t.block_ids, tag=t.tag)


def prefill_task_from_proto(m: engine_pb2.PrefillRequest) -> PrefillTask:
    if not m.block_ids or m.first_block < 0 or not m.receiver_endpoints:
        raise ValueError("a prefill task needs block ids, a first block >= 0 and the receivers' endpoints")
    return PrefillTask(engine_request_from_proto(m.request), tuple(m.receiver_endpoints), m.first_block,
                       list(m.block_ids), m.tag)


def prefill_progress_to_proto(p: PrefillProgress) -> engine_pb2.PrefillResponse:
    return engine_pb2.PrefillResponse(
        first_token_id=p.first_token_id, first_logprobs=[token_logprobs_to_proto(lp) for lp in p.first_logprobs],
        num_cached_tokens=p.num_cached_tokens, sent=p.sent, bytes_sent=p.bytes_sent)


def prefill_progress_from_proto(m: engine_pb2.PrefillResponse) -> PrefillProgress:
    return PrefillProgress(
        first_token_id=m.first_token_id if m.HasField("first_token_id") else None,
        first_logprobs=[token_logprobs_from_proto(lp) for lp in m.first_logprobs],
        num_cached_tokens=m.num_cached_tokens, sent=m.sent, bytes_sent=m.bytes_sent)


def engine_output_to_proto(o: EngineCoreOutput) -> engine_pb2.EngineOutput:
    msg = engine_pb2.EngineOutput(
        request_id=o.request_id, new_token_ids=o.new_token_ids,
        new_logprobs=[token_logprobs_to_proto(lp) for lp in o.new_logprobs],
        new_prompt_logprobs=[token_logprobs_to_proto(lp) for lp in o.new_prompt_logprobs],
        finish_reason=o.finish_reason, num_cached_tokens=o.num_cached_tokens,
    )
    if isinstance(o.stop_reason, str):
        msg.stop_string = o.stop_reason
    elif o.stop_reason is not None:
        msg.stop_token_id = o.stop_reason
    return msg


def engine_output_from_proto(m: engine_pb2.EngineOutput) -> EngineCoreOutput:
    which = m.WhichOneof("stop_reason")
    return EngineCoreOutput(
        request_id=m.request_id, new_token_ids=list(m.new_token_ids),
        new_logprobs=_logprobs_list_from_proto(m.new_logprobs),
        new_prompt_logprobs=_logprobs_list_from_proto(m.new_prompt_logprobs),
        finish_reason=m.finish_reason if m.HasField("finish_reason") else None,
        stop_reason=getattr(m, which) if which is not None else None,
        num_cached_tokens=m.num_cached_tokens,
    )


def engine_stats_to_proto(s: EngineStats) -> engine_pb2.EngineStats:
    lora = None if s.lora is None else fields_to_proto(s.lora, engine_pb2.LoRAState)
    return engine_pb2.EngineStats(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "lora"},
                                  lora=lora)


def engine_stats_from_proto(m: engine_pb2.EngineStats) -> EngineStats:
    lora = fields_from_proto(m.lora, LoRAState) if m.HasField("lora") else None
    return EngineStats(**{f.name: getattr(m, f.name) for f in dataclasses.fields(EngineStats) if f.name != "lora"},
                       lora=lora)


def engine_info_to_proto(info: EngineInfo) -> engine_pb2.EngineInfo:
    return fields_to_proto(info, engine_pb2.EngineInfo)


def engine_info_from_proto(m: engine_pb2.EngineInfo) -> EngineInfo:
    return fields_from_proto(m, EngineInfo)


def prefix_match_to_proto(match: PrefixMatch) -> engine_pb2.MatchPrefixResponse:
    return fields_to_proto(match, engine_pb2.MatchPrefixResponse)


def prefix_match_from_proto(m: engine_pb2.MatchPrefixResponse) -> PrefixMatch:
    return fields_from_proto(m, PrefixMatch)


BLOCK_HASH_BYTES = 32
MAX_MATCH_BLOCKS = 1 << 16  # longer than any context: 65536 blocks of one token


def block_hashes_from_proto(m: engine_pb2.MatchPrefixRequest) -> list[bytes]:
    """ValueError for a chain no prompt could have: too long, or a hash of the wrong size."""
    if len(m.block_hashes) > MAX_MATCH_BLOCKS:
        raise ValueError(f"at most {MAX_MATCH_BLOCKS} block hashes, got {len(m.block_hashes)}")
    for i, h in enumerate(m.block_hashes):
        if len(h) != BLOCK_HASH_BYTES:
            raise ValueError(f"block_hashes[{i}] has {len(h)} bytes, not {BLOCK_HASH_BYTES}")
    return list(m.block_hashes)


# ----------------------------------------------------------------------------- gateway <-> processor

# How deeply a chat message or chat_template_kwargs may nest objects and arrays: far beyond any
# real message, and far below what would make the processor's JSON parser recurse deeply.
MAX_STRUCT_DEPTH = 32


def _json_text(value: object, what: str, items: bool = False) -> str:
    """`value` (JSON: chat messages, chat_template_kwargs) as JSON text; ValueError naming `what`
    for nesting deeper than MAX_STRUCT_DEPTH or a number beyond the range of a double. `items`:
    `value` is a list whose items are checked each on its own (the messages)."""
    for i, item in enumerate(value) if items else [(None, value)]:
        _check_json(item, what if i is None else f"{what}[{i}]")
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (ValueError, TypeError):
        raise ValueError(f"{what} holds a value that cannot be passed on") from None


def _json_value(text: str, what: str, kind: type) -> object:
    """The JSON `text` of a `kind` (dict or list) as _json_text wrote it; ValueError for anything
    else, as a processor must treat what any caller sends."""
    try:
        value = json.loads(text) if text else kind()
    except (ValueError, RecursionError):
        raise ValueError(f"{what} is not JSON") from None
    if not isinstance(value, kind):
        raise ValueError(f"{what} is not a JSON {'object' if kind is dict else 'array'}")
    if kind is dict:
        _check_json(value, what)
    return value


def _check_json(value: object, what: str) -> None:
    """ValueError naming `what` when `value` nests deeper than MAX_STRUCT_DEPTH or holds an integer
    beyond the range of a double; one walk, level by level, without recursion."""
    depth, level = 0, [value]
    while level:
        if any(isinstance(v, int) and not -_DOUBLE_MAX <= v <= _DOUBLE_MAX for v in level):
            raise ValueError(f"{what} holds a number beyond the range of a double")
        containers = [v for v in level if isinstance(v, (Mapping, list, tuple))]
        if containers:
            depth += 1
            if depth > MAX_STRUCT_DEPTH:
                raise ValueError(f"{what} is nested more than {MAX_STRUCT_DEPTH} levels deep")
        level = [child for v in containers for child in (v.values() if isinstance(v, Mapping) else v)]


_DOUBLE_MAX = sys.float_info.max


def _messages(m: processor_pb2.ChatMessages) -> list[dict]:
    messages = _json_value(m.json, "messages", list)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] is not a JSON object")
        _check_json(message, f"messages[{i}]")
    return messages


def generate_request_to_proto(r: GenerateRequest) -> processor_pb2.GenerateRequest:
    msg = processor_pb2.GenerateRequest(
        request_id=r.request_id, params=sampling_params_to_proto(r.params),
        add_generation_prompt=r.add_generation_prompt, continue_final_message=r.continue_final_message,
        add_special_tokens=r.add_special_tokens, priority=r.priority, cache_salt=r.cache_salt,
        truncate_prompt_tokens=r.truncate_prompt_tokens, truncate_right=r.truncate_right, echo=r.echo,
        group_id=r.group_id, session_id=r.session_id, tenant_id=r.tenant_id, model=r.model,
        use_beam_search=r.use_beam_search, length_penalty=None if r.length_penalty == 1.0 else r.length_penalty,
    )
    if r.prompt is not None:
        msg.text = r.prompt
    elif r.prompt_token_ids is not None:
        msg.token_ids.ids.extend(r.prompt_token_ids)
    elif r.messages is not None:
        msg.chat.json = _json_text(list(r.messages), "messages", items=True)
    if r.chat_template_kwargs:
        msg.chat_template_kwargs_json = _json_text(dict(r.chat_template_kwargs), "chat_template_kwargs")
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
        messages=_messages(m.chat) if which == "chat" else None,
        add_generation_prompt=m.add_generation_prompt,
        continue_final_message=m.continue_final_message,
        chat_template_kwargs=_json_value(m.chat_template_kwargs_json, "chat_template_kwargs", dict),
        add_special_tokens=m.add_special_tokens,
        priority=m.priority,
        cache_salt=m.cache_salt if m.HasField("cache_salt") else None,
        truncate_prompt_tokens=m.truncate_prompt_tokens if m.HasField("truncate_prompt_tokens") else None,
        truncate_right=m.truncate_right,
        echo=m.echo,
        group_id=m.group_id if m.HasField("group_id") else None,
        session_id=m.session_id if m.HasField("session_id") else None,
        tenant_id=_tenant_id(m),
        model=m.model,
        use_beam_search=m.use_beam_search,
        length_penalty=m.length_penalty if m.HasField("length_penalty") else 1.0,
    )


def _tenant_id(m: processor_pb2.GenerateRequest | engine_pb2.EngineRequest) -> str | None:
    """A tenant id as the gateway makes them (services/gateway/auth.py): short, so that an engine
    never keys its queue on whatever a caller sends."""
    if not m.HasField("tenant_id"):
        return None
    if len(m.tenant_id) > MAX_TENANT_ID_CHARS:
        raise ValueError(f"tenant_id is {len(m.tenant_id)} characters long; at most {MAX_TENANT_ID_CHARS}")
    return m.tenant_id


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
    # prompt_logprobs[0] is None (the first prompt token has none): the wire leaves it out.
    assert not d.prompt_logprobs or d.prompt_logprobs[0] is None, "the first prompt token has no logprobs"
    return processor_pb2.GenerateResponse(
        choices=[choice_delta_to_proto(c) for c in d.choices], prompt_token_ids=d.prompt_token_ids,
        num_prompt_tokens=d.num_prompt_tokens, num_cached_tokens=d.num_cached_tokens,
        num_generated_tokens=d.num_generated_tokens, prompt_text=d.prompt_text,
        prompt_logprobs=[token_logprobs_to_proto(lp) for lp in d.prompt_logprobs[1:]],
        prompt_logprob_tokens=[processor_pb2.TokenTexts(texts=t) for t in d.prompt_logprob_tokens],
    )


def generate_delta_from_proto(m: processor_pb2.GenerateResponse) -> GenerateDelta:
    # A prompt is never empty (the processor refuses one), so no ids means "not the first delta".
    return GenerateDelta(
        choices=[choice_delta_from_proto(c) for c in m.choices],
        prompt_token_ids=list(m.prompt_token_ids) or None,
        num_prompt_tokens=m.num_prompt_tokens, num_cached_tokens=m.num_cached_tokens,
        num_generated_tokens=m.num_generated_tokens,
        prompt_text=m.prompt_text if m.HasField("prompt_text") else None,
        prompt_logprobs=[None, *_logprobs_list_from_proto(m.prompt_logprobs)] if m.prompt_logprob_tokens else [],
        prompt_logprob_tokens=[list(t.texts) for t in m.prompt_logprob_tokens],
    )


def tokenize_request_to_proto(r: TokenizeRequest) -> processor_pb2.TokenizeRequest:
    msg = processor_pb2.TokenizeRequest(
        add_special_tokens=r.add_special_tokens, add_generation_prompt=r.add_generation_prompt,
        continue_final_message=r.continue_final_message, return_token_strs=r.return_token_strs, model=r.model,
    )
    if r.prompt is not None:
        msg.text = r.prompt
    elif r.messages is not None:
        msg.chat.json = _json_text(list(r.messages), "messages", items=True)
    if r.chat_template_kwargs:
        msg.chat_template_kwargs_json = _json_text(dict(r.chat_template_kwargs), "chat_template_kwargs")
    return msg


def tokenize_request_from_proto(m: processor_pb2.TokenizeRequest) -> TokenizeRequest:
    """Raises ValueError for a request without a prompt (the server answers INVALID_ARGUMENT)."""
    which = m.WhichOneof("prompt")
    if which is None:
        raise ValueError("the request has no prompt: set text or chat")
    return TokenizeRequest(
        prompt=m.text if which == "text" else None,
        messages=_messages(m.chat) if which == "chat" else None,
        add_special_tokens=m.add_special_tokens,
        add_generation_prompt=m.add_generation_prompt,
        continue_final_message=m.continue_final_message,
        chat_template_kwargs=_json_value(m.chat_template_kwargs_json, "chat_template_kwargs", dict),
        return_token_strs=m.return_token_strs,
        model=m.model,
    )


def tokenized_to_proto(t: Tokenized) -> processor_pb2.TokenizeResponse:
    msg = processor_pb2.TokenizeResponse(token_ids=t.token_ids, max_model_len=t.max_model_len)
    if t.token_strs is not None:
        msg.token_strs.texts.extend(t.token_strs)
    return msg


def tokenized_from_proto(m: processor_pb2.TokenizeResponse) -> Tokenized:
    return Tokenized(token_ids=list(m.token_ids), max_model_len=m.max_model_len,
                     token_strs=list(m.token_strs.texts) if m.HasField("token_strs") else None)
