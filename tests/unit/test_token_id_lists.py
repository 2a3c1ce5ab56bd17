"""Token-id lists (allowed_token_ids, logit_bias, stop_token_ids, logprob_token_ids): bounded and
deduplicated where SamplingParams are built, bounded by the vocabulary at the engine, and turned into
tensors once when a request joins the worker's batch, so that a step never walks the lists again."""

from __future__ import annotations

import pytest
import torch

from services.common.engine_output import EngineCoreRequest
from services.common.rpc.convert import sampling_params_from_proto, sampling_params_to_proto
from services.common.sampling_params import MAX_TOKEN_IDS, SamplingParams
from services.common.validation import check_engine_request
from services.worker.sampler import apply_logits_processors
from services.worker.sampling_metadata import RequestSamplingTensors, SamplingMetadata

V = 32
CPU = torch.device("cpu")


class Untouchable(tuple):
    """A list that raises when anything reads its ids (its length alone may be asked)."""

    def __iter__(self):
        raise AssertionError("the ids were read")

    def __getitem__(self, index):
        raise AssertionError("the ids were read")


class UntouchableBias(dict):
    """A logit_bias that raises when anything reads its entries."""

    def __iter__(self):
        raise AssertionError("the bias was read")

    def items(self):
        raise AssertionError("the bias was read")

    keys = values = items


class Huge:
    """A container that claims more ids than any list may hold, and raises when read."""

    def __len__(self) -> int:
        return MAX_TOKEN_IDS + 1

    def __iter__(self):
        raise AssertionError("copied before its length was checked")


# ---- SamplingParams ----------------------------------------------------------------------------------

def test_lists_keep_each_id_once():
    params = SamplingParams(allowed_token_ids=[9, 3, 9, 3, 1] * 1000, stop_token_ids=[7, 2, 7, 2, 5],
                            logprob_token_ids=[4, 1], logprobs=2)
    assert params.allowed_token_ids == (1, 3, 9)  # a set: sorted
    assert params.stop_token_ids == (7, 2, 5)  # first occurrences, in order
    assert params.logprob_token_ids == (4, 1)  # columns of the answer: as asked
    assert SamplingParams(allowed_token_ids=(3, 1)) == SamplingParams(allowed_token_ids=(1, 3, 3))


def test_logit_bias_is_a_copy():
    bias = {3: 1.0}
    params = SamplingParams(logit_bias=bias)
    bias[4] = 2.0
    assert params.logit_bias == {3: 1.0}


@pytest.mark.parametrize("name", ["allowed_token_ids", "logit_bias", "stop_token_ids", "logprob_token_ids"])
def test_a_list_longer_than_any_vocabulary_is_refused_before_it_is_read(name: str):
    with pytest.raises(ValueError, match=f"{name} has {MAX_TOKEN_IDS + 1} token ids; at most {MAX_TOKEN_IDS}"):
        SamplingParams(**{name: Huge()})


def test_the_wire_path_dedupes_and_bounds():
    message = sampling_params_to_proto(SamplingParams())
    message.allowed_token_ids.extend([5, 4, 5] * 100)
    message.stop_token_ids.extend([8, 8, 6])
    message.logit_bias[3] = -1.0
    params = sampling_params_from_proto(message)
    assert params.allowed_token_ids == (4, 5) and params.stop_token_ids == (8, 6) and params.logit_bias == {3: -1.0}
    assert type(params.logit_bias) is dict and type(params.allowed_token_ids) is tuple
    message.allowed_token_ids.extend(range(MAX_TOKEN_IDS))
    with pytest.raises(ValueError, match="allowed_token_ids has"):
        sampling_params_from_proto(message)


# ---- the engine ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("params, message", [
    (SamplingParams(allowed_token_ids=range(101)), "allowed_token_ids has 101 entries; at most 100"),
    (SamplingParams(logit_bias={t: 1.0 for t in range(101)}), "logit_bias has 101 entries; at most 100"),
    (SamplingParams(allowed_token_ids=(1, 100)), "allowed_token_ids: token id 100 is out of vocabulary"),
])
def test_the_engine_bounds_the_lists_by_its_vocabulary(params: SamplingParams, message: str):
    with pytest.raises(ValueError, match=message):
        check_engine_request(EngineCoreRequest("r", [1, 2, 3], params), max_model_len=64, vocab_size=100)
    # A list of duplicates is its distinct ids: the whole vocabulary, many times over, passes.
    check_engine_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(allowed_token_ids=list(range(100)) * 50)),
                         max_model_len=64, vocab_size=100)


# ---- the worker: tensors built once -----------------------------------------------------------------

