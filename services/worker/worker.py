"""The worker core: one device's model, KV cache and model runner.

Start-up is three calls the engine makes in order: `Worker(...)` loads the model,
`determine_num_blocks()` sizes the KV cache from the memory budget (a return value the engine
builds its block pool from), `initialize_cache(num_blocks, ...)` allocates it. Then
`execute_model(scheduler_output)` once per step.
"""

from __future__ import annotations

import torch

from kernels import cpu_fused_ops
from services.common.clients import WorkerInfo
from services.common.config import CacheConfig, ModelConfig, WorkerConfig, default_cache_dir
from services.common.model_runner_output import ModelRunnerOutput
from services.common.scheduler_output import SchedulerOutput
from services.worker.attention import get_attention_backend
from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for_budget
from services.common.model_files import model_id_of
from services.worker.loader import load_model, resolve_model
from services.worker.model_runner import ModelRunner

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, worker_config: WorkerConfig) -> None:
        self.device = torch.device(model_config.device)
        self.dtype = _DTYPES[model_config.dtype]
        self.cache_config = cache_config
        torch.manual_seed(model_config.seed)
        cache_dir = model_config.cache_dir or default_cache_dir()
        self.model_path = resolve_model(model_config.model, cache_dir)
        if self.device.type == "cpu":
            cpu_fused_ops.available(cache_dir)  # built once here; without a compiler the layers use torch ops
        self.model, self.hf_config = load_model(self.model_path, self.dtype, self.device)
        self.backend = get_attention_backend(worker_config.attention_backend, self.device, cache_dir)
        max_len = self.hf_config.max_position_embeddings
        if model_config.max_model_len is not None:
            if model_config.max_model_len > max_len:
                raise ValueError(f"max_model_len {model_config.max_model_len} exceeds the model's {max_len}")
            max_len = model_config.max_model_len
        self.info = WorkerInfo(model_id=model_id_of(self.model_path), model_path=str(self.model_path),
                               vocab_size=self.hf_config.vocab_size, max_model_len=max_len,
                               block_size=cache_config.block_size)
        self.runner: ModelRunner | None = None

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.hf_config
        head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_size,
                           self.cache_config.block_size, self.dtype)

    def determine_num_blocks(self) -> int:
        return num_blocks_for_budget(self.kv_cache_spec, self.cache_config.kv_cache_memory,
                                     self.cache_config.memory_fraction, self.device)

    def initialize_cache(self, num_blocks: int, max_num_reqs: int) -> None:
        kv_caches = allocate_kv_caches(self.kv_cache_spec, num_blocks, self.device)
        self.runner = ModelRunner(self.model, kv_caches, self.backend, self.cache_config.block_size,
                                  max_num_reqs, self.info.max_model_len, self.info.vocab_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_cache() first"
        return self.runner.execute_model(scheduler_output)
