"""Everything a lent GPU (an H200) should tell us about the Triton attention path, in one command
of under 8 minutes:

  1. the kernel tests, compiled on CUDA: the paged attention and cache kernels, the Triton backend
     and the LoRA kernels (only tests/kernels/conftest.py is loaded, so the services' HTTP stack
     need not be installed there);
  2. a device-to-device copy, the bandwidth the attention kernels are measured against;
  3. decode attention (Llama-3-8B heads: 32 query, 8 KV, 128 wide, bfloat16, blocks of 16) at
     batch x context sizes, against torch's scaled_dot_product_attention on the same K/V laid out
     contiguously: median time (CUDA events), achieved bandwidth, share of the copy bandwidth; the
     largest difference from SDPA must stay within the kernel tests' bfloat16 tolerance;
  4. prefill attention (causal, no cached context), same comparison, in TFLOP/s, same tolerance;
  5. the engine against transformers, compiled: a random Llama and a random Mistral (a 16-token
     sliding window) in float32, one batch chunked and preempted in a small KV cache, every greedy
     token equal to transformers' argmax after the engine's own prefix (teacher forcing);
  6. the LoRA kernels (punica's shrink and expand) at Llama-3-8B's qkv shapes, 8 adapters over 256
     rows, against the per-segment torch reference: time and largest difference;
  7. the engine end to end (scheduler, model runner, Triton backend) on a randomly initialised
     Llama-3-8B-shaped model in bfloat16 (no weights to download) at batch 1, 32 and 256:
     128-token prompts, 128 new tokens each, output tokens/s and the median decode step.

With --smoke everything runs on the CPU with tiny shapes under Triton's interpreter, in under two
minutes (tests/kernels/test_gpu_check_smoke.py runs it, so the script cannot rot). A section that
fails is reported with its traceback and the others still run; the exit status says whether all
passed. The report is Markdown, printed and written to --out.

    python scripts/gpu_check.py --out $OUT/gpu_check.md      # on the GPU machine
    python scripts/gpu_check.py --smoke --out /tmp/gpu_check.md
"""

from __future__ import annotations

import os
import sys

# Triton fixes compiled-or-interpreted when the kernels are imported (kvmesh_kernels/interpreter.py):
# decide before any import of ours.
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM as HFLlama, MistralConfig, MistralForCausalLM  # noqa: E402

from kvmesh_kernels.lora import lora_expand_, lora_shrink  # noqa: E402
from kvmesh_kernels.paged_attention import (  # noqa: E402
    AttentionParams, PagedBatch, choose_num_splits, device_num_sms, paged_attention,
)
from services.common.clients import WorkerInfo  # noqa: E402
from services.common.config import CacheConfig, SchedulerConfig  # noqa: E402
from services.common.engine_output import EngineCoreRequest  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.engine.engine_core import EngineCore  # noqa: E402
from services.worker.attention import get_attention_backend  # noqa: E402
from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for_budget  # noqa: E402
from services.worker.loader import load_model  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.models.llama import LlamaForCausalLM, head_size_of  # noqa: E402
from tests.model.hf_reference import HFReference  # noqa: E402


class HFRun(NamedTuple):
    prompts: tuple[int, ...]  # lengths; the longest cross the window and the step's token budget
    new_tokens: int
    kv_blocks: int  # fewer than the batch needs: it is preempted


class Sizes(NamedTuple):
    """What --smoke shrinks."""

    pytest_args: list[str]
    hf_shape: dict  # the random Llama's and Mistral's config arguments (section 5)
    hf_run: HFRun  # its prompts, new tokens and KV blocks
    lora: tuple[int, int, int, int, int]  # rows, in features, out features, rank, adapters (section 6)
    copy_bytes: int
    heads: tuple[int, int, int]  # num_heads, num_kv_heads, head_size
    decode_cases: list[tuple[int, int]]  # (batch, context)
    prefill_cases: list[tuple[int, int]]  # (batch, prompt length)
    iters: int
    model: dict  # LlamaConfig arguments
    engine_batches: list[int]
    prompt_len: int
    output_len: int
    kv_cache_bytes: int


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)

