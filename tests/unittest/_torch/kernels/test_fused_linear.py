"""The small-M fused linear (RMSNorm prologue, bias, SiLU-mul / residual epilogue) vs its eager twin.

Tolerances: fp32 ``1e-5`` (another summation order); 16-bit ``atol = rtol = 4e-2`` (the output rounding, and a
prologue rounding that flips under another order -- the interpreter also truncates its 16-bit casts). Bitwise:
a row's output does not depend on the other rows of the call (same M).
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.kernels.fused_linear import (EPI_NONE, EPI_RESIDUAL, EPI_SILU_MUL, GEMV_MAX_TILE,
                                                   MAX_PREFETCH_LINES, fused_gemv_settings, fused_linear,
                                                   fused_linear_reference, fused_linear_settings, prefetch_lines)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
       torch.float16: dict(atol=4e-2, rtol=4e-2)}


@pytest.fixture(autouse=True)
def _few_row_form_up_to_4_rows(monkeypatch):
    """The few-row form at up to 4 rows (the model takes it at GEMV_MAX_ROWS, 1 by measurement): its tiles of
    2 and 4 rows are tested too."""
    from tensorrt_llm_ext.kernels import fused_linear as fl, fused_qkv as fq
    monkeypatch.setattr(fl, "GEMV_MAX_ROWS", 4)
    monkeypatch.setattr(fq, "GEMV_MAX_ROWS", 4)


def _case(m, k, n, dtype, seed=0, gate_up=False):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gate_up else n
    x = torch.randn(m, k, generator=g)
    w = torch.randn(rows, k, generator=g) / k ** 0.5
    b = 0.1 * torch.randn(rows, generator=g)
    nw = 1 + 0.1 * torch.randn(k, generator=g)
    r = torch.randn(m, n, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (x, w, b, nw, r)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", [EPI_NONE, EPI_SILU_MUL, EPI_RESIDUAL])
@pytest.mark.parametrize("norm", [False, True])
def test_matches_twin_odd_sizes(dtype, epilogue, norm):
    """Odd K / N (masks on every edge), M = 1 (the few-row form) and M = 11 rows (dot tiles), with and without
    bias."""
    for m, k, n, bias in ((1, 37, 21, True), (11, 72, 40, False)):
        x, w, b, nw, r = _case(m, k, n, dtype, gate_up=epilogue == EPI_SILU_MUL)
        kw = dict(norm_weight=nw if norm else None, eps=1e-5, epilogue=epilogue,
                  residual=r if epilogue == EPI_RESIDUAL else None)
        out = fused_linear(x, w, b if bias else None, **kw)
        ref = fused_linear_reference(x, w, b if bias else None, **kw)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_several_row_tiles_and_row_independence():
    """M past one row tile (70 rows: two tiles of 64); a row's bits equal across calls with other neighbours."""
    x, w, b, nw, r = _case(70, 48, 24, torch.float32, seed=2)
    out = fused_linear(x, w, b, norm_weight=nw, eps=1e-6)
    torch.testing.assert_close(out, fused_linear_reference(x, w, b, norm_weight=nw, eps=1e-6), **TOL[torch.float32])
    x2 = torch.randn_like(x)
    x2[3] = x[3]
    x2[69] = x[69]
    out2 = fused_linear(x2, w, b, norm_weight=nw, eps=1e-6)
    assert torch.equal(out2[3], out[3]) and torch.equal(out2[69], out[69])


