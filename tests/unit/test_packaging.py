"""Packaging facts the rest of the code relies on."""

from __future__ import annotations

import importlib.metadata

import kvmesh_kernels
import services


def test_our_kernels_package_does_not_shadow_hugging_faces():
    # `kernels` is the import name of a Hugging Face package that transformers requires and imports
    # with its model classes; a package of ours by that name, first on sys.path, broke that import.
    import kernels
    from transformers.integrations import hub_kernels  # noqa: F401  (imports `kernels` when present)

    assert kvmesh_kernels.__file__.startswith(services.__path__[0].rsplit("/", 1)[0])
    assert importlib.metadata.packages_distributions()["kernels"] == ["kernels"]
    assert hasattr(kernels, "CUDAProperties")


def test_distribution_exposes_the_console_script_and_packages():
    dist = importlib.metadata.distribution("kvmesh")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"kvmesh": "services.cli:main"}
    requires = " ".join(dist.requires or [])
    for dep in ("torch>=2.13", "transformers", "gguf", "grpcio", "fastapi", "redis"):
        assert dep in requires


def test_public_offline_api():
    assert {"LLM", "SamplingParams"} <= set(services.__all__)
