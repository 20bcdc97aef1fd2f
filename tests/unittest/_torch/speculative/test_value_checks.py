"""The device-reading value checks of the selection and verification entry points: one function, opt-in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorrt_llm_ext.speculative import value_checks
from tensorrt_llm_ext.speculative.value_checks import check_row_values

BAD = [
    (dict(temperatures=torch.tensor([1.0, -0.5])), "temperatures: expected values >= 0"),
    (dict(temperatures=torch.tensor([1e-6, 1.0])), "temperatures: expected 0 \\(greedy\\) or >= 1e-05"),
    (dict(temperatures=torch.tensor([1.0]), top_p=torch.tensor([0.0])), "top_p: expected values in \\(0, 1\\]"),
    (dict(temperatures=None, draft_tokens=torch.tensor([[3, 9]]), vocab_size=9), "draft_tokens: expected global"),
]


@pytest.mark.parametrize("kwargs,match", BAD)
def test_bad_row_values_are_refused_by_name_when_checking(monkeypatch, kwargs, match):
    monkeypatch.setattr(value_checks, "ENV", dataclasses.replace(value_checks.ENV, check_values=True))
    with pytest.raises(ValueError, match=match):
        check_row_values(**kwargs)
    check_row_values(torch.tensor([0.0, 1e-5, 2.0]), torch.tensor([1.0, 0.5, 1e-38]), torch.tensor([[0, 8]]), 9)


@pytest.mark.parametrize("kwargs,match", BAD)
def test_serving_reads_nothing_back_without_the_switch(monkeypatch, kwargs, match):
    monkeypatch.setattr(value_checks, "ENV", dataclasses.replace(value_checks.ENV, check_values=False))
    check_row_values(**kwargs)  # no device read, no refusal: the request's SamplingParams were checked already