def test_weight_prefetch_changes_no_bit(monkeypatch):
    """The L2 prefetch of the weight rows past the first block (before the programmatic wait): its lines per row
    (128-byte lines past BLOCK_K, a power of two, capped; none without programmatic launch or when one block
    covers K), and on a GPU (where the launch is programmatic) the same bits with it and without it."""
    assert prefetch_lines(576, 256, 2, True) == 8 and prefetch_lines(1536, 256, 2, True) == 32
    assert prefetch_lines(1536, 256, 2, False) == 0 and prefetch_lines(200, 256, 2, True) == 0
    assert prefetch_lines(14336, 256, 2, True) == MAX_PREFETCH_LINES
    if DEVICE != "cuda":  # the interpreter never launches programmatically: nothing is prefetched there
        return
    from tensorrt_llm_ext.kernels import fused_linear as fl
    for epilogue in (EPI_SILU_MUL, EPI_RESIDUAL):
        x, w, b, nw, r = _case(32, 1536 if epilogue == EPI_RESIDUAL else 576, 72, torch.bfloat16, seed=4,
                               gate_up=epilogue == EPI_SILU_MUL)
        kw = dict(norm_weight=nw if epilogue == EPI_SILU_MUL else None, eps=1e-5, epilogue=epilogue,
                  residual=r if epilogue == EPI_RESIDUAL else None)
        outs = []
        for on in (True, False):
            for peel in (True, False):  # the first block in registers across the wait, or to L2 with the rest
                monkeypatch.setattr(fl, "WEIGHT_PREFETCH", on)
                monkeypatch.setattr(fl, "DOT_PEEL_FIRST_BLOCK", peel)
                outs.append(fused_linear(x, w, b, **kw))
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("m,k", [(1, 600), (11, 600), (11, 72), (32, 1536)])
def test_early_residual_and_unrolled_norm_change_no_bit(monkeypatch, m, k):
    """The residual read before the programmatic wait (``early_residual``) and the norm prologue's chunks unrolled
    (``NORM_UNROLL_MAX``) move loads, never a result: every combination gives the bits of the loop with the late
    read, the output aliasing the residual included; chunks above the bound keep the loop."""
    from tensorrt_llm_ext.kernels import fused_linear as fl
    assert fl.norm_unroll(576, 256) == 3 and fl.norm_unroll(1536, 256) == 6 and fl.norm_unroll(576, 1024) == 1
    assert fl.norm_unroll(14336, 256) == 0  # 56 chunks: the loop
    x, w, b, nw, r = _case(m, k, 40, torch.bfloat16, seed=5)
    results = {}
    for early in (False, True):
        for unroll in (0, fl.NORM_UNROLL_MAX):
            monkeypatch.setattr(fl, "NORM_UNROLL_MAX", unroll)
            res = r.clone()
            a = fused_linear(x, w, b, epilogue=EPI_RESIDUAL, residual=res, out=res, early_residual=early)
            g = fused_linear(x, torch.cat([w, w.flip(0)]), norm_weight=nw, eps=1e-5, epilogue=EPI_SILU_MUL)
            results[early, unroll] = (a, g)
    first = results[False, 0]
    assert not torch.equal(first[0], r)  # the product was added
    for got in results.values():
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])


