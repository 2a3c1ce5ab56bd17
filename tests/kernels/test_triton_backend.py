"""The worker's Triton attention backend against its torch backend, through the backend protocol
(`plan(meta)` once, `forward(...)` per layer) on the engine's own metadata; and how it is chosen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvmesh_kernels.reference import paged_attention_ref
from services.worker.attention import get_attention_backend
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.attention.triton_backend import TritonAttentionBackend
from tests.model.test_model import make_metadata

REPO = Path(__file__).resolve().parents[2]


# A prefill chunk over cached context, decodes, a whole prompt; blocks out of order.
QUERY_LENS, SEQ_LENS = [5, 1, 17, 1], [20, 33, 17, 70]
BLOCK_TABLES = [[3, 0], [7, 1, 9], [2, 4], [5, 6, 8, 10, 11]]


def step_inputs(gen: torch.Generator):
    """On the CPU, where the torch backend runs (its plan keeps the metadata on the host)."""
    num_tokens = sum(QUERY_LENS)
    cache = torch.randn((2, 12, 16, 2, 64), generator=gen)  # earlier steps' K/V
    q = torch.randn((num_tokens, 6, 64), generator=gen)
    k, v = torch.randn((2, num_tokens, 2, 64), generator=gen)
    return cache, q, k, v


@pytest.mark.parametrize("sliding_window", [None, 8])
def test_same_cache_and_output_as_the_torch_backend(sliding_window, device) -> None:
    layer = SimpleNamespace(num_heads=6, num_kv_heads=2, head_size=64, scale=0.125,
                            sliding_window=sliding_window, logits_soft_cap=None)
    meta = make_metadata(QUERY_LENS, SEQ_LENS, BLOCK_TABLES)
    cache, q, k, v = step_inputs(torch.Generator().manual_seed(1))
    triton_cache = cache.clone().to(device)
    torch_backend, triton_backend = TorchAttentionBackend(), get_attention_backend("triton", device)
    assert isinstance(triton_backend, TritonAttentionBackend)
    expected = torch_backend.forward(layer, q, k, v, cache, torch_backend.plan(meta))
    out = triton_backend.forward(layer, q.to(device), k.to(device), v.to(device), triton_cache,
                                 triton_backend.plan(meta))
    assert torch.equal(triton_cache.cpu(), cache)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)


def test_layer_window_and_soft_cap_reach_the_kernel(device) -> None:
    layer = SimpleNamespace(num_heads=6, num_kv_heads=2, head_size=64, scale=0.4, sliding_window=8,
                            logits_soft_cap=3.0)
    meta = make_metadata(QUERY_LENS, SEQ_LENS, BLOCK_TABLES)
    cache, q, k, v = (t.to(device) for t in step_inputs(torch.Generator().manual_seed(2)))
    backend = get_attention_backend("triton", device)
    out = backend.forward(layer, q, k, v, cache, backend.plan(meta))
    expected = paged_attention_ref(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                   scale=0.4, sliding_window=8, logits_soft_cap=3.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_auto_is_not_triton_on_the_cpu() -> None:
    assert get_attention_backend("auto", torch.device("cpu")).name in ("cpu", "torch")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", torch.device("cpu"))


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_torch_backend_needs_no_triton_and_triton_needs_the_interpreter_on_the_cpu() -> None:
    # A fresh process without TRITON_INTERPRET: choosing torch imports no Triton at all; choosing
    # Triton on the CPU fails at once with a message that says what to do.
    code = (
        "import sys, torch\n"
        "from services.worker.attention import get_attention_backend\n"
        "get_attention_backend('torch', torch.device('cpu'))\n"
        "assert 'triton' not in sys.modules, 'the torch backend imported triton'\n"
        "try:\n"
        "    get_attention_backend('triton', torch.device('cpu'))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "set TRITON_INTERPRET=1" in result.stdout
