"""Configuration: frozen dataclasses, one per concern, built once at the edge (CLI or `LLM(...)`).

Each field is the one source of its knob: its default, its help text, its bounds and (through
services/common/flags.py) its command-line flag and environment variable. A service's parser is
built from the dataclasses it takes, `kvmesh serve` hands its children these objects as flags
(flags.to_argv), and a new knob is one field here.

Facts found at run time (the number of KV blocks, eos ids, the model's context length, the block
size an engine learns from its worker) are return values of the components that find them, never
writes into these objects.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from services.common.lora import LoRAModule, parse_lora_module
from services.common.ports import DEFAULT_PORTS, default_address
from services.common.sampling_params import MAX_LOGPROBS, MAX_TOKEN_IDS
from services.common.unix_socket import SCHEME as UNIX_SCHEME, check_path_length, socket_path

DTYPES = ("float32", "bfloat16", "float16", "auto")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names for them
QUANTIZATIONS = ("auto", "gguf", "int8", "f16", "none")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
POLICIES = ("fcfs", "priority")
ROUTING_POLICIES = ("round-robin", "least-load", "kv-aware", "session")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# services/gateway/tool_parsers.py's registry (the gateway checks they agree)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh"))


def parse_dtype(text: str) -> str:
    """A --dtype as DTYPES names it: vLLM's `half` and `float` are float16 and float32."""
    return DTYPE_ALIASES.get(text, text)


