"""The worker core: one device's model, KV cache and model runner.

Start-up is three calls the engine makes in order: `Worker(...)` loads the model,
`determine_num_blocks()` sizes the KV cache from the memory budget (a return value the engine
builds its block pool from), `initialize_cache(num_blocks, ...)` allocates it. Then
`execute_model(scheduler_output)` once per step.

In a tensor-parallel group (ParallelConfig) every rank is such a worker over its slice
of the model, and the engine makes each call on every rank with the same message: the ranks join
their group in `Worker(...)`, agree on the smallest number of KV blocks in `determine_num_blocks()`,
and run every step together (the layers' collectives keep them in step); rank 0 samples.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kvmesh_kernels import cpu_decoder, cpu_fused_ops, cpu_lora, cpu_paged_attention, cpu_quant_matmul
from services.common.clients import WorkerInfo
from services.common.config import (CacheConfig, DisaggregationConfig, LoRAConfig, ModelConfig, ParallelConfig,
                                   WorkerConfig, default_cache_dir)
from services.common.lora import check_adapter
from services.common.model_runner_output import ModelRunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.worker.attention import get_attention_backend
from services.worker.gguf_weights import gguf_weights_for, block_gemm_dtype, resolve_dtype
from services.worker.layers.linear import MergedLinear, RowParallelLinear
from services.worker.layers.quantized_weight import BlockWeightHolder, use_gemm_dtype
from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for_budget
from services.common.model_files import locate_model, model_id_of
from services.worker.loader import load_model, resolve_model
from services.worker.model_runner import ModelRunner
from services.worker import host_limits, native_decoder
from services.worker.kv_transfer import KVTransferEndpoint
from services.worker.lora.layers import SlotShape
from services.worker.lora.manager import LoRAManager
from services.worker.parallel_group import TensorParallelGroup


def gemm_dtype_layers(model: torch.nn.Module) -> list[BlockWeightHolder]:
    """The layers whose block weights take `--dtype auto`'s low-precision copies
    (quantized_weight.use_gemm_dtype): the linear layers and the LM head (its float32 tiles were a
    fifth of a 32-row decode step on AVX2, its int8 ones 1.6-2.5x faster; bfloat16 ones 1.2-1.6x on
    a Zen 5)."""
    layers: list[BlockWeightHolder] = [m for m in model.modules() if isinstance(m, (MergedLinear, RowParallelLinear))]
    return [*layers, model.lm_head]


logger = logging.getLogger(__name__)


def fit_threads_to_cpu_quota() -> None:
    """torch's OpenMP team on this thread, which the native kernels size theirs by, no wider than
    the CPU quota of this process's cgroup (a pod's CPU limit), unless OMP_NUM_THREADS says."""
    threads = host_limits.cpu_threads()
    if "OMP_NUM_THREADS" not in os.environ and threads < torch.get_num_threads():
        logger.info("%d threads, not %d: the CPU quota of this cgroup", threads, torch.get_num_threads())
        torch.set_num_threads(threads)


def compile_kernels_ahead(cache_dir: Path, attention_backend: str, enable_lora: bool) -> None:
    """Start compiling the CPU kernels this worker will build, side by side and beside the model's
    conversion: on a first start (an empty cache) they took 13 s one after the other."""
    kernels = [cpu_fused_ops, cpu_quant_matmul, cpu_decoder]
    if attention_backend in ("auto", "cpu"):
        kernels.append(cpu_paged_attention)
    if enable_lora:
        kernels.append(cpu_lora)
    for kernel in kernels:
        kernel.compile_ahead(cache_dir)


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, worker_config: WorkerConfig,
                 parallel_config: ParallelConfig = ParallelConfig(),
                 disaggregation: DisaggregationConfig = DisaggregationConfig(), secret: str | None = None, *,
                 lora: LoRAConfig = LoRAConfig()) -> None:
        """`secret`: the internal token, which guards the tensor-parallel and KV-transfer stores.
        `lora`: with enable_lora, LoRA layers around the model's projections, and --lora-modules'
        folders checked against the model (ValueError naming what is wrong)."""
        self.device = torch.device(model_config.device)
        if self.device.type == "cpu":  # first: the start-up probes time the kernels with this team
            fit_threads_to_cpu_quota()
        self.dtype = resolve_dtype(model_config.dtype, model_config.quantization, model_config.model, self.device)
        self.cache_config = cache_config
        torch.manual_seed(model_config.seed)
        cache_dir = model_config.cache_dir or default_cache_dir()
        if self.device.type == "cpu":
            locate_model(model_config.model, cache_dir)  # a model that is not there fails before any compile
            compile_kernels_ahead(cache_dir, worker_config.attention_backend, lora.enable_lora)
        self.model_path = resolve_model(model_config.model, cache_dir)
        if self.device.type == "cpu":
            cpu_fused_ops.available(cache_dir)  # built once here; without a compiler the layers use torch ops
            if self.dtype == torch.float16:  # the float16 layers' matmul (cpu_quant_matmul.linear_f16)
                cpu_quant_matmul.available(cache_dir)
        self.tp = TensorParallelGroup.create(parallel_config, self.device, secret)  # waits for the other ranks
        gguf_weights = gguf_weights_for(model_config.quantization, model_config.model, self.device, self.dtype,
                                        cache_dir)
        self.model, self.hf_config = load_model(self.model_path, self.dtype, self.device, self.tp, gguf_weights,
                                                 cache_dir)
        gemm_dtype = block_gemm_dtype(model_config.dtype, self.device)
        if gguf_weights is not None and gemm_dtype != torch.float32:
            use_gemm_dtype(gemm_dtype_layers(self.model), gemm_dtype)
        # `auto` rounds the larger steps' activations already, and a bfloat16 model its q, K and V:
        # prompt attention's products may take bfloat16 operands too.
        self.backend = get_attention_backend(worker_config.attention_backend, self.device, cache_dir,
                                             prefill_bf16=model_config.dtype == "auto" or self.dtype == torch.bfloat16)
        self.lora = self._enable_lora(lora, model_config.dtype) if lora.enable_lora else None
        if self.lora is not None and self.device.type == "cpu":
            cpu_lora.available(cache_dir)  # built once here; without a compiler the LoRA layers use torch's
        # After the LoRA layers are in place: the native decoder binds their slots too.
        if self.device.type == "cpu" and cpu_decoder.available(cache_dir):
            native_decoder.enable(self.model)  # the CPU's small steps as one native call, where it can
        max_len = self.hf_config.max_position_embeddings
        if model_config.max_model_len is not None:
            if model_config.max_model_len > max_len:
                raise ValueError(f"max_model_len {model_config.max_model_len} exceeds the model's {max_len}")
            max_len = model_config.max_model_len
        # Disaggregation: this worker's end of KV transfers with other engines' workers.
        self.kv_transfer = None if disaggregation.kv_transfer_address is None else KVTransferEndpoint(
            disaggregation.kv_transfer_address, self.device, disaggregation.kv_transfer_timeout, secret)
        self.info = WorkerInfo(model_id=model_id_of(self.model_path), model_path=str(self.model_path),
                               vocab_size=self.hf_config.vocab_size, max_model_len=max_len,
                               block_size=cache_config.block_size, rank=self.tp.rank, world_size=self.tp.size,
                               kv_transfer_endpoint=self.kv_transfer.endpoint_id if self.kv_transfer else "")
        self.runner: ModelRunner | None = None

    def _enable_lora(self, lora: LoRAConfig, dtype: str) -> LoRAManager:
        base_config = self.hf_config.to_dict()
        for module in lora.lora_modules:  # a bad folder stops the worker now, not a request later
            check_adapter(module.path, lora.max_lora_rank, base_config)
        # `--dtype auto` on the CPU keeps adapters in bfloat16 under float32 activations: a step reads
        # every adapter of its batch, and half the bytes is most of the adapters' cost there.
        half = self.device.type == "cpu" and dtype == "auto" and self.dtype == torch.float32
        slots = SlotShape(lora.max_loras, lora.max_lora_rank, torch.bfloat16 if half else self.dtype, self.device)
        return LoRAManager(self.model, slots, lora.cpu_loras, base_config)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.hf_config
        head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # This rank's KV heads only (all of them at TP=1).
        return KVCacheSpec(cfg.num_hidden_layers, self.model.heads.num_kv_heads, head_size,
                           self.cache_config.block_size, self.dtype)

    def determine_num_blocks(self) -> int:
        """The blocks this rank's budget holds; in a group, the smallest over the ranks (every rank
        must hold every block the engine hands out)."""
        return self.tp.min_over_group(num_blocks_for_budget(self.kv_cache_spec, self.cache_config.kv_cache_memory,
                                                            self.cache_config.memory_fraction, self.device))

    def initialize_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        spec = self.kv_cache_spec
        tokens = num_blocks * spec.block_size
        # vLLM's two sizing lines: what the cache holds, and how many full-length requests fit in it.
        logger.info("KV cache size: %d tokens (%d blocks, %.2f GiB)", tokens, num_blocks,
                    num_blocks * spec.bytes_per_block / 2**30)
        logger.info("Maximum concurrency for %d tokens per request: %.2fx", self.info.max_model_len,
                    tokens / self.info.max_model_len)
        kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self.runner = ModelRunner(self.model, kv_caches, self.backend, self.cache_config.block_size,
                                  max_num_reqs, self.info.max_model_len, self.info.vocab_size, self.tp, self.lora)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_cache() first"
        return self.runner.execute_model(scheduler_output)

    def send_kv(self, peer: str, block_ids: list[int], tag: int) -> int:
        """Blocks `block_ids` of every layer to the worker `peer` (its receive_kv with `tag`); bytes sent."""
        return self._transfer_endpoint().send(peer, tag, self._kv_caches(block_ids), block_ids)

    def receive_kv(self, peer: str, block_ids: list[int], tag: int) -> int:
        """Blocks from `peer`'s send_kv with `tag` into `block_ids`; bytes received."""
        return self._transfer_endpoint().receive(peer, tag, self._kv_caches(block_ids), block_ids)

    def _transfer_endpoint(self) -> KVTransferEndpoint:
        if self.kv_transfer is None:
            raise ValueError("this worker has no KV-transfer endpoint: start it with --kv-transfer-address")
        return self.kv_transfer

    def _kv_caches(self, block_ids: list[int]) -> list:
        if self.runner is None:
            raise ValueError("no KV cache yet: InitializeCache first")
        num_blocks = self.runner.kv_caches[0].shape[1]
        if not block_ids or not all(0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"KV transfer block ids must be 1 or more of 0..{num_blocks - 1}, got {block_ids}")
        return self.runner.kv_caches

    def close(self) -> None:
        """Leave the tensor-parallel group (nothing to do for a group of one) and close transfers."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.tp.close()
