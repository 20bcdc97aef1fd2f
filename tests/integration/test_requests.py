"""Request handling: bad requests rejected without disturbing the batch; slots and pages freed and reused."""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request, RequestError
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 301, "model.target.capture_layers": [1],
                       "speculative_config.max_draft_len": 2, "max_batch_size": 2, "max_seq_len": 24,
                       "kv_cache_config.tokens_per_block": 4})


@pytest.fixture(scope="module")
def engine():
    return Engine(load_config(**SMALL))


@pytest.mark.parametrize("request_, match", [
    (Request([], 4), "empty prompt"),
    (Request([1, 301], 4), "outside the vocabulary"),
    (Request([-1, 2], 4), "outside the vocabulary"),
    (Request(list(range(20)), 5), "exceeds the cache"),
    (Request([1, 2], 0), "max_new_tokens"),
    (Request([1, 2], 4, sampling=SamplingParams(temperature=-0.5)), "temperature"),
    (Request([1, 2], 4, stop_token_ids=(999,)), "stop_token_ids"),
    (Request([1, 2], 4, sampling=SamplingParams(seed=-3)), "seed"),
])
def test_validation_messages(engine, request_, match):
    with pytest.raises(RequestError, match=match):
        engine.validate(request_)


def test_bad_requests_do_not_disturb_the_batch(engine):
    good = [Request([3, 4, 5], 6), Request([250, 1], 6, sampling=SamplingParams(temperature=0.8, seed=4)), Request([7] * 9, 6)]
    alone, _ = engine.generate(good, "reference")  # served alone: the target's decode, which speculative equals
    mixed = [Request([], 6), good[0], Request([1, 500], 6), good[1], Request(list(range(30)), 6), good[2]]
    results, _ = engine.generate(mixed, "speculative")
    assert [r.finish_reason for r in results] == ["error", "length", "error", "length", "error", "length"]
    assert "empty prompt" in results[0].error and "vocabulary" in results[2].error and "cache" in results[4].error
    assert all(r.output_ids == [] for r in results[0:5:2])
    assert [r.output_ids for r in results[1::2]] == [r.output_ids for r in alone]
    assert engine.slots.num_free == 2 and engine.pages.num_free == engine.pages.num_pages


def test_slot_reuse_over_many_requests(engine):
    """Nine requests through two slots (each slot reused several times, pages freed and handed out again):
    every request still equals the target's own decode, and runs the same alone."""
    reqs = [Request([(13 * i + 1) % 301, (7 * i) % 301, 42], max_new_tokens=3 + (i % 4), sampling=SamplingParams(seed=i, temperature=0.6 if i % 3 == 0 else 0.0)) for i in range(9)]
    spec, stats = engine.generate(reqs, "speculative")
    ref, _ = engine.generate(reqs, "reference")
    assert [r.output_ids for r in spec] == [r.output_ids for r in ref]
    assert all(len(r.output_ids) == q.max_new_tokens for r, q in zip(spec, reqs))
    assert engine.slots.num_free == 2 and engine.pages.num_free == engine.pages.num_pages
    assert int((engine.pages.encoded_offsets >= 0).sum()) == 0
    solo, _ = engine.generate([reqs[7]], "speculative")
    assert solo[0].output_ids == spec[7].output_ids


@pytest.mark.parametrize("ids, error", [
    ([3, 1, 4], None), ((3, 1, 4), None),
    ([3, type("Token", (int,), {})(5)], None),  # an int subclass: not the fast path's exact int, still an int
    ([3, True], "must be a list of ints"), ([3, 4.0], "must be a list of ints"), ([3, None], "must be a list of ints"),
    ([3, -1], r"\[-1\] outside"), ([3, 2 ** 70], "outside the vocabulary"), ([0, 517], r"\[517\] outside"),
    ([], "empty prompt"), ("abc", "must be a list of ints"),
])
def test_prompt_ids_validated_alike_on_the_fast_path_and_off_it(ids, error):
    """Plain in-range ints pass in C-level passes (types, min, max); anything else takes the per-token checks
    that name the offending value: the same verdict and message either way."""
    req = Request(ids, max_new_tokens=2)
    if error is None:
        req.validate(517, 64)
    else:
        with pytest.raises(RequestError, match=error):
            req.validate(517, 64)
