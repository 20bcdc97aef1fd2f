"""Chunked prefill (``enable_chunked_prefill`` + ``max_num_tokens``): the prefill forward in column chunks over
the paged cache gives the tokens of the unchunked prefill, speculative and target-only, and the same K/V
(up to GEMM rounding of another row count: asserted at 1e-5 on O(1) fp32 values)."""

from __future__ import annotations

import torch

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.testing.tiny_models import tiny_model

TINY = {"model.target.num_layers": 1, "model.target.capture_layers": [0], "max_batch_size": 4, "max_seq_len": 40}
PROMPTS = [[5, 17, 300, 42], [101], list(range(200, 219)), [7, 7, 7, 480, 2, 9, 31, 64, 128, 256, 3]]


def test_chunked_prefill_equals_unchunked():
    whole = Engine(load_config(**tiny_model(**TINY)))
    chunked = Engine(load_config(**tiny_model(**TINY, enable_chunked_prefill=True, max_num_tokens=9)))
    assert whole.prefill_chunk_tokens is None and chunked.prefill_chunk_tokens == 9
    calls = []
    orig = chunked.target.forward

    def counting(ids, *args, _orig=orig):
        calls.append(ids.numel())
        return _orig(ids, *args)

    chunked.target.forward = counting
    reqs = [Request(list(p), max_new_tokens=6, sampling=SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i))
            for i, p in enumerate(PROMPTS)]
    for mode in ("speculative", "target_only"):
        calls.clear()
        want, _ = whole.generate(reqs, mode)
        got, _ = chunked.generate(reqs, mode)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        # 4 prompts padded to 19 columns, 2 columns (8 tokens) per forward: 10 prefill forwards, then the steps.
        assert calls[:10] == [8] * 9 + [4] and max(calls[:10]) <= 9
    # The prompts' K/V, chunked vs whole, at the same pages (both engines handed out the same ones).
    eng = {}
    for name, e in (("whole", whole), ("chunked", chunked)):
        for slot, p in enumerate(PROMPTS):
            e.pages.allocate(slot, e.pages_for(Request(list(p), max_new_tokens=6)))
        e.worker().prefill_batch(list(range(4)), PROMPTS, [SamplingParams()] * 4)
        eng[name] = e
    table = whole.pages.page_table
    assert torch.equal(table, chunked.pages.page_table)
    for a, b in zip(whole.state.kv_cache.tensors(), chunked.state.kv_cache.tensors()):
        for slot, p in enumerate(PROMPTS):
            rows = table[slot].long()
            torch.testing.assert_close(b[:, rows].flatten(1, 2)[:, :len(p)], a[:, rows].flatten(1, 2)[:, :len(p)],
                                       atol=1e-5, rtol=1e-5)
