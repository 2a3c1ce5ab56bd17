"""Hugging Face transformers' greedy generate() as the model's truth, one prompt at a time, each
prompt computed once per session (the `hf_reference` fixture in tests/conftest.py) and shared by
every test that compares with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    token_ids: list[int]
    logprobs: torch.Tensor  # [num_generated, vocab] log-softmax of the raw logits


class HFReference:
    """Greedy generations of `hf_model`, memoized per (prompt, eos ids). A request for fewer new
    tokens than a memoized generation is its prefix: greedy decoding does the same steps."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf_model = hf_model
        self._generated: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, Reference]] = {}

    def __call__(self, prompt: list[int], eos_token_ids: tuple[int, ...], max_new_tokens: int) -> Reference:
        key = (tuple(prompt), tuple(eos_token_ids))
        if key not in self._generated or self._generated[key][0] < max_new_tokens:
            self._generated[key] = (max_new_tokens, self._generate(prompt, eos_token_ids, max_new_tokens))
        whole = self._generated[key][1]
        return Reference(whole.token_ids[:max_new_tokens], whole.logprobs[:max_new_tokens])

    def _generate(self, prompt: list[int], eos_token_ids: tuple[int, ...], max_new_tokens: int) -> Reference:
        with torch.inference_mode():
            out = self.hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                pad_token_id=eos_token_ids[0], output_logits=True, return_dict_in_generate=True,
            )
        generated = out.sequences[0, len(prompt):].tolist()
        return Reference(generated, torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
