"""The model families (tiny random models, tests/model/families.py) across processes, as users run them:

  - Qwen2, whose q, k and v biases are cut with their heads, at tensor-parallel size 2 (`LLM` over
    two worker processes): transformers' greedy tokens through chunks, preemption and a prefix hit;
  - `kvmesh serve` of an architecture kvmesh does not serve exits at once, naming it.

Several families behind one `kvmesh serve` are in test_serve_models.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from services import LLM
from tests.model.families import BATCHED_TOKENS, KV_BLOCKS, Family, check_greedy, run_scenario, save_unsupported
from tests.services.procs import PYTHON, REPO_ROOT, free_port, gone



def test_qwen2_at_tensor_parallel_size_2_matches_transformers(model_families: dict[str, Family]) -> None:
    family = model_families["qwen2"]
    # Each rank holds one of the two KV heads: half a block's bytes.
    with LLM(model=str(family.path), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=BATCHED_TOKENS,
             kv_cache_memory=KV_BLOCKS * family.block_bytes // 2) as llm:
        pids = llm._worker_processes.pids
        assert len(pids) == 2
        scenario = run_scenario(llm)
    assert all(gone(pid) for pid in pids)
    assert check_greedy(scenario, family.reference) <= 1, "more partings than float noise"


def test_serve_refuses_an_unsupported_architecture_by_name(model_path: Path, tmp_path: Path) -> None:
    save_unsupported(tmp_path, model_path)
    done = subprocess.run([PYTHON, "-m", "services.cli", "serve", "--model", str(tmp_path), "--port", str(free_port())],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("kvmesh: unsupported model architecture ['GPT2LMHeadModel']; supported: "
                           "Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM\n")
    assert done.stdout == ""
