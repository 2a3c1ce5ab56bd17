"""Beam search through `kvmesh serve` with the `openai` client (vLLM's `use_beam_search` in extra_body):
the same beams as the in-process `LLM` (tests/model/test_beam_search.py holds them against
transformers), sorted best first, on completions and chat; what it cannot do is a 400; nothing is
left in the engine, also when the client goes away mid-search. On the session's shared stack."""

from __future__ import annotations

import time

import httpx2 as httpx
import openai
import pytest

from services import BeamSearchParams
from tests.services.test_openai_api import CHAT, PROMPT, client, http, model  # noqa: F401 (the same fixtures)

BEAMS = {"use_beam_search": True}


def test_completion_and_chat_beams_are_the_offline_llms(client, model, offline, serve):
    answer = client.completions.create(model=model, prompt=PROMPT, n=2, max_tokens=4, extra_body=BEAMS)
    [expected] = offline.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4))
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [c.text for c in expected.outputs]
    assert [c.finish_reason for c in answer.choices] == [c.finish_reason for c in expected.outputs]
    assert len({c.text for c in answer.choices}) == 2  # two different beams
    # Streamed (the whole answer comes at the end), with vLLM's temperature, which changes nothing.
    chunks = client.chat.completions.create(model=model, messages=CHAT, n=2, max_tokens=3, temperature=0.7,
                                            stream=True, extra_body={**BEAMS, "length_penalty": 0.0})
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    [expected] = offline.beam_search([offline.processor.tokenize_chat(CHAT)],
                                     BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0))
    assert [streamed[i] for i in range(2)] == [c.text for c in expected.outputs]
    serve.wait_until_engine_idle()


@pytest.mark.parametrize("extra, match", [
    ({"stop": ["x"]}, "does not support stop"),
    ({"top_p": 0.5, "seed": 1}, "does not support top_p, seed"),
    ({"logprobs": 2}, "does not support logprobs"),
    ({"n": 17}, "--max-n"),
    ({"length_penalty": 0.5, "use_beam_search": False}, "length_penalty weighs beam search only"),
])
def test_what_beam_search_cannot_do_is_a_400(client, model, extra, match):
    with pytest.raises(openai.BadRequestError, match=match):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={**BEAMS, **extra})


def test_a_client_that_goes_away_mid_search_leaves_nothing(serve, model):
    body = {"model": model, "prompt": PROMPT, "n": 4, "max_tokens": 200, "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{serve.api}/completions", json=body, timeout=2.0)
    serve.wait_until_engine_idle(timeout=30)
    # And it stays idle: the search stopped, it did not only fall between two steps.
    queried = serve.engine_stats().prefix_cache_queries
    time.sleep(1.0)
    assert serve.engine_stats().prefix_cache_queries == queried
    serve.wait_until_engine_idle(timeout=0.1)
