"""What every request must satisfy before it is queued, checked where it enters a service: by the
processor (with the tokenizer's vocabulary) and again by the engine (with the model's), which must
not trust its callers. One function per check, so both say the same thing."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.sampling_params import SamplingParams


def check_token_ids(token_ids: Sequence[int], vocab_size: int, where: str | None = None) -> None:
    """ValueError naming the first id outside [0, vocab_size) (and `where` it was)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}token id {bad} is out of vocabulary (size {vocab_size})")


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
