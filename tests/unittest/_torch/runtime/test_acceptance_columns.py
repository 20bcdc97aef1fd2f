"""bench acceptance's per-position columns: the cumulative acceptance by position and the acceptance of a position
given the ones before it (which tells a weak later position from a uniformly low acceptance)."""

from __future__ import annotations

import math

import pytest

from tensorrt_llm_ext.bench.acceptance import acceptance_per_position, conditional_acceptance


def test_cumulative_and_conditional_columns_on_hand_made_steps():
    lens = [1, 2, 2, 3, 4, 4, 1, 2]  # tokens per step = accepted drafts + 1, K = 3
    assert acceptance_per_position(lens, 3) == pytest.approx([6 / 8, 3 / 8, 2 / 8])
    assert conditional_acceptance(lens, 3) == pytest.approx([6 / 8, 3 / 6, 2 / 3])


def test_a_uniform_acceptance_reads_flat_given_the_previous():
    p, k = 0.4, 5
    # a geometric ladder of 10^5 steps: exactly round(N * p^j) steps accept at least j drafts
    n = 100_000
    at_least = [n] + [round(n * p ** j) for j in range(1, k + 1)] + [0]
    lens = [j + 1 for j in range(k + 1) for _ in range(at_least[j] - at_least[j + 1])]
    assert conditional_acceptance(lens, k) == pytest.approx([p] * k, abs=1e-3)
    assert acceptance_per_position(lens, k) == pytest.approx([p ** j for j in range(1, k + 1)], abs=1e-4)
    assert all(math.isnan(x) for x in conditional_acceptance([1, 1], 2)[1:])  # no step got past position 1
