"""One tiny random-weight Hugging Face folder per model family kvmesh serves, made at test time from
transformers' own config and model classes (no download): a few seconds for all of them.

  llama-tied     Llama, the LM head tied to the embedding
  llama-untied   Llama, an LM head of its own
  llama3         Llama 3.1's frequency-dependent RoPE scaling (`rope_type: llama3`)
  qwen2          Qwen2: a bias on q, k and v, none on o
  mistral        Mistral: a 16-token sliding window (one KV block), crossed by the test prompts
  gemma3         Gemma 3 (tests/model/tiny_gemma3.py): windows, QK-norm, GELU, a logit softcap

Each is 2 layers of hidden size 64, 4 query heads over 2 KV heads of 16, a 256-token context, seeded
(Gemma 3: 4 layers, 512 tokens). Every weight, biases and norms included, is drawn from N(0, 0.5):
the biases are not zeros that a loader could forget, and the logits spread wide enough that the top
two are rarely within float noise (wider weights amplify the noise more than the spread). The
tokenizer files are the default model's (the same vocabulary), so `LLM` and `kvmesh serve` load each
folder as any model. `save_unsupported` writes a GPT-2 folder the same way, for the start-up refusal.

`run_scenario` puts one engine through what a family must survive: chunked prefill next to decodes,
preemption and a prefix-cache hit, prompts crossing the windows; `check_greedy` compares its outputs
with transformers' by teacher forcing (tests/model/hf_reference.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, PretrainedConfig, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM)

from services import LLM, SamplingParams
from services.llm import RequestOutput
from tests.model.hf_reference import HFReference
from tests.model.tiny_gemma3 import json_vocab, save_tiny_gemma3

MAX_POSITIONS = 256
WINDOW = 16  # Mistral's and Gemma 3's sliding window: one KV block
BLOCK_SIZE = 16
WEIGHT_STD = 0.5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)
LOGPROB_TOL = 1e-3
NEAR_TIE_GAP = 1e-3
KV_BLOCKS = 8  # room for the longest prompt and its output (6 blocks), far less than the batch's
BATCHED_TOKENS = 24  # the step's token budget: longer prompts are prefilled in chunks next to decodes
BATCH_LENGTHS = (3, WINDOW - 1, WINDOW + 1, 33, 40, 61)
PREFIX_BLOCKS = 3
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@dataclass(frozen=True)
class Family:
    name: str
    path: Path
    reference: HFReference  # transformers on the same weights, float32

    @property
    def block_bytes(self) -> int:
        """The KV cache's bytes per block of this model at TP=1 in float32."""
        config = self.reference.hf_model.config
        return 2 * config.num_hidden_layers * BLOCK_SIZE * config.num_key_value_heads * config.head_dim * 4


def shape(vocab_size: int) -> dict[str, object]:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POSITIONS,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


LLAMA_LIKE: dict[str, Callable[[int], tuple[type[PreTrainedModel], PretrainedConfig]]] = {
    "llama-tied": lambda v: (LlamaForCausalLM, LlamaConfig(**shape(v), tie_word_embeddings=True)),
    "llama-untied": lambda v: (LlamaForCausalLM, LlamaConfig(**shape(v), tie_word_embeddings=False)),
    "llama3": lambda v: (LlamaForCausalLM, LlamaConfig(**shape(v), tie_word_embeddings=False,
                                                       rope_parameters=dict(LLAMA3_ROPE))),
    "qwen2": lambda v: (Qwen2ForCausalLM, Qwen2Config(**shape(v), tie_word_embeddings=False)),
    "mistral": lambda v: (MistralForCausalLM, MistralConfig(**shape(v), tie_word_embeddings=False,
                                                            sliding_window=WINDOW)),
}
FAMILIES = (*LLAMA_LIKE, "gemma3")


def save_family(name: str, folder: Path, tokenizer_folder: Path) -> Family:
    """Write family `name`'s tiny model (and `tokenizer_folder`'s tokenizer) to `folder`."""
    if name == "gemma3":
        return Family(name, folder, save_tiny_gemma3(folder, tokenizer_folder))
    model_class, config = LLAMA_LIKE[name](len(json_vocab(tokenizer_folder / "tokenizer.json")))
    return Family(name, folder, HFReference(save_random(model_class, config, folder, tokenizer_folder)))


