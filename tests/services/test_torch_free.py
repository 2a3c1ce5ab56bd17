"""The processor and the gateway never import torch (a processor once dequantized the whole GGUF
model to get its tokenizer), and kvmesh_kernels/ imports nothing from services/.

Checked twice: in a fresh interpreter (sys.modules), and on the real processes (/proc/<pid>/maps).
The processor starts from an empty cache dir, as a Kubernetes pod without the worker's cache does.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

from tests.services.procs import PYTHON, REPO_ROOT, free_port, gateway_command, processor_command, running_service

PROCESSOR_CORE = """
import json, sys
from pathlib import Path
import services.cli, services.gateway.app, services.gateway.server, services.processor.server
from services.common.model_files import model_id_of, resolve_tokenizer
from services.processor.processor import Processor

path = resolve_tokenizer("smollm2", Path(sys.argv[1]))  # what processor.server.serve does
processor = Processor.load(path, 2048)
ids = processor.tokenize_chat([{"role": "user", "content": "Hi 👋"}])
print(json.dumps({"torch": "torch" in sys.modules, "model_id": model_id_of(path),
                  "text": processor.detokenize(ids), "cache": sorted(p.name for p in Path(sys.argv[1]).iterdir())}))
"""

KERNELS_IMPORTS = """
import json, pkgutil, importlib, sys
import kvmesh_kernels
for module in pkgutil.iter_modules(kvmesh_kernels.__path__):
    importlib.import_module(f"kvmesh_kernels.{module.name}")
print(json.dumps(sorted(name for name in sys.modules if name == "services" or name.startswith("services."))))
"""


def run_python(code: str, *args: str) -> str:
    result = subprocess.run([PYTHON, "-c", code, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.strip().splitlines()[-1]


def torch_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        return {line.split()[-1] for line in f if "libtorch" in line}


def test_processor_core_imports_no_torch(tmp_path: Path) -> None:
    out = json.loads(run_python(PROCESSOR_CORE, str(tmp_path)))
    assert out["torch"] is False
    assert out["model_id"] == "SmolLM2-135M-Instruct.Q4_1-98362432"  # the engine's, so the check agrees
    assert out["text"].endswith("<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n")
    # Only the tokenizer was extracted into the empty cache (beside the GGUF file's digest): no weights
    # were converted.
    assert len(out["cache"]) == 2 and out["cache"][0].endswith(".tokenizer") and out["cache"][1] == "digests"


def test_kernels_import_nothing_from_services() -> None:
    assert json.loads(run_python(KERNELS_IMPORTS)) == []


def test_worker_and_engine_import_no_web_stack_and_the_engine_no_model_code() -> None:
    """A worker pod needs no HTTP server, nor transformers once its model's config is resolved (the
    import is slow); an engine pod none of them, nor torch."""
    code = """
import json, sys
import services.cli, services.{service}.server
print(json.dumps(sorted(m for m in ("fastapi", "starlette", "uvicorn", "torch", "transformers") if m in sys.modules)))
"""
    assert json.loads(run_python(code.format(service="worker"))) == ["torch"]
    assert json.loads(run_python(code.format(service="engine"))) == []


def test_processor_and_gateway_processes_map_no_libtorch(tmp_path: Path) -> None:
    # A plain socket stands in for the engine: the processor connects to it once its tokenizer is
    # loaded (it then waits for the engine), which is when it would have loaded torch.
    with socket.create_server(("127.0.0.1", 0)) as engine:
        engine.settimeout(240)
        cmd = processor_command(engine_address=f"127.0.0.1:{engine.getsockname()[1]}", port=free_port(),
                                cache_dir=tmp_path, metrics_port=0)
        processor = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        try:
            while not list(tmp_path.glob("*.tokenizer")):  # connections before the tokenizer (none today)
                engine.accept()[0].close()
            engine.accept()[0].close()  # an engine.info() of wait_for_engine: the tokenizer is loaded
            assert processor.poll() is None
            assert torch_libraries(processor.pid) == set()
        finally:
            processor.kill()
            processor.wait()
    gateway_port = free_port()
    with running_service(gateway_command(processor_address=f"127.0.0.1:{free_port()}", port=gateway_port),
                         gateway_port, health="http", http_path="/version") as gateway:
        assert torch_libraries(gateway.proc.pid) == set()
