"""A request that outlives the engine streaming it: what was streamed so far, and the request that
goes on from there on another engine (token replay, as Dynamo's migration).

    engine A: prompt ──▶ t0 t1 t2 ✗ (EngineDeadError / ConnectionError)
    engine B: prompt + [t0 t1 t2], num_resumed_outputs=3, max_tokens - 3, min_tokens - 3 ──▶ t3 t4 ... stop

The caller sees one stream: B's outputs follow A's under the same request id, with A's
`num_cached_tokens` (the prefix-cache hit of the request as the client sent it). Seeded sampling is
keyed by the seed and each token's position (services/worker/sampling_metadata.py `position_seed`),
so B draws what A would have drawn; greedy is the same by construction.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.errors import EngineDeadError

# What a dying engine's stream raises (services/common/errors.py): the engine stopped serving (its
# worker failed, it shuts down), or it cannot be reached (the process is gone). Not ValueError (the
# request is wrong anywhere), not EngineOverloadedError (the engine lives; the caller may retry).
MIGRATABLE_ERRORS: tuple[type[Exception], ...] = (EngineDeadError, ConnectionError)
DEATHS_REMEMBERED = 10_000  # request ids whose engine deaths are kept, the latest first


class EngineDeaths:
    """How many engines died with each request id in flight, for the latest `capacity` ids: a request
    that kills every engine it reaches (a poison request) is failed after a few, not replayed across
    the fleet; a client that sends it again under the same id gets the same answer at once."""

    def __init__(self, capacity: int = DEATHS_REMEMBERED) -> None:
        self.capacity = capacity
        self._counts: OrderedDict[str, int] = OrderedDict()

    def count(self, request_id: str) -> int:
        return self._counts.get(request_id, 0)

    def record(self, request_id: str) -> int:
        """One more engine died under `request_id`: its count now."""
        count = self._counts.pop(request_id, 0) + 1
        self._counts[request_id] = count
        if len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return count

    def __len__(self) -> int:
        return len(self._counts)


class Migration:
    """One engine request across the engines that serve it in turn. `forward` each output the caller
    gets; after a migratable error, `resumed()` is the request to send to the next engine."""

    def __init__(self, request: EngineCoreRequest) -> None:
        self.original = request
        self.token_ids: list[int] = []  # every token streamed to the caller so far
        self.num_cached_tokens: int | None = None  # of the first output the caller got
        self.num_migrations = 0

    def forward(self, output: EngineCoreOutput) -> EngineCoreOutput:
        """Records `output` (as the caller gets it) and makes it read as part of one stream."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = output.num_cached_tokens
        else:
            output.num_cached_tokens = self.num_cached_tokens
        self.token_ids.extend(output.new_token_ids)
        return output

    def resumed(self) -> EngineCoreRequest | EngineCoreOutput:
        """The request that goes on where the stream stopped; or, when the tokens streamed already
        used up max_tokens (the engine died before it said so), the final output that ends it."""
        self.num_migrations += 1
        if self.num_cached_tokens is None:  # nothing reached the caller: start over, prompt logprobs too
            return self.original
        params = self.original.sampling_params
        num_done = len(self.token_ids)
        if params.max_tokens is not None and num_done >= params.max_tokens:
            return EngineCoreOutput(self.original.request_id, [], finish_reason="length",
                                    num_cached_tokens=self.num_cached_tokens)
        return replace(
            self.original,
            prompt_token_ids=[*self.original.prompt_token_ids, *self.token_ids],
            sampling_params=replace(
                params,
                max_tokens=None if params.max_tokens is None else params.max_tokens - num_done,
                min_tokens=max(0, params.min_tokens - num_done),
                prompt_logprobs=None,  # streamed already, with the first output
                num_resumed_outputs=params.num_resumed_outputs + num_done,
            ),
        )
