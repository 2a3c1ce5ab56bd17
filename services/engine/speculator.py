"""Speculative decoding's engine side: which decoding requests draft this step, how many tokens, and
the counts behind vLLM's vllm:spec_decode_* metrics.

A drafted token costs the compute of a decoded one, accepted or not. A step costs a fixed part (weights
read, Python, sampling) plus a part per token. With n requests decoding, a draft that is accepted with
probability a pays for itself when

    a > n / (n + STEP_OVERHEAD_TOKENS)        (the per-token share of the step's time)

where STEP_OVERHEAD_TOKENS is the fixed part in tokens' worth of compute. One stream that copies its
prompt drafts freely; 32 chat streams need near-certain drafts. Each request keeps a moving average of
its acceptance. Below the threshold it stops drafting for 1, 2, 4 ... MAX_BACKOFF_STEPS steps, then
probes with one drafted token, so a request whose output starts to copy is found again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import SpeculativeConfig
from services.engine.ngram_proposer import NgramProposer
from services.engine.request import Request

MAX_BACKOFF_STEPS = 32
# A step's fixed cost in decoded tokens' worth: on a 2-core CPU a one-token step takes ~8 ms and each
# more token ~3 ms (docs/benchmarks/index.md, speculative decoding). A GPU's is far larger: this errs
# towards drafting less there.
STEP_OVERHEAD_TOKENS = 2.0
ACCEPTANCE_SMOOTHING = 0.5  # weight of the latest step in a request's acceptance average


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative, as vLLM counts them: drafts (one per request-step that speculated), drafted and
    accepted tokens, and accepted tokens by draft position (0 = the first drafted token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                      config.num_speculative_tokens)
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)

    def draft(self, request: Request, max_tokens: int, num_running: int) -> list[int]:
        """Tokens to verify after `request`'s next one (at most `max_tokens`), with `num_running`
        requests in the batch; [] when it should not speculate (it is backing off). Under a grammar the
        drafts stop before the first one it refuses or one that completes it
        (RequestGrammar.valid_drafts): no draw is verified past a forbidden token or the grammar's end."""
        if max_tokens <= 0:
            return []
        if request.spec_skip_steps > 0:
            request.spec_skip_steps -= 1
            return []
        if request.spec_acceptance < self.threshold(num_running):
            max_tokens = 1  # a probe after backing off
        drafts = self.proposer.propose(request.token_array(), max_tokens).tolist()
        if drafts and request.grammar is not None:
            drafts = request.grammar.valid_drafts(drafts)
        return drafts

    @staticmethod
    def threshold(num_running: int) -> float:
        """The acceptance rate from which drafting pays, with `num_running` requests decoding."""
        return num_running / (num_running + STEP_OVERHEAD_TOKENS)

    def record(self, request: Request, num_drafted: int, num_accepted: int, num_running: int) -> None:
        """The worker accepted the first `num_accepted` of `num_drafted` drafted tokens."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1
        request.spec_acceptance += ACCEPTANCE_SMOOTHING * (num_accepted / num_drafted - request.spec_acceptance)
        if request.spec_acceptance >= self.threshold(num_running):
            request.spec_backoff = 0
        else:
            request.spec_backoff = min(max(1, 2 * request.spec_backoff), MAX_BACKOFF_STEPS)
            request.spec_skip_steps = request.spec_backoff
