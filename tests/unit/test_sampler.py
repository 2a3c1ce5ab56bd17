"""The batched sampler against plain per-row references, on small random vocabularies."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sampler import Sampler, apply_logits_processors, compute_prompt_logprobs
from services.worker.sampling_metadata import SamplingMetadata

V = 64
CPU = torch.device("cpu")


def build(params: list[SamplingParams], vocab_size: int = V, outputs: list[list[int]] | None = None,
          prompts: list[list[int]] | None = None, stops: list[set[int]] | None = None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, outputs or [[] for _ in range(n)], prompts or [[] for _ in range(n)],
                                  stops or [set() for _ in range(n)], vocab_size, CPU)


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    return Sampler()(logits, build(params, logits.shape[1], **kwargs)).sampled_token_ids


def random_logits(num_rows: int, vocab_size: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def allowed_tokens(row: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0, slack: float = 1e-5) -> set[int]:
    """Plain reference, in vLLM's order (min-p, top-k, top-p); `slack` makes it a superset at float borders."""
    probs = (row / temperature).softmax(-1).tolist()
    largest = max(probs)
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    order = [t for t in order if probs[t] >= largest * min_p - slack]
    if top_k:
        order = order[:top_k]
    total = sum(probs[t] for t in order)
    kept, mass = [], 0.0
    for t in order:
        if mass >= top_p + slack:
            break
        kept.append(t)
        mass += probs[t] / total
    return set(kept)


# ---- greedy -------------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_cheap() -> None:
    logits = random_logits(8)
    meta = build([SamplingParams(temperature=0.0)] * 8)
    assert meta.all_greedy and not meta.all_random
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None and meta.penalties is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_tiny_temperature_is_greedy_and_turns_filters_off() -> None:
    logits = random_logits(6, scale=0.1)  # flat: a random draw would rarely hit the argmax
    params = [SamplingParams(temperature=1e-6, top_k=3, top_p=0.5, min_p=0.5), SamplingParams()] * 3
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random
    assert meta.temperature.tolist()[0::2] == [0.0] * 3
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None  # only greedy rows set them
    for _ in range(20):
        tokens = Sampler()(logits, meta).sampled_token_ids
        assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0)])
def test_tightest_filters_are_greedy(kwargs: dict) -> None:
    # The top token always survives: top-p's cumulative sum can round to <= 1 - p for every token.
    logits = random_logits(500, scale=0.5)
    assert torch.equal(sample(logits, [SamplingParams(**kwargs)] * 500), logits.argmax(-1))


def test_top_k_at_least_vocab_size_is_off() -> None:
    assert build([SamplingParams(top_k=V), SamplingParams(top_k=V + 5)]).top_k is None


# ---- filters ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(top_k=5),
    dict(top_p=0.6),
    dict(min_p=0.2),
    dict(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
    dict(temperature=1.5, top_p=0.9),
])
def test_draws_stay_in_the_allowed_set(kwargs: dict) -> None:
    row = random_logits(1, scale=2.0, seed=3)[0]
    allowed = allowed_tokens(row, **kwargs)
    torch.manual_seed(0)
    tokens = set(sample(row.expand(4000, V).contiguous(), [SamplingParams(**kwargs)] * 4000).tolist())
    assert tokens <= allowed
    assert len(tokens) > 1  # a real draw, not a disguised argmax


@pytest.mark.parametrize("kinds", [
    [dict(top_k=2), dict(), dict(top_p=0.3), dict(min_p=0.5)],  # top-p present: the sorting path
    [dict(top_k=2), dict(), dict(top_k=9), dict(temperature=0.0)],  # top-k alone: the topk path
])
def test_filters_only_touch_their_own_rows(kinds: list[dict]) -> None:
    row = random_logits(1, scale=2.0, seed=4)[0]
    params = [SamplingParams(**kwargs) for kwargs in kinds] * 500
    torch.manual_seed(1)
    tokens = sample(row.expand(len(params), V).contiguous(), params)
    for i, kwargs in enumerate(kinds):
        drawn = set(tokens[i::4].tolist())
        if kwargs.get("temperature") == 0.0:
            assert drawn == {int(row.argmax())}
            continue
        assert drawn <= allowed_tokens(row, **kwargs)
        if not kwargs:
            assert len(drawn) > 10  # unfiltered rows see most of the vocabulary


