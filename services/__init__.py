"""kvmesh: vLLM's V1 engine taken apart into services. The offline API lives here."""

from services.common.sampling_params import SamplingParams
from services.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