# Only the kernels' conftest: the root one starts the services' HTTP stack for other tiers.
CONFTEST = ["--confcutdir", "tests/kernels"]
FULL = Sizes(
    pytest_args=[*CONFTEST, "-n", "8", "tests/kernels/test_paged_attention.py",
                 "tests/kernels/test_reshape_and_cache.py",
                 "tests/kernels/test_triton_backend.py", "tests/kernels/test_lora_kernels.py"],
    hf_shape=dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    hf_run=HFRun((3, 15, 17, 33, 40, 61), 20, 8),  # the longest prompt and its output take 6 blocks
    lora=(256, 4096, 6144, 16, 8),
    copy_bytes=2**30,
    heads=(32, 8, 128),
    decode_cases=[(1, 4096), (1, 32768), (32, 1024), (32, 4096), (256, 1024), (256, 4096)],
    prefill_cases=[(1, 8192), (4, 2048), (32, 512)],
    iters=20,
    model=LLAMA3_8B,
    engine_batches=[1, 32, 256],
    prompt_len=128,
    output_len=128,
    kv_cache_bytes=16 * 2**30,
)
SMOKE = Sizes(
    pytest_args=[*CONFTEST, "tests/kernels/test_reshape_and_cache.py", "-k", "padding"],
    hf_shape=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    hf_run=HFRun((3, 17, 40), 6, 4),  # 6 blocks asked of 4
    lora=(12, 64, 96, 8, 3),
    copy_bytes=16 * 2**20,
    heads=(4, 2, 64),
    decode_cases=[(2, 64), (1, 300)],
    prefill_cases=[(1, 48)],
    iters=2,
    model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False),
    engine_batches=[1, 4],
    prompt_len=12,
    output_len=4,
    kv_cache_bytes=8 * 2**20,
)
DTYPE = torch.bfloat16
BLOCK_SIZE = 16
# The largest |Triton - SDPA| allowed: the kernel tests' bfloat16 bound (tests/kernels/paged_inputs.py),
# about four bfloat16 ulps at 1.0; the outputs here are averages of unit-normal values.
MAX_ABS_DIFF = 3e-2


def check_differences(lines: list[str], diffs: list[float]) -> list[str]:
    """`lines`, or AssertionError carrying them when a difference is over MAX_ABS_DIFF (or NaN)."""
    bad = [d for d in diffs if not d <= MAX_ABS_DIFF]
    if bad:
        raise AssertionError("\n".join(lines) + f"\nmax abs diff over {MAX_ABS_DIFF:g}: {bad}")
    return lines


def median_seconds(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median of `iters` timed calls after one warm-up (which also compiles the kernels)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- sections: each returns Markdown lines ------------------------------------------------------------

def environment(device: torch.device, smoke: bool) -> list[str]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    lines = [f"- device: {name}, {device_num_sms(device)} SMs" if device.type == "cuda" else f"- device: {name}",
             f"- torch {torch.__version__}, triton {triton.__version__}, mode: {'smoke' if smoke else 'full'}"]
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        lines.append(f"- memory: {total / 2**30:.0f} GiB ({free / 2**30:.0f} GiB free)")
    return lines


def kernel_tests(sizes: Sizes) -> list[str]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sizes.pytest_args],
                            cwd=REPO, env=os.environ.copy(), capture_output=True, text=True, timeout=300)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    if result.returncode != 0:
        raise RuntimeError(f"kernel tests failed: {summary}\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}")
    return [f"- `pytest {' '.join(sizes.pytest_args)}`: {summary} ({time.perf_counter() - start:.0f} s wall)"]