def test_request_tensors_hold_exactly_the_lists():
    params = SamplingParams(allowed_token_ids=(0, 7, 31, 7), logit_bias={4: -2.5, 30: 1.0}, min_tokens=2)
    t = RequestSamplingTensors.of(params, frozenset({2, 9}), V, CPU)
    assert t.allowed.dtype == torch.bool and t.allowed.nonzero().flatten().tolist() == [0, 7, 31]
    assert dict(zip(t.bias_token_ids.tolist(), t.bias_values.tolist())) == {4: -2.5, 30: 1.0}
    assert sorted(t.min_tokens_stop_ids.tolist()) == [2, 9]
    plain = RequestSamplingTensors.of(SamplingParams(), frozenset({2}), V, CPU)
    assert plain == (None, None, None, None)  # nothing to apply: no min_tokens, so no stop mask either


@pytest.mark.parametrize("params, stops, what", [
    (SamplingParams(allowed_token_ids=(1, V, -1)), frozenset(), r"allowed_token_ids token ids \[-1, 32\]"),
    (SamplingParams(logit_bias={V + 5: 1.0}), frozenset(), r"logit_bias token ids \[37\]"),
    (SamplingParams(), frozenset({V}), r"stop token token ids \[32\]"),
    (SamplingParams(allowed_token_ids=(10**30,)), frozenset(), "allowed_token_ids token ids must be in"),
])
def test_request_tensors_refuse_ids_outside_the_vocabulary(params: SamplingParams, stops: frozenset, what: str):
    with pytest.raises(ValueError, match=what):
        RequestSamplingTensors.of(params, stops, V, CPU)


def reference(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
              stops: list[frozenset[int]]) -> torch.Tensor:
    """Row by row, token by token: allowed ids, then the bias, then the min_tokens stop mask."""
    out = logits.clone()
    for row, (p, produced, stop_ids) in enumerate(zip(params, outputs, stops)):
        for token in range(V):
            if p.allowed_token_ids is not None and token not in p.allowed_token_ids:
                out[row, token] = float("-inf")
            out[row, token] += (p.logit_bias or {}).get(token, 0.0)
            if len(produced) < p.min_tokens and token in stop_ids:
                out[row, token] = float("-inf")
    return out


def test_a_step_from_the_kept_tensors_matches_the_reference():
    params = [SamplingParams(allowed_token_ids=(3, 5, 3, 8)),
              SamplingParams(logit_bias={1: 4.0, 2: -3.0}),
              SamplingParams(),
              SamplingParams(allowed_token_ids=tuple(range(0, V, 2)), logit_bias={4: 2.0, 5: 9.0}, min_tokens=3),
              SamplingParams(min_tokens=1, stop_token_ids=(6,)),  # reached min_tokens: no mask
              SamplingParams(allowed_token_ids=(31,))]
    outputs = [[], [1], [], [0, 0], [7], []]
    stops = [frozenset({2}), frozenset({2}), frozenset(), frozenset({2, 4}), frozenset({2, 6}), frozenset({2})]
    kept = [RequestSamplingTensors.of(p, s, V, CPU) for p, s in zip(params, stops)]
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(0))
    meta = SamplingMetadata.build(params, outputs, [[1]] * len(params), stops, V, CPU, request_tensors=kept)
    assert meta.allowed_tokens.restricted_rows.tolist() == [0, 3, 5]
    assert torch.equal(apply_logits_processors(logits, meta), reference(logits, params, outputs, stops))
    # Built from the params in the step instead (the per-step path tests use): the same.
    fresh = SamplingMetadata.build(params, outputs, [[1]] * len(params), stops, V, CPU)
    assert torch.equal(apply_logits_processors(logits, fresh), apply_logits_processors(logits, meta))


def test_a_step_never_reads_the_lists_again():
    params = SamplingParams(allowed_token_ids=(3, 5), logit_bias={1: 4.0}, stop_token_ids=(6,), min_tokens=4)
    kept = RequestSamplingTensors.of(params, frozenset({2, 6}), V, CPU)
    object.__setattr__(params, "allowed_token_ids", Untouchable(params.allowed_token_ids))
    object.__setattr__(params, "stop_token_ids", Untouchable(params.stop_token_ids))
    object.__setattr__(params, "logit_bias", UntouchableBias(params.logit_bias))
    stops = Untouchable()
    meta = SamplingMetadata.build([params], [[]], [[1]], [stops], V, CPU, request_tensors=[kept])
    assert meta.allowed_tokens is not None and meta.logit_bias is not None and meta.stop_token_mask is not None
    with pytest.raises(ValueError, match="one entry per batch row"):
        SamplingMetadata.build([params], [[]], [[1]], [stops], V, CPU, request_tensors=[])
