"""The beam search core (services/processor/beam_search.py) step by step, with engine outputs
written out: which requests each step sends, which candidates live on or finish, the final ranking
by vLLM's score. The model-level truth is tests/model/test_beam_search.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.clients import GenerateRequest
from services.common.engine_output import EngineCoreOutput
from services.common.model_runner_output import TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.processor.beam_search import BeamSearch
from services.processor.processor import Processor

PROMPT = [10, 11, 12]
EOS = 2  # SmolLM2-Instruct's <|im_end|>


@pytest.fixture
def processor(tokenizer, model_path: Path) -> Processor:
    return Processor.for_tokenizer(tokenizer, model_path, 64)


def search(processor: Processor, width: int = 2, max_tokens: int = 2, length_penalty: float = 1.0,
           **params) -> BeamSearch:
    request = GenerateRequest("r", SamplingParams(n=width, max_tokens=max_tokens, **params), prompt_token_ids=PROMPT,
                              use_beam_search=True, length_penalty=length_penalty)
    return BeamSearch(processor, request)


def output(request_id: str, top: dict[int, float]) -> EngineCoreOutput:
    """A one-token request's output: the sampled (greedy) token first, then the top ones."""
    ids, logprobs = list(top), list(top.values())
    return EngineCoreOutput(request_id, [ids[0]], [TokenLogprobs([ids[0], *ids], [logprobs[0], *logprobs], 1)],
                            finish_reason="length")


def test_each_step_sends_every_live_beam_as_a_one_token_greedy_request(processor):
    s = search(processor, width=2, max_tokens=3)
    [first] = s.step_requests()
    assert first.request_id == "r-s0-b0" and first.prompt_token_ids == PROMPT and first.group_id == "r"
    params = first.sampling_params
    assert (params.max_tokens, params.greedy, params.logprobs, params.ignore_eos) == (1, True, 4, True)
    s.advance([output("r-s0-b0", {5: -0.1, 6: -0.5, 7: -2.0, 8: -3.0})])
    assert [r.prompt_token_ids for r in s.step_requests()] == [[*PROMPT, 5], [*PROMPT, 6]]
    assert [r.request_id for r in s.step_requests()] == ["r-s1-b0", "r-s1-b1"]


def test_eos_endings_finish_whatever_their_rank_and_the_best_width_live_on(processor):
    s = search(processor, width=2, max_tokens=2, length_penalty=0.0)
    s.advance([output("r-s0-b0", {5: -0.1, 6: -0.2, 7: -0.3, EOS: -0.4})])  # EOS ranks 4th of 4
    assert [(b.token_ids, b.finish_reason) for b in s.done] == [([EOS], "stop")]
    s.advance([output("r-s1-b0", {8: -5.0, 9: -6.0, 10: -7.0, 11: -8.0}),
               output("r-s1-b1", {12: -1.0, 13: -6.0, 14: -7.0, 15: -8.0})])
    assert s.finished
    assert [(b.token_ids, round(b.cumulative_logprob, 6)) for b in s.live] == [([6, 12], -1.2), ([5, 8], -5.1)]
    delta = s.result()
    # The EOS ending (score -0.4) beats both live beams; its EOS is not an output token.
    assert [(c.token_ids, c.finish_reason, c.stop_reason) for c in delta.choices] == [
        ([], "stop", EOS), ([6, 12], "length", None)]
    assert delta.prompt_token_ids == PROMPT and delta.num_generated_tokens == 2


def test_length_penalty_divides_by_the_length_prompt_included_eos_not(processor):
    s = search(processor, width=2, max_tokens=2, length_penalty=1.0, include_stop_str_in_output=True)
    s.advance([output("r-s0-b0", {5: -1.0, EOS: -1.5, 6: -2.0, 7: -3.0})])
    s.advance([output("r-s1-b0", {8: -0.9, 9: -6.0, 10: -7.0, 11: -8.0}),
               output("r-s1-b1", {12: -9.0, 13: -9.5, 14: -9.6, 15: -9.7})])
    # [5, 8]: -1.9 / 5 = -0.38 beats [EOS]: -1.5 / 3 = -0.5, though its cumulative logprob is lower.
    assert [c.token_ids for c in s.result().choices] == [[5, 8], [EOS]]
    assert [s.score(b) for b in s.best()] == [pytest.approx(-1.9 / 5), pytest.approx(-1.5 / 3)]


def test_ignore_eos_makes_eos_a_token_like_any(processor):
    s = search(processor, width=1, max_tokens=1, ignore_eos=True)
    s.advance([output("r-s0-b0", {EOS: -0.1, 5: -0.2})])
    assert [(c.token_ids, c.finish_reason) for c in s.result().choices] == [([EOS], "length")]


@pytest.mark.parametrize("params, match", [
    ({"stop": ("x",)}, "does not support stop"),
    ({"logprobs": 1, "min_tokens": 1}, "does not support min_tokens, logprobs"),
    ({"width": 33}, "at most 32"),
    ({"length_penalty": float("nan")}, r"length_penalty must be a number in \[-32, 32\]"),
    ({"length_penalty": 33.0}, "length_penalty must be a number"),
])
def test_what_beam_search_cannot_do_is_refused(processor, params, match):
    with pytest.raises(ValueError, match=match):
        search(processor, **params)
