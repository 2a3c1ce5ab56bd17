"""Configuration: frozen dataclasses, one per concern, built once at the edge (CLI or `LLM(...)`).

Facts found at run time (the number of KV blocks, eos ids, the model's context length) are return
values of the components that find them, never writes into these objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import os

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
POLICIES = ("fcfs", "priority")
DEFAULT_MAX_NUM_WAITING = 1024  # the engine service's bound on its queue (SchedulerConfig.max_num_waiting)


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh"))


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's own
    cache_dir: Path | None = None  # None: default_cache_dir()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: memory_fraction of what is free
    memory_fraction: float = 0.2
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Requests the engine may hold beyond its max_num_seqs running slots; a new one past that is
    # refused (EngineOverloadedError) rather than queued without bound. None: no limit (the offline
    # LLM queues a whole batch); the engine service defaults to DEFAULT_MAX_NUM_WAITING.
    max_num_waiting: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_waiting is not None and self.max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be non-negative, got {self.max_num_waiting}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass(frozen=True)
class WorkerConfig:
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )


@dataclass(frozen=True)
class EngineArgs:
    """Everything the in-process engine needs, composed once."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    worker: WorkerConfig = WorkerConfig()
