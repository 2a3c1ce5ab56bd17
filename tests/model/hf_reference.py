"""Hugging Face transformers as the model's truth, by teacher forcing: one forward pass of the
reference model over prompt + the tokens our engine generated gives, at every output position, the
reference's distribution for the next token given exactly our prefix.

Our greedy tokens are what `generate(do_sample=False)` would produce iff each of them is the
reference's argmax at its position (by induction over the positions: equal prefixes, equal next
token). Where one is not, the sequences part there, and the test decides whether it is a float
near-tie. One forward pass per sequence instead of one per generated token: the reference costs
seconds, not the minute and more of 25 x 64 decode steps. Memoized per session (the `hf_reference`
fixture in tests/conftest.py), so tests that generate the same tokens share it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.llm import RequestOutput


@dataclass
class Reference:
    token_ids: list[int]  # the reference's argmax at each output position, given our prefix
    logprobs: torch.Tensor  # [num_generated, vocab] log-softmax of the raw logits


class HFReference:
    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf_model = hf_model
        self._scored: dict[tuple[tuple[int, ...], tuple[int, ...]], Reference] = {}

    def __call__(self, prompt: list[int], generated: list[int]) -> Reference:
        key = (tuple(prompt), tuple(generated))
        if key not in self._scored:
            self._scored[key] = self._score(prompt, generated)
        return self._scored[key]

    def _score(self, prompt: list[int], generated: list[int]) -> Reference:
        assert prompt and generated, "a prompt and at least one generated token"
        # The logits at position p predict token p + 1: the outputs are predicted from the last
        # prompt position up to the one before the last output. Only those go through the LM head
        # (transformers' own logits_to_keep: the last len(generated) + 1 positions): its 49,152 logits
        # a position over a whole 1,300-token prompt were most of the reference's time.
        with torch.inference_mode():
            logits = self.hf_model(torch.tensor([prompt + generated]), logits_to_keep=len(generated) + 1).logits[0]
        logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
        return Reference(logprobs.argmax(dim=-1).tolist(), logprobs)


class Agreement(NamedTuple):
    """How a dtype that is not float32 agrees with a reference, by teacher forcing."""

    agree: int  # positions where our greedy token is the reference's argmax given our prefix
    positions: int
    errors: torch.Tensor  # |our logprob - the reference's| of each of our top tokens at each position

    @property
    def rate(self) -> float:
        return self.agree / self.positions

    def summary(self) -> str:
        return (f"top-1 agreement {self.rate:.4f} ({self.agree}/{self.positions}); logprob error mean "
                f"{self.errors.mean().item():.4f}, p99 {self.errors.quantile(0.99).item():.4f}, "
                f"max {self.errors.max().item():.4f}")


def agreement(reference: HFReference, prompts: Sequence[list[int]], outputs: Sequence[RequestOutput]) -> Agreement:
    """Our greedy outputs (with logprobs) of `prompts` scored against `reference`."""
    agree = positions = 0
    errors: list[float] = []
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0]
        ref = reference(prompt, ours.token_ids)
        agree += sum(a == b for a, b in zip(ours.token_ids, ref.token_ids))
        positions += len(ours.token_ids)
        for i, top in enumerate(ours.logprobs):
            errors.extend(abs(lp.logprob - ref.logprobs[i, token].item()) for token, lp in top.items())
    return Agreement(agree, positions, torch.tensor(errors))