def save_unsupported(folder: Path, tokenizer_folder: Path) -> None:
    """A tiny GPT-2, an architecture kvmesh does not serve, as a complete folder."""
    config = GPT2Config(vocab_size=len(json_vocab(tokenizer_folder / "tokenizer.json")), n_positions=MAX_POSITIONS,
                        n_embd=64, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None)
    save_random(GPT2LMHeadModel, config, folder, tokenizer_folder)


def save_random(model_class: type[PreTrainedModel], config: PretrainedConfig, folder: Path,
                tokenizer_folder: Path) -> PreTrainedModel:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, WEIGHT_STD)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_folder / name, folder / name)
    return model


class Scenario(NamedTuple):
    prompts: list[list[int]]
    outputs: list[RequestOutput]


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40_000, (n,), generator=gen).tolist() for n in lengths]


def run_scenario(llm: LLM) -> Scenario:
    """`llm` has KV_BLOCKS blocks and a BATCHED_TOKENS budget. One batch, chunked and preempted; then
    two prompts sharing PREFIX_BLOCKS full blocks, one after the other: the second starts from the
    first's cached blocks, its windows reaching back into them."""
    pool = llm.engine.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == KV_BLOCKS
    batch = random_prompts(BATCH_LENGTHS, seed=0)
    outputs = llm.generate(batch, GREEDY)
    assert llm.engine.stats().num_preemptions > 0, "the small KV cache should have forced preemption"
    prefix = random_prompts((PREFIX_BLOCKS * BLOCK_SIZE,), seed=1)[0]
    shared = [prefix + tail for tail in random_prompts((9, 21), seed=2)]
    first = llm.generate([shared[0]], GREEDY)
    second = llm.generate([shared[1]], GREEDY)
    assert second[0].num_cached_tokens == PREFIX_BLOCKS * BLOCK_SIZE
    manager = llm.engine.kv_cache_manager
    manager.check_integrity()
    assert pool.get_num_free_blocks() == KV_BLOCKS and not llm.engine.has_unfinished_requests()
    return Scenario(batch + shared, outputs + first + second)


def check_greedy(scenario: Scenario, reference: HFReference) -> int:
    """Asserts full-length outputs, our top-5 logprobs within LOGPROB_TOL of transformers' and our
    greedy tokens equal to its argmax after each of our prefixes, but where the two part at a float
    near-tie (both tokens in each other's top 5, NEAR_TIE_GAP apart); returns how many parted so."""
    partings = 0
    for i, (prompt, output) in enumerate(zip(*scenario)):
        ours = output.outputs[0]
        assert ours.finish_reason == "length" and len(ours.token_ids) == NEW_TOKENS, (i, ours.finish_reason)
        ref = reference(prompt, ours.token_ids)
        for pos, (token, ref_token) in enumerate(zip(ours.token_ids, ref.token_ids)):
            top = ours.logprobs[pos]
            ref_top = torch.topk(ref.logprobs[pos], len(top))
            got = torch.tensor(sorted((lp.logprob for lp in top.values()), reverse=True))
            assert torch.allclose(got, ref_top.values, atol=LOGPROB_TOL), (i, pos, got, ref_top.values)
            for token_id, lp in top.items():
                assert abs(lp.logprob - ref.logprobs[pos, token_id].item()) < LOGPROB_TOL, (i, pos, token_id)
            if token != ref_token:
                gap = abs(ref.logprobs[pos, token].item() - ref.logprobs[pos, ref_token].item())
                assert ref_token in top and token in ref_top.indices.tolist() and gap < NEAR_TIE_GAP, (
                    f"prompt {i} ({len(prompt)} tokens), position {pos}: {token} vs transformers' {ref_token}, "
                    f"logprob gap {gap}")
                partings += 1  # the reference scored our prefix: the next positions compare as well
    return partings