def parse_bytes(text: str) -> int:
    """`134217728`, `128MiB`, `128M`, `1GiB`, `1.5G` -> bytes (K/M/G are binary, as for memory)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 134217728, 128MiB, 1GiB)")
    number, unit = float(match.group(1)), match.group(2)
    return int(number * 1024 ** " kmgt".index(unit or " "))


def http_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise ValueError(f"not an http(s) URL: {text!r}")
    return text


def trusted_proxy(text: str) -> str:
    """An IP address or network, as written (ValueError for anything else)."""
    ipaddress.ip_network(text.strip(), strict=False)
    return text.strip()


def option(default: Any, help: str, *, flag: str | None = None, choices: Sequence[Any] | None = None,
           minimum: float | None = None, maximum: float | None = None,
           parse: Callable[[str], Any] | None = None, nargs: str | None = None) -> Any:
    """A config field with what its flag needs: `flag` (default `--field-name`), `choices` and the
    bounds (checked by `check_fields` for every way the object is built), `parse` for flag and
    environment text (default: the field's type). A tuple-typed field is a repeatable flag; with
    nargs="+" one flag also takes several values (vLLM's `--lora-modules a=x b=y`)."""
    metadata = {"help": help, "flag": flag, "choices": choices, "minimum": minimum, "maximum": maximum,
                "parse": parse, "nargs": nargs}
    if isinstance(default, (list, dict, set)):
        raise TypeError("config fields are immutable: use a tuple")
    return field(default=default, metadata=metadata)


def check_fields(config: object) -> None:
    """ValueError for a field outside its choices or bounds (None always passes: it means unset)."""
    for f in fields(config):
        value = getattr(config, f.name)
        if value is None or not f.metadata:
            continue
        choices, minimum, maximum = f.metadata["choices"], f.metadata["minimum"], f.metadata["maximum"]
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {tuple(choices)}, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{f.name} must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ValueError(f"{f.name} must be at most {maximum}, got {value}")


# ----------------------------------------------------------------------------- model, cache, engine, worker


@dataclass(frozen=True)
class ModelConfig:
    model: str = option("smollm2", "model: smollm2 (the embedded default), gemma3-270m, a Hugging Face folder or "
                                   "a .gguf file")
    served_model_name: str | None = option(
        None, "the name clients use and metrics are labelled with (default: --model)")
    chat_template: str | None = option(
        None, "the chat template for chat requests, as Jinja text or a file holding it, in place of the model's own "
              "(a base model has none: its chat requests are refused without this)")
    dtype: str = option("auto", "weights' and activations' dtype; auto: the fastest this device runs natively "
                                "(weights in GGUF blocks: float32, their steps of 24+ tokens in bfloat16 on a CPU "
                                "with AVX512_BF16 or AMX, else of 2+ tokens against int8 activations with AVX2, "
                                "each where a start-up probe measures it faster than float32; other weights on a CPU bfloat16 with those, else float32; "
                                "on a GPU bfloat16, else float16); float32 is the exact one (greedy tokens "
                                "identical to transformers'); half and float are vLLM's names for float16 "
                                "and float32", choices=DTYPES, parse=parse_dtype)
    quantization: str = option(
        "auto", "weights in blocks for a native CPU kernel (float32 activations): gguf keeps a .gguf model's "
                "own (Q4_1, Q8_0, F16: its exact weights), int8 quantizes any model's to Q8_0 at load (weight-only "
                "int8, not exact), f16 rounds them to float16 (not exact), none keeps floats in --dtype, auto is "
                "gguf where it can be (a .gguf model, CPU, float32, AVX2 or AVX-512), else none",
        choices=QUANTIZATIONS)
    device: str = option("cpu", "torch device of the worker (cpu, cuda, cuda:1)")
    max_model_len: int | None = option(None, "context length (default: the model's own)", minimum=2)
    seed: int = option(0, "seed of the worker's random state")
    cache_dir: Path | None = option(
        None, "where converted GGUF models and resolved model configs are kept "
              "(default: $KVMESH_CACHE_DIR, else ~/.cache/kvmesh)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))  # LLM(dtype="half") hands vLLM's name
        check_fields(self)
        on_cpu = self.device.split(":")[0] == "cpu"
        if self.quantization not in ("auto", "none") and (self.dtype not in ("float32", "auto") or not on_cpu):
            raise ValueError(f"quantization {self.quantization} runs on the CPU in float32: use --dtype float32 "
                             "--device cpu, or --quantization none")

    @property
    def name(self) -> str:
        """What clients call the model."""
        return self.served_model_name or self.model


@dataclass(frozen=True)
class FleetConfig:
    """The models one gateway and processor serve, each on a pool of engines of its own (`kvmesh serve`,
    the processor, the gateway). The first is the model of requests that name none."""

    model: tuple[str, ...] = option(
        ("smollm2",), "a model to serve: smollm2 (the embedded default), gemma3-270m, a Hugging Face folder or a "
                      ".gguf file; repeat it to serve several models, each on engines of its own", flag="--model")
    served_model_name: tuple[str, ...] = option(
        (), "the name clients use for each --model, in the same order, and metrics' model_name (default: the "
            "--model itself)", flag="--served-model-name")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("at least one --model is needed")
        if self.served_model_name and len(self.served_model_name) != len(self.model):
            raise ValueError(f"--served-model-name is given {len(self.served_model_name)} time(s) for "
                             f"{len(self.model)} --model: give it once per model, in the same order, or not at all")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"two models have one name ({', '.join(self.names)}): give each its own "
                             "--served-model-name")

    @property
    def names(self) -> tuple[str, ...]:
        """What clients call each model, in --model's order."""
        return self.served_model_name or self.model

    def model_configs(self, base: ModelConfig = ModelConfig()) -> tuple[ModelConfig, ...]:
        """`base` (dtype, device, ...) once per model, with that model and its served name."""
        return tuple(replace(base, model=model, served_model_name=name) for model, name in zip(self.model, self.names))


@dataclass(frozen=True)
class CacheConfig:
    """The worker's KV cache. The engine learns the block size from its worker (WorkerInfo)."""

    block_size: int = option(16, "tokens per KV-cache block (a power of two)", minimum=1)
    kv_cache_memory: int | None = option(
        None, "KV cache bytes, e.g. 512MiB (default: --memory-fraction of free memory)", minimum=1, parse=parse_bytes)
    memory_fraction: float = option(
        0.2, "share of free memory (within the memory limit of the worker's cgroup) for the KV cache when "
        "--kv-cache-memory is unset", minimum=0.0, maximum=1.0)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.memory_fraction == 0:
            raise ValueError("memory_fraction must be in (0, 1], got 0")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` JSON names it. `ngram` (prompt lookup):
    the engine drafts the tokens that followed the latest earlier occurrence of the context's last
    n-gram (n from prompt_lookup_max down to prompt_lookup_min); the worker verifies them in one step."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        # As vLLM: one bound given stands for both; neither means 5.
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = low or high or 5, high or low or 5
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON object; ValueError naming what is wrong."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        return cls.of(values)

    @classmethod
    def of(cls, values: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        if isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"the speculative config must be a JSON object, got {values!r}")
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative config key(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    def __str__(self) -> str:
        """The flag's JSON (flags.to_argv hands it on to a child process)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":"))


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = option(2048, "tokens one engine step may compute", minimum=1)
    max_num_seqs: int = option(128, "requests running at once", minimum=1)
    # The offline LLM passes None (it queues a whole batch); a service never queues without bound.
    max_num_waiting: int | None = option(
        1024, "requests held beyond --max-num-seqs; more are refused (RESOURCE_EXHAUSTED, HTTP 503 with "
              "Retry-After), never queued without bound", minimum=0)
    policy: str = option("fcfs", "the waiting queue's order", flag="--scheduling-policy", choices=POLICIES)
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of prompts' shared prefixes")
    target_step_seconds: float = option(
        0.5, "the step time the scheduler aims at: prefill chunks are cut to the tokens recent steps computed in "
             "this long, so running streams get a token at least this often (0: always the full "
             "--max-num-batched-tokens)", minimum=0.0)
    speculative_config: SpeculativeConfig | None = option(
        None, 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_min": 2, "prompt_lookup_max": 5}; off when unset', parse=SpeculativeConfig.from_json)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.speculative_config is not None:  # `LLM(speculative_config={...})` passes vLLM's dict
            object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))


@dataclass(frozen=True)
class WorkerConfig:
    attention_backend: str = option("auto", "attention kernels (auto: cpu on a CPU, triton on a GPU)",
                                    choices=ATTENTION_BACKENDS)
    max_num_seqs: int = option(1024, "the largest batch an engine may ask this worker for", minimum=1)
    owner_lease: float = option(
        15.0, "seconds an engine keeps this worker after its last call; another engine may take the worker "
              "over only after that (see services/worker/server.py WorkerServicer)", minimum=0.0)
    step_port: int = option(
        0, "port of the step channel the engine drives this worker over, on --host (0: any free port; the "
           "engine learns it from GetInfo); with --unix-socket PATH the channel is the socket PATH.step instead",
        minimum=0, maximum=65535)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class ParallelConfig:
    """A worker's place in its tensor-parallel group. Size 1: no process group at all."""

    tensor_parallel_size: int = option(1, "workers (ranks) that share one model replica's layers", minimum=1)
    rank: int = option(0, "this worker's rank in its tensor-parallel group (0 is the driver)", minimum=0)
    distributed_address: str | None = option(
        None, "host:port of rank 0's TCPStore; default 127.0.0.1:<free port> for a size-1 group")
    distributed_timeout: float = option(
        10.0, "seconds a rendezvous or a collective may wait for the group's other ranks", minimum=0.1)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rank >= self.tensor_parallel_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.tensor_parallel_size}")
        if self.distributed_address is not None:
            host, _, port = self.distributed_address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"distributed_address must be host:port, got {self.distributed_address!r}")


# LoRAConfig's fields only the gateway reads (engines and workers take the adapters from load RPCs).
GATEWAY_LORA_FIELDS = ["allow_runtime_lora_updating"]


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served next to a base model, vLLM's flags (services/common/lora.py reads the
    folders). The processor takes the names, the engine names and folders, the worker the sizes."""

    enable_lora: bool = option(False, "serve LoRA adapters: those of --lora-modules, and in-process those an "
                                      "LLM's LoRARequest names")
    lora_modules: tuple[LoRAModule, ...] = option(
        (), "adapters to serve, each name=path (a PEFT folder) or vLLM's JSON form {\"name\": ..., \"path\": ..., "
            "\"base_model_name\": ...}; a request whose model is the name runs with it (default: none)",
        parse=parse_lora_module, nargs="+")
    max_loras: int = option(1, "distinct adapters one step may run (each holds a slot of stacked weights)",
                            minimum=1)
    max_lora_rank: int = option(16, "the largest adapter rank served (slots are padded to it)", minimum=1)
    max_cpu_loras: int | None = option(
        None, "adapters kept loaded in host memory, least recently used evicted (default: --max-loras)", minimum=1)
    allow_runtime_lora_updating: bool = option(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING): any client with an API key may then load a folder of the "
               "engines' disks")

    def __post_init__(self) -> None:
        # LLM(lora_modules=["a=/path"]) hands strings; flags hand parsed entries.
        object.__setattr__(self, "lora_modules", tuple(
            m if isinstance(m, LoRAModule) else parse_lora_module(m) for m in self.lora_modules))
        check_fields(self)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.allow_runtime_lora_updating and not self.enable_lora:
            raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {', '.join(names)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def parents(self, served_names: Sequence[str]) -> dict[str, str]:
        """Each adapter's base model by served name (the first when it names none); ValueError for a
        base model not served, or an adapter named as a served model."""
        parents = {m.name: m.base_model_name or served_names[0] for m in self.lora_modules}
        for name, parent in parents.items():
            if parent not in served_names:
                raise ValueError(f"LoRA adapter {name!r} is for base model {parent!r}, which is not served "
                                 f"(served: {', '.join(served_names)})")
            if name in served_names:
                raise ValueError(f"LoRA adapter {name!r} has the name of a served model: give it another")
        return parents

    def modules_of(self, served_name: str, served_names: Sequence[str]) -> tuple[LoRAModule, ...]:
        """The adapters of the served model `served_name`."""
        parents = self.parents(served_names)
        return tuple(m for m in self.lora_modules if parents[m.name] == served_name)


@dataclass(frozen=True)
class EngineArgs:
    """Everything the in-process stack needs, composed once (services/inprocess.py)."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    worker: WorkerConfig = WorkerConfig()
    parallel: ParallelConfig = ParallelConfig()
    lora: LoRAConfig = LoRAConfig()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """From keyword arguments named as the flags are (`LLM(max_num_seqs=8, scheduling_policy=
        "priority")`); `max_num_seqs` sizes both the scheduler and the worker's batch. TypeError for
        a name no config has."""
        unknown = set(kwargs)
        parts = {}
        for part in fields(cls):
            config_class = type(part.default)
            values = {f.name: kwargs[kwarg_name(f)] for f in fields(config_class) if kwarg_name(f) in kwargs}
            unknown -= {kwarg_name(f) for f in fields(config_class)}
            parts[part.name] = config_class(**values)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**parts)


def flag_name(f: Field) -> str:
    """A field's command-line flag: `--max-num-seqs`, or its own (`--scheduling-policy` for SchedulerConfig.policy)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def kwarg_name(f: Field) -> str:
    """A field's name as a keyword argument: its flag's (`scheduling_policy` for SchedulerConfig.policy)."""
    return flag_name(f).removeprefix("--").replace("-", "_")


# ----------------------------------------------------------------------------- services


@dataclass(frozen=True)
class ServingConfig:
    """Where a service listens and how it stops (services/common/rpc/server.py RpcServer.shutdown).
    Each service gives its own default ports (flags.add_flags(defaults=...))."""

    host: str = option("127.0.0.1", "interface to listen on (loopback unless a deployment asks for more)")
    port: int = option(0, "port to listen on", minimum=0, maximum=65535)
    grace: float = option(5.0, "seconds in-flight calls get at shutdown", minimum=0.0)
    drain: float = option(0.0, "seconds between NOT_SERVING and refusing new calls at shutdown", minimum=0.0)
    metrics_port: int = option(0, "port of /metrics on --host (0: none)", minimum=0, maximum=65535)
    unix_socket: Path | None = option(
        None, "Unix socket to serve gRPC on instead of --host:--port (kvmesh serve's children: a socket in a "
              "private directory cannot be taken over by another local user the way a free port can)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.unix_socket is not None:
            check_path_length(self.unix_socket)


@dataclass(frozen=True)
class SecurityConfig:
    """How the internal gRPC services (worker, engine, processor) know their callers, on both
    sides of each call (services/common/rpc/security.py). A token is never a flag: a file (a
    mounted Kubernetes Secret) or $KVMESH_INTERNAL_TOKEN, so that `ps` does not show it. Each caller
    role (gateway, processor, engine) has its own token file; a service accepts the tokens it is
    given, each for the methods its role may call, and the shared token for every method."""

    internal_token_file: Path | None = option(
        None, "file holding the shared token every internal gRPC call carries and every internal service "
              "requires (default: $KVMESH_INTERNAL_TOKEN; neither: no authentication, with a warning)")
    gateway_token_file: Path | None = option(
        None, "file holding the gateway's own token: the gateway sends it, and a processor accepts it for "
              "the Processor service only")
    processor_token_file: Path | None = option(
        None, "file holding the processor's own token: the processor sends it, and an engine accepts it for "
              "its client methods (Generate, Abort, GetStats, GetInfo, MatchPrefix)")
    engine_token_file: Path | None = option(
        None, "file holding the engine's own token: an engine sends it, and a worker accepts it (gRPC and "
              "step channel), as does another engine for disaggregated prefill")
    tls_cert_file: Path | None = option(
        None, "PEM certificate this service presents, as server and as client (mutual TLS; needs "
              "--tls-key-file and --tls-ca-file)")
    tls_key_file: Path | None = option(None, "PEM private key of --tls-cert-file")
    tls_ca_file: Path | None = option(None, "PEM CA bundle that peers' certificates must chain to")
    tls_server_name: str | None = option(
        None, "the name clients expect in servers' certificates (default: the host of the address dialled)")

    def __post_init__(self) -> None:
        check_fields(self)
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if any(f is not None for f in tls) and not all(f is not None for f in tls):
            raise ValueError("mutual TLS needs --tls-cert-file, --tls-key-file and --tls-ca-file together")
        if self.tls_server_name is not None and self.tls_cert_file is None:
            raise ValueError("--tls-server-name needs --tls-cert-file")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


@dataclass(frozen=True)
class EngineServiceConfig:
    """How the engine service finds its workers (one, or a tensor-parallel group): addresses, or a
    Kubernetes Service's endpoints."""

    worker_address: tuple[str, ...] = option(
        (), "a worker's host:port, off Kubernetes (repeatable, or comma-separated in the environment, in rank "
            "order: several are one tensor-parallel group, as many as --tensor-parallel-size; default "
            f"{default_address('worker')})")
    worker_service: str | None = option(
        None, "the workers' Kubernetes Service: connect to its ready endpoints (port named grpc) whose hostnames "
              "are --worker-hostname; excludes --worker-address")
    worker_hostname: tuple[str, ...] = option(
        (), "with --worker-service, a worker's hostname (repeatable, in rank order; default: this host's name "
            "with -engine- replaced by -worker-, and -<rank> appended with --tensor-parallel-size above 1)")
    namespace: str | None = option(
        None, "the Service's namespace (default: this pod's, else $KVMESH_NAMESPACE, else default)")
    worker_timeout: float = option(60.0, "deadline (s) of the worker's set-up calls, and for it to come up "
                                         "(a step has no deadline: see --worker-liveness-timeout)", minimum=0.0)
    worker_liveness_interval: float = option(
        1.0, "seconds between checks that the worker is alive (its health service), while a step runs and while "
             "idle", minimum=0.01)
    worker_liveness_timeout: float = option(
        5.0, "seconds the worker may take to answer a liveness check; no answer is a stuck worker, fatal to the "
             "engine (a slow step is never failed while the worker answers)", minimum=0.01)
    exit_grace: float = option(
        1.0, "seconds a dead engine (its worker failed) stays up NOT_SERVING, for open streams to get their "
             "error, before it exits non-zero", minimum=0.0)
    advertise_address: str | None = option(
        None, "host:port (or unix:/path) processors reach this engine at: its id in the prefix index (default: "
              "--host:--port, or unix:--unix-socket; in Kubernetes the pod's IP and port)")

    def __post_init__(self) -> None:
        check_fields(self)
        if self.worker_service is None and self.worker_hostname:
            raise ValueError("--worker-hostname needs --worker-service")
        if self.worker_service is not None and self.worker_address:
            raise ValueError("--worker-address and --worker-service exclude each other")


def allowed_address(text: str) -> str:
    """host:port, unix:/path, an IP address or a CIDR network, as written (ValueError for anything else)."""
    text = text.strip()
    if text.startswith(UNIX_SCHEME):
        socket_path(text)  # an absolute path, or ValueError
        return text
    try:
        ipaddress.ip_network(text, strict=False)
        return text
    except ValueError:
        pass
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not host:port, an IP or a CIDR network: {text!r} (examples: 10.0.0.7:50052, 10.0.0.0/16)")
    return text


def redis_url(text: str) -> str:
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"not a Redis URL: {text!r} (example: redis://127.0.0.1:6379/0)")
    return text


@dataclass(frozen=True)
class PrefixIndexConfig:
    """The shared prefix-cache index (services/prefix_index/), as engines (which publish to it) and
    processors (which read it) both take it."""

    prefix_index: str | None = option(
        None, "Redis URL of the shared prefix-cache index (redis://host:port/db); default: none, and the "
              "processor asks the engines what they hold (Engine.MatchPrefix)", parse=redis_url)
    prefix_index_namespace: str = option("kvmesh:pi", "key prefix of the index in Redis")
    prefix_index_timeout: float = option(
        0.5, "seconds an index call may take; slower or unreachable, the router routes by load and the "
             "engine keeps serving", minimum=0.01)
    heartbeat_ttl: float = option(
        10.0, "seconds an engine stays in the index without a heartbeat (it sends one every third of this)",
        minimum=0.1)
    prefix_index_username: str | None = option(
        None, "Redis ACL user of the index (default: the URL's, else Redis's default user)")
    prefix_index_password_file: Path | None = option(
        None, "file holding the Redis password (a mounted Secret), read at start: never on the command line")
    prefix_index_ca_file: Path | None = option(
        None, "PEM CA bundle the Redis server's certificate must chain to (needs a rediss:// URL)")
    prefix_index_cert_file: Path | None = option(
        None, "PEM client certificate presented to Redis over TLS (with --prefix-index-key-file)")
    prefix_index_key_file: Path | None = option(None, "PEM private key of --prefix-index-cert-file")

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.prefix_index_cert_file is None) != (self.prefix_index_key_file is None):
            raise ValueError("--prefix-index-cert-file and --prefix-index-key-file go together")
        tls_files = (self.prefix_index_ca_file, self.prefix_index_cert_file)
        if any(f is not None for f in tls_files) and not (self.prefix_index or "").startswith("rediss://"):
            raise ValueError("--prefix-index-ca-file and --prefix-index-cert-file need a rediss:// --prefix-index")


ENGINE_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class DisaggregationConfig:
    """Disaggregated prefill/decode (docs/features/disaggregation.md). Each service takes its fields:
    the worker its KV-transfer endpoint, the engine its role and lease, the processor the prefill
    engines and the decider's threshold."""

    engine_role: str = option(
        "both", "prefill (computes prompts for decode engines), decode (decodes; long prompts are prefilled "
                "on a prefill engine) or both (colocated: everything here)", choices=ENGINE_ROLES)
    kv_transfer_address: str | None = option(
        None, "host:port this worker's KV-transfer endpoint listens on (a TCPStore, this interface only; "
              "port 0: any free one); unset: the worker takes no part in KV transfers")
    kv_transfer_timeout: float = option(
        5.0, "seconds a KV transfer (rendezvous, send or receive) may take before the decode engine "
             "recomputes the prompt itself", minimum=0.1)
    remote_prefill_timeout: float = option(
        60.0, "seconds a decode engine waits for the prefill engine's first token (its queue and the prompt's "
              "compute) before it computes the prompt itself", minimum=0.1)
    kv_lease: float = option(
        30.0, "seconds a prefill engine holds the KV blocks it sent, unless the decode engine releases them "
              "first", minimum=0.1)
    prefill_engine_address: tuple[str, ...] = option(
        (), "a prefill engine's host:port (repeatable): prompts with more uncached tokens than "
            "--prefill-threshold on the decode engine are prefilled there")
    prefill_threshold: int = option(
        512, "uncached prompt tokens above which the processor has a prefill engine compute the prompt "
             "(at or below: the decode engine computes it)", minimum=0)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class RoutingConfig:
    """How a processor chooses the engine for each request (services/processor/router.py)."""

    routing: str = option(
        "kv-aware", "round-robin, least-load, kv-aware (the engine holding the longest cached prefix, weighed "
                    "against load) or session (the same --session-header value, the same engine)",
        choices=ROUTING_POLICIES)
    routing_imbalance: int = option(
        8, "requests in flight by which the busiest engine may exceed the idlest before kv-aware routing "
           "sends to the idlest whatever it has cached", minimum=0)
    max_migrations: int = option(
        2, "times a request moves to another engine when its engine dies mid-stream (0: never; the "
           "client gets the error)", minimum=0)
    max_engine_deaths: int = option(
        2, "engines that may die with one request id in flight, retries with that id included, before the "
           "processor fails it instead of sending it to another: a request that kills engines reaches no more",
        minimum=1)
    routing_request_cost: int = option(
        256, "prompt tokens that one request already running or waiting on an engine counts as, when kv-aware "
             "routing weighs an engine's cache hit against its queue", minimum=0)

    def __post_init__(self) -> None:
        check_fields(self)


# What the processor takes of ModelConfig besides FleetConfig's models and their names (--model,
# --served-model-name): how it templates chats and where GGUF tokenizers are extracted to.
PROCESSOR_MODEL_FIELDS = ("chat_template", "cache_dir")


@dataclass(frozen=True)
class ProcessorServiceConfig:
    """How the processor service finds its engines: an address, or a Kubernetes Service's endpoints."""

    engine_address: tuple[str, ...] = option(
        (), "an engine's host:port, off Kubernetes (repeatable, or comma-separated in the environment; several: "
            f"the router chooses per request; default {default_address('engine')})")
    engine_service: str | None = option(
        None, "the engines' Kubernetes Service: route to its ready endpoints (port named grpc); "
              "excludes --engine-address")
    engines_from_index: bool = option(
        False, "route to the engines alive in --prefix-index (their heartbeats; engine ids are addresses), "
               "followed every few seconds; excludes --engine-address and --engine-service; needs "
               "--engine-allowed-address or --trust-index-engines")
    engine_allowed_address: tuple[str, ...] = option(
        (), "with --engines-from-index, an engine the processor may dial: host:port, unix:/path, an IP (any "
            "port) or a network in CIDR (repeatable); index entries outside these are never dialled",
        parse=allowed_address)
    trust_index_engines: bool = option(
        False, "with --engines-from-index, dial whatever engine the index names (no allow-list): only for an "
               "index that no one else can write")
    namespace: str | None = option(
        None, "the Service's namespace (default: this pod's, else $KVMESH_NAMESPACE, else default)")
    engine_timeout: float = option(10.0, "deadline (s) of each unary engine call", minimum=0.0)
    startup_timeout: float = option(300.0, "seconds to wait for an engine to come up", minimum=0.0)
    tokenizer_threads: int = option(4, "threads that tokenize prompts and render chat templates, off the event loop",
                                    minimum=1)

    def __post_init__(self) -> None:
        check_fields(self)
        sources = (bool(self.engine_address), self.engine_service is not None, self.engines_from_index)
        if sum(sources) > 1:
            raise ValueError("--engine-address, --engine-service and --engines-from-index exclude each other")
        if len(set(self.engine_address)) != len(self.engine_address):
            raise ValueError(f"--engine-address names an engine twice: {self.engine_address}")
        for allowed in self.engine_allowed_address:
            allowed_address(allowed)
        if self.engines_from_index and not self.engine_allowed_address and not self.trust_index_engines:
            raise ValueError("--engines-from-index needs --engine-allowed-address (the engines it may dial) or "
                             "--trust-index-engines: anyone who can write the index could name an engine")
        if (self.engine_allowed_address or self.trust_index_engines) and not self.engines_from_index:
            raise ValueError("--engine-allowed-address and --trust-index-engines go with --engines-from-index")


@dataclass(frozen=True)
class GatewayConfig:
    processor_address: str = option(default_address("processor"), "the processor")
    timeout: float = option(10.0, "deadline (s) of each unary processor call and of the health check",
                            minimum=0.0)
    access_log: bool = option(True, "uvicorn's access log")
    log_level: str = option("info", "uvicorn's log level", choices=LOG_LEVELS)
    api_key: tuple[str, ...] = option(
        (), "a key clients must send as `Authorization: Bearer <key>` (repeatable; default: the "
            "comma-separated keys in KVMESH_API_KEY; none: no authentication)")
    api_key_file: Path | None = option(
        None, "a file of API keys clients may send, one a line (a mounted Secret: keys stay off the command line "
              "and out of the environment); read once at start, added to --api-key's; an empty file is an error")
    priority_api_key_file: Path | None = option(
        None, "a file of API keys, one a line, that may set a request's `priority` (and are keys like --api-key's); "
              "with --api-key, any other key's request that sets it is a 403")
    aggregate_metrics: tuple[str, ...] = option(
        (), "/metrics URL of a local service to merge into this /metrics (repeatable; set by `kvmesh serve`, "
            "never in a pod, where each is scraped on its own)", parse=http_url)
    # A client's connection (services/gateway/connection_guard.py).
    header_timeout: float = option(10.0, "seconds a client has to send a request's headers, from its connection "
                                         "or its request's first byte; then it is closed (408)", minimum=0.1)
    body_timeout: float = option(60.0, "seconds a client has to send a request's whole body once its headers are "
                                       "in; then it is closed", minimum=0.1)
    keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive connection stays open", minimum=0.1)
    send_timeout: float = option(
        60.0, "seconds a client may leave the gateway's answer unread (its socket's buffers full) before the "
              "connection is closed and its requests aborted: a client that stops reading is paused, never "
              "buffered without end", minimum=0.1)
    max_connections: int = option(1000, "client connections open at once; more are answered 503 and closed at once "
                                        "(lowered to fit the process's file-descriptor limit)", minimum=1)
    max_connections_per_client: int = option(
        256, "connections one client may hold open at once; more are answered 429 and closed at once (the client "
             "is the peer's address, or X-Forwarded-For's behind a --trusted-proxy)", minimum=1)
    trusted_proxy: tuple[str, ...] = option(
        (), "the IP address or network (10.0.0.0/8) of proxies in front of the gateway (repeatable): on their "
            "connections the client is the last address X-Forwarded-For names that is not a trusted proxy; "
            "elsewhere that header is ignored", parse=trusted_proxy)
    max_buffered_body_bytes: int = option(
        256 * 2**20, "bytes of request bodies the gateway holds at once, all requests in flight together; a request "
                     "whose body would go over is answered 503 and closed", minimum=1)
    max_header_bytes: int = option(16384, "bytes of a request's line and headers; more is a 431", minimum=1024)
    max_headers: int = option(100, "headers of one request; more is a 431", minimum=1)
    session_header: str = option(
        "x-session-id", "the header whose value routes a client's requests to one engine (--routing session); "
                        "at most 256 characters, longer is a 400")
    return_tokens_as_token_ids: bool = option(
        False, "write logprobs' tokens as 'token_id:N' unless a request's return_tokens_as_token_ids says "
               "otherwise (vLLM's flag)")
    # vLLM's server flags.
    root_path: str = option(
        "", "the path prefix a proxy serves the API under and strips before forwarding (e.g. /kvmesh): the "
            "ASGI root_path, as vLLM's --root-path")
    cache_salt_per_api_key: bool = option(
        False, "keep each API key's prefix cache its own: every request's cache_salt starts with a hash of its "
               "key, so cached_tokens cannot tell one tenant what another sent. Off: keys share cached prefixes")
    enable_request_id_headers: bool = option(
        False, "answer every response with an X-Request-Id header (the client's, or a new one), as vLLM's flag")
    enable_force_include_usage: bool = option(
        False, "usage on every stream chunk and a usage chunk last, whatever stream_options say (as vLLM)")
    enable_tokenizer_info_endpoint: bool = option(
        False, "serve GET /tokenizer_info (the tokenizer's configuration, chat template included)")
    # Tool calling: tool_choice "required" or named works with any model, through the grammar;
    # "auto" reads the calls out of the model's own text, as vLLM's flags of the same names.
    enable_auto_tool_choice: bool = option(
        False, "accept tool_choice 'auto' (the default with tools): the model decides, --tool-call-parser "
               "reads its calls")
    tool_call_parser: str | None = option(
        None, "how the model writes tool calls (services/gateway/tool_parsers.py); a model whose own chat template "
              "shows it no tools takes the parser's from services/processor/chat_templates/ as --chat-template",
        choices=TOOL_CALL_PARSERS)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with / and not end with one (e.g. /kvmesh), got {self.root_path!r}")


# What `kvmesh serve` takes of GatewayConfig (the rest it sets itself, or leaves to a pod).
GATEWAY_SERVE_FIELDS = ("api_key", "api_key_file", "priority_api_key_file", "access_log", "log_level",
                        "header_timeout", "body_timeout", "keep_alive_timeout", "send_timeout", "max_connections",
                        "max_connections_per_client", "trusted_proxy", "max_buffered_body_bytes", "max_header_bytes",
                        "max_headers", "session_header", "return_tokens_as_token_ids", "root_path",
                        "cache_salt_per_api_key", "enable_request_id_headers", "enable_force_include_usage",
                        "enable_tokenizer_info_endpoint", "enable_auto_tool_choice", "tool_call_parser")


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the gateway; over a limit is a 400 naming the limit's flag
    (services/gateway/limits.py checks them)."""

    max_body_bytes: int = option(8 * 2**20, "bytes of a request body", minimum=1)
    max_prompts: int = option(64, "prompts in one completion request (conversations in one batched chat request)",
                              minimum=1)
    max_n: int = option(16, "choices per prompt (n)", minimum=1)
    max_chars_per_token: int = option(
        128, "characters one token may cover: a prompt (or chat messages) of more than the context length times "
             "this many characters is refused before it is tokenized (the processor checks again with its "
             "vocabulary's longest token)", minimum=1)
    max_sequences_per_request: int = option(
        64, "sequences one request may ask for: its prompts times n", minimum=1)
    max_logprobs: int = option(
        MAX_LOGPROBS, "top logprobs per token (logprobs, top_logprobs, prompt_logprobs); -1: no limit, so that -1 in "
                      "a request (the whole vocabulary) is allowed, as vLLM's --max-logprobs", minimum=-1)
    max_stop_strings: int = option(16, "stop strings in one request", minimum=1)
    max_stop_string_length: int = option(256, "characters of one stop string", minimum=1)
    # Token-id lists, counted as sent (duplicates included); each id must also be in the vocabulary.
    max_allowed_token_ids: int = option(
        131072, "token ids in one request's allowed_token_ids, duplicates counted. The default covers most of a "
                "152k vocabulary; to ban a few tokens, logit_bias -100 is the cheaper way",
        minimum=1, maximum=MAX_TOKEN_IDS)
    max_logit_bias: int = option(1024, "token ids in one request's logit_bias", minimum=1, maximum=MAX_TOKEN_IDS)
    max_stop_token_ids: int = option(1024, "token ids in one request's stop_token_ids, duplicates counted",
                                     minimum=1, maximum=MAX_TOKEN_IDS)
    max_answer_tokens: int = option(
        131072, "tokens one request's answer may hold over all its choices, each top logprob counted as a token: "
                "prompts x n x max_tokens x (1 + top logprobs). A request that leaves max_tokens open gets at most "
                "what fits; one that sets more is a 400", minimum=1)
    # None: only the model's context bounds it. --max-tokens would read as a default, hence the name.
    max_tokens: int | None = option(
        None, "tokens one choice may generate; a request that leaves max_tokens open gets this many at most "
              "(default: no limit)", flag="--max-tokens-limit", minimum=1)

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class GrammarLimits:
    """What one output constraint (JSON schema, regex, choice list, grammar) may hold, and what its
    compile may cost. Gateway, processor and engine each check the bounds in linear time before
    anything compiles (services/common/grammar.py); over one is a 400 naming its flag."""

    max_constraint_bytes: int = option(
        128 * 1024, "bytes of one request's constraint: its JSON schema, regex, grammar or choice list as JSON",
        minimum=16)
    max_constraint_choices: int = option(4096, "entries of one choice list (guided_choice, structured_outputs.choice)",
                                         minimum=1)
    max_constraint_depth: int = option(
        64, "nesting depth of a JSON schema: its objects and arrays within each other, counted as in the JSON text",
        minimum=2)
    max_regex_length: int = option(4096, "characters of a regex constraint (guided_regex, structured_outputs.regex)",
                                   minimum=1)
    max_grammar_rules: int = option(1024, "rules of a Lark or GBNF grammar constraint (guided_grammar, "
                                          "structured_outputs.grammar)", minimum=1)
    grammar_compile_timeout: float = option(
        10.0, "seconds a request waits for its grammar to compile on the engine before it fails; llguidance's "
              "own fuel limits end the compile itself", minimum=0.0)
    grammar_compile_threads: int = option(
        2, "threads that compile grammars on the engine, off its loop: a slow grammar holds one of them, never "
           "the others' compiles or the steps", minimum=1)

    def __post_init__(self) -> None:
        check_fields(self)


# The engine's fields of GrammarLimits: gateway and processor check bounds and validate, never compile.
GRAMMAR_COMPILE_FIELDS = ("grammar_compile_timeout", "grammar_compile_threads")


@dataclass(frozen=True)
class ServeConfig:
    """`kvmesh serve`'s own knobs (the services' come from the dataclasses above)."""

    host: str = option("127.0.0.1", "interface the API listens on")
    port: int = option(DEFAULT_PORTS["gateway"].port, "port of the API", minimum=0, maximum=65535)
    startup_timeout: float = option(600.0, "seconds each service may take to become healthy", minimum=0.0)
    print_addresses: bool = option(False, "print one JSON line with every service's address and pid once ready")
    grace: float = option(5.0, "seconds requests in flight get to finish at shutdown (the gateway's drain); those "
                               "still running then end with an error", minimum=0.0)
    internal_grace: float = option(2.0, "the same for processor, engine and worker, stopped once the gateway is "
                                        "gone", minimum=0.0)
    restart_backoff: float = option(1.0, "seconds before the first restart of a dead engine+worker pair, processor "
                                         "or gateway; doubled for each restart that follows within --restart-window",
                                    minimum=0.0)
    restart_backoff_max: float = option(30.0, "the most seconds between restarts", minimum=0.0)
    max_restarts: int = option(5, "restarts of one engine+worker pair, the processor or the gateway within "
                                  "--restart-window before kvmesh serve gives up on it; the other pairs serve "
                                  "on, and losing the last pair, the processor or the gateway stops everything "
                                  "(exit 1)", minimum=0)
    restart_window: float = option(300.0, "seconds over which restarts are counted; a pair healthy this long "
                                          "starts again from --restart-backoff", minimum=1.0)
    num_engines: int = option(1, "engine+worker pairs behind the one processor (each restarted on its own)",
                              minimum=1, maximum=64)
    prefill_engines: int = option(0, "disaggregated prefill/decode: prefill engine+worker pairs (with "
                                     "--decode-engines; replaces --num-engines)", minimum=0, maximum=32)
    decode_engines: int = option(0, "disaggregated prefill/decode: decode engine+worker pairs, the ones the "
                                    "processor routes to (with --prefill-engines)", minimum=0, maximum=32)

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.prefill_engines > 0) != (self.decode_engines > 0):
            raise ValueError("--prefill-engines and --decode-engines go together (at least one of each)")
        if self.prefill_engines and self.num_engines != 1:
            raise ValueError("--num-engines and --prefill-engines/--decode-engines exclude each other")


def flag_of(config_class: type, name: str) -> str:
    """The command-line flag of a field, e.g. `--max-tokens-limit` for Limits.max_tokens."""
    return flag_name(next(f for f in fields(config_class) if f.name == name))
