"""One request may not monopolise the engine: under `kvmesh serve` with room for few sequences at
once, a request of the most sequences a request may ask for (--max-sequences-per-request: prompts x
n) is running when a small chat arrives; the waiting queue takes turns between the two requests,
so the chat is answered long before the big request ends (without turns, it would wait for every
sequence queued before it)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.services.procs import Serve, serving

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 4
MAX_SEQUENCES = 32  # per request: 4 prompts x n = 8
BIG_TOKENS = 24


@pytest.fixture(scope="module")
def serve(model_path: Path) -> Iterator[Serve]:
    yield from serving(model_path, ["--max-num-seqs", str(MAX_NUM_SEQS),
                                    "--max-sequences-per-request", str(MAX_SEQUENCES)])


def test_a_small_chat_is_served_while_a_request_of_many_sequences_runs(serve: Serve):
    client = openai.OpenAI(base_url=serve.api, api_key="unused", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="max-sequences-per-request"):
        client.completions.create(model=model, prompt=["a"] * 4, n=MAX_SEQUENCES // 4 + 1, max_tokens=1)

    big: dict[str, float] = {}

    def run_big() -> None:
        big["start"] = time.monotonic()
        response = client.completions.create(model=model, prompt=["Once upon a time", "The sea", "In 1900", "Dear"],
                                             n=MAX_SEQUENCES // 4, max_tokens=BIG_TOKENS, temperature=1.0,
                                             extra_body={"ignore_eos": True})
        big["end"] = time.monotonic()
        big["choices"] = len(response.choices)

    thread = threading.Thread(target=run_big)
    thread.start()
    deadline = time.monotonic() + 120
    while serve.engine_stats().num_running < MAX_NUM_SEQS:  # the big one fills the engine
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    chat_start = time.monotonic()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    chat_end = time.monotonic()
    thread.join(600)
    assert big["choices"] == MAX_SEQUENCES and reply.usage.completion_tokens == 8
    big_took, chat_took = big["end"] - big["start"], chat_end - chat_start
    # Fair turns: the chat waits for about one running sequence to finish, not for the 28 queued.
    assert chat_took < big_took / 3, f"the chat took {chat_took:.1f}s, the big request {big_took:.1f}s"
    serve.wait_until_engine_idle()
