"""Chunked prefill (``enable_chunked_prefill`` + ``max_num_tokens``): the prefill in chunks over the paged cache
(the scheduler's chunks between steps in ``generate``, the worker's column chunks in one prefill call) gives the
tokens of the unchunked prefill, speculative and target-only, and the same K/V (up to GEMM rounding of another
row count: asserted at 1e-5 on O(1) fp32 values)."""

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
    calls = []  # per prefill call: its tokens (rows x columns, padding included)
    orig_rows, orig_chunk = chunked.launch_prefill, chunked.prefill_chunk

    def rows(slots, requests, mode="speculative", starts=None, **kw):
        calls.append(len(slots) * max(len(r.prompt_ids) - s for r, s in zip(requests, starts or [0] * len(slots))))
        return orig_rows(slots, requests, mode, starts, **kw)

    def chunk(slot, request, start, end, mode="speculative"):
        calls.append(end - start)
        return orig_chunk(slot, request, start, end, mode)

    chunked.launch_prefill, chunked.prefill_chunk = rows, chunk
    reqs = [Request(list(p), max_new_tokens=6, sampling=SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i))
            for i, p in enumerate(PROMPTS)]
    for mode in ("speculative", "target_only"):
        calls.clear()
        # speculative: the unchunked engine's target decode, which its speculative tokens equal bit for bit
        want, _ = whole.generate(reqs, "reference" if mode == "speculative" else mode)
        got, _ = chunked.generate(reqs, mode)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        # The generate loop's plans carry at most 9 prefill tokens each: prompts 4 and 1 in one batched prefill
        # (2 x 4), the 19- and 11-token prompts as chunks and rests between the steps.
        assert calls[0] == 8 and max(calls) <= 9 and sum(calls) >= sum(len(p) for p in PROMPTS), calls
    del chunked.launch_prefill, chunked.prefill_chunk
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
