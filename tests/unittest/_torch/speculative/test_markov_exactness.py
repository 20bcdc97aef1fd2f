"""Load-time exactness guard of the exact Markov mode on a vocab shard (single process; the agreed
multi-rank decision is in multi_gpu/test_low_latency_exchange.py)."""

import logging

import pytest
import torch

from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.speculative.markov_exactness import first_inexact_batch_size, resolve_markov_mode


def _weights(vocab: int, r: int, tp: int, seed: int = 5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    width = -(-vocab // tp)
    w1 = torch.randn(vocab, r, generator=g).to(dtype)
    w2_pad = torch.zeros(width * tp, r, dtype=dtype)
    w2_pad[:vocab] = torch.randn(vocab, r, generator=g).to(dtype)
    return w1, w2_pad, width


@pytest.mark.parametrize("vocab,r,tp", [(512, 12, 2), (1536, 48, 4), (384, 16, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_guard_passes_where_the_sliced_gemm_is_exact(vocab, r, tp, dtype):
    w1, w2_pad, width = _weights(vocab, r, tp, dtype=dtype)
    for k in range(tp):
        shard = w2_pad[k * width:(k + 1) * width]
        assert first_inexact_batch_size(w1, w2_pad[:vocab], shard, k * width, vocab, range(1, 10)) == 0
        assert resolve_markov_mode("exact", Mapping(), w1, w2_pad[:vocab], shard, k * width, vocab,
                                   range(1, 10)) == "exact"


def test_forced_mismatch_falls_back_to_fused_with_one_line(caplog):
    vocab, r, tp = 512, 12, 2
    w1, w2_pad, width = _weights(vocab, r, tp)
    start = width  # rank 1's shard
    shard = w2_pad[start:start + width]
    full = w2_pad[:vocab].clone()
    full[start + 5, 3] += 1.0  # the "full" projection now differs in one of this shard's columns
    assert first_inexact_batch_size(w1, full, shard, start, vocab, range(1, 8)) == 1
    assert first_inexact_batch_size(w1, full, shard, start, vocab, [5, 3]) == 3  # the smallest failing size
    with caplog.at_level(logging.WARNING, logger="tensorrt_llm_ext"):
        for mode in ("exact", "auto"):
            assert resolve_markov_mode(mode, Mapping(), w1, full, shard, start, vocab, range(1, 8)) == "fused"
        assert resolve_markov_mode("fused", Mapping(), w1, full, shard, start, vocab, range(1, 8)) == "fused"
        # "auto" whose every size runs fused checks nothing: no warning, mode kept.
        assert resolve_markov_mode("auto", Mapping(), w1, full, shard, start, vocab, []) == "auto"
    lines = [r.getMessage() for r in caplog.records if "Markov chain" in r.getMessage()]
    assert len(lines) == 2 and "batch size 1 on tp rank 0" in lines[0] and "using mode 'fused'" in lines[0]


def test_guard_ignores_padded_rows_and_catches_a_late_batch_size(monkeypatch):
    vocab, r, tp = 509, 8, 2  # the last shard has padded rows past the vocabulary
    w1, w2_pad, width = _weights(vocab, r, tp)
    start = width
    shard = w2_pad[start:start + width].clone()
    shard[-1] = 1e30  # a padded row (global id >= vocab): never compared, never wins
    full = w2_pad[:vocab]
    exact_here = first_inexact_batch_size(w1, full, shard, start, vocab, range(1, 7))
    assert exact_here == first_inexact_batch_size(w1, full, w2_pad[start:start + width], start, vocab, range(1, 7))

    # A projection that differs only from batch size 4 on: the sweep must reach it.
    calls = {"n": 0}
    real_linear = torch.nn.functional.linear

    def linear(h, w):
        out = real_linear(h, w)
        calls["n"] += 1
        if h.shape[0] >= 4:
            out = out.clone()
            out[0, start] += 1.0
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    got = first_inexact_batch_size(w1, full, w2_pad[start:start + width], start, vocab, range(1, 7))
    assert calls["n"] == 6
    assert got == (exact_here if 0 < exact_here < 4 else 4)
