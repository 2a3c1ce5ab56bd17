"""The serving benchmark's client (loadtests/serving_client.py) against the session's shared stack:
in both of its APIs every request completes at full length, and the prompt the server counted is
the one the client meant. A base model without a chat template is benchmarked through the
completions API, so that API must be as trustworthy as the chat one."""

from __future__ import annotations

import asyncio

from loadtests.serving_client import Endpoint, Load, run_load, transcript
from loadtests.serving_scenarios import Session
from loadtests.serving_targets import VLLM_EXTRAS
from services.processor.tokenizer import apply_chat_template, load_tokenizer
from services.worker.loader import resolve_model
from tests.services.procs import Serve

MAX_TOKENS = 6
SESSIONS = [Session([{"role": "system", "content": "You answer briefly."},
                     {"role": "user", "content": f"Name {n} colours."}]) for n in ("two", "three")]


def bench(serve: Serve, api: str) -> list:
    endpoint = Endpoint(serve.url, "smollm2", VLLM_EXTRAS, api)
    result = asyncio.run(run_load(endpoint, SESSIONS, Load(concurrency=2), MAX_TOKENS, 120.0, 300.0))
    return result.requests


def test_chat_and_completions_requests_complete_at_full_length_on_the_meant_prompt(serve: Serve):
    tokenizer = load_tokenizer(resolve_model("smollm2"))
    chat, completions = bench(serve, "chat"), bench(serve, "completions")
    for requests in (chat, completions):
        assert [(r.error, r.output_tokens) for r in requests] == [(None, MAX_TOKENS)] * len(SESSIONS)
    assert sorted(r.prompt_tokens for r in chat) == sorted(len(apply_chat_template(tokenizer, s.messages))
                                                          for s in SESSIONS)
    assert sorted(r.prompt_tokens for r in completions) == sorted(len(tokenizer(transcript(s.messages)).input_ids)
                                                                 for s in SESSIONS)
    assert transcript(SESSIONS[0].messages) == "System: You answer briefly.\n\nUser: Name two colours.\n\nAssistant:"
