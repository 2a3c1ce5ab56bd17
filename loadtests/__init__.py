"""Load tests and benchmarks. Run each one as a module from the repository root, e.g.

    .venv/bin/python -m loadtests.offline_throughput --help
"""
