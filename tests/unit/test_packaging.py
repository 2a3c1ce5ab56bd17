"""Packaging facts the rest of the code relies on."""

from __future__ import annotations

import importlib.metadata

import kernels
import services


def test_transformers_does_not_mistake_our_kernels_package_for_hugging_faces():
    # `kernels` is also the import name of a Hugging Face package that transformers probes; if it
    # believed ours were that one it would try to load hub kernels (and fail offline).
    from transformers.utils.import_utils import is_kernels_available

    assert kernels.__file__.startswith(services.__path__[0].rsplit("/", 1)[0])
    assert not is_kernels_available()


def test_distribution_exposes_the_console_script_and_packages():
    dist = importlib.metadata.distribution("kvmesh")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"kvmesh": "services.cli:main"}
    requires = " ".join(dist.requires or [])
    for dep in ("torch>=2.13", "transformers", "gguf", "grpcio", "fastapi", "redis"):
        assert dep in requires


def test_public_offline_api():
    assert {"LLM", "SamplingParams"} <= set(services.__all__)
