"""Norm + QKV product + (q / k norms) + RoPE + paged K/V store in one launch vs its eager twin.

Tolerances: fp32 ``1e-5`` (another summation order in the product); bf16 ``atol = rtol = 4e-2`` on the O(1)
values (roundings of the product, the norms and the rotation that flip under another order; the interpreter
truncates its 16-bit casts). Exact: WHERE each k / v row lands (the twin's page slots, the scratch page past
the table, nothing else touched).
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.kernels.fused_qkv import fused_qkv_rope, fused_qkv_rope_reference, qkv_chunks, qkv_settings
from tensorrt_llm_ext.kernels.rope import rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}


@pytest.fixture(autouse=True)
def _few_row_form_up_to_4_rows(monkeypatch):
    """The few-row form at up to 4 rows (the model takes it at GEMV_MAX_ROWS, 1 by measurement): its tiles of
    2 and 4 rows are tested too."""
    from tensorrt_llm_ext.kernels import fused_linear as fl, fused_qkv as fq
    monkeypatch.setattr(fl, "GEMV_MAX_ROWS", 4)
    monkeypatch.setattr(fq, "GEMV_MAX_ROWS", 4)


def _case(b, t, hidden, heads, kvh, d, dtype, *, bias=False, qk_norm=False, page=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = (heads + 2 * kvh) * d
    x = torch.randn(b, t, hidden, generator=g)
    w = torch.randn(rows, hidden, generator=g) / hidden ** 0.5
    bb = 0.1 * torch.randn(rows, generator=g) if bias else None
    nw = 1 + 0.1 * torch.randn(hidden, generator=g)
    qn = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
    kn = 1 + 0.1 * torch.randn(d, generator=g) if qk_norm else None
    # Slot 0 at positions crossing a page edge; slot 1 from 0; the last row of slot 2 past its table (scratch).
    max_pages = 3
    positions = torch.stack([torch.arange(3, 3 + t), torch.arange(0, t), torch.arange(12 - t + 1, 13)])[:b]
    table = torch.tensor([[2, 0, 5], [1, 6, 7], [4, 3, 8], [9, 9, 9]], dtype=torch.int32)
    slots = torch.arange(b, dtype=torch.int32)
    cos, sin = rope_cos_sin(positions, d, 10000.0)
    pools = [torch.zeros(10, page, kvh, d) for _ in range(4)]
    cast = [t.to(dtype).to(DEVICE) if t is not None else None for t in (x, w, bb, nw, qn, kn)]
    return cast, [t.to(DEVICE) for t in (cos, sin, positions, slots, table)], [p.to(dtype).to(DEVICE) for p in pools]


@pytest.mark.parametrize("t", [4, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d,bias,qk_norm", [(3, 1, 16, False, False), (4, 4, 10, True, False),
                                                      (8, 1, 64, False, True), (6, 2, 128, True, True),
                                                      (6, 2, 64, True, False), (2, 2, 128, False, False)])
def test_matches_twin_gqa_head_dims_bias_and_qk_norm(t, dtype, heads, kvh, d, bias, qk_norm):
    """GQA 3 / 1 / 8 / 3, head dims 16 / 10 (odd half) / 64 / 128, an odd hidden size, T = 4 verify rows across a
    page edge (12 rows: the dot tiles) or T = 1 (3 rows: the few-row form), a row past its table; heads cut into
    column chunks."""
    (x, w, bb, nw, qn, kn), (cos, sin, pos, slots, table), pools = _case(3, t, 37, heads, kvh, d, dtype, bias=bias,
                                                                         qk_norm=qk_norm)
    args = (cos, sin, pos, slots, table)
    q = fused_qkv_rope(x, w, bb, nw, 1e-5, *args, pools[0], pools[1], heads, qn, kn, 1e-6)
    q_ref = fused_qkv_rope_reference(x, w, bb, nw, 1e-5, *args, pools[2], pools[3], heads, qn, kn, 1e-6)
    assert q.dtype == dtype and q.shape == (3, t, heads, d)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    torch.testing.assert_close(pools[0].float(), pools[2].float(), **TOL[dtype])
    torch.testing.assert_close(pools[1].float(), pools[3].float(), **TOL[dtype])
    # The same slots written, and nothing else: page 9 (scratch) holds only slot 2's position 12.
    for got, ref in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.abs().sum((-1, -2)) > 0, ref.abs().sum((-1, -2)) > 0)
    assert pools[1][9, 0].abs().sum() > 0 and pools[1][9, 1:].abs().sum() == 0


@pytest.mark.parametrize("t", [1, 4])
def test_early_step_inputs_and_unrolled_norm_change_no_bit(monkeypatch, t):
    """Positions, slots, the page table and cos / sin read before the programmatic wait (``EARLY_EPILOGUE``) and
    the norm prologue unrolled (``NORM_UNROLL_MAX``): the same q and the same pools, bit for bit, a row past its
    table (the scratch page) included."""
    from tensorrt_llm_ext.kernels import fused_linear as fl
    outs = []
    for early in (False, True):
        for unroll in (0, fl.NORM_UNROLL_MAX):
            monkeypatch.setattr(fl, "EARLY_EPILOGUE", early)
            monkeypatch.setattr(fl, "NORM_UNROLL_MAX", unroll)
            (x, w, bb, nw, qn, kn), args, pools = _case(3, t, 300, 6, 2, 16, torch.bfloat16, bias=True, seed=7)
            q = fused_qkv_rope(x, w, bb, nw, 1e-5, *args, pools[0], pools[1], 6)
            outs.append((q, pools[0], pools[1]))
    assert outs[0][1].abs().sum() > 0 and outs[0][2][9].abs().sum() > 0  # k rows stored, the scratch row too
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


def test_decode_rows_without_prologue_and_row_independence():
    """T = 1, no input norm (an already normalized x); a row's q bits do not depend on the other rows."""
    (x, w, _, _, _, _), (cos, sin, pos, slots, table), pools = _case(3, 1, 24, 3, 1, 16, torch.float32, seed=3)
    q = fused_qkv_rope(x, w, None, None, 1e-6, cos, sin, pos, slots, table, pools[0], pools[1], 3)
    q_ref = fused_qkv_rope_reference(x, w, None, None, 1e-6, cos, sin, pos, slots, table, pools[2], pools[3], 3)
    torch.testing.assert_close(q, q_ref, **TOL[torch.float32])
    x2 = torch.randn_like(x)
    x2[1] = x[1]
    q2 = fused_qkv_rope(x2, w, None, None, 1e-6, cos, sin, pos, slots, table, pools[0], pools[1], 3)
    assert torch.equal(q2[1], q[1])