def copy_bandwidth(device: torch.device, sizes: Sizes) -> float:
    """Bytes read + written per second by a plain device copy."""
    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * sizes.copy_bytes / median_seconds(lambda: dst.copy_(src), device, sizes.iters)


def paged_inputs(batch: int, seq_len: int, q_len: int, sizes: Sizes, device: torch.device):
    """Random K/V for `batch` sequences of `seq_len` tokens in shuffled blocks, the last `q_len` of
    each the new tokens; also the same K/V contiguous ([batch, num_kv_heads, seq_len, head_size])
    for scaled_dot_product_attention."""
    num_heads, num_kv_heads, head_size = sizes.heads
    blocks_per_seq = triton.cdiv(seq_len, BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size), dtype=DTYPE, device=device)
    block_table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    q = torch.randn((batch * q_len, num_heads, head_size), dtype=DTYPE, device=device)
    paged = PagedBatch(
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_table=block_table, max_query_len=q_len, max_seq_len=seq_len,
    )

    def contiguous(i: int) -> torch.Tensor:
        rows = kv_cache[i][block_table.long()].view(batch, blocks_per_seq * BLOCK_SIZE, num_kv_heads, head_size)
        return rows[:, :seq_len].transpose(1, 2).contiguous()

    return q, kv_cache, paged, contiguous(0), contiguous(1)


def decode_attention(device: torch.device, sizes: Sizes, copy_bw: float) -> list[str]:
    num_heads, num_kv_heads, head_size = sizes.heads
    params = AttentionParams(scale=head_size**-0.5)
    lines = ["| batch | context | splits | Triton µs | GB/s | % of copy | SDPA µs | SDPA / Triton | max abs diff |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    diffs = []
    for batch, context in sizes.decode_cases:
        q, kv_cache, paged, k, v = paged_inputs(batch, context, 1, sizes, device)
        out = torch.empty_like(q)
        splits = choose_num_splits(batch, num_kv_heads, 1, context, device_num_sms(device))
        ours = median_seconds(lambda: paged_attention(q, kv_cache, out, paged, params), device, sizes.iters)
        qs = q.view(batch, num_heads, 1, head_size)
        sdpa = median_seconds(lambda: F.scaled_dot_product_attention(qs, k, v, scale=params.scale, enable_gqa=True),
                              device, sizes.iters)
        expected = F.scaled_dot_product_attention(qs, k, v, scale=params.scale, enable_gqa=True)
        diff = (out.float() - expected.view_as(out).float()).abs().max().item()
        diffs.append(diff)
        moved = 2 * batch * context * num_kv_heads * head_size * kv_cache.element_size()  # K and V, read once
        lines.append(f"| {batch} | {context} | {splits} | {ours * 1e6:.0f} | {moved / ours / 1e9:.0f} | "
                     f"{100 * moved / ours / copy_bw:.0f} | {sdpa * 1e6:.0f} | {sdpa / ours:.2f} | {diff:.1e} |")
        del q, kv_cache, paged, k, v, out
    return check_differences(lines, diffs)


def prefill_attention(device: torch.device, sizes: Sizes) -> list[str]:
    num_heads, num_kv_heads, head_size = sizes.heads
    params = AttentionParams(scale=head_size**-0.5)
    lines = ["| batch | prompt | Triton ms | TFLOP/s | SDPA ms | SDPA TFLOP/s | max abs diff |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    diffs = []
    for batch, length in sizes.prefill_cases:
        q, kv_cache, paged, k, v = paged_inputs(batch, length, length, sizes, device)
        out = torch.empty_like(q)
        ours = median_seconds(lambda: paged_attention(q, kv_cache, out, paged, params), device, sizes.iters)
        qs = q.view(batch, length, num_heads, head_size).transpose(1, 2)

        def sdpa_call() -> torch.Tensor:
            return F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=params.scale, enable_gqa=True)

        sdpa = median_seconds(sdpa_call, device, sizes.iters)
        diff = (out.float() - sdpa_call().transpose(1, 2).reshape_as(out).float()).abs().max().item()
        diffs.append(diff)
        flops = 4 * batch * num_heads * head_size * length * (length + 1) / 2  # causal: half the scores
        lines.append(f"| {batch} | {length} | {ours * 1e3:.2f} | {flops / ours / 1e12:.1f} | {sdpa * 1e3:.2f} | "
                     f"{flops / sdpa / 1e12:.1f} | {diff:.1e} |")
        del q, kv_cache, paged, k, v, out
    return check_differences(lines, diffs)


WINDOW = 16  # the random Mistral's sliding window: one KV block, crossed by the prompts
HF_STEP_TOKENS = 24  # a step's token budget: the longer prompts are prefilled in chunks next to decodes
NEAR_TIE = 1e-3  # a parting where transformers' top two logprobs are this close is float noise


def random_hf_model(model_class, config, folder: Path, device: torch.device):
    """A transformers model with every weight from N(0, 0.5) (logits spread wide: few near ties),
    saved to `folder`, in float32 on `device`."""
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model.to(device)


def greedy_batch(folder: Path, device: torch.device, prompts: list[list[int]], run: HFRun
                 ) -> tuple[list[list[int]], int]:
    """Our engine's greedy tokens for `prompts`, Triton attention, chunked and preempted; the preemptions."""
    model, config = load_model(folder, torch.float32, device)
    spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, head_size_of(config), BLOCK_SIZE,
                       torch.float32)
    max_model_len = max(map(len, prompts)) + run.new_tokens
    kv_caches = allocate_kv_caches(spec, run.kv_blocks, device)
    runner = ModelRunner(model, kv_caches, get_attention_backend("triton", device), BLOCK_SIZE, len(prompts),
                         max_model_len, config.vocab_size)
    scheduler = SchedulerConfig(max_num_batched_tokens=HF_STEP_TOKENS, max_num_seqs=len(prompts))
    engine = EngineCore(runner, WorkerInfo("random", str(folder), config.vocab_size, max_model_len, BLOCK_SIZE),
                        run.kv_blocks, scheduler)
    params = SamplingParams(temperature=0.0, max_tokens=run.new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineCoreRequest(str(i), prompt, params))
    tokens: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[int(out.request_id)] += out.new_token_ids
    engine.step()
    engine.check_integrity()
    preemptions = engine.stats().num_preemptions
    return tokens, preemptions


