"""Tensor parallelism inside the worker: two `kvmesh worker` processes form a gloo group
(CPU, float32), each driven by its own GrpcWorkerClient; an EngineCore in the test sends every step
to both at once (a small fan-out executor, as the engine's does) and reads rank 0's tokens.

  - the engine's equivalence prompts (batched, chunked prefill, prefix hits, preemption) give the
    same greedy tokens at TP=2 as at TP=1 and as Hugging Face, logprobs within 1e-3, with the
    default model's weights in their GGUF blocks as a CPU serves them;
  - each rank holds its shards only (their shapes), and about half of the weights' memory;
  - a killed rank makes the other's next step fail within the group timeout, and that rank exits.
"""

from __future__ import annotations

import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from services.common.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, WorkerConfig,
                                    default_cache_dir)
from services.common.engine_output import EngineCoreRequest
from services.common.model_files import DEFAULT_MODEL
from services.common.model_runner_output import ModelRunnerOutput
from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import SchedulerOutput
from services.engine.engine_core import EngineCore
from services.processor.tokenizer import apply_chat_template
from services.worker.client import GrpcWorkerClient, InProcessWorkerClient
from services.worker.gguf_weights import gguf_weights_for
from services.worker.loader import load_model
from services.worker.parallel_group import TensorParallelGroup, free_loopback_address
from services.worker.worker import Worker
from tests.model.families import Family, random_prompts
from tests.model.hf_reference import HFReference
from tests.model.prompts import conversations, long_text, raw_prompts
from tests.services.procs import ServiceProcess, free_port, start_service, worker_command

pytestmark = pytest.mark.slow  # torch.distributed groups of worker processes

MAX_NEW_TOKENS = 12
LOGPROB_TOL = 1e-3
NEAR_TIE_GAP = 1e-4
BLOCK_SIZE = 16
# Rank 0 holds 2 of SmolLM2's 3 KV heads: a block is 2 (K, V) x 30 layers x 16 tokens x 2 heads x 64 x 4 bytes.
RANK0_BLOCK_BYTES = 2 * 30 * BLOCK_SIZE * 2 * 64 * 4
SCHEDULER = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_num_waiting=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5, ignore_eos=True)


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per position: token id -> logprob
    num_cached_tokens: int = 0


class FanOutExecutor:
    """Every step to every rank at once; rank 0's output is the step's. The other ranks must answer
    for the same requests, in the same order, without tokens."""

    def __init__(self, clients: list) -> None:
        self.clients = clients
        self.pool = ThreadPoolExecutor(len(clients))
        self.follower_outputs: list[ModelRunnerOutput] = []

    def each(self, method: str, *args: object) -> list:
        return [f.result() for f in [self.pool.submit(getattr(c, method), *args) for c in self.clients]]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        driver, *followers = self.each("execute_model", scheduler_output)
        for out in followers:
            assert out.req_ids == driver.req_ids and out.sampled_token_ids == []
        return driver

    def engine(self, scheduler_config: SchedulerConfig) -> EngineCore:
        infos = self.each("get_info")
        assert [(i.rank, i.world_size) for i in infos] == [(r, len(self.clients)) for r in range(len(self.clients))]
        num_blocks = self.each("initialize_cache", scheduler_config.max_num_seqs)
        assert len(set(num_blocks)) == 1, f"the ranks disagree on the KV cache: {num_blocks}"
        return EngineCore(self, infos[0], num_blocks[0], scheduler_config)

    def close(self) -> None:
        self.pool.shutdown()
        for c in self.clients:
            c.close()


def start_group(model: str | Path, size: int, kv_bytes: int, timeout: float,
                attention_backend: str = "auto") -> list[ServiceProcess]:
    """`size` worker processes of one group, started together (rank 0 waits for the others)."""
    address = free_loopback_address()
    # Triton's kernels run on the CPU under its interpreter, chosen before they are imported.
    env = {"TRITON_INTERPRET": "1"} if attention_backend == "triton" else None

    def start(rank: int) -> ServiceProcess:
        port = free_port()
        return start_service(worker_command(model=model, dtype="float32", port=port, kv_cache_memory=kv_bytes,
                                            tensor_parallel_size=size, rank=rank, distributed_address=address,
                                            distributed_timeout=timeout, attention_backend=attention_backend),
                             port, env=env)

    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(start, r) for r in range(size)]
        return [f.result() for f in futures]


