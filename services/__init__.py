"""kvmesh: vLLM's V1 engine taken apart into services. The offline API lives here.

`LLM` is imported lazily: the engine, processor and gateway processes import `services.*` without
needing torch's model code or transformers' models at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.common.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from services.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from services import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'services' has no attribute {name!r}")
