"""The engine's side of tensor parallelism: the GroupWorkerClient over real worker
processes, the offline `LLM` with worker processes, and `kvmesh serve --tensor-parallel-size 2`
end to end, whose supervisor restarts an engine with all its workers when one rank dies.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import openai
import pytest

from services import LLM, SamplingParams
from services.common.config import SchedulerConfig
from services.common.engine_output import EngineCoreRequest
from services.engine.engine_core import EngineCore
from services.engine.executor import GroupWorkerClient
from services.worker.client import GrpcWorkerClient
from tests.services.procs import (
    SHARED_MAX_MODEL_LEN,
    Serve,
    ServiceProcess,
    child_processes,
    client_for,
    gone,
    http_ok,
    running_kvmesh,
    serve_child_pid,
    serving,
)
from tests.services.test_serve_fleet import LIVENESS, RECOVERY_SECONDS, argv_of, flag_values

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def running_worker(served_model: str, kv_cache_memory: int) -> AbstractContextManager[ServiceProcess]:
    # --owner-lease 0: a new engine session may take a worker over as soon as the last one let go.
    return running_kvmesh("worker", model=served_model, dtype="float32", max_model_len=SHARED_MAX_MODEL_LEN,
                          kv_cache_memory=kv_cache_memory, owner_lease=0)


@pytest.fixture(scope="module")
def two_workers(served_model: str) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """Two workers of size 1 with KV caches of different sizes."""
    with running_worker(served_model, 32 * 2**20) as a, running_worker(served_model, 16 * 2**20) as b:
        yield a, b


def greedy_tokens(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineCoreRequest(str(i), prompt, GREEDY))
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.check_integrity()
    return [tokens[str(i)] for i in range(len(prompts))]


def test_a_group_checks_its_workers_fans_each_step_out_and_fails_with_any_rank(two_workers, offline: LLM):
    a, b = two_workers
    prompts = [offline.get_tokenizer().encode(p) for p in PROMPTS]
    truth = [o.outputs[0].token_ids for o in offline.generate([list(p) for p in prompts], GREEDY)]
    group = GroupWorkerClient([GrpcWorkerClient(a.address, timeout=30), GrpcWorkerClient(b.address, timeout=30)])
    try:
        # Two workers that each run alone are no group: refused before anything is allocated.
        with pytest.raises(ValueError, match="tensor-parallel size of \\[1\\]"):
            group.get_info()
        # Each rank sized its own cache; they disagree, and the group says so with the numbers.
        with pytest.raises(RuntimeError, match="disagree on the KV cache's size") as error:
            group.initialize_cache(4)
        num_blocks = [int(n) for n in str(error.value).split("[")[1].split("]")[0].split(",")]
        assert num_blocks[0] > num_blocks[1] > 0  # 32MiB, 16MiB (less what each holds back)

        # Every step goes to both (each holds the same persistent batch, or its next step's diff
        # would be refused); rank 0's output is the step's.
        engine = EngineCore(group, group.ranks[0].get_info(), num_blocks[1], SchedulerConfig(max_num_seqs=4))
        assert greedy_tokens(engine, prompts) == truth
        group.check_alive()

        b.kill()  # rank 1 dies: the next step fails, as a step does with one worker gone
        engine.add_request(EngineCoreRequest("after", prompts[0], GREEDY))
        with pytest.raises(ConnectionError):
            engine.step()
        with pytest.raises(ConnectionError):
            group.check_alive()
    finally:
        group.close()

    # A group of one is today's engine: the same tokens, through the same client.
    one = GroupWorkerClient([GrpcWorkerClient(a.address, timeout=30)])
    try:
        engine = EngineCore.create(one, SchedulerConfig(max_num_seqs=4), executor=one)
        assert len(engine.kv_cache_manager.block_pool.blocks) == num_blocks[0]
        assert greedy_tokens(engine, prompts) == truth
    finally:
        one.close()


def test_a_group_refuses_to_be_empty():
    with pytest.raises(ValueError, match="at least one worker"):
        GroupWorkerClient([])


def worker_children() -> set[int]:
    """This process's `kvmesh worker` children."""
    return {pid for pid, argv in child_processes(os.getpid()) if argv[2:4] == ["services.cli", "worker"]}