def generate(engine: EngineCore, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Generated]:
    results = {str(i): Generated() for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineCoreRequest(str(i), prompt, params, (2,)))
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            results[out.request_id].token_ids += out.new_token_ids
            results[out.request_id].logprobs += [dict(zip(lp.token_ids, lp.logprobs)) for lp in out.new_logprobs]
            results[out.request_id].num_cached_tokens = max(results[out.request_id].num_cached_tokens,
                                                            out.num_cached_tokens)
        engine.check_integrity()
    manager = engine.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == len(manager.block_pool.blocks)
    return [results[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts(model_path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # Every length class of the equivalence prompts once (tests/model/test_hf_equivalence.py runs them
    # all at TP=1): 1, 12, 268 and 1,394 tokens (the longest, whose room in the KV cache leaves too
    # little for the others: preemption), two chats (39 and 245 tokens).
    chats = [apply_chat_template(tokenizer, c) for c in conversations()]
    raws = sorted((tokenizer.encode(p) for p in raw_prompts()), key=len)
    prefix = tokenizer.encode(long_text(9))[:300]  # two prompts that share 18 full blocks: a prefix hit
    shared = [prefix + tokenizer.encode(" Question one: what is this about?"),
              prefix + tokenizer.encode(" Question two: who wrote it?")]
    return [chats[0], chats[-1], raws[0], raws[len(raws) // 2], raws[-3], raws[-1], *shared]


def preempting_num_blocks(prompts: list[list[int]]) -> int:
    """Room for the longest prompt and its output, far less than all prompts together."""
    return -(-(max(map(len, prompts)) + MAX_NEW_TOKENS) // BLOCK_SIZE) + 8


@pytest.fixture(scope="module")
def tp1_outputs(prompts: list[list[int]]) -> list[Generated]:
    # The same number of blocks as at TP=2 (a whole block holds 3 KV heads, rank 0's 2): the same schedule.
    kv_bytes = preempting_num_blocks(prompts) * RANK0_BLOCK_BYTES * 3 // 2
    worker = Worker(ModelConfig(model=DEFAULT_MODEL, dtype="float32"), CacheConfig(kv_cache_memory=kv_bytes),
                    WorkerConfig())
    client = InProcessWorkerClient(worker)
    engine = EngineCore.create(client, SCHEDULER, executor=client)
    return generate(engine, prompts)


def compare_to_reference(ours: Generated, ref_tokens: list[int], ref_logprobs: list[dict[int, float]] | torch.Tensor,
                         label: str, teacher_forced: bool = False, length: int = MAX_NEW_TOKENS) -> int:
    """Asserts full-length outputs, equal greedy tokens and logprobs within LOGPROB_TOL; returns how
    often the sequences part at a near-tie of the reference (top-2 within NEAR_TIE_GAP). A free-running
    reference (another engine's output) is compared up to the first parting; a teacher-forced one
    (Hugging Face scoring our own prefix) at every position."""
    assert len(ours.token_ids) == length, f"{label}: {len(ours.token_ids)} tokens (EOS is ignored)"
    ref_tokens = ref_tokens[:length]
    partings = 0
    for i, (a, b) in enumerate(zip(ours.token_ids, ref_tokens)):
        for token_id, lp in ours.logprobs[i].items():
            ref = ref_logprobs[i][token_id]
            ref = ref.item() if isinstance(ref, torch.Tensor) else ref
            assert abs(lp - ref) < LOGPROB_TOL, f"{label}, position {i}: logprob of {token_id} {lp} vs {ref}"
        if a != b:
            gap = abs(ours.logprobs[i][a] - ours.logprobs[i].get(b, float("-inf")))
            assert gap < NEAR_TIE_GAP, f"{label}, position {i}: {a} vs {b} is no near-tie (gap {gap})"
            partings += 1
            if not teacher_forced:
                return partings  # the two prefixes differ from here on: nothing more to compare
    if not partings:
        assert ours.token_ids == ref_tokens, label
    return partings


def test_tp2_matches_tp1_and_hugging_face(prompts: list[list[int]], tp1_outputs: list[Generated],
                                          hf_reference: HFReference):
    with ExitStack() as exits:
        ranks = start_group(DEFAULT_MODEL, 2, preempting_num_blocks(prompts) * RANK0_BLOCK_BYTES, timeout=30.0)
        for rank in ranks:
            exits.callback(rank.kill)
        executor = FanOutExecutor([GrpcWorkerClient(r.address) for r in ranks])
        exits.callback(executor.close)
        engine = executor.engine(SCHEDULER)
        outputs = generate(engine, prompts)
        assert engine.stats().num_preemptions > 0, "the small KV cache should have forced preemption"
        assert engine.kv_cache_manager.block_pool.get_num_free_blocks() == preempting_num_blocks(prompts)
    partings = 0
    for i, (prompt, ours, tp1) in enumerate(zip(prompts, outputs, tp1_outputs)):
        partings += compare_to_reference(ours, tp1.token_ids, tp1.logprobs, f"prompt {i} vs TP=1")
        ref = hf_reference(prompt, ours.token_ids)
        partings += compare_to_reference(ours, ref.token_ids, ref.logprobs, f"prompt {i} vs Hugging Face",
                                         teacher_forced=True)
    print(f"TP=2: {len(prompts)} prompts, {partings} near-tie partings, "
          f"{engine.stats().num_preemptions} preemptions")
    assert partings <= 2
    assert sum(o.num_cached_tokens for o in outputs) > 0, "no prefix hit"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_takes_sharded_heads(model_families: dict[str, Family], backend: str):
    """The run above uses the `cpu` backend; the others on a tiny Mistral (tests/model/families.py:
    4 query heads over 2 KV heads, one of each pair per rank, a 16-token window the long prompt
    crosses), its prompts prefilled in 16-token chunks: Triton's interpreter runs each kernel's
    programs in Python, seconds a step on the default model."""
    family = model_families["mistral"]
    prompts = random_prompts((5, 40), seed=3)
    with ExitStack() as exits:
        ranks = start_group(family.path, 2, 64 * family.block_bytes, 30.0, backend)
        for rank in ranks:
            exits.callback(rank.kill)
        executor = FanOutExecutor([GrpcWorkerClient(r.address) for r in ranks])
        exits.callback(executor.close)
        outputs = generate(executor.engine(replace(SCHEDULER, max_num_batched_tokens=16)), prompts)
    partings = 0
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        ref = family.reference(prompt, ours.token_ids)
        partings += compare_to_reference(ours, ref.token_ids, ref.logprobs, f"{backend}: prompt {i}",
                                         teacher_forced=True)
    print(f"{backend}: {len(prompts)} prompts, {partings} near-tie partings")
    assert partings <= 1, f"{partings} partings in {len(prompts)} prompts: more than float noise"


# --- the shards each rank holds ---------------------------------------------------------------------


def _load_rank(rank: int, size: int, address: str, model_path: str, results: dict) -> None:
    """In a spawned process: join the group and load this rank's shards as floats from the converted
    folder (their shapes, the memory they took), then kept in the GGUF file's blocks (how many
    weights stay in blocks, and whether each equals its float shard bit for bit)."""
    torch.set_num_threads(1)
    before = _anon_rss()
    tp = TensorParallelGroup.create(ParallelConfig(size, rank, address, 30.0), torch.device("cpu"))
    cpu = torch.device("cpu")
    floats, _ = load_model(Path(model_path), torch.float32, cpu, tp)
    rss = _anon_rss() - before
    float_modules = dict(floats.named_modules())
    blocks, _ = load_model(Path(model_path), torch.float32, cpu, tp,
                           gguf_weights_for("gguf", "smollm2", cpu, torch.float32, default_cache_dir()))
    kept = [(name, m.block_weight) for name, m in blocks.named_modules() if getattr(m, "block_weight", None)]
    results[rank] = ({n: tuple(p.shape) for n, p in floats.named_parameters()}, rss,
                     sum(p.numel() * p.element_size() for p in floats.parameters()),
                     len(kept), all(torch.equal(w.dequantize(), float_modules[name].weight) for name, w in kept))
    tp.close()


def _anon_rss() -> int:
    """This process's anonymous resident memory (what it allocated; not the mapped files)."""
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def load_in_processes(model_path: Path, size: int) -> dict:
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        address = free_loopback_address()
        procs = [context.Process(target=_load_rank, args=(r, size, address, str(model_path), results))
                 for r in range(size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
        return dict(results)


def test_each_rank_holds_its_shards_in_the_gguf_blocks_and_half_the_weights(model_path: Path):
    ranks = load_in_processes(model_path, 2)
    with safe_open(model_path / "model.safetensors", framework="pt") as f:  # the whole model, float32
        full_bytes = sum(math.prod(f.get_slice(name).get_shape()) * 4 for name in f.keys())
    layer = "model.layers.0."
    # 9 q heads and 3 KV heads of 64: rank 0 takes KV heads 0-1 with their 6 q heads, rank 1 KV head 2 with 3.
    assert ranks[0][0][layer + "self_attn.qkv_proj.weight"] == ((6 + 2 + 2) * 64, 576)
    assert ranks[1][0][layer + "self_attn.qkv_proj.weight"] == ((3 + 1 + 1) * 64, 576)
    assert ranks[0][0][layer + "self_attn.o_proj.weight"] == (576, 6 * 64)
    assert ranks[1][0][layer + "self_attn.o_proj.weight"] == (576, 3 * 64)
    for rank in (0, 1):
        shapes, rss, weight_bytes, num_kept, equal = ranks[rank]
        assert shapes[layer + "mlp.gate_up_proj.weight"] == (2 * 768, 576)
        assert shapes[layer + "mlp.down_proj.weight"] == (576, 768)
        assert shapes["model.embed_tokens.weight"] == (49152 // 2, 576)
        assert shapes[layer + "input_layernorm.weight"] == (576,)  # norms are whole on every rank
        print(f"rank {rank}/2: weights {weight_bytes / 2**20:.1f} MiB, anon RSS +{rss / 2**20:.1f} MiB; "
              f"the whole model: {full_bytes / 2**20:.1f} MiB")
        assert 0.3 < weight_bytes / full_bytes < 0.6
        assert rss < 0.7 * full_bytes, "a rank should hold about half of the weights, never the whole model"
        # Rows of q|k|v by KV head, o_proj's and down_proj's columns (384 / 192, 768: whole blocks of 32),
        # half the vocabulary each: every weight of both ranks stays in blocks, equal to its float shard.
        assert (num_kept, equal) == (1 + 4 * 30, True)


# --- a dead peer ---------------------------------------------------------------------------------------


def test_killed_rank_fails_the_next_step_and_the_other_exits(model_path: Path):
    timeout = 5.0
    with ExitStack() as exits:
        ranks = start_group(model_path, 2, 64 * RANK0_BLOCK_BYTES, timeout)
        for rank in ranks:
            exits.callback(rank.kill)
        executor = FanOutExecutor([GrpcWorkerClient(r.address) for r in ranks])
        exits.callback(executor.close)
        engine = executor.engine(SCHEDULER)
        engine.add_request(EngineCoreRequest("a", [1, 2, 3, 4, 5], GREEDY, (2,)))
        engine.step()
        os.kill(ranks[1].proc.pid, signal.SIGKILL)
        ranks[1].proc.wait()
        start = time.monotonic()
        with pytest.raises(ConnectionError):
            executor.clients[0].execute_model(engine.schedule())
        assert time.monotonic() - start < timeout + 5
        assert ranks[0].proc.wait(timeout=30) == 1, ranks[0].log()
        assert "tensor-parallel group failed" in ranks[0].log()