def engine_against_transformers(device: torch.device, sizes: Sizes, workdir: Path) -> list[str]:
    gen = torch.Generator().manual_seed(5)
    run = sizes.hf_run
    prompts = [torch.randint(0, sizes.hf_shape["vocab_size"], (n,), generator=gen).tolist() for n in run.prompts]
    models = {"llama": (HFLlama, LlamaConfig(**sizes.hf_shape, tie_word_embeddings=False)),
              "mistral": (MistralForCausalLM, MistralConfig(**sizes.hf_shape, tie_word_embeddings=False,
                                                            sliding_window=WINDOW))}
    lines = ["| model | prompts | tokens | preemptions | equal to transformers | near-tie partings |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    failures = []
    for name, (model_class, config) in models.items():
        folder = workdir / name
        reference = HFReference(random_hf_model(model_class, config, folder, device))
        ours, preemptions = greedy_batch(folder, device, prompts, run)
        equal = ties = 0
        for i, (prompt, generated) in enumerate(zip(prompts, ours)):
            if len(generated) != run.new_tokens:
                failures.append(f"{name} prompt {i}: {len(generated)} tokens")
                continue
            with torch.device(device):
                ref = reference(prompt, generated)
            for pos, (token, want) in enumerate(zip(generated, ref.token_ids)):
                if token == want:
                    equal += 1
                    continue
                gap = (ref.logprobs[pos, want] - ref.logprobs[pos, token]).item()
                if gap < NEAR_TIE:
                    ties += 1
                else:
                    failures.append(f"{name} prompt {i} position {pos}: {token}, transformers {want} "
                                    f"({gap:.2g} apart)")
                break  # after a parting the prefixes differ: the rest is not comparable
        lines.append(f"| {name} | {len(prompts)} | {sum(map(len, ours))} | {preemptions} | "
                     f"{equal} of {len(prompts) * run.new_tokens} | {ties} |")
        del reference
        if preemptions == 0:
            failures.append(f"{name}: the small KV cache should have preempted")
    if failures:
        raise AssertionError("\n".join(lines + failures))
    return lines


def lora_kernels(device: torch.device, sizes: Sizes) -> list[str]:
    """Triton's shrink and expand (what `auto` takes on CUDA) against the torch reference. Shrink's
    float32 sums must be within MAX_ABS_DIFF; expand rounds float32 sums once to bfloat16 in both, in
    another order, so they may differ by an ulp: at most 2^-7 of the largest value."""
    rows, in_features, out_features, rank, adapters = sizes.lora
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen, device=device).to(DTYPE)
    a_stack = (torch.randn(adapters, rank, in_features, generator=gen, device=device) / in_features**0.5).to(DTYPE)
    b_stack = (torch.randn(adapters, out_features, rank, generator=gen, device=device) / rank**0.5).to(DTYPE)
    bounds = torch.linspace(0, rows, adapters + 1).round().int().to(device)
    slots = torch.arange(adapters, dtype=torch.int32, device=device)
    slots[-1] = -1  # the last segment runs the base model
    out = torch.zeros(rows, out_features, dtype=DTYPE, device=device)

    def shrink(backend: str) -> torch.Tensor:
        return lora_shrink(x, a_stack, bounds, slots, backend=backend)

    def expand(backend: str, into: torch.Tensor = out) -> torch.Tensor:
        lora_expand_(into, y, b_stack, bounds, slots, 0, backend=backend)
        return into

    y = shrink("torch")
    shrink_diff = (shrink("triton") - y).abs().max().item()
    want = expand("torch", out.clone()).float()
    expand_diff = (expand("triton", out.clone()).float() - want).abs().max().item() / want.abs().max().item()
    times = {(kernel, backend): median_seconds(lambda: fn(backend), device, sizes.iters)
             for kernel, fn in (("shrink", shrink), ("expand", expand)) for backend in ("triton", "torch")}
    us = {key: f"{seconds * 1e6:.0f}" for key, seconds in times.items()}
    lines = ["| kernel | rows | in x out | rank | adapters | Triton µs | torch reference µs | difference |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
             f"| shrink | {rows} | {in_features} x {rank} | {rank} | {adapters} | {us['shrink', 'triton']} | "
             f"{us['shrink', 'torch']} | {shrink_diff:.1e} |",
             f"| expand | {rows} | {rank} x {out_features} | {rank} | {adapters} | {us['expand', 'triton']} | "
             f"{us['expand', 'torch']} | {expand_diff:.1e} of the largest value |"]
    if not (shrink_diff <= MAX_ABS_DIFF and expand_diff <= 2**-7):
        raise AssertionError("\n".join(lines) + f"\nshrink over {MAX_ABS_DIFF:g} or expand over 2^-7")
    return lines