def test_an_llm_whose_workers_fail_to_start_raises_and_leaves_none_behind(tmp_path: Path):
    before = worker_children()
    with pytest.raises(RuntimeError, match="2 worker processes of the tensor-parallel group did not start"):
        LLM(model=str(tmp_path / "no-such-model"), dtype="float32", tensor_parallel_size=2)
    assert worker_children() - before == set()


# ----------------------------------------------------------------------------- TP=2, end to end


@pytest.mark.slow
def test_llm_with_two_worker_processes_matches_one(served_model: str, offline: LLM):
    """`LLM(tensor_parallel_size=2)`: two worker processes give the greedy tokens of one."""
    truth = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)]
    with LLM(model=served_model, dtype="float32", tensor_parallel_size=2, kv_cache_memory=offline.args.cache.kv_cache_memory,
             max_model_len=SHARED_MAX_MODEL_LEN) as llm:
        pids = llm._worker_processes.pids
        assert len(pids) == 2
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == truth
    assert all(gone(pid) for pid in pids)


GROUP = ("worker-r0", "worker-r1", "engine")


@pytest.fixture(scope="module")
def tp2(served_model: str) -> Iterator[Serve]:
    yield from serving(served_model, ["--tensor-parallel-size", "2", "--max-model-len", str(SHARED_MAX_MODEL_LEN),
                                    *LIVENESS])


def assert_matches(serve: Serve, truth: list[list[int]]) -> None:
    client, model = client_for(serve)
    for prompt, tokens in zip(PROMPTS, truth):
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert completion.choices[0].token_ids == tokens


@pytest.mark.slow
def test_serve_with_tensor_parallel_size_2_matches_one(tp2: Serve, offline: LLM):
    """`kvmesh serve --tensor-parallel-size 2` with the openai client: the greedy tokens of the
    in-process TP=1 stack."""
    assert set(tp2.services) == {*GROUP, "processor", "gateway"}
    engine_argv = argv_of(serve_child_pid(tp2, "engine"))
    assert flag_values(engine_argv, "--worker-address") == [tp2.services[w]["address"] for w in GROUP[:2]]
    assert_matches(tp2, [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)])


@pytest.mark.slow
def test_a_dead_rank_fails_its_stream_and_restarts_the_whole_group(tp2: Serve, offline: LLM):
    """Rank 1 killed mid-stream: the stream ends with an error (there is no other engine to migrate
    to) rather than hanging, the engine and both ranks are restarted on the same ports, the old
    processes are gone, and the group serves the same tokens again."""
    before = {name: serve_child_pid(tp2, name) for name in GROUP}
    client, model = client_for(tp2, timeout=60)  # far longer than the group's timeout (10 s)
    stream = iter(client.completions.create(model=model, prompt="Once upon a time", max_tokens=200,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    os.kill(before["worker-r1"], signal.SIGKILL)
    with pytest.raises(openai.APIError) as error:
        for _ in stream:
            pass
    assert not isinstance(error.value, openai.APITimeoutError)
    deadline = time.monotonic() + RECOVERY_SECONDS
    while "worker-r0, worker-r1 and engine are serving again" not in tp2.log():
        assert tp2.proc.poll() is None, tp2.log()
        assert time.monotonic() < deadline, f"the group did not come back:\n{tp2.log()}"
        time.sleep(0.5)
    # As a client would: once /health says so (the processor has reached the restarted engine again).
    while not http_ok(tp2.api.removesuffix("/v1") + "/health"):
        assert time.monotonic() < deadline, f"/health did not come back:\n{tp2.log()}"
        time.sleep(0.5)
    after = {name: serve_child_pid(tp2, name) for name in GROUP}
    assert all(after[name] != before[name] and gone(before[name]) for name in GROUP), (before, after)
    assert_matches(tp2, [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)])
