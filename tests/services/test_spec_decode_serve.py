"""`kvmesh serve --speculative-config` with the `openai` client: the answers are those of the engine
without speculation, stop strings cut inside accepted drafts, and the engine exports vLLM's
vllm:spec_decode_* counters."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import LLM, SamplingParams
from services.common.structured_outputs import StructuredOutputs
from tests.services.procs import PYTHON, REPO_ROOT, Serve, client_for, free_port, serving
from tests.unit.test_metrics import samples

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
           "and wrote the weather in a leather book that had belonged to his grandfather.")
PROMPT = f"Copy the text exactly.\nText: {PASSAGE}\nCopy: {PASSAGE[:40]}"


@pytest.fixture(scope="module")
def stack(served_model: str) -> Iterator[Serve]:
    yield from serving(served_model, ["--speculative-config", json.dumps(SPEC)])


def spec_counters(serve: Serve) -> dict[str, float]:
    with urllib.request.urlopen(serve.services["engine"]["metrics"], timeout=10) as response:
        page = response.read().decode()
    values = samples(page)
    counters = {}
    for (name, labels), value in values.items():
        if name.startswith("vllm:spec_decode_"):
            position = dict(labels).get("position")
            counters[name if position is None else f"{name}[{position}]"] = value
    return counters


def test_answers_are_those_without_speculation_and_drafts_are_counted(stack: Serve, offline: LLM):
    client, model = client_for(stack)
    before = spec_counters(stack)
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    [expected] = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))
    assert reply.choices[0].text == expected.outputs[0].text
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
    after = spec_counters(stack)
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0)
    drafted = after["vllm:spec_decode_num_draft_tokens_total"] - before.get("vllm:spec_decode_num_draft_tokens_total", 0)
    assert 10 <= accepted <= drafted
    assert after["vllm:spec_decode_num_drafts_total"] >= 1
    per_pos = [after[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{p}]"] for p in range(4)]
    assert sum(per_pos) == after["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)  # position p is accepted only after p - 1


def test_a_stop_string_inside_accepted_drafts_cuts_the_stream(stack: Serve, offline: LLM):
    client, model = client_for(stack)
    [full] = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40))
    stop = "great lamp"
    assert stop in full.outputs[0].text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
                                       stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.outputs[0].text.split(stop)[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    stack.wait_until_engine_idle()


def test_a_json_schema_answer_is_drafted_and_the_one_without_speculation(stack: Serve, offline: LLM):
    """Structured outputs speculate across the split: the engine sends a mask row per verified
    position over gRPC, and the worker masks each draw with its own."""
    record = {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "city": "London"}
    schema = {"type": "object", "properties": {k: {"type": "integer" if k == "born" else "string"} for k in record},
              "required": list(record), "additionalProperties": False}
    prompt = f"Copy the JSON exactly.\nJSON: {json.dumps(record, separators=(',', ':'))}\nCopy: "
    client, model = client_for(stack)
    before = spec_counters(stack).get("vllm:spec_decode_num_accepted_tokens_total", 0)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=60, temperature=0,
                                      extra_body={"structured_outputs": {"json": schema}})
    [expected] = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured_outputs=(
        StructuredOutputs("json", json.dumps(schema)))))
    assert reply.choices[0].text == expected.outputs[0].text
    assert json.loads(reply.choices[0].text) == record
    assert reply.choices[0].finish_reason == expected.outputs[0].finish_reason == "stop"
    assert spec_counters(stack)["vllm:spec_decode_num_accepted_tokens_total"] - before >= 10
    stack.wait_until_engine_idle()


def test_a_bad_speculative_config_is_a_usage_error(model_path: Path):
    for config, problem in (('{"method": "eagle"}', "speculative method must be one of"),
                            ("{not json", "--speculative-config is not JSON")):
        done = subprocess.run([PYTHON, "-m", "services.cli", "serve", "--model", str(model_path),
                               "--port", str(free_port()), "--speculative-config", config],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert problem in done.stderr, done.stderr[-2000:]
