"""Speculative decoding's engine side: which decoding requests draft this step, how many tokens, and
the counts behind vLLM's vllm:spec_decode_* metrics.

Drafts cost compute whether or not they are accepted: a request whose drafts keep being rejected
backs off (it skips speculation for 1, 2, 4 ... up to MAX_BACKOFF_STEPS steps), and an accepted
draft resets it. Chat-like outputs rarely repeat their context, so they mostly propose nothing or
back off, and a batch of them computes about one token per request per step, as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.common.config import SpeculativeConfig
from services.engine.ngram_proposer import NgramProposer
from services.engine.request import Request

MAX_BACKOFF_STEPS = 16


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

    def draft(self, request: Request, max_tokens: int) -> list[int]:
        """Tokens to verify after `request`'s next one (at most `max_tokens`); [] when it should not
        speculate: it samples under a grammar (the mask covers one position), or it is backing off."""
        if max_tokens <= 0 or request.grammar is not None:
            return []
        if request.spec_skip_steps > 0:
            request.spec_skip_steps -= 1
            return []
        tokens = np.asarray(request.all_token_ids, dtype=np.int64)
        return self.proposer.propose(tokens, max_tokens).tolist()

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """The worker accepted the first `num_accepted` of `num_drafted` drafted tokens."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.num_accepted_tokens_per_pos[pos] += 1
        if num_accepted:
            request.spec_backoff = 0
        else:
            request.spec_backoff = min(max(1, 2 * request.spec_backoff), MAX_BACKOFF_STEPS)
            request.spec_skip_steps = request.spec_backoff
