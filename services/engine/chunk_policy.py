"""How many prompt tokens a step may compute: the scheduler's answer to "how much prefill fits in
one step?".

A step computes every running request's next token and prefill chunks of the prompts still being
read; nobody gets a token before the whole step is done. On a CPU one 2,048-token chunk at long
context takes seconds, during which every stream stalls. AdaptiveChunking cuts the step's prompt
tokens (all requests together) to what recent steps computed in `target_seconds`, measured (seconds
per token, a moving average) from the steps themselves, so it follows the device, the model and the
context length (a chunk at 7,000 tokens of context costs more per token than one at 100, and the
measurement after each chunk sees it). A GPU, where a full chunk takes milliseconds, is never cut.

    prefill tokens = clamp(target_seconds / seconds_per_token, min_tokens, max_tokens)

The cap is the step's, shared first come, first served (services/engine/scheduler.py): eight
1,000-token prompts arriving together are read one after another, the first one's first token after
its own prefill (~1/8 of the time), where a cap per request read them side by side and gave every
one its first token only at the end (docs/benchmarks/log.md, long prompts).
"""

from __future__ import annotations

# Until a step was measured, a step reads this many prompt tokens: short on any device, and on a GPU the next
# (measured) step goes to the full budget.
INITIAL_CHUNK = 256
# Steps computing fewer tokens measure the step's fixed cost (reading the weights), not the cost of
# a token: they are not counted.
MIN_MEASURED_TOKENS = 32
SMOOTHING = 0.5  # weight of the latest step in the moving average


class AdaptiveChunking:
    def __init__(self, max_tokens: int, target_seconds: float, min_tokens: int = MIN_MEASURED_TOKENS) -> None:
        """`max_tokens`: the step's whole budget (max_num_batched_tokens); `target_seconds` 0: no cut."""
        self.max_tokens = max_tokens
        self.target_seconds = target_seconds
        self.min_tokens = min(min_tokens, max_tokens)
        self.seconds_per_token: float | None = None  # unknown until a step is measured

    def max_prefill_tokens(self) -> int:
        """Prompt tokens the next step may compute, all requests together."""
        if not self.target_seconds:
            return self.max_tokens
        if self.seconds_per_token is None:
            return min(INITIAL_CHUNK, self.max_tokens)
        return max(self.min_tokens, min(self.max_tokens, int(self.target_seconds / self.seconds_per_token)))

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """A step that computed `num_tokens` took `seconds` (schedule to outputs)."""
        if num_tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        latest = seconds / num_tokens
        previous = self.seconds_per_token
        self.seconds_per_token = latest if previous is None else SMOOTHING * latest + (1 - SMOOTHING) * previous
