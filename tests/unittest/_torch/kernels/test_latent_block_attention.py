"""The fused single-latent block attention vs its eager twin (the drafter's original path).

Tolerances (stated in the kernel module): fp32 ``1e-5`` (same math, another summation order); bf16
``atol = rtol = 2e-2`` on O(1) outputs (the twin rounds keys/values to bf16, the kernel keeps fp32 and,
on the GPU, TF32 products; the interpreter truncates the final bf16 store). The block-latent store is
bitwise, and nothing else in the pool is written.
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import DraftBlockPlacement
from tensorrt_llm_ext.kernels.common import CaptureAllocationError
from tensorrt_llm_ext.kernels.latent_block_attention import (ATTENTION_SCHEDULES, AttentionSchedule,
                                                             attention_schedule, latent_block_attention,
                                                             latent_block_attention_reference)
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_case(dtype, *, b=4, k=3, heads=3, head_dim=10, d_c=24, page_size=4, max_pages=5, ctx=(9, 1, 0, 13),
              dummy=(2,), device=DEVICE, seed=0, num_pages=None):
    """Rows with the given context lengths (row in ``dummy`` is CUDA-graph padding), permuted (non-contiguous)
    physical pages, a table tail left unallocated (-1), one block position without a page, a random stale pool."""
    g = torch.Generator().manual_seed(seed)
    num_slots = b + 1
    num_pages = num_pages or num_slots * max_pages
    pool = torch.randn(num_pages, page_size, d_c, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g)[: num_slots * max_pages].view(num_slots, max_pages).to(torch.int32)
    slots = torch.randperm(num_slots, generator=g)[:b].to(torch.int32)
    ctx_lens = torch.tensor(ctx, dtype=torch.int32)
    seq_lens = ctx_lens + k
    positions = (ctx_lens.long()[:, None] + torch.arange(k)).to(torch.int32)
    for r in dummy:
        seq_lens[r], ctx_lens[r] = 0, 0
        positions[r] = torch.arange(k, dtype=torch.int32)
    rows = table[slots.long()].long()
    pidx = (positions.long() // page_size).clamp(max=max_pages - 1)
    page_ids = torch.gather(rows, 1, pidx).to(torch.int32)
    over = positions.long() // page_size >= max_pages
    page_ids[over] = -1
    if k > 1:
        page_ids[0, -1] = -1  # a block position whose page is unallocated: attended, not stored
    for r in dummy:
        page_ids[r] = -1
    # Unallocated table tails past every row's needs.
    for r in range(b):
        need = -(-(int(ctx_lens[r]) + k) // page_size)
        table[int(slots[r]), min(need, max_pages):] = -1
    placement = DraftBlockPlacement(positions, page_ids, (positions % page_size).to(torch.int32), ctx_lens, seq_lens)
    q = torch.randn(b, k, heads, head_dim, generator=g).to(dtype)
    blk = torch.randn(b, k, d_c, generator=g).to(dtype)
    wk = (torch.randn(heads * head_dim, d_c, generator=g) / d_c ** 0.5).to(dtype)
    wv = (torch.randn(heads * head_dim, d_c, generator=g) / d_c ** 0.5).to(dtype)
    mv = lambda t: t.to(device)  # noqa: E731
    placement = DraftBlockPlacement(*(mv(t) for t in (placement.positions, placement.page_ids, placement.page_offsets,
                                                      placement.ctx_lens, placement.seq_lens)))
    return dict(q=mv(q), block_latents=mv(blk), pool_layer=mv(pool), block_table=mv(table), slot_ids=mv(slots),
                placement=placement, k_up_weight=mv(wk), v_up_weight=mv(wv), rope_theta=10000.0,
                scale=head_dim ** -0.5)


def run_both(case, **kw):
    a, b = dict(case), dict(case)
    a["pool_layer"], b["pool_layer"] = case["pool_layer"].clone(), case["pool_layer"].clone()
    fused = latent_block_attention(**a, **kw)
    ref = latent_block_attention_reference(**b)
    return fused, ref, a["pool_layer"], b["pool_layer"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(heads=1, head_dim=6, d_c=7, page_size=3, max_pages=7, k=5,
                                               ctx=(1, 17, 2, 0), dummy=(3,)),
                                   dict(b=1, k=1, heads=2, head_dim=32, d_c=40, page_size=16, ctx=(33,), dummy=())])
def test_fused_matches_eager_twin(dtype, shape):
    case = make_case(dtype, **shape)
    before = case["pool_layer"].clone()
    fused, ref, pool_f, pool_r = run_both(case, schedule=AttentionSchedule(None, block_n=16))
    assert fused.shape == ref.shape and fused.dtype == dtype
    torch.testing.assert_close(fused.float(), ref.float(), **TOL[dtype])
    assert torch.equal(pool_f, pool_r)  # the block-latent store is a copy, bit for bit
    pl = case["placement"]
    stored = pl.page_ids >= 0
    assert stored.any() and (not stored.all() or pl.page_ids.shape[1] == 1)
    written = torch.zeros(before.shape[:2], dtype=torch.bool, device=before.device)
    written[pl.page_ids[stored].long(), pl.page_offsets[stored].long()] = True
    assert torch.equal(pool_f[~written], before[~written])
    dummy = pl.seq_lens == 0
    assert torch.equal(fused[dummy], torch.zeros_like(fused[dummy]))


def test_context_spanning_pages_and_tiles_and_length_one():
    """Every context length from 0 to a few pages (several BLOCK_N tiles), incl. 1 and page boundaries."""
    lens = (0, 1, 3, 4, 5, 15, 16, 17, 31)
    case = make_case(torch.float32, b=len(lens), k=2, ctx=lens, dummy=(), page_size=4, max_pages=9)
    fused, ref, _, _ = run_both(case, schedule=AttentionSchedule(None, block_n=16))
    torch.testing.assert_close(fused, ref, **TOL[torch.float32])
    # The tile size is a tuning knob only.
    wide = run_both(case, schedule=AttentionSchedule(None, block_n=64))[0]
    torch.testing.assert_close(wide, fused, **TOL[torch.float32])


def test_stale_pool_garbage_never_leaks():
    """NaN everywhere outside the live context and the block: the kernel never reads it (the twin, which
    up-projects the whole table span, is given zeros there instead)."""
    case = make_case(torch.float32)
    pool, table, pl = case["pool_layer"], case["block_table"], case["placement"]
    live = torch.zeros(pool.shape[:2], dtype=torch.bool, device=pool.device)
    ps = pool.shape[1]
    for r in range(pl.ctx_lens.shape[0]):
        for p in range(int(pl.ctx_lens[r])):
            live[int(table[int(case["slot_ids"][r]), p // ps]), p % ps] = True
    nan_pool = pool.masked_fill(~live[..., None], float("nan"))
    zero_pool = pool.masked_fill(~live[..., None], 0.0)
    fused = latent_block_attention(**{**case, "pool_layer": nan_pool})
    ref = latent_block_attention_reference(**{**case, "pool_layer": zero_pool})
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(fused, ref, **TOL[torch.float32])


def test_out_buffer_no_store_and_validation():
    case = make_case(torch.float32)
    out = torch.full_like(case["q"], float("nan"))
    before = case["pool_layer"].clone()
    got = latent_block_attention(**case, store_block_latents=False, out=out)
    assert got is out and torch.isfinite(out).all()
    assert torch.equal(case["pool_layer"], before)  # nothing stored
    bad = {**case, "k_up_weight": case["k_up_weight"][:, :-1]}
    with pytest.raises(ValueError, match="k_up_weight"):
        latent_block_attention(**bad)
    with pytest.raises(ValueError, match="block_latents"):
        latent_block_attention(**{**case, "block_latents": case["block_latents"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="head_dim must be even"):
        latent_block_attention(**{**case, "q": case["q"][..., :-1]})
    with pytest.raises(ValueError, match="block_n"):
        AttentionSchedule(None, block_n=24)
    with pytest.raises(ValueError, match="split_k"):
        AttentionSchedule(None, split_k=0)
    with pytest.raises(ValueError, match="schedule: expected an AttentionSchedule"):
        latent_block_attention(**case, schedule=(32, 4))
    with pytest.raises(ValueError, match="out"):
        latent_block_attention(**case, out=out[:, :1])


def test_split_k_schedules_within_tolerance_and_store_bitwise():
    """Context split-K (splits written as online-softmax partials, merged in split order by a second
    launch): every split count -- including splits past a row's live context (empty) and more splits than
    tiles -- equals the twin within the fp32 tolerance (the sum order changes, so not bitwise) and the
    unsplit kernel within the same; the block-latent store stays bitwise, dummy rows stay zero."""
    lens = (0, 1, 5, 16, 17, 35)
    case = make_case(torch.float32, b=len(lens), k=2, ctx=lens, dummy=(0,), page_size=4, max_pages=9)
    one, ref, pool_one, pool_ref = run_both(case, schedule=AttentionSchedule(None, block_n=16))
    for split_k in (2, 3, 64):
        got, _, pool_got, _ = run_both(case, schedule=AttentionSchedule(None, block_n=16, split_k=split_k))
        torch.testing.assert_close(got, ref, **TOL[torch.float32])
        torch.testing.assert_close(got, one, **TOL[torch.float32])
        assert torch.equal(pool_got, pool_ref) and torch.equal(got[0], torch.zeros_like(got[0])), split_k
    bf = make_case(torch.bfloat16, seed=3)
    got, ref, pool_got, pool_ref = run_both(bf, schedule=AttentionSchedule(None, block_n=16, split_k=2))
    torch.testing.assert_close(got.float(), ref.float(), **TOL[torch.bfloat16])
    assert torch.equal(pool_got, pool_ref)


def test_split_k_empty_splits_are_neither_written_nor_read():
    """Splits past a row's live context write no partial state and the combine reads none: with the split-K
    scratch poisoned with NaN first, 10 splits (up to 9 empty between a row's context splits and the block's
    last one) equal 4 splits (none empty: every row here has at most 3 context tiles of 16) bit for bit -- the
    same context tiles per split, the same block split, merged in the same order."""
    from tensorrt_llm_ext.kernels import latent_block_attention as lba

    lens = (0, 1, 5, 16, 17, 35, 48)
    case = make_case(torch.float32, b=len(lens), k=2, ctx=lens, dummy=(0,), page_size=4, max_pages=40)
    outs = {}
    for split_k in (4, 10):
        lba._partials(torch.device(DEVICE), 1 << 16).fill_(float("nan"))
        outs[split_k], ref, pool_got, pool_ref = run_both(case, schedule=AttentionSchedule(None, block_n=16,
                                                                                            split_k=split_k))
        assert torch.isfinite(outs[split_k]).all(), split_k
        torch.testing.assert_close(outs[split_k], ref, **TOL[torch.float32])
        assert torch.equal(pool_got, pool_ref)
    assert torch.equal(outs[4], outs[10])
    assert torch.equal(outs[10][0], torch.zeros_like(outs[10][0]))  # the dummy row


def test_attention_schedule_table():
    table = (AttentionSchedule(8, block_n=16, split_k=4), AttentionSchedule(None, block_n=64, num_warps=8))
    assert [attention_schedule(b, table).split_k for b in (1, 8, 9, 512)] == [4, 4, 1, 1]
    last = ATTENTION_SCHEDULES[-1]
    assert last.max_batch is None and last.max_latent is None  # the last row covers every larger B and d_c
    assert attention_schedule(10 ** 6, ATTENTION_SCHEDULES, latent_dim=10 ** 4) == last
    for b in (1, 3, 8, 64):  # every (B, d_c) finds a row of its own latent bound or wider
        for d_c in (32, 256, 512):
            got = attention_schedule(b, ATTENTION_SCHEDULES, latent_dim=d_c)
            assert (got.max_batch is None or b <= got.max_batch) and (got.max_latent is None or d_c <= got.max_latent)
    assert table[1].describe() == "n64/w8/sauto/k1"


# -- GPU: realistic shapes, CUDA-graph replay -------------------------------------------------------------
@CUDA
@pytest.mark.parametrize("b", [1, 8, 64])
def test_realistic_shapes_bf16_and_graph_replay(b):
    """8 heads x 64, latent 256, context up to 256 in pages of 64, K = 7, bf16: fused vs the twin within the
    stated tolerance; a CUDA-graph replay of the fused launch equals its eager run bit for bit."""
    k, page_size, max_pages = 7, 64, 5
    ctx = tuple(int(x) for x in torch.randint(1, 257, (b,), generator=torch.Generator().manual_seed(b)))
    dummy = (b - 1,) if b > 1 else ()
    case = make_case(torch.bfloat16, b=b, k=k, heads=8, head_dim=64, d_c=256, page_size=page_size,
                     max_pages=max_pages, ctx=ctx, dummy=dummy, device="cuda", seed=b)
    pool0 = case["pool_layer"].clone()
    fused, ref, pool_f, pool_r = run_both(case)
    torch.testing.assert_close(fused.float(), ref.float(), **TOL[torch.bfloat16])
    assert torch.equal(pool_f, pool_r)

    out = torch.empty_like(case["q"])
    case["pool_layer"] = pool0.clone()
    latent_block_attention(**case, out=out)  # warm-up outside capture (compile, RoPE table)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        latent_block_attention(**case, out=out)
    out.zero_()
    case["pool_layer"].copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(case["pool_layer"], pool_f)
    with pytest.raises(CaptureAllocationError, match="out="):
        with graph_capture(torch.cuda.CUDAGraph()):
            latent_block_attention(**case)


@CUDA
@pytest.mark.parametrize("b", [1, 8])
@pytest.mark.parametrize("split_k", [4, 16])
def test_gpu_split_k_bf16_and_graph_replay(b, split_k):
    """Split-K on the H200 shapes of the drafter (8 heads x 64, latent 256, K = 7, context up to 1024 in pages
    of 64): within the bf16 tolerance of the twin and of the unsplit kernel, the block-latent store bitwise,
    and a CUDA-graph replay of both launches equal to the eager run bit for bit (the partials are cached)."""
    k, page_size, max_pages = 7, 64, 17
    ctx = tuple(int(x) for x in torch.randint(1, 1025, (b,), generator=torch.Generator().manual_seed(7 + b)))
    case = make_case(torch.bfloat16, b=b, k=k, heads=8, head_dim=64, d_c=256, page_size=page_size,
                     max_pages=max_pages, ctx=ctx, dummy=(), device="cuda", seed=b)
    sched = AttentionSchedule(None, block_n=32, split_k=split_k)
    pool0 = case["pool_layer"].clone()
    got, ref, pool_got, pool_ref = run_both(case, schedule=sched)
    one = run_both(case, schedule=AttentionSchedule(None))[0]
    torch.testing.assert_close(got.float(), ref.float(), **TOL[torch.bfloat16])
    torch.testing.assert_close(got.float(), one.float(), **TOL[torch.bfloat16])
    assert torch.equal(pool_got, pool_ref)
    out = torch.empty_like(case["q"])
    case["pool_layer"] = pool0.clone()
    latent_block_attention(**case, out=out, schedule=sched)  # warm-up: compile, RoPE table, partials
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        latent_block_attention(**case, out=out, schedule=sched)
    out.zero_()
    case["pool_layer"].copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
