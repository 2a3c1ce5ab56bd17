"""The servers the serving benchmark compares, each started on a free loopback port and stopped after.

    kvmesh        `kvmesh serve`: gateway, processor, engine and worker as four processes over gRPC
    inprocess     the same components in one process (loadtests.inprocess_server)
    transformers  `transformers serve --continuous-batching` on the same model folder
    llama-server  llama.cpp's `llama-server` (the CPU anchor), built by
                  ../shared/anchors/build-llama-server.sh into --llama-server-dir, serving the GGUF of
                  --llama-file-type (SmolLM2 requantised from the wheel's Q4_1) with --llama-slots
                  slots of 2,048 tokens, continuous batching, --threads threads (-t and -tb),
                  its weight repacking as --llama-repack says (off: llama.cpp's AMX repack of Q4_1 /
                  Q8_0 dies with SIGILL in this workplace's Xeon VMs; no other repack applies to Q4_1)
    url           a server already running at --url (not started, not stopped)

Every started server gets the same model folder, dtype, device, KV cache size and thread count
(OMP_NUM_THREADS for all, llama-server's -t and -tb besides); kvmesh and
inprocess also the same scheduler limits. transformers serve takes its KV cache as a number of
blocks of its default page size (256 tokens, all layers), so it gets the blocks that fit in the same
bytes (`--cb-num-blocks`), and kvmesh's token budget per step (`--cb-max-batch-tokens`); its page
size stays its own default. Making every answer exactly max_tokens long takes
`ignore_eos` on kvmesh (vLLM's extra); transformers serve refuses unknown fields, so it gets a
`generation_config` whose eos id is -1 (none), which its continuous batching reads per request.

A server writes its output to <log dir>/<target>.log; if it does not come up, `TargetUnavailable`
carries the reason and the log's last lines. Stopping: SIGTERM, then SIGKILL after STOP_TIMEOUT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
from transformers import AutoConfig
from transformers.utils.import_utils import is_serve_available

from loadtests.serving_client import Endpoint
from services.common.model_files import locate_model
from services.common.processes import free_ports, http_ok, read_ready_line
from services.worker.loader import resolve_model

TARGETS = ("kvmesh", "inprocess", "transformers", "llama-server", "url")
DEFAULT_ANCHOR_DIR = Path.home() / ".cache" / "kvmesh-anchors"  # where build-llama-server.sh builds
LLAMA_SLOT_TOKENS = 2048  # context per llama-server slot (its -c is slots x this), unless configured
LOOPBACK = "127.0.0.1"
URL_WAIT = 30.0  # seconds a --url server (already started) may take to answer /health
STOP_TIMEOUT = 30.0  # seconds a server gets to stop after SIGTERM (kvmesh serve needs about 10)
TRANSFORMERS_PAGE_SIZE = 256  # tokens per KV block of transformers' continuous batching (its default)
DTYPE_BYTES = {"float32": 4, "auto": 4, "bfloat16": 2, "float16": 2}  # auto: float32 KV for the GGUF default
VLLM_EXTRAS = {"ignore_eos": True, "stream_options": {"include_usage": True}}


class TargetUnavailable(Exception):
    """A target that could not be started or reached; the message says why."""


@dataclass(frozen=True)
class ServerConfig:
    """What every server the benchmark starts is given."""

    model: str
    dtype: str
    device: str
    kv_cache_memory: int  # bytes
    max_num_seqs: int
    max_num_batched_tokens: int
    startup_timeout: float  # seconds
    log_dir: Path
    threads: int = os.cpu_count() or 1  # of every server: OMP_NUM_THREADS, llama-server's -t and -tb
    llama_server_dir: Path = DEFAULT_ANCHOR_DIR
    llama_file_type: str = "f16"  # models/smollm2-<this>.gguf: f16, f32, bf16, q8_0, q4_1; "model": --model's own GGUF
    llama_slots: int = 32
    llama_repack: bool = True  # llama-server's --repack / --no-repack
    kvmesh_args: tuple[str, ...] = ()  # more flags for kvmesh and inprocess (LoRA adapters, say)
    llama_slot_tokens: int = LLAMA_SLOT_TOKENS  # context per llama-server slot


@contextmanager
def started(target: str, config: ServerConfig, url: str | None = None,
            url_api: str = "vllm") -> Iterator[Endpoint]:
    """The target's endpoint while its server runs; the server is stopped on the way out."""
    if target == "url":
        if not url:
            raise TargetUnavailable("--target url needs --url http://127.0.0.1:PORT")
        url = url.rstrip("/")
        wait_healthy(url, None, min(config.startup_timeout, URL_WAIT), None)
        yield Endpoint(url, served_model(url), VLLM_EXTRAS if url_api == "vllm" else _transformers_extras())
        return
    port, = free_ports(1)
    url = f"http://{LOOPBACK}:{port}"
    command = server_command(target, config, port)
    log_path = config.log_dir / f"{target}.log"
    env = server_env(config)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    try:
        wait_healthy(url, proc, config.startup_timeout, log_path)
        extras = _transformers_extras() if target == "transformers" else VLLM_EXTRAS
        yield Endpoint(url, served_model(url), extras)
    finally:
        stop(proc, target, log_path)