def test_column_chunks_spread_wide_layers_and_keep_whole_heads_for_qk_norm():
    assert qkv_chunks(15, 32, False) == (16, 2)  # SmolLM2-135M: 9 + 2 x 3 heads of 64
    assert qkv_chunks(48, 64, False) == (16, 4)  # an 8B Llama: 32 + 2 x 8 heads of 128
    assert qkv_chunks(400, 64, False) == (64, 1)  # enough heads: whole halves
    assert qkv_chunks(48, 64, True) == (64, 1)  # per-head norms need the whole head in one program
    assert qkv_chunks(15, 5, False) == (16, 1)  # the dot's 16-column minimum
    assert qkv_chunks(15, 32, False, gemv=True) == (2, 16)  # the few-row form: 240 programs
    # Few-row steps: one load round trip over SmolLM2's K = 576; past GEMV_MAX_ROWS (4 here): 16-row dot tiles.
    assert qkv_settings(1, 15, 32, 576, False) == (1, 2, 16, 1024, True)
    assert qkv_settings(5, 15, 32, 576, False)[0::4] == (16, False)


def test_validation_names_the_argument():
    (x, w, bb, nw, qn, kn), (cos, sin, pos, slots, table), pools = _case(3, 1, 24, 3, 1, 16, torch.float32,
                                                                         qk_norm=True)
    with pytest.raises(ValueError, match="qkv_weight"):
        fused_qkv_rope(x, w[:-1], None, nw, 1e-6, cos, sin, pos, slots, table, pools[0], pools[1], 3)
    with pytest.raises(ValueError, match="go together"):
        fused_qkv_rope(x, w, None, nw, 1e-6, cos, sin, pos, slots, table, pools[0], pools[1], 3, qn, None)
    with pytest.raises(ValueError, match="page_table"):
        fused_qkv_rope(x, w, None, nw, 1e-6, cos, sin, pos, slots, table.long(), pools[0], pools[1], 3)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d,bias,qk_norm", [(3, 1, 16, False, False), (6, 2, 16, True, True)])
def test_k_split_matches_twin(monkeypatch, split, dtype, heads, kvh, d, bias, qk_norm):
    """DOT_K_SPLIT (fused_linear's K-split dot tiles) in the QKV kernel: 12 verify rows over a 300-wide input (two
    K blocks, the second partial), within the twin's tolerance, the same page slots written."""
    from tensorrt_llm_ext.kernels import fused_linear as fl
    monkeypatch.setattr(fl, "DOT_K_SPLIT", split)
    bm, bh, _, bk, gemv = qkv_settings(12, heads + 2 * kvh, d // 2, 300, qk_norm)
    assert not gemv and fl.dot_k_split(bm, bk, 2 * bh) == split
    (x, w, bb, nw, qn, kn), args, pools = _case(3, 4, 300, heads, kvh, d, dtype, bias=bias, qk_norm=qk_norm, seed=11)
    q = fused_qkv_rope(x, w, bb, nw, 1e-5, *args, pools[0], pools[1], heads, qn, kn, 1e-6)
    q_ref = fused_qkv_rope_reference(x, w, bb, nw, 1e-5, *args, pools[2], pools[3], heads, qn, kn, 1e-6)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    for got, ref in ((pools[0], pools[2]), (pools[1], pools[3])):
        torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])
        assert torch.equal(got.abs().sum((-1, -2)) > 0, ref.abs().sum((-1, -2)) > 0)