def test_residual_output_may_alias_the_residual():
    x, w, b, nw, r = _case(3, 40, 40, torch.float32, seed=4)
    ref = fused_linear_reference(x, w, epilogue=EPI_RESIDUAL, residual=r)
    out = fused_linear(x, w, epilogue=EPI_RESIDUAL, residual=r, out=r)
    assert out.data_ptr() == r.data_ptr()
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_settings_depend_on_shape_only_and_spread_wide_weights():
    assert fused_linear_settings(1, 576, 576)[:3] == (16, 16, 256)
    assert fused_linear_settings(64, 576, 576)[0] == 64
    # steps of up to 32 rows in 16-row tiles (twice the programs of one 32-row tile), larger ones as before
    assert fused_linear_settings(32, 576, 576)[0] == 16 and fused_linear_settings(17, 576, 576)[0] == 16
    assert fused_linear_settings(33, 576, 576)[0] == 64
    assert fused_linear_settings(200, 576, 576)[0] == 64
    bm, bn, bk, _ = fused_linear_settings(1, 14336, 4096, gate_up=True)  # an 8B gate-up: >= 2 programs per SM
    assert bn == 32 and -(-14336 // bn) >= 264 and bk == 256
    # One pipeline stage stays within 40 KB of shared memory and the input tile within 8192 elements.
    for m in (1, 8, 64):
        for elem in (2, 4):
            for gate_up in (False, True):
                bm, bn, bk, warps = fused_linear_settings(m, 14336, 4096, elem, gate_up)
                assert (bm + bn * (1 + gate_up)) * bk * elem <= 40960 and bm * bk <= 8192 and bk >= 16
                assert warps == (8 if bm == 64 else 4)


@pytest.mark.parametrize("epilogue", [EPI_SILU_MUL, EPI_RESIDUAL])
def test_few_row_form_over_several_k_chunks_and_row_independence(epilogue):
    """3 rows in the dot-free form (the fixture's 4-row limit): K = 2500 needs two 2048-wide chunks; a row's bits do not
    depend on the other rows of the call."""
    m, k, n = 3, 2500, 21
    assert fused_gemv_settings(m, n, k, epilogue == EPI_SILU_MUL)[2] < k
    x, w, b, nw, r = _case(m, k, n, torch.float32, seed=5, gate_up=epilogue == EPI_SILU_MUL)
    kw = dict(norm_weight=nw, eps=1e-5, epilogue=epilogue, residual=r if epilogue == EPI_RESIDUAL else None)
    out = fused_linear(x, w, b, **kw)
    torch.testing.assert_close(out, fused_linear_reference(x, w, b, **kw), **TOL[torch.float32])
    x2 = torch.randn_like(x)
    x2[1] = x[1]
    assert torch.equal(fused_linear(x2, w, b, **kw)[1], out[1])


def test_few_row_settings_spread_the_columns():
    """SmolLM2's o_proj / gate-up / down at one row: one load round trip (BLOCK_K >= K) and a program per SM."""
    for n, k, gate_up in ((576, 576, False), (1536, 576, True), (576, 1536, False)):
        bm, bn, bk, _ = fused_gemv_settings(1, n, k, gate_up)
        assert bm == 1 and bk >= k and -(-n // bn) >= 132 and bn * bk * (1 + gate_up) <= GEMV_MAX_TILE
    for m in range(1, 9):
        bm, bn, bk, _ = fused_gemv_settings(m, 14336, 4096, True)
        assert bm >= m and bm * bn * bk * 2 <= GEMV_MAX_TILE and bn >= 1


def test_validation_names_the_argument():
    x, w, b, nw, r = _case(2, 8, 6, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        fused_linear(x, w[:, :5])
    with pytest.raises(ValueError, match="residual"):
        fused_linear(x, w, epilogue=EPI_RESIDUAL)
    with pytest.raises(ValueError, match="2N rows"):
        fused_linear(x, w[:5], epilogue=EPI_SILU_MUL)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_linear(x, w, norm_weight=nw[:3])


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", [EPI_NONE, EPI_SILU_MUL, EPI_RESIDUAL])
def test_k_split_matches_twin_and_rows_keep_their_bits(monkeypatch, split, dtype, epilogue):
    """DOT_K_SPLIT: the 16-row dot tiles' K blocks summed in parts (a batched dot) -- within the twin's tolerance
    with the norm prologue over several K blocks (K = 600: a partial last block; K = 72: one block, parts past K),
    and a row's bits the same at every step size that takes 16-row tiles (11 and 32 rows) and with other
    neighbours."""
    from tensorrt_llm_ext.kernels import fused_linear as fl
    monkeypatch.setattr(fl, "DOT_K_SPLIT", split)
    for k, n in ((600, 40), (72, 24)):
        bm, bn, bk, _ = fused_linear_settings(32, n, k, gate_up=epilogue == EPI_SILU_MUL)
        assert fl.dot_k_split(bm, bk, bn * (2 if epilogue == EPI_SILU_MUL else 1)) == split
        x, w, b, nw, r = _case(32, k, n, dtype, seed=5, gate_up=epilogue == EPI_SILU_MUL)
        kw = dict(norm_weight=nw, eps=1e-5, epilogue=epilogue)
        res = (lambda rows: dict(residual=r[:rows])) if epilogue == EPI_RESIDUAL else (lambda rows: {})
        out = fused_linear(x, w, b, **kw, **res(32))
        torch.testing.assert_close(out.float(), fused_linear_reference(x, w, b, **kw, **res(32)).float(),
                                   **TOL[dtype])
        x11 = torch.randn_like(x[:11])
        x11[4] = x[4]
        out11 = fused_linear(x11, w, b, **kw, **res(11))
        assert torch.equal(out11[4], out[4])
    assert fl.dot_k_split(16, 256, 128) == 1  # a wide tile's accumulators would not fit split (SPLIT_MAX_ACC)
    monkeypatch.setattr(fl, "DOT_K_SPLIT", 1)
    assert fl.dot_k_split(16, 256, 16) == 1
