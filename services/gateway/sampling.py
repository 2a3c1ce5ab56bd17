"""The one mapping from an OpenAI request to SamplingParams."""

from __future__ import annotations

from services.common.config import GrammarLimits
from services.common.sampling_params import SamplingParams
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.structured import structured_outputs_of


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest,
                       grammar_limits: GrammarLimits = GrammarLimits()) -> SamplingParams:
    """Raises ValueError (answered with 400) for values SamplingParams refuses, APIError 400 for a
    constraint over `grammar_limits` (whether it compiles: structured.validate_structured_outputs)."""
    prompt_logprobs = request.prompt_logprobs
    if isinstance(request, ChatCompletionRequest):
        # Chat defaults to the rest of the context (None), completions to 16 (the request's default).
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        # echo with max_tokens 0 scores the prompt: the engine generates one token, the answer drops it
        # (as vLLM does); echo with logprobs needs the prompt's logprobs too.
        max_tokens = 1 if request.echo_only else request.max_tokens
        logprobs = request.logprobs
        if request.echo and logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = logprobs
    if request.logprob_token_ids is not None:
        logprobs = None  # the explicit ids take the top-N's place (vLLM)
    return SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=_token_biases(request.logit_bias),
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=() if request.stop is None else request.stop,
        stop_token_ids=request.stop_token_ids or (),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        allowed_token_ids=request.allowed_token_ids,
        logprob_token_ids=request.logprob_token_ids,
        structured_outputs=structured_outputs_of(request, grammar_limits),
    )


def _token_biases(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, so as strings; biases are clamped to [-100, 100].
    ValueError naming every key that is not a token id."""
    if not logit_bias:
        return None
    bad = [key for key in logit_bias if not _is_int(key)]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids; these are not: {', '.join(map(repr, bad))}")
    return {int(key): max(-100.0, min(100.0, float(bias))) for key, bias in logit_bias.items()}


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True