@pytest.mark.parametrize(("top_p", "expected"), [(0.01, {0}), (0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}),
                                                  (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, expected: set[int]) -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(3000, 4).contiguous()
    torch.manual_seed(2)
    assert set(sample(logits, [SamplingParams(top_p=top_p)] * 3000).tolist()) == expected


# ---- seeds --------------------------------------------------------------------------------------------

TARGET = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
NUM_STEPS = 6


def target_logits(step: int) -> torch.Tensor:
    return random_logits(1, seed=100 + step, scale=1.0)[0]


def seeded_tokens(position: int, batch_size: int, mates_seed: int) -> list[int]:
    """The target request's tokens over NUM_STEPS steps at `position` among random batch-mates."""
    mate_kinds = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=4, min_p=0.1),
                  SamplingParams(temperature=1.3, seed=mates_seed), SamplingParams(presence_penalty=1.0)]
    params = [mate_kinds[(i + mates_seed) % len(mate_kinds)] for i in range(batch_size)]
    params[position] = TARGET
    torch.manual_seed(mates_seed)  # unseeded batch-mates draw differently in every scenario
    tokens = []
    for step in range(NUM_STEPS):
        logits = random_logits(batch_size, seed=mates_seed * 1000 + step)
        logits[position] = target_logits(step)
        outputs = [[1, 2] + [step] * step for _ in range(batch_size)]  # one token longer each step
        meta = build(params, outputs=outputs)
        tokens.append(Sampler()(logits, meta).sampled_token_ids[position].item())
    return tokens


def test_seeded_request_does_not_depend_on_its_batch() -> None:
    alone = seeded_tokens(position=0, batch_size=1, mates_seed=0)
    for position, mates_seed in [(0, 1), (7, 2), (15, 3), (9, 4)]:
        assert seeded_tokens(position, batch_size=16, mates_seed=mates_seed) == alone


def test_different_seeds_draw_differently() -> None:
    logits = random_logits(1, scale=0.1)  # nearly uniform over 64 tokens
    draws = []
    for seed in (1, 2):
        draws.append([sample(logits, [SamplingParams(seed=seed)], outputs=[[0] * i]).item() for i in range(8)])
    assert draws[0] != draws[1]


def test_a_seeded_draw_is_keyed_by_seed_and_position_only() -> None:
    """The draw at position p is the same whether the tokens before it are prompt or outputs, whatever
    they are, and whichever Sampler draws it; another position draws anew."""
    logits = random_logits(1, scale=0.1)
    params = [SamplingParams(seed=3)]

    def draws(prompt: list[int], outputs: list[int]) -> list[int]:
        return [sample(logits, params, prompts=[prompt], outputs=[outputs]).item() for _ in range(2)]

    at_five = draws([1, 2, 3, 4, 5], [])
    assert at_five[0] == at_five[1]
    assert draws([9, 9], [1, 2, 3]) == draws([7], [0, 0, 0, 0]) == at_five
    assert [draws([], [0] * p)[0] for p in range(8)] != [at_five[0]] * 8


def test_greedy_rows_are_not_seeded() -> None:
    meta = build([SamplingParams(temperature=0.0, seed=5), SamplingParams(seed=6)])
    assert list(meta.seeds) == [1]


# ---- penalties, bias, min_tokens ----------------------------------------------------------------------

def reference_penalties(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    out = row.clone()
    for t in range(len(row)):
        if t in prompt or t in output:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count
        if count:
            out[t] -= p.presence_penalty
    return out


def test_penalties_match_the_plain_reference() -> None:
    params = [
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=0.4),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=-1.1),
        SamplingParams(),  # no penalty: unchanged although it has tokens
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0),
    ]
    prompts = [[1, 2, 3], [4, 4, 5], [6, 7, 7, 8, 9], [10], [1, 2, 3, 4], [11, 12]]
    outputs = [[1, 1, 20], [4, 4, 4, 21], [7, 22, 22], [10, 10, 23, 24, 24, 24], [1], []]
    logits = random_logits(len(params))
    meta = build(params, outputs=outputs, prompts=prompts)
    got = apply_logits_processors(logits, meta)
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], reference_penalties(logits[i], prompts[i], outputs[i], p),
                                   rtol=1e-6, atol=1e-6)


