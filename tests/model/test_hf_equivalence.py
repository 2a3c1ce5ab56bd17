"""The model's truth is Hugging Face transformers: greedy tokens from our engine (paged KV cache,
continuous batching, chunked prefill, preemption, prefix caching) must be identical to
`generate(do_sample=False)` on the same weights, one prompt at a time (checked by teacher forcing:
tests/model/hf_reference.py), and our top-5 logprobs within 1e-3 of the reference log-softmax.

The one tolerated difference is vLLM's rule for float near-ties: where the two sequences part,
each side's token must be in the other's top-5 with a logprob gap under 1e-3. The reference scores
our own prefix, so the comparison goes on past a parting to the last token; the partings are
counted and bounded, and every output must be full length or end at an EOS.

The engine runs the default model both ways the worker can hold it: from its GGUF file with the
weights kept in their Q4_1/Q8_0 blocks (the CPU default, `--quantization auto`: the same weights,
computed by the native kernel) and from the converted float32 folder, as the reference is. The
tests of one engine config (chunked prefill, preemption) use the GGUF blocks: the faster of the two."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from services import LLM, SamplingParams
from services.processor.tokenizer import apply_chat_template, load_tokenizer
from tests.model.hf_reference import HFReference, Reference
from tests.model.prompts import conversations, long_text, raw_prompts

MAX_NEW_TOKENS = 32
LOGPROB_TOL = 1e-3
NEAR_TIE_GAP = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)
TEST_KV_BYTES = 256 * 2**20


@pytest.fixture(scope="module")
def blocks_llm():
    """The default model from its GGUF file, the weights kept in their blocks."""
    engine = LLM(model="smollm2", dtype="float32", quantization="gguf", kv_cache_memory=TEST_KV_BYTES)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module", params=["gguf-blocks", pytest.param("float32-folder", marks=pytest.mark.slow)])
def llm(request: pytest.FixtureRequest, model_path: Path):
    """Both ways of holding the weights, for the tests whose truth is transformers'."""
    if request.param == "gguf-blocks":
        yield request.getfixturevalue("blocks_llm")
        return
    engine = LLM(model=str(model_path), dtype="float32", kv_cache_memory=TEST_KV_BYTES)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def prompt_token_ids(model_path: Path) -> list[list[int]]:
    # The folder's tokenizer (the GGUF file's, converted): not `llm`'s, so that the tests that build
    # their own engine do not run once per `llm` parameter.
    tokenizer = load_tokenizer(model_path)
    chats = [apply_chat_template(tokenizer, c) for c in conversations()]
    raws = [tokenizer.encode(p) for p in raw_prompts()]
    prompts = chats + raws
    assert len(prompts) >= 24
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] <= 5 and lengths[-1] >= 1300, lengths
    return prompts


def compare(ours, ref: Reference, eos_token_ids: tuple[int, ...]) -> int:
    """Asserts equivalence at every position; returns how often the sequences parted at a near-tie."""
    tokens = ours.token_ids
    if ours.finish_reason == "stop":
        assert tokens and tokens[-1] in eos_token_ids, f"stopped without an EOS: {tokens[-3:]}"
    else:
        assert ours.finish_reason == "length" and len(tokens) == MAX_NEW_TOKENS, (ours.finish_reason, len(tokens))
    partings = 0
    for i, (a, b) in enumerate(zip(tokens, ref.token_ids)):
        ours_top = ours.logprobs[i]
        ref_lp = ref.logprobs[i]
        for token_id, lp in ours_top.items():
            assert abs(lp.logprob - ref_lp[token_id].item()) < LOGPROB_TOL, (
                f"position {i}: logprob of {token_id} is {lp.logprob}, reference {ref_lp[token_id].item()}")
        ref_top5 = torch.topk(ref_lp, 5)
        ours_top5 = sorted((lp.logprob for lp in ours_top.values()), reverse=True)[:5]
        assert torch.allclose(torch.tensor(ours_top5), ref_top5.values, atol=LOGPROB_TOL)
        if a != b:
            gap = abs(ref_lp[a].item() - ref_lp[b].item())
            assert a in ref_top5.indices.tolist() and b in ours_top, f"position {i}: {a} vs {b} is no near-tie"
            assert gap < NEAR_TIE_GAP, f"position {i}: {a} vs {b} part with a logprob gap of {gap}"
            partings += 1  # the reference scored our prefix: the next position compares as well
    return partings