def random_model(sizes: Sizes, device: torch.device) -> tuple[LlamaForCausalLM, LlamaConfig]:
    config = LlamaConfig(**sizes.model)
    with torch.device(device):
        model = LlamaForCausalLM(config, DTYPE)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)  # Llama's initializer_range: activations stay finite
    return model.eval(), config


def engine_end_to_end(device: torch.device, sizes: Sizes) -> list[str]:
    model, config = random_model(sizes, device)
    spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, head_size_of(config), BLOCK_SIZE, DTYPE)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory=sizes.kv_cache_bytes)
    num_blocks = num_blocks_for_budget(spec, cache_config.kv_cache_memory, cache_config.memory_fraction, device)
    max_batch = max(sizes.engine_batches)
    max_model_len = sizes.prompt_len + sizes.output_len
    runner = ModelRunner(model, allocate_kv_caches(spec, num_blocks, device), get_attention_backend("triton", device),
                         BLOCK_SIZE, max_batch, max_model_len, config.vocab_size)
    scheduler_config = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_batch,
                                       enable_prefix_caching=False)
    worker_info = WorkerInfo("random-llama", "", config.vocab_size, max_model_len, BLOCK_SIZE)
    engine = EngineCore(runner, worker_info, num_blocks, scheduler_config)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    ids = iter(range(10**9))

    def run(batch: int) -> tuple[float, list[float], int]:
        for _ in range(batch):
            prompt = torch.randint(0, config.vocab_size, (sizes.prompt_len,), generator=gen).tolist()
            engine.add_request(EngineCoreRequest(str(next(ids)), prompt, params))
        step_times, tokens = [], 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            step_times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - start
        engine.step()  # an empty step: the worker drops the finished requests
        return wall, step_times, tokens

    run(min(sizes.engine_batches))  # warm-up: kernel compilation, allocator
    lines = ["| batch | output tokens | wall s | output tokens/s | median decode step ms |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for batch in sizes.engine_batches:
        wall, step_times, tokens = run(batch)
        assert tokens == batch * sizes.output_len, f"{tokens} tokens, expected {batch * sizes.output_len}"
        decode_steps = step_times[len(step_times) // 2 :]  # the second half: every request decoding
        lines.append(f"| {batch} | {tokens} | {wall:.2f} | {tokens / wall:.0f} | "
                     f"{1e3 * statistics.median(decode_steps):.1f} |")
    engine.check_integrity()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.md"), help="where to write the report")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --smoke on a CPU")
    torch.manual_seed(0)

    report = [f"# gpu_check ({'smoke' if args.smoke else 'full'})", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    started = time.perf_counter()

    def section(title: str, fn: Callable[[], list[str]]) -> None:
        t0 = time.perf_counter()
        print(f"== {title}", flush=True)
        try:
            lines = fn()
        except Exception:
            failed.append(title)
            lines = ["FAILED:", "```", traceback.format_exc().rstrip(), "```"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.extend([f"## {title} ({time.perf_counter() - t0:.0f} s)", "", *lines, ""])
        print("\n".join(lines), flush=True)
        args.out.write_text("\n".join(report) + "\n")  # what ran so far, should a later section hang

    copy_bw: list[float] = []
    section("Environment", lambda: environment(device, args.smoke))
    section("Kernel tests", lambda: kernel_tests(sizes))

    def copy_section() -> list[str]:
        copy_bw.append(copy_bandwidth(device, sizes))
        return [f"- device copy of {sizes.copy_bytes / 2**20:.0f} MiB: {copy_bw[0] / 1e9:.0f} GB/s (read + write)"]

    section("Copy bandwidth", copy_section)
    section("Decode attention (bf16, one token per sequence)",
            lambda: decode_attention(device, sizes, copy_bw[0] if copy_bw else float("nan")))
    section("Prefill attention (bf16, causal)", lambda: prefill_attention(device, sizes))
    with tempfile.TemporaryDirectory() as workdir:
        section("Engine against transformers (random Llama and Mistral, float32)",
                lambda: engine_against_transformers(device, sizes, Path(workdir)))
    section("LoRA kernels (bf16)", lambda: lora_kernels(device, sizes))
    section("Engine end to end (random Llama, bf16)", lambda: engine_end_to_end(device, sizes))
    report.append(f"Total {time.perf_counter() - started:.0f} s; "
                  + (f"FAILED: {', '.join(failed)}" if failed else "all sections passed."))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report) + "\n")
    print(report[-1])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
