"""The n-gram proposer and the speculator's policy around it, on hand-made token sequences."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.config import SchedulerConfig, SpeculativeConfig
from services.common.sampling_params import SamplingParams
from services.engine.ngram_proposer import NgramProposer
from services.engine.request import Request
from services.engine.speculator import MAX_BACKOFF_STEPS, Speculator


def propose(tokens, min_n=2, max_n=4, k=3, max_tokens=None) -> list[int]:
    return NgramProposer(min_n, max_n, k).propose(np.array(tokens, dtype=np.int64), max_tokens).tolist()


def test_the_tokens_after_the_match_are_drafted():
    assert propose([1, 2, 3, 4, 5, 9, 9, 1, 2, 3]) == [4, 5, 9]
    assert propose([1, 2, 3, 4, 5, 9, 9, 1, 2, 3], max_tokens=2) == [4, 5]
    assert propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]  # the draft may run into the suffix itself


def test_no_match_no_draft():
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([5, 3, 9, 3]) == []  # a 1-gram match is below min_n
    assert propose([5, 3, 9, 3], min_n=1) == [9, 3]
    assert propose([7]) == [] and propose([]) == []


def test_the_longest_match_wins_then_the_latest():
    # "8 1 2" matches a 3-gram at the start; "1 2" alone matches later too.
    assert propose([8, 1, 2, 5, 6, 1, 2, 7, 7, 8, 1, 2]) == [5, 6, 1]
    assert propose([7, 1, 2, 8, 1, 2, 9, 1, 2]) == [9, 1, 2]


def test_a_match_at_the_very_start_counts():
    assert propose([1, 2, 6, 1, 2], min_n=2, max_n=4) == [6, 1, 2]


def test_config_follows_vllm_defaults_and_refuses_bad_values():
    assert SpeculativeConfig(num_speculative_tokens=3).prompt_lookup_min == 5
    assert SpeculativeConfig(prompt_lookup_max=3).prompt_lookup_min == 3
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.from_json(str(config)) == config
    assert SchedulerConfig(speculative_config={"num_speculative_tokens": 2}).speculative_config == \
        SpeculativeConfig(num_speculative_tokens=2)
    for text, message in (('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', "num_speculative"),
                          ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must not exceed"),
                          ('{"k": 2}', "unknown"), ("[1]", "JSON object"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(text)


def test_low_acceptance_backs_off_and_probes_with_one_token():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1))
    request = Request("r", [1, 2, 1], SamplingParams(max_tokens=50), 50, block_size=4)
    # Alone in the batch, an even chance (its start) is above 1 / 3: it drafts in full.
    assert speculator.draft(request, 8, num_running=1) == [2, 1]
    speculator.record(request, 2, 2, num_running=1)  # acceptance 0.5 -> 0.75
    assert request.spec_acceptance == 0.75
    assert speculator.draft(request, 8, num_running=1) == [2, 1]
    # With 8 requests decoding a draft pays from 8 / 10 = 0.8 acceptance: 0.75 is below it.
    assert speculator.draft(request, 8, num_running=8) == [2]  # a probe
    skipped = []
    for _ in range(7):  # rejected every time: skip 1, 2, 4 ... 32 steps, then probe with one token
        speculator.record(request, 1, 0, num_running=8)
        skipped.append(0)
        while not (drafts := speculator.draft(request, 8, num_running=8)):
            skipped[-1] += 1
        assert drafts == [2]
    assert skipped == [1, 2, 4, 8, 16, 32, MAX_BACKOFF_STEPS]
    for _ in range(3):  # accepted: the average climbs back over the threshold, the backoff ends
        speculator.record(request, 1, 1, num_running=8)
        while not speculator.draft(request, 8, num_running=8):
            pass
    assert request.spec_acceptance > Speculator.threshold(8) and request.spec_backoff == 0
    assert speculator.draft(request, 8, num_running=8) == [2, 1]
    assert (speculator.stats.num_drafts, speculator.stats.num_draft_tokens) == (11, 12)
    assert speculator.stats.num_accepted_tokens_per_pos == [4, 1]


def test_the_token_array_follows_every_append_and_drafts_from_the_new_tokens():
    """The proposer's context is copied incrementally: after appends of any size (across the array's
    growth), it holds exactly the request's tokens, and a draft sees the tokens just appended."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2))
    prompt = list(range(100, 190))
    request = Request("r", prompt, SamplingParams(max_tokens=500), 500, block_size=16)
    assert np.array_equal(request.token_array(), prompt)
    for size in (1, 3, 70, 1, 200):
        request.append_output_token_ids(list(range(size)))
        tokens = request.token_array()
        assert tokens.dtype == np.int64 and tokens.tolist() == request.all_token_ids
    request.append_output_token_ids([150, 151])  # a copy of the prompt starts
    assert speculator.draft(request, 8, num_running=1) == [152, 153, 154]
