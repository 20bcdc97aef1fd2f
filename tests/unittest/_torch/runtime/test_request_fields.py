"""``Request`` read by field name: code written against the dict form of the engine loop's submit keeps
working (a stand-in loop reading ``f["max_new_tokens"]``), read-only, the fields only."""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request


def test_fields_read_by_name_and_nothing_else():
    sp = SamplingParams(temperature=0.5, seed=3)
    r = Request([1, 2, 3], 7, stop_token_ids=(4,), sampling=sp, min_tokens=2, logprobs=1)
    assert r["max_new_tokens"] == 7 and r["prompt_ids"] == [1, 2, 3] and r["sampling"] is sp
    assert [r[k] for k in ("stop_token_ids", "min_tokens", "logprobs", "ignore_eos")] == [(4,), 2, 1, False]
    for bad in ("validate", "_validate", "temperature", "__class__", 0):
        with pytest.raises(KeyError):
            r[bad]
    with pytest.raises(TypeError):
        r["max_new_tokens"] = 3  # read-only: the object's attributes are its one source of truth
