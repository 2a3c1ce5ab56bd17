"""The fleet side of LoRA on `kvmesh serve --num-engines 2` over a tiny Llama (tests/model/families.py)
with a PEFT adapter made at test time (tests/model/lora_adapters.py), as vLLM users drive it:

  - --allow-runtime-lora-updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter behind the
    API key, with vLLM's statuses (400 for a bad folder or a name in use, 404 for an unknown name);
    /v1/models follows them; every engine of the pool serves the adapter, then forgets it once its
    last request in flight finished (nothing left registered or in a slot);
  - adapter affinity: requests for one adapter, each with a fresh prompt, all go to one engine;
  - vllm:lora_requests_info on an engine's metrics page while a request of the adapter runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, NamedTuple

import openai
import pytest

from services.common.clients import EngineStats
from services.engine.client import GrpcEngineClient
from tests.model.families import Family, random_prompts
from tests.model.lora_adapters import Adapter, save_adapter
from tests.services.procs import Serve, gone, serving
from tests.unit.test_metrics import samples

BASE = "tiny"
KEY = "fleet-key"
ENGINES = ("engine-0", "engine-1")
PROMPTS = random_prompts((19,) * 7, seed=23)


@pytest.fixture(scope="module")
def family(model_families: dict[str, Family]) -> Family:
    return model_families["llama-untied"]


@pytest.fixture(scope="module")
def adapter(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Adapter:
    return save_adapter(family.path, tmp_path_factory.mktemp("fleet-adapters") / "a", "a", 1, rank=4, seed=5)


@pytest.fixture(scope="module")
def stack(family: Family, adapter: Adapter) -> Iterator[Serve]:
    yield from serving(family.path, ["--served-model-name", BASE, "--num-engines", "2", "--api-key", KEY,
                                     "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                                     "--allow-runtime-lora-updating", "--lora-modules", adapter.module])


def client(stack: Serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.api, api_key=KEY, timeout=120, max_retries=0)


class Answer(NamedTuple):
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def post(stack: Serve, path: str, body: dict, key: str | None = KEY) -> Answer:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{stack.url}{path}", json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return Answer(response.status, response.read().decode())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.read().decode())


def tokens(stack: Serve, model: str, prompt: list[int], max_tokens: int = 5) -> list[int]:
    completion = client(stack).completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=0)
    return [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]


def engine_stats(stack: Serve) -> dict[str, EngineStats]:
    async def ask() -> dict[str, EngineStats]:
        found = {}
        for name in ENGINES:
            engine = GrpcEngineClient(stack.services[name]["address"], timeout=10, security=stack.security)
            try:
                found[name] = await engine.stats()
            finally:
                await engine.close()
        return found
    return asyncio.run(ask())


def wait_until_idle(stack: Serve, timeout: float = 30.0) -> dict[str, EngineStats]:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(stack)
        if all(s.num_running == s.num_waiting == 0 for s in stats.values()):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_an_adapter_loaded_at_run_time_serves_then_unloads_everywhere(stack: Serve, adapter: Adapter) -> None:
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapter.path)}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        assert post(stack, path, body, key=None).status_code == 401
    assert [m.id for m in client(stack).models.list().data] == [BASE, "a"]
    prompt = PROMPTS[0]
    expected = tokens(stack, "a", prompt)
    assert expected != tokens(stack, BASE, prompt)  # else a request run without its adapter could pass
    loaded = post(stack, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(adapter.path)})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'a2' added successfully."), stack.log()
    assert [(m.id, m.model_extra["parent"]) for m in client(stack).models.list().data] == [
        (BASE, None), ("a", BASE), ("a2", BASE)]
    assert all(s.lora.adapters == ("a", "a2") for s in engine_stats(stack).values())
    assert tokens(stack, "a2", prompt) == expected

    for body, status, message in (
            ({"lora_name": "a2", "lora_path": str(adapter.path)}, 400, "The lora adapter 'a2' has already been loaded."),
            ({"lora_name": "c", "lora_path": str(adapter.path.parent / "missing")}, 400,
             f"LoRA adapter folder {adapter.path.parent / 'missing'} does not exist"),
            ({"lora_name": "c"}, 400, "lora_path")):
        refused = post(stack, "/v1/load_lora_adapter", body)
        assert refused.status_code == status and message in refused.json()["error"]["message"], refused.text
    unknown = post(stack, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The lora adapter 'c' cannot be found."

    # Unloaded while a request of it streams: that request finishes with it, new ones are refused.
    stream = client(stack).completions.create(model="a2", prompt=PROMPTS[1], max_tokens=48, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    unloaded = post(stack, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'a2' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        tokens(stack, "a2", prompt)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client(stack).models.list().data] == [BASE, "a"]
    for stats in wait_until_idle(stack).values():
        assert stats.lora.adapters == ("a",) and "a2" not in stats.lora.loaded, stats
    assert tokens(stack, "a", prompt) == expected


def test_requests_for_an_adapter_go_to_the_engine_holding_it(stack: Serve) -> None:
    """Fresh prompts, one at a time: no cached prefix and no load tells the engines apart, so only
    the adapter's affinity keeps them on one engine (by turns, they would alternate)."""
    wait_until_idle(stack)
    for prompt in PROMPTS[2:]:
        tokens(stack, "a", prompt, max_tokens=2)
    holding = {name: s.lora.loaded for name, s in wait_until_idle(stack).items()}
    assert sorted(holding.values()) == [(), ("a",)], holding


def test_lora_requests_info_names_the_running_adapter(stack: Serve) -> None:
    stream = client(stack).completions.create(model="a", prompt=PROMPTS[2], max_tokens=64, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    found = {}
    for name in ENGINES:
        with urllib.request.urlopen(stack.services[name]["metrics"], timeout=10) as page:
            found[name] = sorted(dict(labels) for (metric, labels), _ in samples(page.read()).items()
                                 if metric == "vllm:lora_requests_info")
    list(chunks)
    infos = [info for per_engine in found.values() for info in per_engine]
    assert len(infos) == 2, found  # one series per engine: its present state
    assert sorted(i["running_lora_adapters"] for i in infos) == ["", "a"]
    assert {(i["max_lora"], i["waiting_lora_adapters"]) for i in infos} == {("1", "")}


def test_an_engine_back_from_a_restart_gets_the_run_time_adapters_again(stack: Serve, adapter: Adapter) -> None:
    """Last: it kills an engine. kvmesh serve restarts it with its --lora-modules only; the processor
    sees the run-time adapter missing from its stats and loads it there again."""
    loaded = post(stack, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(adapter.path)})
    assert loaded.status_code == 200, loaded.text
    pid = stack.services["engine-1"]["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # the engine's stats once its pair is back; requests for a3 make the processor read them
        try:
            stats = engine_stats(stack)
        except (ConnectionError, TimeoutError):
            stats = {}
        if stats and all(s.lora.adapters == ("a", "a3") for s in stats.values()):
            break
        assert time.monotonic() < deadline, (stats, stack.log())
        with contextlib.suppress(openai.APIError):
            tokens(stack, "a3", PROMPTS[3], max_tokens=1)
        time.sleep(0.2)
    assert gone(pid)
    unloaded = post(stack, "/v1/unload_lora_adapter", {"lora_name": "a3"})
    assert unloaded.status_code == 200, unloaded.text
    for stats in wait_until_idle(stack).values():
        assert stats.lora.adapters == ("a",), stats
