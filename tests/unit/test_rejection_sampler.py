"""Draft verification keeps the target distribution: the real sampler's draws over a tiny vocabulary,
verified against one-hot drafts (n-gram drafts carry no probabilities), many times over, compared with
the distribution the sampler targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.rejection_sampler import num_accepted_drafts
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import SamplingMetadata

VOCAB = 6
TRIALS = 20_000
# Logits at the three positions of a request with two drafts (the third gives the bonus token).
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5],
                       [0.0, 0.3, 2.5, 1.0, 0.2, -0.5],
                       [1.0, 1.0, 1.0, 0.0, 0.0, 3.0]])
DRAFTS = [1, 2]  # x_1 is unlikely at position 0 (p ~ 0.14), x_2 likely at position 1
TEMPERATURE, TOP_K = 0.9, 4


def target(logits: torch.Tensor) -> np.ndarray:
    """What the sampler draws from: temperature, then the top-k tokens, renormalised."""
    scaled = (logits / TEMPERATURE).numpy().astype(np.float64)
    keep = scaled >= np.sort(scaled)[-TOP_K]
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    return probs / probs.sum()


def distribution(samples: np.ndarray) -> np.ndarray:
    return np.bincount(samples, minlength=VOCAB) / len(samples)


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def verify_many() -> tuple[np.ndarray, np.ndarray]:
    """TRIALS requests with the same drafts; each one's new tokens (-1 past its last) and accepted count."""
    torch.manual_seed(1234)
    rows = TRIALS * (len(DRAFTS) + 1)
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K)
    meta = SamplingMetadata.build([params] * rows, [[]] * rows, [[1]] * rows, [frozenset()] * rows, VOCAB, "cpu")
    draws = Sampler()(LOGITS.repeat(TRIALS, 1), meta).sampled_token_ids.numpy()
    accepted = num_accepted_drafts(draws, [DRAFTS] * TRIALS)
    grid = draws.reshape(TRIALS, len(DRAFTS) + 1)
    new_tokens = np.where(np.arange(len(DRAFTS) + 1)[None, :] <= accepted[:, None], grid, -1)
    return new_tokens, accepted


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_every_kept_token_has_the_target_distribution():
    new_tokens, accepted = verify_many()
    # Sampling noise: TV of 20,000 draws over 6 tokens is ~0.006; 0.02 is far beyond it, and far
    # below what a biased verifier shows (e.g. always keeping the draft: TV 0.7 at position 0).
    first = new_tokens[:, 0]
    assert total_variation(distribution(first), target(LOGITS[0])) < 0.02
    # The second token exists when the first draft was accepted; given that, it follows position 1's.
    second = new_tokens[accepted >= 1, 1]
    assert len(second) > 1000
    assert total_variation(distribution(second), target(LOGITS[1])) < 0.03
    # The bonus token after both drafts follows position 2's.
    third = new_tokens[accepted == 2, 2]
    assert total_variation(distribution(third), target(LOGITS[2])) < 0.05


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_each_draft_is_accepted_with_its_target_probability():
    _, accepted = verify_many()
    p1, p2 = target(LOGITS[0])[DRAFTS[0]], target(LOGITS[1])[DRAFTS[1]]
    # Binomial standard deviations at 20,000 trials are below 0.004; allow 4 of them.
    assert abs((accepted >= 1).mean() - p1) < 0.016
    assert abs((accepted >= 2).mean() / (accepted >= 1).mean() - p2) < 0.03


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    draws = np.array([0, 2, 5,   0, 3, 5,   4, 2, 5])
    assert num_accepted_drafts(draws, [[0, 2], [0, 2], [0, 2]]).tolist() == [2, 1, 0]
    assert num_accepted_drafts(np.array([5, 1, 7, 9]), [[], [1], []]).tolist() == [0, 1, 0]
