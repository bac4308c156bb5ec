"""Sampling keyed by position: the token drawn at a position depends on the seed, the position and the logits
alone (so a window of drafts checked at once, a redo, or a sequence beside others draws what one token per
pass draws), and the draws follow the temperature / top-k / top-p distribution."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.coordinator.decode.sampling import Sampler, SamplingParams, position_uniform


def test_position_uniform_is_a_function_of_seed_and_position() -> None:
    draws = [position_uniform(7, p) for p in range(4000)]
    assert draws == [position_uniform(7, p) for p in range(4000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert [position_uniform(8, p) for p in range(50)] != draws[:50]
    # roughly uniform: each tenth of [0, 1) holds about a tenth of the draws
    tenths = [sum(1 for u in draws if k / 10 <= u < (k + 1) / 10) for k in range(10)]
    assert all(abs(n - 400) < 80 for n in tenths), tenths


def test_a_seeded_draw_is_the_same_at_the_same_position_whatever_came_before() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    a = Sampler(SamplingParams(temperature=0.9, seed=11))
    b = Sampler(SamplingParams(temperature=0.9, seed=11))
    forward = [a(logits, p) for p in range(40)]
    backward = [b(logits, p) for p in reversed(range(40))][::-1]
    assert forward == backward
    assert len(set(forward)) > 5  # it does sample


def test_draws_follow_the_distribution_and_its_cuts() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log()
    n = 6000
    plain = Sampler(SamplingParams(temperature=1.0, seed=3))
    counts = torch.bincount(torch.tensor([plain(logits, p) for p in range(n)]), minlength=4).double() / n
    for got, want in zip(counts.tolist(), probs.tolist(), strict=True):
        assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n) + 1e-3, (counts, probs)
    top_k = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=3))
    assert {top_k(logits, p) for p in range(2000)} == {0, 1}
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=3))  # 0.6 + 0.25 reach 0.8
    assert {top_p(logits, p) for p in range(2000)} == {0, 1}


@pytest.mark.parametrize("seed", [None, 5])
def test_greedy_ignores_the_seed(seed: int | None) -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    s = Sampler(SamplingParams(temperature=0.0, seed=seed))
    assert {s(logits, p) for p in range(20)} == {1}
