"""What a worker returns for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """Logprobs of one position: column 0 is the chosen token, then the top-N alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token (1 = most likely)


@dataclass(slots=True)
class ModelRunnerOutput:
    # One entry per request that completed its scheduled tokens this step (no partial prefills).
    req_ids: list[str]
    # The token each request sampled after its accepted drafts (without drafts: its next token).
    sampled_token_ids: list[int]
    # When any request asked: one per new token, in req_ids order, each request's accepted drafts
    # first, then its sampled token.
    logprobs: list[TokenLogprobs] | None = None
    # Prompt logprobs of the chunk computed this step, per request that asked for them.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Requests this step could not compute for a fault of their own (parameters the worker refuses),
    # with the reason; the worker has dropped them, the others' step went on.
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: how many of its drafted tokens (SchedulerOutput.scheduled_spec_decode_tokens)
    # each request accepted, aligned with req_ids; empty when no request of the step had drafts.
    num_accepted_drafts: list[int] = field(default_factory=list)
