"""Token-id lists sent to `kvmesh serve` as a client would:

- allowed_token_ids, logit_bias, stop_token_ids and logprob_token_ids longer than their limits, or
  naming ids outside the vocabulary, are 400s that name the field and the bound;
- a request of 16 choices, each allowed most of the vocabulary through a list heavy with duplicates,
  shares its steps with another client's stream: that stream gets exactly the tokens it gets alone,
  and every choice of the big request keeps to its allowed ids.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import pytest

from services.common.config import Limits
from tests.services.procs import Serve, client_for, serving

pytestmark = pytest.mark.slow

LIMITS = Limits()
VOCAB = 49152  # smollm2's
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def serve(served_model: str) -> Iterator[Serve]:
    yield from serving(served_model)


def _post(serve: Serve, body: dict, timeout: float = 120) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_over_long_or_unknown_id_lists_are_400s_naming_field_and_bound(serve: Serve):
    _, model = client_for(serve)
    over = LIMITS.max_allowed_token_ids + 1
    cases = [
        ({"allowed_token_ids": [7] * over}, "allowed_token_ids", [str(LIMITS.max_allowed_token_ids),
                                                                  "--max-allowed-token-ids"]),
        ({"allowed_token_ids": [7] * 2**18, "n": 16}, "allowed_token_ids", ["--max-allowed-token-ids"]),
        ({"logit_bias": {str(t): -1 for t in range(LIMITS.max_logit_bias + 1)}}, "logit_bias",
         [str(LIMITS.max_logit_bias), "--max-logit-bias"]),
        ({"stop_token_ids": [2] * (LIMITS.max_stop_token_ids + 1)}, "stop_token_ids",
         [str(LIMITS.max_stop_token_ids), "--max-stop-token-ids"]),
        ({"logprobs": 129, "logprob_token_ids": list(range(129))}, None, ["logprob_token_ids", "128"]),
        ({"allowed_token_ids": [5, VOCAB, VOCAB]}, None, ["allowed_token_ids", str(VOCAB), "out of vocabulary"]),
        ({"logit_bias": {str(VOCAB + 3): 1}}, None, ["logit_bias", str(VOCAB + 3), "out of vocabulary"]),
    ]
    for extra, param, named in cases:
        status, answer = _post(serve, {"model": model, "prompt": PROMPT, "max_tokens": 2, **extra})
        assert status == 400, (list(extra), answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert all(word in error["message"] for word in named), (named, error)
        if param is not None:
            assert error["param"] == param and error["code"] == "limit_exceeded", error
    serve.wait_until_engine_idle()


def test_a_long_allowed_list_leaves_its_batch_mates_tokens_alone(serve: Serve):
    _, model = client_for(serve)
    neighbour = {"model": model, "prompt": "Tell me a story about a dragon.", "max_tokens": 24, "temperature": 0,
                 "ignore_eos": True, "return_token_ids": True}
    status, alone = _post(serve, neighbour)
    assert status == 200, alone
    # 16 choices, each allowed ids [1000, 40000): 39,000 distinct ids in a list of 131,072 entries.
    allowed = list(range(1000, 40000))
    allowed = (allowed * 4)[:LIMITS.max_allowed_token_ids]
    big = {"model": model, "prompt": PROMPT, "max_tokens": 24, "n": 16, "seed": 5, "ignore_eos": True,
           "allowed_token_ids": allowed, "return_token_ids": True}
    answers: dict[str, tuple[int, dict]] = {}
    thread = threading.Thread(target=lambda: answers.update(big=_post(serve, big, timeout=300)))
    thread.start()
    answers["neighbour"] = _post(serve, neighbour, timeout=300)
    thread.join(300)
    assert not thread.is_alive()
    status, together = answers["neighbour"]
    assert status == 200, together
    assert together["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    status, restricted = answers["big"]
    assert status == 200, restricted
    assert len(restricted["choices"]) == 16
    for choice in restricted["choices"]:
        assert len(choice["token_ids"]) == 24 and all(1000 <= t < 40000 for t in choice["token_ids"]), choice
    serve.wait_until_engine_idle()
