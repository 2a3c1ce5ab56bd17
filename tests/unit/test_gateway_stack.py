"""The gateway app over the whole in-process stack with the real model: AsyncProcessor over
AsyncEngine over InProcessWorkerClient. A streamed answer equals the non-streamed one; stop strings
and clients that go away leave no KV block behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx2 as httpx
import pytest

from services.common.config import EngineArgs
from services.engine.async_engine import AsyncEngine
from services.gateway.app import ApiOptions, create_app
from services.inprocess import AsyncStack

from tests.unit.test_gateway import RawClient, sse_events

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = "smollm2"
KV_BYTES = 128 * 2**20
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 24,
        "temperature": 0}



@pytest.fixture(scope="module")
async def stack() -> AsyncIterator[AsyncStack]:
    stack = await AsyncStack.create(EngineArgs.from_kwargs(model="smollm2", dtype="float32", quantization="gguf",
                                                           kv_cache_memory=KV_BYTES, max_num_batched_tokens=256,
                                                           max_num_seqs=8))
    yield stack
    await stack.shutdown()


@pytest.fixture(scope="module")
def engine(stack: AsyncStack) -> AsyncEngine:
    return stack.engine


@pytest.fixture(scope="module")
def app(stack: AsyncStack):
    return create_app(stack.processor, MODEL)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
        yield c


async def assert_no_blocks_used(engine: AsyncEngine) -> None:
    for _ in range(200):
        stats = await engine.stats()
        if stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks still in use: {await engine.stats()}")


async def test_streamed_chat_equals_the_whole_answer(client, engine):
    whole = (await client.post("/v1/chat/completions", json=CHAT)).json()
    text = whole["choices"][0]["message"]["content"]
    assert text and whole["usage"]["completion_tokens"] <= 24
    r = await client.post("/v1/chat/completions",
                          json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == text
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1] if c["choices"][0]["finish_reason"]] == \
        [whole["choices"][0]["finish_reason"]]
    await assert_no_blocks_used(engine)


async def test_stop_string_frees_the_engine_request(client, engine):
    whole = (await client.post("/v1/completions", json={"prompt": "The sea is", "max_tokens": 12, "temperature": 0,
                                                         "ignore_eos": True})).json()
    text = whole["choices"][0]["text"]
    stop = text.split()[2]  # a word in the middle of the answer
    r = await client.post("/v1/completions", json={"prompt": "The sea is", "max_tokens": 12, "temperature": 0,
                                                    "ignore_eos": True, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == text[:text.index(stop)] and choice["stop_reason"] == stop
    await assert_no_blocks_used(engine)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_that_goes_away_frees_its_blocks(app, engine, stream):
    client = RawClient(app, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                                                "ignore_eos": True, "stream": stream})
    call = asyncio.create_task(client())
    if stream:
        await asyncio.wait_for(client.got_body.wait(), 60)
    else:
        while (await engine.stats()).num_running == 0:
            await asyncio.sleep(0.02)
    assert (await engine.stats()).num_used_blocks > 0
    client.disconnect.set()
    await asyncio.wait_for(call, 10)
    await assert_no_blocks_used(engine)


async def test_seeded_choices_are_reproducible(client, engine):
    body = {"prompt": "My favourite animal is", "max_tokens": 8, "n": 2, "seed": 11, "temperature": 1.0}
    first = [c["text"] for c in (await client.post("/v1/completions", json=body)).json()["choices"]]
    again = [c["text"] for c in (await client.post("/v1/completions", json=body)).json()["choices"]]
    assert first == again
    await assert_no_blocks_used(engine)


# The hermes format, forced by a regex (this model's chat template shows it no tools, so it would
# never call one of its own accord): tool_choice "auto" reads the call out of the text.
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


async def test_auto_tool_choice_reads_hermes_calls(stack, engine, client):
    auto = create_app(stack.processor, MODEL, options=ApiOptions(tool_call_parser="hermes"))
    body = {**CHAT, "max_tokens": 40, "tools": TOOLS, "structured_outputs": {"regex": HERMES_CALL}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=auto), base_url="http://test", timeout=120) as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        [choice] = whole["choices"]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in (
            "Paris", "Rome")
        events = [json.loads(e) for e in sse_events((await c.post("/v1/chat/completions",
                                                                   json={**body, "stream": True})).text)[:-1]]
        deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", ())]
        assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == [
            ("get_weather", call["function"]["arguments"])]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # No call in the text: a plain answer.
        plain = (await c.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})).json()["choices"][0]
        assert plain["message"]["content"] and plain["message"].get("tool_calls") is None
        assert plain["finish_reason"] in ("stop", "length")
    # A server without --enable-auto-tool-choice refuses "auto" (tools alone default to it).
    refused = await client.post("/v1/chat/completions", json={**CHAT, "tools": TOOLS})
    assert refused.status_code == 400 and "--enable-auto-tool-choice" in refused.json()["error"]["message"]
    await assert_no_blocks_used(engine)
