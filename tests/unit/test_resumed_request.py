"""Migration: what a request that moves to another engine carries, exactly."""

from __future__ import annotations

from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.processor.migration import EngineDeaths, Migration

PARAMS = SamplingParams(temperature=0.7, seed=5, max_tokens=10, min_tokens=4, prompt_logprobs=2, logprobs=1)
REQUEST = EngineCoreRequest("r", [1, 2, 3], PARAMS, eos_token_ids=(0,), cache_salt="s", group_id="g",
                            tenant_id="t")


def test_nothing_streamed_starts_over_prompt_logprobs_and_all() -> None:
    migration = Migration(REQUEST)
    assert migration.resumed() is REQUEST and migration.num_migrations == 1


def test_the_resumed_request_carries_the_streamed_tokens_as_outputs() -> None:
    migration = Migration(REQUEST)
    first = migration.forward(EngineCoreOutput("r", [7], num_cached_tokens=16))
    assert first.num_cached_tokens == 16
    migration.forward(EngineCoreOutput("r", [8, 9], num_cached_tokens=0))
    resumed = migration.resumed()
    assert resumed.prompt_token_ids == [1, 2, 3, 7, 8, 9] and resumed.request_id == "r"
    assert resumed.sampling_params == SamplingParams(temperature=0.7, seed=5, max_tokens=7, min_tokens=1,
                                                     logprobs=1, num_resumed_outputs=3)
    assert (resumed.eos_token_ids, resumed.cache_salt, resumed.group_id, resumed.tenant_id) == ((0,), "s", "g", "t")
    # The next engine's outputs read as the first engine's: its prefix-cache hit is not the client's.
    assert migration.forward(EngineCoreOutput("r", [10], num_cached_tokens=48)).num_cached_tokens == 16
    again = migration.resumed()  # a second move counts every token so far, from the original request
    assert again.prompt_token_ids == [1, 2, 3, 7, 8, 9, 10] and migration.num_migrations == 2
    assert (again.sampling_params.max_tokens, again.sampling_params.min_tokens,
            again.sampling_params.num_resumed_outputs) == (6, 0, 4)


def test_all_tokens_streamed_but_not_the_end_finishes_by_length() -> None:
    migration = Migration(REQUEST)
    migration.forward(EngineCoreOutput("r", list(range(10)), num_cached_tokens=0))
    end = migration.resumed()
    assert isinstance(end, EngineCoreOutput) and end.finish_reason == "length" and end.new_token_ids == []


def test_no_max_tokens_stays_none() -> None:
    migration = Migration(EngineCoreRequest("r", [1], SamplingParams(max_tokens=None)))
    migration.forward(EngineCoreOutput("r", [4], num_cached_tokens=0))
    assert migration.resumed().sampling_params.max_tokens is None


def test_engine_deaths_are_counted_per_request_id_for_the_latest_ids() -> None:
    deaths = EngineDeaths(capacity=2)
    assert [deaths.record("a"), deaths.record("b"), deaths.record("a")] == [1, 1, 2]
    deaths.record("c")  # the third id: the one least recently seen ("b") is forgotten
    assert (deaths.count("a"), deaths.count("b"), deaths.count("c"), len(deaths)) == (2, 0, 1, 2)