def test_no_repetition_penalty_means_no_prompt_tensor() -> None:
    meta = build([SamplingParams(presence_penalty=1.0)], prompts=[[1, 2, 3]], outputs=[[4]])
    assert meta.penalties is not None and meta.penalties.prompt_token_ids is None


def test_frequency_penalty_steers_greedy_away_from_repeats() -> None:
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 9] = 2.0, 1.5
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.3)]
    assert sample(logits, params, outputs=[[3]]).tolist() == [3]
    assert sample(logits, params, outputs=[[3, 3]]).tolist() == [9]


def test_logit_bias_forces_a_token() -> None:
    logits = random_logits(200)
    params = [SamplingParams(logit_bias={7: 100.0}), SamplingParams(temperature=0.0, logit_bias={11: 100.0})] * 100
    tokens = sample(logits, params)
    assert set(tokens[0::2].tolist()) == {7} and set(tokens[1::2].tolist()) == {11}


def test_logit_bias_outside_the_vocabulary_is_an_error() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build([SamplingParams(logit_bias={V: 1.0})])


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    eos, stop = 0, 5
    logits = torch.zeros(5, V)
    logits[:, eos], logits[:, stop], logits[:, 9] = 50.0, 40.0, 30.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,)),  # 1 output: masked
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,), ignore_eos=True),  # still masked
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(stop,)),  # 3 outputs: reached
        SamplingParams(min_tokens=2, logit_bias={eos: 100.0}),  # the bias cannot lift the mask
        SamplingParams(temperature=0.0),
    ]
    outputs = [[1], [1], [1, 2, 3], [], []]
    stops = [{eos, stop}] * 5
    meta = build(params, outputs=outputs, stops=stops)
    assert sorted(set(meta.stop_token_mask.rows.tolist())) == [0, 1, 3]
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [9, 9, eos, 9, eos]
    assert build(params[2:3], outputs=outputs[2:3], stops=stops[2:3]).stop_token_mask is None


def test_processors_leave_the_callers_logits_alone() -> None:
    logits = random_logits(2)
    before = logits.clone()
    params = [SamplingParams(logit_bias={1: 5.0}, repetition_penalty=1.3, min_tokens=1, logprobs=2),
              SamplingParams(temperature=0.5, top_k=3, top_p=0.5, min_p=0.1)]
    Sampler()(logits, build(params, outputs=[[], [2]], prompts=[[3], [4]], stops=[{0}, {0}]))
    assert torch.equal(logits, before)


# ---- logprobs -----------------------------------------------------------------------------------------

def check_logprobs(logits: torch.Tensor, tokens: torch.Tensor, lp, num: int) -> None:
    raw = logits.log_softmax(-1)
    assert lp.token_ids.shape == lp.logprobs.shape == (logits.shape[0], num + 1)
    assert torch.equal(lp.token_ids[:, 0], tokens)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, tokens[:, None])[:, 0])
    top = raw.topk(num, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    for i, t in enumerate(tokens.tolist()):
        assert lp.ranks[i].item() == 1 + int((raw[i] > raw[i, t]).sum())


def test_logprobs_are_raw_and_carry_the_sampled_token() -> None:
    logits = random_logits(6)
    plain = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(logprobs=1), SamplingParams()] * 2
    shaped = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.9),
              SamplingParams(temperature=0.3, logprobs=1, frequency_penalty=2.0, top_k=4),
              SamplingParams(temperature=2.0, presence_penalty=1.5)] * 2
    kwargs = dict(outputs=[[int(t)] for t in logits.argmax(-1)], prompts=[[0, 1]] * 6)
    meta = build(plain, **kwargs)
    assert meta.max_num_logprobs == 3
    out = Sampler()(logits, meta)
    check_logprobs(logits, out.sampled_token_ids, out.logprobs, 3)
    assert out.logprobs.ranks[0::3].tolist() == [1, 1]  # greedy without penalties: the top token
    shaped_out = Sampler()(logits, build(shaped, **kwargs))
    check_logprobs(logits, shaped_out.sampled_token_ids, shaped_out.logprobs, 3)
    # The penalties pushed the greedy rows off their argmax; the raw logprobs still rank it as such.
    assert (shaped_out.logprobs.ranks[0::3] > 1).all()
    torch.testing.assert_close(shaped_out.logprobs.logprobs[:, 1:], out.logprobs.logprobs[:, 1:])


