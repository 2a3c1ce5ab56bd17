"""What every request must satisfy before it is queued, checked where it enters a service: by the
processor (with the tokenizer's vocabulary) and again by the engine (with the model's), which must
not trust its callers. One function per check, so both say the same thing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from services.common.engine_output import EngineCoreRequest
from services.common.sampling_params import WHOLE_VOCABULARY, SamplingParams

# What one engine request may carry beyond its prompt. Generous for every real caller (the
# processor sends a model's few eos ids and the gateway's bounded stop lists); they bound the
# work and memory of a request that comes from anywhere else.
MAX_REQUEST_ID_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024  # eos_token_ids and stop_token_ids, each
MAX_STOP_STRINGS = 1024
MAX_CACHE_SALT_LENGTH = 1024


def check_token_ids(token_ids: Sequence[int], vocab_size: int, where: str | None = None) -> None:
    """ValueError naming every id outside [0, vocab_size) (and `where` they were)."""
    bad = list(dict.fromkeys(t for t in token_ids if not 0 <= t < vocab_size))
    if bad:
        prefix = f"{where}: " if where else ""
        ids = f"token id {bad[0]} is" if len(bad) == 1 else f"token ids {', '.join(map(str, bad))} are"
        raise ValueError(f"{prefix}{ids} out of vocabulary (size {vocab_size})")


def check_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """A prompt the engine can schedule: not empty, leaving at least one token of context to
    generate, every id in the vocabulary."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens; this model's maximum context length is "
            f"{max_model_len} tokens, and at least one must be left to generate"
        )
    check_token_ids(prompt_token_ids, vocab_size)


def check_params_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids in the sampling parameters index the logits: each must be in the vocabulary."""
    check_token_ids(list(params.logit_bias or {}), vocab_size, "logit_bias")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(params.allowed_token_ids or (), vocab_size, "allowed_token_ids")
    check_token_ids(params.logprob_token_ids or (), vocab_size, "logprob_token_ids")


def resolved_logprobs(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """`params` with -1 (the whole vocabulary) as `vocab_size`; ValueError for more than the
    vocabulary has (vLLM's check against the model's vocabulary)."""
    counts = {}
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value == WHOLE_VOCABULARY:
            counts[name] = value = vocab_size
        if value is not None and value > vocab_size:
            raise ValueError(f"{name} asks for {value} top logprobs; the vocabulary has {vocab_size} tokens (-1 "
                             "asks for all of them)")
    return replace(params, **counts) if counts else params


def check_engine_request(request: EngineCoreRequest, max_model_len: int, vocab_size: int) -> None:
    """Everything an engine request carries, checked as if it came from anywhere (the engine's
    gRPC port is reachable by more than its processor): the prompt, every token id that indexes the
    logits (eos ids too: the min_tokens mask writes them), the counts and lengths the engine holds
    on to, one sequence per request (the processor splits n). Ranges and finiteness of the sampling
    parameters were checked when they were built (SamplingParams, also for the proto path)."""
    params = request.sampling_params
    if not request.request_id or len(request.request_id) > MAX_REQUEST_ID_LENGTH:
        raise ValueError(f"request_id must have 1 to {MAX_REQUEST_ID_LENGTH} characters")
    if params.n != 1:
        raise ValueError(f"an engine request is one sequence (n=1; the processor splits n), got n={params.n}")
    for name, count, limit in (("eos_token_ids", len(request.eos_token_ids), MAX_STOP_TOKEN_IDS),
                               ("stop_token_ids", len(params.stop_token_ids), MAX_STOP_TOKEN_IDS),
                               ("stop", len(params.stop), MAX_STOP_STRINGS),
                               # Each id once (SamplingParams), so the vocabulary bounds these:
                               ("allowed_token_ids", len(params.allowed_token_ids or ()), vocab_size),
                               ("logit_bias", len(params.logit_bias or ()), vocab_size)):
        if count > limit:
            raise ValueError(f"{name} has {count} entries; at most {limit}")
    if request.cache_salt is not None and len(request.cache_salt) > MAX_CACHE_SALT_LENGTH:
        raise ValueError(f"cache_salt must have at most {MAX_CACHE_SALT_LENGTH} characters")
    check_prompt(request.prompt_token_ids, max_model_len, vocab_size)
    if params.num_resumed_outputs >= len(request.prompt_token_ids):
        raise ValueError(f"num_resumed_outputs ({params.num_resumed_outputs}) must be below the number of prompt "
                         f"tokens ({len(request.prompt_token_ids)}): a resumed request keeps its original prompt")
    check_params_token_ids(params, vocab_size)
    check_token_ids(request.eos_token_ids, vocab_size, "eos_token_ids")
    for name in ("logprobs", "prompt_logprobs"):  # the processor resolved -1 to the vocabulary's size
        value = getattr(params, name)
        if value is not None and not 0 <= value <= vocab_size:
            raise ValueError(f"{name} must be in [0, {vocab_size}] (the vocabulary), got {value}")