def check_all(llm: LLM, hf_reference: HFReference, prompts: list[list[int]], outputs, label: str) -> None:
    eos = tuple(llm.processor.info.eos_token_ids)
    partings = sum(compare(o.outputs[0], hf_reference(p, o.outputs[0].token_ids), eos)
                   for p, o in zip(prompts, outputs))
    print(f"{label}: {len(prompts)} prompts, {partings} near-tie partings")
    assert partings <= 2, f"{partings} partings in {len(prompts)} prompts: more than float noise"
    assert_no_leaks(llm)


def assert_no_leaks(llm: LLM) -> None:
    manager = llm.engine.kv_cache_manager
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == len(manager.block_pool.blocks)
    assert not llm.engine.has_unfinished_requests()
    assert llm.worker.runner.batch.num_reqs == 0


@pytest.mark.slow  # the whole prompt set, both ways of holding the weights: `make test`, not test-fast
def test_greedy_batch_matches_hf(llm, hf_reference, prompt_token_ids):
    outputs = llm.generate(prompt_token_ids, GREEDY)
    check_all(llm, hf_reference, prompt_token_ids, outputs, "continuous batching")


@pytest.mark.slow  # the whole prompt set again under another engine config: `make test`, not test-fast
def test_chunked_prefill_and_preemption_match_hf(hf_reference, prompt_token_ids):
    """A 64-token step budget (prompts read in chunks next to other requests' decodes) and room in the
    KV cache for the longest prompt and its output, far less than all prompts together (preemption:
    requests give their blocks back and recompute)."""
    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # layers, block size, kv heads, head size, fp32
    num_blocks = -(-(max(map(len, prompt_token_ids)) + MAX_NEW_TOKENS) // 16) + 8
    llm = LLM(model="smollm2", dtype="float32", quantization="gguf", kv_cache_memory=num_blocks * block_bytes,
              max_num_batched_tokens=64)
    assert llm.engine.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks
    outputs = llm.generate(prompt_token_ids, GREEDY)
    assert llm.engine.stats().num_preemptions > 0, "the small KV cache should have forced preemption"
    print(f"preemptions: {llm.engine.stats().num_preemptions}")
    check_all(llm, hf_reference, prompt_token_ids, outputs, "chunked prefill (64-token budget) and preemption")


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_shared_prefix_hits_cache_and_matches_hf(llm, hf_reference):
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode(long_text(9))[:300]
    first = prefix + tokenizer.encode(" Question one: what is this about?")
    second = prefix + tokenizer.encode(" Question two: who wrote it?")
    out_first = llm.generate([first], GREEDY)[0]
    out_second = llm.generate([second], GREEDY)[0]
    assert out_second.num_cached_tokens >= 288, out_second.num_cached_tokens  # 18 full blocks of 16
    check_all(llm, hf_reference, [first, second], [out_first, out_second], "shared prefix")
    # The same prompt twice: every full block but never the whole prompt.
    again = llm.generate([second], GREEDY)[0]
    assert again.num_cached_tokens == (len(second) - 1) // 16 * 16
    assert again.outputs[0].token_ids == out_second.outputs[0].token_ids


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_seeded_sampling_is_reproducible_in_any_batch(blocks_llm):
    """The sampler's seeds, whatever holds the weights: one way is enough."""
    llm = blocks_llm
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    prompt = "Write a sentence about the sea:"
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    others = [f"Tell me a fact about the number {i}." for i in range(15)]
    mates = [SamplingParams(temperature=1.0, seed=i, max_tokens=10 + i) for i in range(15)]
    batch = llm.generate(others[:7] + [prompt] + others[7:], mates[:7] + [params] + mates[7:])
    assert batch[7].outputs[0].token_ids == alone
    different = llm.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99,
                                                      max_tokens=24))[0].outputs[0].token_ids
    assert different != alone
    assert_no_leaks(llm)
