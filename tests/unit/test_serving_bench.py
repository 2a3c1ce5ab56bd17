"""The serving benchmark's side-by-side bookkeeping: alternated runs keep their own labels, each
kvmesh run is held against the llama-server run of the same number, and only when both sides
completed every request at full length on the same prompts; every server gets the same model,
cache and threads, and every request is greedy, streamed, full length and reports its usage."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx2 as httpx
import pytest

from loadtests.serving_bench import (Summary, anchor_ratios, build_parser, not_comparable, ratios, run_labels,
                                    server_config)
from loadtests.serving_client import Endpoint, RequestResult, send
from loadtests.serving_targets import (LLAMA_SLOT_TOKENS, VLLM_EXTRAS, ServerConfig, TargetUnavailable,
                                       _transformers_extras, server_command, server_env)
from services.worker.loader import resolve_model


def summary(target: str, scenario: str, mode: str, out: float, ttft_p50: float) -> Summary:
    nan3 = (math.nan,) * 3
    return Summary(target, scenario, mode, 8, 8, 1.0, 8.0, out, (ttft_p50, math.nan, math.nan), nan3,
                   (math.nan, math.nan), (math.nan, math.nan), 0, None, 100.0)


def test_a_target_named_twice_runs_twice_numbered():
    assert run_labels(["kvmesh", "llama-server", "llama-server", "kvmesh"]) == [
        ("kvmesh", "kvmesh #1"), ("llama-server", "llama-server #1"),
        ("llama-server", "llama-server #2"), ("kvmesh", "kvmesh #2")]
    assert run_labels(["kvmesh", "inprocess"]) == [("kvmesh", "kvmesh"), ("inprocess", "inprocess")]


def test_each_kvmesh_run_is_held_against_the_anchor_run_of_its_number():
    lines = anchor_ratios([
        summary("kvmesh #1", "short-chat", "c=8", 120.0, 100.0),
        summary("llama-server #1", "short-chat", "c=8", 100.0, 50.0),
        summary("llama-server #2", "short-chat", "c=8", 200.0, 50.0),
        summary("kvmesh #2", "short-chat", "c=8", 100.0, 25.0),
        summary("kvmesh #1", "long-prompt", "c=8", 10.0, 400.0),
        summary("llama-server #1", "long-prompt", "c=8", 10.0, 1000.0),
    ])
    assert lines == [
        "- kvmesh / llama-server, run 1, short-chat c=8: out tok/s 1.20x, TTFT p50 2.00x (goal >= 1.2x: met)",
        "- kvmesh / llama-server, run 2, short-chat c=8: out tok/s 0.50x, TTFT p50 0.50x (goal >= 1.2x: NOT met)",
        "- kvmesh / llama-server, run 1, long-prompt c=8: out tok/s 1.00x, TTFT p50 0.40x "
        "(goal TTFT p50 <= 0.5x: met)",
    ]


def test_no_ratio_unless_both_sides_completed_every_request_at_full_length_on_the_same_prompts():
    def side(target: str, ok: int = 8, wrong_length: int = 0, prompt_tokens: float = 100.0) -> Summary:
        return summary(target, "short-chat", "c=8", 100.0, 50.0)._replace(
            ok=ok, wrong_length=wrong_length, prompt_tokens=prompt_tokens)

    assert not_comparable(side("kvmesh"), side("llama-server", prompt_tokens=101.5)) is None  # within 2 %
    assert "1 of 8 requests failed" in not_comparable(side("kvmesh"), side("llama-server", ok=7))
    assert "not at full length" in not_comparable(side("kvmesh", wrong_length=1), side("llama-server"))
    assert "prompt tokens differ" in not_comparable(side("kvmesh"), side("llama-server", prompt_tokens=103.0))
    assert "no prompt tokens" in not_comparable(side("kvmesh"), side("llama-server", prompt_tokens=math.nan))
    [line] = anchor_ratios([side("kvmesh"), side("llama-server", ok=7)])
    assert "no ratio" in line and "x" not in line.split("(")[0]
    [line, _] = ratios([side("kvmesh"), side("inprocess", wrong_length=2),
                        side("transformers", prompt_tokens=120.0)])
    assert "no ratio" in line and "%" not in line.split("(")[0]


def config(tmp_path: Path, threads: int = 3) -> ServerConfig:
    return ServerConfig("smollm2", "auto", "cpu", 2**30, 32, 2048, 60.0, tmp_path, threads,
                        llama_server_dir=tmp_path, llama_file_type="q4_1", llama_slots=4)


def test_the_command_line_gives_llama_server_its_slots_and_their_context(tmp_path: Path):
    args = build_parser().parse_args(["--llama-server-dir", str(tmp_path), "--llama-file-type", "q8_0",
                                      "--llama-repack", "off"])
    (tmp_path / "llama-build" / "bin").mkdir(parents=True)
    (tmp_path / "llama-build" / "bin" / "llama-server").touch()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-q8_0.gguf").touch()
    llama = server_command("llama-server", server_config(args, tmp_path), 9006)
    assert (flag(llama, "-np"), flag(llama, "-c")) == ("32", str(32 * LLAMA_SLOT_TOKENS)) and "--no-repack" in llama


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_server_gets_the_same_model_cache_and_threads(tmp_path: Path):
    cfg = config(tmp_path)
    kvmesh = server_command("kvmesh", cfg, 9001)
    assert kvmesh[1:5] == ["-m", "services.cli", "serve", "--print-addresses"]
    inprocess = server_command("inprocess", cfg, 9002)
    assert inprocess[1:3] == ["-m", "loadtests.inprocess_server"]
    for command in (kvmesh, inprocess):
        assert (flag(command, "--model"), flag(command, "--dtype"), flag(command, "--host")) == \
            ("smollm2", "auto", "127.0.0.1")
        assert (flag(command, "--kv-cache-memory"), flag(command, "--max-num-seqs"),
                flag(command, "--max-num-batched-tokens")) == (str(2**30), "32", "2048")
    transformers = server_command("transformers", cfg, 9003)
    assert transformers[1:3] == ["serve", str(resolve_model("smollm2"))] and "--continuous-batching" in transformers
    assert flag(transformers, "--cb-max-batch-tokens") == "2048" and int(flag(transformers, "--cb-num-blocks")) > 0
    with pytest.raises(TargetUnavailable, match="build-llama-server.sh"):
        server_command("llama-server", cfg, 9004)  # nothing built in tmp_path yet
    (tmp_path / "llama-build" / "bin").mkdir(parents=True)
    (tmp_path / "llama-build" / "bin" / "llama-server").touch()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-q4_1.gguf").touch()
    llama = server_command("llama-server", cfg, 9004)
    assert (flag(llama, "-t"), flag(llama, "-tb"), flag(llama, "-np"), flag(llama, "-c")) == ("3", "3", "4", "8192")
    assert flag(llama, "-m").endswith("smollm2-q4_1.gguf") and "-cb" in llama
    env = server_env(cfg, {"OMP_NUM_THREADS": "64", "PATH": "/bin"})
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["PATH"]) == ("3", "3", "/bin")


def test_every_request_is_greedy_streamed_at_full_length_with_usage():
    seen: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        chunks = [{"choices": [{"delta": {"content": "hi"}}]},
                  {"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 9}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def run(extra_body: dict) -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await send(client, Endpoint("http://x", "m", extra_body), [{"role": "user", "content": "q"}], 4, 5.0)

    result = asyncio.run(run(VLLM_EXTRAS))
    assert result.ok and (result.output_tokens, result.prompt_tokens) == (4, 9)
    assert seen[-1] == {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 4,
                        "temperature": 0.0, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
    asyncio.run(run(_transformers_extras()))
    assert json.loads(seen[-1]["generation_config"]) == {"eos_token_id": -1, "do_sample": False}


def test_a_stream_without_usage_is_a_failed_request():
    def answer(request: httpx.Request) -> httpx.Response:
        body = f"data: {json.dumps({'choices': [{'delta': {'content': 'hi'}}]})}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def run() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await send(client, Endpoint("http://x", "m", {}), [{"role": "user", "content": "q"}], 4, 5.0)

    result = asyncio.run(run())
    assert not result.ok and "no usage" in result.error
