"""Beam search (services/processor/beam_search.py) on the in-process `LLM` against Hugging Face
transformers' `generate(num_beams=k, num_return_sequences=k, do_sample=False)` on the same weights.

kvmesh scores beams as vLLM does, which agrees with transformers exactly when no candidate ends in
EOS (any length_penalty), and with EOS under length_penalty 0 and early_stopping "never" as long as
every EOS ending that makes the answer ranked among the step's top k; transformers drops the others,
vLLM and kvmesh keep them (docs/serving/vllm_api.md). Widths 2 to 4, a few tokens: seconds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from services import BeamSearchParams

# Each check runs the default model's beams against transformers' for a second or more: `make test`,
# not test-fast (the unit tier checks the beam search core).
pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "1, 2, 3, 4,"]  # no EOS among the candidates of their first 6 tokens
CHAT = [{"role": "user", "content": "Say yes or no."}]  # ends within a few tokens


def hf_beams(hf_model, prompt: list[int], width: int, max_tokens: int, length_penalty: float) -> list[list[int]]:
    """transformers' `width` beams, best first, cut at their first EOS (which they include)."""
    config = GenerationConfig(**{**hf_model.generation_config.to_dict(), "num_beams": width,
                                 "num_return_sequences": width, "do_sample": False, "max_new_tokens": max_tokens,
                                 "length_penalty": length_penalty, "early_stopping": "never"})
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        sequences = hf_model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
    eos = set(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])
    beams = []
    for sequence in sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(sequence) if t in eos), len(sequence))
        beams.append(sequence[:end])
    return beams


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (4, 2.0)])
def test_beams_without_eos_are_transformers_beams(offline, hf_reference, width, length_penalty):
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
    outputs = offline.beam_search(PROMPTS, params)
    for output in outputs:
        ours = [c.token_ids for c in output.outputs]
        assert ours == hf_beams(hf_reference.hf_model, output.prompt_token_ids, width, 6, length_penalty)
        assert all(c.finish_reason == "length" for c in output.outputs)
        scores = [c.cumulative_logprob for c in output.outputs]
        assert scores == sorted(scores, reverse=True)
        reference = hf_reference(output.prompt_token_ids, ours[0]).logprobs
        expected = reference[torch.arange(len(ours[0])), torch.tensor(ours[0])].sum().item()
        assert scores[0] == pytest.approx(expected, abs=1e-3)
        assert [c.text for c in output.outputs] == [offline.get_tokenizer().decode(t) for t in ours]


def test_beams_ending_in_eos_are_transformers_beams(offline, hf_reference):
    prompt = offline.processor.tokenize_chat(CHAT)
    params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.0, include_stop_str_in_output=True)
    [output] = offline.beam_search([prompt], params)
    hf = hf_beams(hf_reference.hf_model, prompt, 2, 6, 0.0)
    assert [c.finish_reason for c in output.outputs] == ["stop", "stop"]
    assert [c.token_ids for c in output.outputs] == hf  # the EOS kept, as include_stop_str_in_output asks
    assert [c.stop_reason for c in output.outputs] == [hf[0][-1], hf[1][-1]]
    assert [c.text for c in output.outputs] == [offline.get_tokenizer().decode(b[:-1]) for b in hf]
    # ignore_eos: EOS is a token like any other, and every beam runs max_tokens.
    [ignored] = offline.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    assert [len(c.token_ids) for c in ignored.outputs] == [4, 4]
    assert [c.finish_reason for c in ignored.outputs] == ["length", "length"]


def test_eos_endings_below_the_top_k_are_kept_as_vllm_keeps_them(offline, hf_reference):
    """The documented difference: "Paris." + EOS ranks below the top 2 at its step; transformers
    drops it, vLLM's rule keeps it, and it beats every beam transformers returns."""
    [output] = offline.beam_search(["The capital of France is"], BeamSearchParams(beam_width=2, max_tokens=6,
                                                                                 length_penalty=0.0))
    hf = hf_beams(hf_reference.hf_model, output.prompt_token_ids, 2, 6, 0.0)
    best = output.outputs[0]
    assert best.finish_reason == "stop" and best.text == " Paris."
    assert best.token_ids not in [beam[:-1] for beam in hf]
    assert output.outputs[1].token_ids == hf[0]


def test_beams_share_their_prefix_blocks_and_leave_nothing(offline):
    """Every step re-sends prompt + beam: all but the last partial block of each is a prefix hit.
    Afterwards no request and no block is held."""
    engine = offline.engine
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16, never seen before
    before = engine.stats()
    offline.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    after = engine.stats()
    block = engine.kv_cache_manager.block_size
    # Step 1: one request (the prompt), a miss. Steps 2-5: three beams each, each finding at least
    # the prompt's full blocks cached.
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 4 * 3 * (len(prompt) // block) * block, (queried, hits)
    assert after.num_running == after.num_waiting == after.num_used_blocks == 0
    engine.kv_cache_manager.check_integrity()


def test_bad_beam_search_is_a_value_error(offline):
    with pytest.raises(ValueError, match="beam width.*at most 32"):
        offline.beam_search(["a"], BeamSearchParams(beam_width=33, max_tokens=2))
    with pytest.raises(ValueError, match="length_penalty"):
        offline.beam_search(["a"], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=float("nan")))
    assert offline.engine.stats().num_running == 0