def test_zero_logprobs_still_returns_the_sampled_token() -> None:
    logits = random_logits(3)
    out = Sampler()(logits, build([SamplingParams(logprobs=0)] * 3))
    check_logprobs(logits, out.sampled_token_ids, out.logprobs, 0)


def test_logprobs_to_host_cuts_each_row_to_its_own_n() -> None:
    logits = random_logits(2)
    out = Sampler()(logits, build([SamplingParams(temperature=0.0, logprobs=3),
                                   SamplingParams(temperature=0.0, logprobs=1)]))
    rows = out.logprobs.to_host([3, 1])
    assert [len(r.token_ids) for r in rows] == [4, 2] and [len(r.logprobs) for r in rows] == [4, 2]
    assert [r.rank for r in rows] == [1, 1]
    assert rows[0].token_ids[0] == rows[0].token_ids[1] == logits[0].argmax().item()


def test_prompt_logprobs() -> None:
    logits = random_logits(7)
    targets = torch.tensor([3, 0, 63, 5, 5, 1, 2])
    lp = compute_prompt_logprobs(logits, targets, 4)
    check_logprobs(logits, targets, lp, 4)


# ---- distribution -------------------------------------------------------------------------------------

@pytest.mark.slow  # over a second: `make test`, not test-fast
@pytest.mark.parametrize(("kwargs", "expected"), [
    (dict(), torch.tensor([1.0, 0.5, -0.5, 0.0]).softmax(-1)),
    (dict(temperature=2.0), (torch.tensor([1.0, 0.5, -0.5, 0.0]) / 2.0).softmax(-1)),
    (dict(top_k=2), torch.tensor([1.0, 0.5]).softmax(-1).tolist() + [0.0, 0.0]),
])
def test_draws_follow_the_distribution(kwargs: dict, expected) -> None:
    num_draws = 20_000
    logits = torch.tensor([[1.0, 0.5, -0.5, 0.0]]).expand(num_draws, 4).contiguous()
    torch.manual_seed(0)
    tokens = sample(logits, [SamplingParams(**kwargs)] * num_draws)
    frequencies = torch.bincount(tokens, minlength=4).float() / num_draws
    torch.testing.assert_close(frequencies, torch.as_tensor(expected, dtype=torch.float32), rtol=0, atol=0.015)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_seeded_draws_follow_the_distribution() -> None:
    """Over the positions of one seeded request (its successive draws)."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    sampler = Sampler()
    tokens = torch.stack([sampler(probs.log()[None], build([SamplingParams(seed=9)], vocab_size=4, prompts=[[0] * p]))
                          .sampled_token_ids[0] for p in range(1, 4001)])
    torch.testing.assert_close(torch.bincount(tokens, minlength=4).float() / 4000, probs, rtol=0, atol=0.03)


def test_build_checks_row_counts() -> None:
    with pytest.raises(ValueError, match="one entry per batch row"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [set()], V, CPU)


def test_chunked_argmax_matches_torch_including_ties_and_infinities():
    from services.worker.sampler import argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4096, generator=gen)
    x[1, 100] = x[1, 3000] = 50.0  # a tie across chunks: the first index wins
    x[2, 5] = x[2, 6] = 50.0  # a tie inside a chunk
    x[3] = float("-inf")
    x[3, 4000] = 0.0
    x[4, 1023] = float("inf")
    x[5] = 1.0  # all equal
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert argmax(x)[1].item() == 100


# ---- resumed requests (migrated from an engine that died) -----------------------------------------------

def toy_model_logits(tokens: list[int]) -> torch.Tensor:
    """[1, V] logits of a bigram model with peaked rows: without penalties it repeats itself."""
    return random_logits(1, seed=tokens[-1], scale=3.0)


def run(prompt: list[int], params: SamplingParams, num_steps: int) -> list[int]:
    """`num_steps` tokens of one request decoded alone, a fresh Sampler each step (as a new engine)."""
    outputs: list[int] = []
    for _ in range(num_steps):
        logits = toy_model_logits(prompt + outputs)
        meta = build([params], prompts=[prompt], outputs=[outputs], stops=[{0, 1}])
        outputs.append(Sampler()(logits, meta).sampled_token_ids[0].item())
    return outputs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, seed=11, presence_penalty=0.8, frequency_penalty=1.5, repetition_penalty=1.3,
                   min_tokens=6, max_tokens=12),
    SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=2.0, min_tokens=6, max_tokens=12),
], ids=["seeded", "greedy"])
@pytest.mark.parametrize("k", [1, 4, 9])
def test_a_resumed_request_draws_what_it_would_have_uninterrupted(params: SamplingParams, k: int) -> None:
    """Resumed after k outputs: prompt + those outputs, marked as outputs, with what is left of
    max_tokens and min_tokens; penalties and the min_tokens mask go on exactly."""
    prompt = [5, 9, 5, 30, 2]
    whole = run(prompt, params, 12)
    assert len(set(whole)) > 4 and not {0, 1} & set(whole[:6])
    resumed = replace(params, num_resumed_outputs=k, max_tokens=12 - k, min_tokens=max(0, params.min_tokens - k))
    assert whole[:k] + run(prompt + whole[:k], resumed, 12 - k) == whole
    # The logits the draw sees at the resume point: the same as uninterrupted; without the marker the
    # penalties would forget the earlier outputs.
    logits = toy_model_logits(prompt + whole[:k])

    def processed(p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        return apply_logits_processors(logits, build([p], prompts=[prompt_ids], outputs=[output_ids], stops=[{0, 1}]))

    expected = processed(params, prompt, whole[:k])
    assert torch.equal(processed(resumed, prompt + whole[:k], []), expected)
    assert not torch.equal(processed(replace(resumed, num_resumed_outputs=0), prompt + whole[:k], []), expected)


# ---- allowed_token_ids and logprob_token_ids (vLLM's) ---------------------------------------------------

def test_allowed_token_ids_restrict_their_row_only() -> None:
    logits = random_logits(3)
    allowed = (5, 17, 40)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=3, allowed_token_ids=(9,))]
    out = sample(logits, params)
    assert out[0].item() == max(allowed, key=lambda t: logits[0, t].item())
    assert out[1].item() == logits[1].argmax().item()  # not restricted
    assert out[2].item() == 9  # one allowed token: it is drawn whatever the temperature
    for seed in range(20):  # random rows draw inside their set only
        drawn = sample(random_logits(1, seed=seed), [SamplingParams(temperature=2.0, allowed_token_ids=allowed)])
        assert drawn.item() in allowed


def test_logprob_token_ids_replace_the_top_n_of_their_row() -> None:
    logits = random_logits(3)
    raw = logits.log_softmax(-1)
    asked = (3, 60, 3)  # a repeat is answered twice, as asked
    params = [SamplingParams(temperature=0.0, logprob_token_ids=asked), SamplingParams(temperature=0.0, logprobs=4),
              SamplingParams(temperature=0.0, logprob_token_ids=(11,))]
    meta = build(params)
    assert meta.max_num_logprobs == 4
    out = Sampler()(logits, meta)
    rows = out.logprobs.to_host([p.num_logprobs for p in params])
    sampled = logits.argmax(-1).tolist()
    assert rows[0].token_ids == [sampled[0], *asked]
    assert rows[0].logprobs == pytest.approx([raw[0, t].item() for t in rows[0].token_ids])
    assert rows[1].token_ids[1:] == raw[1].topk(4).indices.tolist()  # the others keep their top-N
    assert rows[2].token_ids == [sampled[2], 11] and rows[2].rank == 1


def test_token_lists_are_checked_where_they_are_built() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=())
    with pytest.raises(ValueError, match="1 to 128"):
        SamplingParams(logprob_token_ids=tuple(range(129)))
    with pytest.raises(ValueError, match="must equal the number of logprob_token_ids"):
        SamplingParams(logprobs=1, logprob_token_ids=(1, 2))
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids \[64, 99\]"):
        build([SamplingParams(allowed_token_ids=(1, 99, 64))])
