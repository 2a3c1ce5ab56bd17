"""services/worker/host_limits.py in real cgroups made here, a child of this process's own: a worker
whose cgroup has a memory limit sizes its KV cache within it, and one whose cgroup has a CPU quota
computes with as many threads as the quota allows. Each runs in a process of its own that moves
itself into the cgroup first. Needs root and a writable cgroup hierarchy; skipped where there is
none (most containers)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.worker import host_limits

MiB = 2**20
LIMIT_FILES = {"memory": ("memory.max", "memory.limit_in_bytes"), "cpu": ("cpu.max", "cpu.cfs_quota_us")}


@pytest.fixture
def make_cgroup() -> Iterator[Callable[[str], tuple[Path, bool]]]:
    """make_cgroup(controller) -> (a new child of this process's cgroup for it, whether it is v2)."""
    made: list[Path] = []

    def make(controller: str) -> tuple[Path, bool]:
        own = host_limits.cgroups(controller, *LIMIT_FILES[controller])
        if not own:
            pytest.skip(f"no {controller} cgroup hierarchy is mounted here")
        parent, v2 = own[0]
        directory = parent / f"kvmesh-test-{os.getpid()}-{controller}"
        try:
            directory.mkdir()
        except OSError as error:
            pytest.skip(f"cannot make a {controller} cgroup here: {error}")
        made.append(directory)
        if not (directory / LIMIT_FILES[controller][0 if v2 else 1]).exists():
            pytest.skip(f"the {controller} controller is not enabled for child cgroups here")
        return directory, v2

    yield make
    for directory in made:
        directory.rmdir()


def run_in(directory: Path, body: str, env: dict[str, str] | None = None) -> list[str]:
    """`body` in a new Python process (environment `env`, else this one's) that first moves itself
    into the cgroup; its printed words."""
    script = f"import os\nopen({str(directory / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n{body}"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_a_cache_sized_from_free_memory_stays_within_the_cgroups_limit(make_cgroup) -> None:
    directory, v2 = make_cgroup("memory")
    limit = 768 * MiB
    (directory / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
    room, budget = map(int, run_in(directory, (
        "import torch\n"
        "from services.worker import host_limits\n"
        "from services.worker.kv_cache import KVCacheSpec, num_blocks_for_budget\n"
        "spec = KVCacheSpec(30, 3, 64, 16, torch.float32)\n"
        "blocks = num_blocks_for_budget(spec, None, 0.5, torch.device('cpu'))\n"
        "print(host_limits.available_bytes(), blocks * spec.bytes_per_block)\n")))
    assert limit - 256 * MiB < room <= limit  # the limit, less what the process itself holds
    assert budget <= 0.5 * room
    assert host_limits.available_bytes() > limit  # this process, outside that cgroup, is not bound by it


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a quota below the CPUs needs two of them")
def test_a_worker_under_a_cpu_quota_computes_with_that_many_threads(make_cgroup) -> None:
    directory, v2 = make_cgroup("cpu")
    if v2:
        (directory / "cpu.max").write_text("100000 100000")
    else:
        (directory / "cpu.cfs_period_us").write_text("100000")
        (directory / "cpu.cfs_quota_us").write_text("100000")
    generate = (
        "import torch\n"
        "from services import LLM, SamplingParams\n"
        "llm = LLM(model='smollm2', kv_cache_memory=64 * 2**20, max_model_len=256)\n"
        "[out] = llm.generate(['The capital of France is'], SamplingParams(temperature=0, max_tokens=4))\n"
        "print(torch.get_num_threads(), len(out.outputs[0].token_ids))\n")
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    threads, tokens = map(int, run_in(directory, generate, env))
    assert (threads, tokens) == (1, 4)  # one CPU's worth of time per period: one thread
    assert host_limits.cpu_threads() == len(os.sched_getaffinity(0))  # outside it, every CPU
    # The user's OMP_NUM_THREADS wins over the quota.
    threads, _ = map(int, run_in(directory, generate, {**env, "OMP_NUM_THREADS": "2"}))
    assert threads == 2