def server_env(config: ServerConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Every server's environment: the same thread count for all, whatever this shell says."""
    env = dict(os.environ if environ is None else environ)
    env.update(OMP_NUM_THREADS=str(config.threads), MKL_NUM_THREADS=str(config.threads))
    return env


def server_command(target: str, config: ServerConfig, port: int) -> list[str]:
    common = ["--host", LOOPBACK, "--port", str(port), "--dtype", config.dtype, "--device", config.device]
    if target in ("kvmesh", "inprocess"):
        entry = ["services.cli", "serve", "--print-addresses"] if target == "kvmesh" else ["loadtests.inprocess_server"]
        return [sys.executable, "-m", *entry, "--model", config.model, *common,
                "--kv-cache-memory", str(config.kv_cache_memory), "--max-num-seqs", str(config.max_num_seqs),
                "--max-num-batched-tokens", str(config.max_num_batched_tokens), *config.kvmesh_args]
    if target == "transformers":
        if not is_serve_available():
            raise TargetUnavailable("`transformers serve` needs pydantic, fastapi, uvicorn and openai; "
                                    "install them with: pip install -e '.[bench]'")
        exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
        if exe is None:
            raise TargetUnavailable("no `transformers` command next to this Python or on PATH")
        model_path = resolve_model(config.model)
        return [exe, "serve", str(model_path), "--continuous-batching", *common,
                "--cb-num-blocks", str(kv_blocks(model_path, config)),
                "--cb-max-batch-tokens", str(config.max_num_batched_tokens), "--log-level", "warning"]
    if target == "llama-server":
        exe = config.llama_server_dir / "llama-build" / "bin" / "llama-server"
        gguf = llama_gguf(config)
        for needed in (exe, gguf):
            if not needed.exists():
                raise TargetUnavailable(f"{needed} is missing: build it with ../shared/anchors/build-llama-server.sh "
                                        f"{config.llama_server_dir}")
        threads = str(config.threads)
        return [str(exe), "-m", str(gguf), "--host", LOOPBACK, "--port", str(port), "-t", threads, "-tb", threads,
                "-np", str(config.llama_slots), "-cb", "-c", str(config.llama_slots * config.llama_slot_tokens),
                "--no-webui", "--repack" if config.llama_repack else "--no-repack"]
    raise ValueError(f"unknown target {target!r}; choose from {TARGETS}")


def llama_gguf(config: ServerConfig) -> Path:
    """The file llama-server serves: a SmolLM2 requantisation of the anchor build, or with
    file type "model" the very GGUF file kvmesh serves for --model (Gemma 3's Q4_K_M, say)."""
    if config.llama_file_type != "model":
        return config.llama_server_dir / "models" / f"smollm2-{config.llama_file_type}.gguf"
    path = locate_model(config.model)
    if path.suffix != ".gguf":
        raise TargetUnavailable(f"--llama-file-type model needs a GGUF model; {config.model} is {path}")
    return path


def kv_blocks(model_path: Path, config: ServerConfig) -> int:
    """transformers' KV blocks (TRANSFORMERS_PAGE_SIZE tokens) that fit in config.kv_cache_memory bytes."""
    hf = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    # K and V, for every layer and KV head: bytes per token
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * DTYPE_BYTES[config.dtype]
    return config.kv_cache_memory // (per_token * TRANSFORMERS_PAGE_SIZE)


def _transformers_extras() -> dict[str, object]:
    # A JSON string, as transformers serve wants it: no eos (-1), greedy. Its stream always ends with usage.
    return {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise TargetUnavailable(f"the server exited with code {proc.returncode} while starting; "
                                    f"{_tail(log_path)}")
        if http_ok(f"{url}/health"):
            return
        if time.monotonic() > deadline:
            raise TargetUnavailable(f"{url}/health did not answer 200 within {timeout:g}s; {_tail(log_path)}")
        time.sleep(0.5)


def served_model(url: str) -> str:
    try:
        models = httpx.get(f"{url}/v1/models", timeout=10.0).json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise TargetUnavailable(f"{url}/v1/models: {type(exc).__name__}: {exc}") from exc
    if not models:
        raise TargetUnavailable(f"{url}/v1/models lists no model")
    return models[0]["id"]


def stop(proc: subprocess.Popen, target: str, log_path: Path) -> None:
    """SIGTERM to the server (kvmesh serve stops its own services in order), SIGKILL to its process
    group if it is not gone within STOP_TIMEOUT; then any kvmesh service it left behind."""
    services = _kvmesh_service_pids(log_path) if target == "kvmesh" else []
    if proc.poll() is None:
        # kvmesh serve stops its children itself; the others may have helpers in their group
        if target == "kvmesh":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            print(f"serving_bench: the {target} server did not stop in {STOP_TIMEOUT:g}s; killing it", file=sys.stderr)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pid in services:  # each service leads a process group of its own
        if _is_kvmesh_service(pid):
            print(f"serving_bench: kvmesh service {pid} outlived kvmesh serve; killing it", file=sys.stderr)
            os.killpg(pid, signal.SIGKILL)


def _kvmesh_service_pids(log_path: Path) -> list[int]:
    ready = read_ready_line(log_path)
    return [] if ready is None else [s["pid"] for s in ready.services.values()]


def _is_kvmesh_service(pid: int) -> bool:
    """Still running and still ours (`python -m services.cli <service>`), not a reused pid."""
    try:
        return b"services.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _tail(log_path: Path | None, lines: int = 15) -> str:
    if log_path is None:
        return "not started here"
    text = log_path.read_text(errors="replace").splitlines()[-lines:]
    return f"the last lines of {log_path}:\n    " + "\n    ".join(text)
