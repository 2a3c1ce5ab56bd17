"""The worker's side of structured outputs: the engine's packed bitmask unpacked bit for bit, applied
to exactly the rows it names, before sampling (greedy and random) and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.common.scheduler_output import GrammarBitmask
from services.worker.grammar_bitmask import apply_grammar_bitmask, unpack_bitmask
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import SamplingMetadata

V = 70  # not a multiple of 32: the last word is partly padding


def pack(allowed_per_row: list[set[int]], num_words: int = (V + 31) // 32) -> bytes:
    """The engine's layout, built independently: bit t % 32 of word t // 32, little-endian int32 words."""
    words = np.zeros((len(allowed_per_row), num_words), dtype=np.uint32)
    for row, allowed in enumerate(allowed_per_row):
        for t in allowed:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return words.astype("<u4").tobytes()


ALLOWED = [{0, 31, 32, 33, 69}, {5}, set(range(40, 70))]


def test_unpack_gives_back_each_rows_tokens():
    bits = unpack_bitmask(GrammarBitmask(["a", "b", "c"], pack(ALLOWED)), V)
    assert bits.shape == (3, V)
    assert [set(np.flatnonzero(row).tolist()) for row in bits] == ALLOWED


def test_tokens_past_the_mask_are_never_allowed():
    bits = unpack_bitmask(GrammarBitmask(["a"], pack([{0, 63}], num_words=2)), 100)
    assert set(np.flatnonzero(bits[0]).tolist()) == {0, 63}


def test_a_bitmask_must_have_whole_rows():
    with pytest.raises(ValueError, match="7 bytes for 2 rows"):
        GrammarBitmask(["a", "b"], bytes(7))


def test_apply_masks_only_the_named_rows_whatever_their_order():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    # Rows of the batch: w x y z; the mask names z, x and a request not sampled here.
    bitmask = GrammarBitmask(["z", "x", "gone"], pack(ALLOWED))
    apply_grammar_bitmask(logits, ["w", "x", "y", "z"], bitmask)
    for row, allowed in ((3, ALLOWED[0]), (1, ALLOWED[1])):
        kept = torch.zeros(V, dtype=torch.bool)
        kept[list(allowed)] = True
        assert torch.equal(logits[row][kept], before[row][kept])
        assert torch.isneginf(logits[row][~kept]).all()
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # unconstrained rows untouched


def test_a_request_verifying_drafts_gets_its_mask_rows_in_position_order():
    """A request with d drafts has d + 1 logits rows side by side and as many mask rows, row j of each
    for the draw after its first j drafts; its batch-mates keep theirs."""
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    allowed = [{1}, {2}, {3}, {4, 5}]
    # Draws: w, then x at positions 0..2, then z; the mask: z's row, then x's three.
    apply_grammar_bitmask(logits, ["w", "x", "x", "x", "z"], GrammarBitmask(["z", "x", "x", "x"], pack(allowed)))
    for row, allowed_here in ((4, allowed[0]), (1, allowed[1]), (2, allowed[2]), (3, allowed[3])):
        assert set(torch.isfinite(logits[row]).nonzero().flatten().tolist()) == allowed_here
    assert torch.equal(logits[0], before[0])



def test_more_mask_rows_than_draws_fails_the_step_and_leaves_the_logits():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    with pytest.raises(ValueError, match="more mask rows than sampled positions"):
        apply_grammar_bitmask(logits, ["x", "w"], GrammarBitmask(["x", "x"], pack([{1}, {2}])))
    assert torch.equal(logits, before)

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_and_logprobs_keep_to_the_mask(temperature):
    rows = 64
    logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(1)) * 4
    allowed = [{(7 * r) % V, (7 * r + 3) % V, (11 * r + 1) % V} for r in range(rows)]
    ids = [f"r{r}" for r in range(rows)]
    apply_grammar_bitmask(logits, ids, GrammarBitmask(ids, pack(allowed)))
    params = [SamplingParams(temperature=temperature, logprobs=2)] * rows
    meta = SamplingMetadata.build(params, [[]] * rows, [[1]] * rows, [set()] * rows, V, torch.device("cpu"))
    out = Sampler()(logits, meta)
    assert all(t in allowed[r] for r, t in enumerate(out.sampled_token_ids.tolist()))
    # logprobs come from the masked logits (as vLLM's): a forbidden token has none to speak of.
    top = out.logprobs.token_ids[:, 1:].tolist()
    top_logprobs = out.logprobs.logprobs[:, 1:].tolist()
    for r in range(rows):
        for t, lp in zip(top[r], top_logprobs[r]):
            assert t in allowed[r] or lp == float("-inf")
