"""The target's paged decode / verify / prefill attention and its RoPE + KV write vs their eager twins.

Tolerances: fp32 ``1e-5`` (same math, another summation order); bf16 ``atol = rtol = 2e-2`` on O(1) outputs
(the kernel feeds the probabilities to the second product in bf16). Bitwise: a row's output does not depend
on its neighbours (same shape, other rows / lengths / split pieces beyond it), and the KV write stores
exactly the twin's values at exactly the twin's page slots.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tensorrt_llm_ext.kernels.paged_attention import (CONFIG_CANDIDATES, DECODE_CONFIGS, SPLIT_TOKENS,
                                                      AttentionConfig, one_block_form, paged_attention,
                                                      paged_attention_reference, split_plan, tile_counters)
from tensorrt_llm_ext.kernels.paged_kv_write import paged_kv_write, paged_kv_write_reference
from tensorrt_llm_ext.kernels.rope import rope_cos_sin
from tensorrt_llm_ext.kernels.silu_mul import silu_mul, silu_mul_reference
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(*, b=3, t=1, kvh=2, group=3, d=16, page_size=4, max_pages=6, lens=None, dtype=torch.float32,
              seed=0, dummy=()):
    """Random pools with permuted pages, a table whose tail is unallocated (scratch), queries at the last ``t``
    positions of each row's length (``lens``: keys in use per row incl. the block); rows in ``dummy`` point at
    the dummy slot (an all-scratch table row)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = b + 1
    num_pages = num_slots * max_pages
    k_pool = torch.randn(num_pages + 1, page_size, kvh, d, generator=g).to(dtype)
    v_pool = torch.randn(num_pages + 1, page_size, kvh, d, generator=g).to(dtype)
    table = torch.randperm(num_pages, generator=g).view(num_slots, max_pages).to(torch.int32)
    lens = lens or [max_pages * page_size - 2 * i for i in range(b)]
    for s, n in enumerate(lens):
        table[s, -(-n // page_size):] = num_pages  # unused tail -> scratch
    table[b] = num_pages  # the dummy slot
    slots = torch.arange(b, dtype=torch.int32)
    for r in dummy:
        slots[r] = b
    positions = torch.stack([torch.arange(n - t, n) for n in lens])
    q = torch.randn(b, t, kvh * group, d, generator=g).to(dtype)
    dev = DEVICE
    return [x.to(dev) for x in (q, k_pool, v_pool, table, slots, positions)]


def _candidates():
    """CONFIG_CANDIDATES as they run here: the L2 prefetch (2) is a GPU-only hint, the same kernel as none (0)
    elsewhere, so each setting runs once (the register prefetch (1) runs under the interpreter too)."""
    return sorted({dataclasses.replace(c, prefetch=c.prefetch % 2) if not torch.cuda.is_available() else c
                   for c in CONFIG_CANDIDATES}, key=lambda c: c.describe())


def _run(case, scale=None):
    q, kp, vp, table, slots, pos = case
    scale = scale or 1.0 / math.sqrt(q.shape[-1])
    return paged_attention(q, kp, vp, table, slots, pos, scale), paged_attention_reference(q, kp, vp, table, slots,
                                                                                           pos, scale)


@pytest.mark.parametrize("group,d", [(1, 64), (3, 16), (8, 128)])
@pytest.mark.parametrize("t", [1, 4])
def test_matches_eager_twin_gqa_head_dims_and_blocks(group, d, t):
    case = make_case(group=group, d=d, t=t, lens=[5, 24, 9])
    out, ref = _run(case)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_length_one_page_boundaries_and_bf16():
    for lens in ([1, 4, 5], [8, 3, 12]):  # a single key; lengths on and across page edges (page 4)
        case = make_case(lens=lens, t=1, dtype=torch.bfloat16, page_size=4, max_pages=3)
        out, ref = _run(case)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
        assert not out.isnan().any()


def test_long_context_multi_split_and_prefill_tiles():
    page, max_pages = 16, 3 * SPLIT_TOKENS // 16 + 2  # > 3 split pieces
    n = max_pages * page - 5
    _, _, splits = split_plan(4 * 3, max_pages, page)
    assert splits > 3
    case = make_case(b=2, t=4, group=3, d=16, page_size=page, max_pages=max_pages, lens=[n, SPLIT_TOKENS + 1])
    out, ref = _run(case)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    # The merging program of each tile reset its arrival counter: a second launch merges again, to the same bits.
    assert tile_counters(out.device, 1).count_nonzero() == 0
    assert torch.equal(_run(case)[0], out)
    # A prefill block (T * G > 64 rows: several query tiles, one piece) over the same cache.
    case = make_case(b=2, t=30, group=3, d=16, page_size=page, max_pages=4, lens=[64, 40])
    assert split_plan(30 * 3, 4, page)[1:] == (2, 1)
    out, ref = _run(case)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    # ... and over more keys than a split piece holds (its one program takes every key: once cut at 128).
    case = make_case(b=1, t=30, group=3, d=16, page_size=page, max_pages=12, lens=[SPLIT_TOKENS + 52])
    out, ref = _run(case)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_one_block_pieces_launch_one_stage(monkeypatch):
    """The model's split launch drops the second pipeline stage exactly where every piece is one block (verify
    tiles at 128-key blocks, decode tiles whose widest row, the table, cuts into one-block pieces), keeping the
    L2 prefetch (of that one block: ``piece_blocks``) unless ``ONE_BLOCK_PREFETCH`` is off."""
    import tensorrt_llm_ext.kernels.paged_attention as pa
    model = DECODE_CONFIGS[64]  # 128-key blocks, 32 pieces, 2 stages, L2 prefetch
    one = dataclasses.replace(model, num_stages=1)
    assert pa.piece_blocks(model, 0, 8192, 1) == 1 and pa.piece_blocks(model, model.pieces, 8192, 32) == 2
    monkeypatch.setattr(pa, "ONE_BLOCK_PREFETCH", False)
    assert one_block_form(model, 0, 8192, 1) == dataclasses.replace(one, prefetch=0)
    monkeypatch.setattr(pa, "ONE_BLOCK_PREFETCH", True)
    assert one_block_form(model, 0, 8192, 1) == one  # verify: SPLIT_TOKENS keys = one 128-key block
    assert one_block_form(model, model.pieces, 32 * 128, 32) == one  # a 4k table: 32 pieces of one block
    assert one_block_form(model, model.pieces, 32 * 128 + 32, 32) == model  # one more page: pieces of two blocks
    assert one_block_form(model, model.pieces, 8192, 32) == model
    assert one_block_form(model, model.pieces, 1024, 8) == one  # a narrow table: fewer pieces, still one block each
    three = dataclasses.replace(model, min_blocks=3)
    assert one_block_form(three, three.pieces, 1024, 8) == three  # min_blocks keeps pieces long
    small = AttentionConfig(64, 4, 3, 16)  # 64-key blocks: a verify piece is two blocks
    assert one_block_form(small, 0, 8192, 1) == small
    assert SPLIT_TOKENS == 128 and model.block_n == 128


def test_every_launch_config_candidate_matches_the_twin():
    """The split tiles' settings the benchmark compares (keys per iteration 32 / 64 / 128) over several pieces."""
    page, max_pages = 16, 2 * SPLIT_TOKENS // 16 + 2
    case = make_case(b=2, t=2, group=3, d=16, page_size=page, max_pages=max_pages, lens=[2 * SPLIT_TOKENS + 20, 70])
    q, kp, vp, table, slots, pos = case
    ref = paged_attention_reference(q, kp, vp, table, slots, pos, 0.25)
    for cfg in _candidates():
        out = paged_attention(q, kp, vp, table, slots, pos, 0.25, config=cfg)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
    with pytest.raises(ValueError, match="block_n"):
        AttentionConfig(block_n=256)
    with pytest.raises(ValueError, match="min_blocks"):
        AttentionConfig(min_blocks=0)
    for cfg in CONFIG_CANDIDATES:  # the benchmark's --decode-config form round-trips
        assert AttentionConfig.parse(cfg.describe()) == cfg
    assert AttentionConfig.parse("n64w4s2p32m3") == AttentionConfig(64, 4, 2, 32, 3)
    with pytest.raises(ValueError, match="form"):
        AttentionConfig.parse("n64w4")


def test_row_bits_do_not_depend_on_neighbours_or_on_blocks_past_the_row():
    """The per-row determinism speculative decoding relies on: the same query at the same position over the
    same keys gives the same bits at another row of a same-shaped step, next to rows of other lengths, and
    when its own block reaches further (verify row j vs the decode step whose first row it is)."""
    page, max_pages = 8, 2 * SPLIT_TOKENS // 8 + 1
    q, kp, vp, table, slots, pos = make_case(b=3, t=4, page_size=page, max_pages=max_pages, lens=[150, 60, 9])
    out = paged_attention(q, kp, vp, table, slots, pos, 0.25)
    # Row 0's query 1 (position 147) as the first query of a block reaching position 150 instead of 149.
    q2, pos2 = q.clone(), pos.clone()
    q2[2, 0], pos2[2] = q[0, 1], torch.arange(147, 151)
    slots2 = slots.clone()
    slots2[2] = slots[0]
    q2[1], pos2[1] = torch.randn_like(q[1]), torch.arange(10, 14)  # another neighbour
    out2 = paged_attention(q2, kp, vp, table, slots2, pos2, 0.25)
    assert torch.equal(out2[2, 0], out[0, 1])
    assert torch.equal(out2[0], out[0])
    # A row whose keys fit one piece, in a tile that merges (its block crosses the piece edge) and in one that
    # writes directly (no row of its block does): the merge of one piece is the identity, bit for bit. (Same
    # row index t: the interpreter's fp32 matmul may round a row differently at another index of its tile.)
    edge = SPLIT_TOKENS - 3
    pos3, slots3 = pos.clone(), slots.clone()
    pos3[0] = torch.arange(edge, edge + 4)  # keys 0 .. 128: two live pieces, merged
    pos3[1] = torch.tensor([edge, 1, 2, 3])  # keys 0 .. 125: one piece, written directly
    slots3[1] = slots[0]
    q3 = q.clone()
    q3[1, 0] = q3[0, 0]
    out3 = paged_attention(q3, kp, vp, table, slots3, pos3, 0.25)
    assert torch.equal(out3[1, 0], out3[0, 0])


@pytest.mark.parametrize("group,d", [(1, 64), (3, 64), (8, 128)])
def test_decode_tiles_cut_each_rows_keys_in_pieces(group, d):
    """Decode tiles (T = 1) cut a row's keys in runs of whole blocks sized from the row's own length: lengths
    1, on / across block and page edges, short and table-wide, a padded row, against the twin; every candidate
    (fixed pieces "f", 8 / 16 / 32 pieces) agrees (GQA 3; the model's settings elsewhere)."""
    page, max_pages = 16, 40  # 640 keys: up to 10 pieces of 64
    lens = [1, 63, 64, 65, 300, 640]
    case = make_case(b=len(lens), t=1, kvh=1, group=group, d=d, page_size=page, max_pages=max_pages, lens=lens,
                     dummy=(1,))
    q, kp, vp, table, slots, pos = case
    assert split_plan(group, max_pages, page, 16, 64)[2] == 10 and split_plan(group, max_pages, page, 8, 64)[2] == 8
    ref = paged_attention_reference(q, kp, vp, table, slots, pos, d ** -0.5)
    live = [0, 2, 3, 4, 5]
    for cfg in _candidates() if group == 3 else [None]:
        out = paged_attention(q, kp, vp, table, slots, pos, d ** -0.5, config=cfg)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[live], ref[live], **TOL[torch.float32])
    assert tile_counters(out.device, 1).count_nonzero() == 0


def test_decode_tile_bits_depend_on_the_rows_own_position_and_keys_only():
    """A decode row's pieces follow from its own length: the same query at the same position over the same keys
    gives the same bits at another row, in a batch of another size (on the same side of DECODE_CONFIGS_BY_BATCH's
    boundaries: the next test), next to rows of other lengths."""
    page, max_pages = 8, 48
    q, kp, vp, table, slots, pos = make_case(b=3, t=1, page_size=page, max_pages=max_pages, lens=[333, 20, 129])
    out = paged_attention(q, kp, vp, table, slots, pos, 0.25)
    q2, slots2, pos2 = q[[2, 0]], slots[[2, 0]], pos[[2, 0]]  # rows 2 and 0, in a batch of two
    out2 = paged_attention(q2, kp, vp, table, slots2, pos2, 0.25)
    assert torch.equal(out2[0], out[2]) and torch.equal(out2[1], out[0])


def test_larger_decode_steps_take_fewer_pieces(monkeypatch):
    """``DECODE_CONFIGS_BY_BATCH``: from each entry's first batch a decode step takes its settings (here at most 4
    pieces from 5 requests, at most 2 from 9; the table's 8 below): within the twin's tolerance everywhere, a row's
    bits the same in any batch on the same side of a boundary (the rule follows the step's size, never its lengths),
    and other bits across a boundary (other merges)."""
    import tensorrt_llm_ext.kernels.paged_attention as pa
    cfgs = [AttentionConfig(16, 4, 2, 8), AttentionConfig(16, 4, 2, 4), AttentionConfig(16, 4, 2, 2)]
    monkeypatch.setattr(pa, "DECODE_CONFIGS", {16: cfgs[0]})
    monkeypatch.setattr(pa, "DECODE_CONFIGS_BY_BATCH", {16: ((5, cfgs[1]), (9, cfgs[2]))})
    assert [pa.decode_config(16, n) for n in (1, 4, 5, 8, 9, 100)] == [cfgs[0]] * 2 + [cfgs[1]] * 2 + [cfgs[2]] * 2
    assert pa.decode_config(32, 100) == AttentionConfig()  # a head dim no table lists
    b = 14
    lens = [200 + (37 * i) % 56 for i in range(b)]  # 13-16 blocks of 16 keys: pieces of 1-2 / 4 / 7-8 blocks
    q, kp, vp, table, slots, pos = make_case(b=b, t=1, kvh=1, group=2, d=16, page_size=4, max_pages=64, lens=lens)
    ref = paged_attention_reference(q, kp, vp, table, slots, pos, 0.25)
    outs = {}
    for n, cfg in ((4, cfgs[0]), (8, cfgs[1]), (b, cfgs[2])):  # the largest step on each side of each boundary
        rows = list(range(n))
        out = paged_attention(q[rows], kp, vp, table, slots[rows], pos[rows], 0.25)
        torch.testing.assert_close(out, ref[rows], **TOL[torch.float32])
        assert torch.equal(out, paged_attention(q[rows], kp, vp, table, slots[rows], pos[rows], 0.25, config=cfg))
        outs[n] = out
    # another step of 5 / 9 requests (rows 3.. / 5..): the same bits as the step of 8 / 14 on the same side
    assert torch.equal(paged_attention(q[3:8], kp, vp, table, slots[3:8], pos[3:8], 0.25), outs[8][3:8])
    assert torch.equal(paged_attention(q[5:14], kp, vp, table, slots[5:14], pos[5:14], 0.25), outs[b][5:14])
    assert not torch.equal(outs[4], outs[8][:4]) and not torch.equal(outs[8], outs[b][:8])
    assert tile_counters(q.device, 1).count_nonzero() == 0


def test_prefetch_changes_no_bit():
    """The first block read early (AttentionConfig.prefetch): keys of earlier steps before the wait, the step's own
    keys (at or past the first query position) after it -- the same bits as reading every key in the loop, for
    decode and verify tiles whose first block holds the step's keys or not."""
    page, max_pages = 8, 24
    for t in (1, 3):
        q, kp, vp, table, slots, pos = make_case(b=3, t=t, page_size=page, max_pages=max_pages, lens=[190, 64, 2])
        cfgs = [AttentionConfig(32, 4, 2, 6, prefetch=p) for p in (0, 1, -1)]
        outs = [paged_attention(q, kp, vp, table, slots, pos, 0.25, config=c) for c in cfgs]
        for o in outs[1:]:
            assert torch.equal(outs[0], o)
    assert tile_counters(q.device, 1).count_nonzero() == 0
    assert AttentionConfig.parse("n64w4s2p32a").prefetch == -1
    assert AttentionConfig.parse("n64w4s2p32m2l") == AttentionConfig(64, 4, 2, 32, 2, prefetch=2)


def test_padded_rows_and_masked_queries_are_finite():
    """A dummy row (all-scratch table) and queries whose pieces are empty for some rows of their tile: no NaN."""
    case = make_case(b=3, t=2, lens=[2, 20, 7], dummy=(1,))
    out, ref = _run(case)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[[0, 2]], ref[[0, 2]], **TOL[torch.float32])


def test_kv_write_of_one_token_rows_takes_views_of_one_qkv_output():
    """T = 1 (decode): views of a ``[B, 1, W]`` GEMM output, whose size-1 dimension has an arbitrary stride."""
    b, h, kvh, d = 2, 3, 1, 16
    qkv = torch.randn(b, 1, (h + 2 * kvh) * d, device=DEVICE)
    q = qkv[..., :h * d].view(b, 1, h, d)
    k = qkv[..., h * d:(h + kvh) * d].view(b, 1, kvh, d)
    v = qkv[..., (h + kvh) * d:].view(b, 1, kvh, d)
    positions = torch.tensor([[5], [0]], device=DEVICE)
    cos, sin = rope_cos_sin(positions, d, 10000.0)
    table = torch.tensor([[0, 1], [2, 3], [4, 4]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    pools = [torch.zeros(5, 4, kvh, d, device=DEVICE) for _ in range(4)]
    q_rot = paged_kv_write(q, k, v, cos, sin, positions, slots, table, pools[0], pools[1])
    q_ref = paged_kv_write_reference(q, k, v, cos, sin, positions, slots, table, pools[2], pools[3])
    torch.testing.assert_close(q_rot, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pools[0], pools[2], atol=1e-6, rtol=1e-6)
    assert torch.equal(pools[1], pools[3]) and pools[1][1, 1].abs().sum() > 0


def test_kv_write_matches_twin_bitwise_in_the_pools():
    g = torch.Generator().manual_seed(3)
    b, t, h, kvh, d, page = 3, 2, 6, 2, 16, 4
    qkv = torch.randn(b, t, (h + 2 * kvh) * d, generator=g).to(DEVICE)
    q = qkv[..., :h * d].view(b, t, h, d)
    k = qkv[..., h * d:(h + kvh) * d].view(b, t, kvh, d)
    v = qkv[..., (h + kvh) * d:].view(b, t, kvh, d)
    positions = torch.tensor([[3, 4], [0, 1], [7, 8]], device=DEVICE)  # row 2's position 8 is past its table
    cos, sin = rope_cos_sin(positions, d, 10000.0)
    table = torch.tensor([[2, 0], [1, 5], [4, 3], [6, 6]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    pools = [torch.zeros(7, page, kvh, d, device=DEVICE) for _ in range(4)]
    q_rot = paged_kv_write(q, k, v, cos, sin, positions, slots, table, pools[0], pools[1])
    q_ref = paged_kv_write_reference(q, k, v, cos, sin, positions, slots, table, pools[2], pools[3])
    torch.testing.assert_close(q_rot, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pools[0], pools[2], atol=1e-6, rtol=1e-6)
    assert torch.equal(pools[1], pools[3])  # v is copied
    assert pools[1][6, 0].abs().sum() > 0  # position 8 of slot 2 went to the scratch page (id 6)
    assert pools[1][6, 1:].abs().sum() == 0  # and nowhere else in it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_twin(dtype):
    """fp32 to rounding; bf16 within two units in the last place (two roundings, each off by up to one unit: the
    GPU's exp, and the interpreter truncating its bf16 casts); strided rows; odd widths."""
    g = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(5, 2 * 1100 + 64, generator=g)).to(dtype).to(DEVICE)[:, :2 * 1100]
    out = silu_mul(x)
    ref = silu_mul_reference(x)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out, ref, **tol)
    with pytest.raises(ValueError, match="even number of columns"):
        silu_mul(x[:, :7])


def test_validation_names_the_argument():
    q, kp, vp, table, slots, pos = make_case()
    with pytest.raises(ValueError, match="page_table"):
        paged_attention(q, kp, vp, table.long(), slots, pos, 1.0)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention(q[:, :, :5], kp, vp, table, slots, pos, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group,d,kvh", [(3, 64, 3), (4, 128, 8)])  # SmolLM2-135M, an 8B Llama
def test_realistic_shapes_bf16_long_context_and_graph_replay(group, d, kvh):
    """bf16 at 4k+ keys (many pieces) vs the twin, then the same call captured and replayed with new lengths
    written into the captured position tensor (lengths are tensors: no re-capture)."""
    page, max_pages, b, t = 16, 300, 4, 8
    lens = [4700, 4096, 1, 17]
    case = make_case(b=b, t=t, kvh=kvh, group=group, d=d, page_size=page, max_pages=max_pages,
                     lens=[max(n, t) for n in lens], dtype=torch.bfloat16)
    q, kp, vp, table, slots, pos = case
    out, ref = _run(case)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])
    o = torch.empty_like(q)
    paged_attention(q, kp, vp, table, slots, pos, d ** -0.5, out=o)  # warm-up (compile) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        paged_attention(q, kp, vp, table, slots, pos, d ** -0.5, out=o)
    pos.copy_(torch.stack([torch.arange(n - t, n) for n in (300, 2000, 4700, 64)]).to(pos.device))
    graph.replay()
    ref = paged_attention_reference(q, kp, vp, table, slots, pos, d ** -0.5)
    torch.testing.assert_close(o.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the interpreter ignores num_stages")
@pytest.mark.parametrize("t", [1, 8])
def test_pipeline_stages_change_no_bit(t):
    """``num_stages`` schedules the loads, never the arithmetic: 1, 2 and 3 stages give the same bits on bf16
    decode and verify tiles of one- and many-block pieces (what lets the stage count follow the grid, as the
    prefetch does, if a sweep says so)."""
    page, max_pages = 32, 300
    q, kp, vp, table, slots, pos = make_case(b=4, t=t, kvh=3, group=3, d=64, page_size=page, max_pages=max_pages,
                                             lens=[1024, 8190, 130, 9], dtype=torch.bfloat16)
    outs = [paged_attention(q, kp, vp, table, slots, pos, 0.125, config=AttentionConfig(128, 4, st, 32, prefetch=2))
            for st in (1, 2, 3)]
    # the one-block form without its prefetch, and the model's own pick for this table
    outs += [paged_attention(q, kp, vp, table, slots, pos, 0.125, config=AttentionConfig(128, 4, 1, 32)),
             paged_attention(q, kp, vp, table, slots, pos, 0.125)]
    for o in outs[1:]:
        assert torch.equal(outs[0], o)
    assert tile_counters(q.device, 1).count_nonzero() == 0


@pytest.mark.parametrize("t", [1, 4])
def test_last_piece_first_changes_no_bit(monkeypatch, t):
    """The split axis scheduled from the last piece (``LAST_PIECE_FIRST``): another program arrives last and
    merges (the interpreter runs the grid in order), never other bits -- rows of one to many pieces, a row shorter
    than one piece, the counters left at zero."""
    import tensorrt_llm_ext.kernels.paged_attention as pa
    q, kp, vp, table, slots, pos = make_case(b=4, t=t, kvh=3, group=3, d=64, page_size=32, max_pages=40,
                                             lens=[1270, 300, 130, 9], dtype=torch.bfloat16)
    outs = []
    for last_first in (False, True):
        monkeypatch.setattr(pa, "LAST_PIECE_FIRST", last_first)
        outs.append(paged_attention(q, kp, vp, table, slots, pos, 0.125))
        assert tile_counters(q.device, 1).count_nonzero() == 0
    assert torch.equal(outs[0], outs[1])
    want = paged_attention_reference(q, kp, vp, table, slots, pos, 0.125)
    torch.testing.assert_close(outs[1].float(), want.float(), atol=2e-2, rtol=2e-2)


def test_split_tile_past_its_table_leaves_no_counter_behind():
    """A verify-shaped (split) tile whose padding rows reach past the slot's table -- a batched prefill's ragged
    block can -- would need more fixed pieces than the launch has: the merge counts only the pieces that exist, so
    the tile's counter is reset and the next call (the same counters) is exact; rows inside the table match the
    twin in both calls."""
    page_size, max_pages, t = 8, 2 * SPLIT_TOKENS // 8, 8
    width = page_size * max_pages  # two fixed pieces in the grid
    q, kp, vp, table, slots, pos = make_case(b=2, t=t, page_size=page_size, max_pages=max_pages, lens=[width, 150])
    past = pos.clone()
    past[0] = torch.arange(width - 4, width + 4)  # its last 4 rows: padding past the table (a third piece)
    tile_counters(q.device, 1).zero_()
    first = paged_attention(q, kp, vp, table, slots, past, 0.25)
    assert tile_counters(q.device, 1).count_nonzero() == 0, "a tile's counter was left behind"
    want = paged_attention_reference(q, kp, vp, table, slots, past, 0.25)
    torch.testing.assert_close(first[0, :4], want[0, :4], **TOL[torch.float32])  # rows inside the table
    torch.testing.assert_close(first[1], want[1], **TOL[torch.float32])
    got = paged_attention(q, kp, vp, table, slots, pos, 0.25)
    torch.testing.assert_close(got, paged_attention_reference(q, kp, vp, table, slots, pos, 0.25),
                               **TOL[torch.float32])


def test_outgrown_tile_counters_stay_allocated(monkeypatch):
    """A graph captured while a counter buffer was current keeps its address: growing the counters for a larger
    eager launch keeps the old buffer allocated (and zeroed) instead of freeing memory a replay still counts on."""
    import tensorrt_llm_ext.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "_COUNTERS", {})
    monkeypatch.setattr(pa, "_RETIRED_COUNTERS", [])
    first = tile_counters(DEVICE, 1)
    address = first.data_ptr()
    del first
    grown = tile_counters(DEVICE, pa.MIN_COUNTERS + 1)
    assert grown.numel() > pa.MIN_COUNTERS and grown.count_nonzero() == 0
    assert [t.data_ptr() for t in pa._RETIRED_COUNTERS] == [address]
    assert pa._RETIRED_COUNTERS[0].count_nonzero() == 0
    assert tile_counters(DEVICE, 1) is grown  # later launches use the grown buffer


@pytest.mark.parametrize("t", [1, 4])
def test_page_ids_one_iteration_ahead_change_no_bit(t):
    """``AttentionConfig.ids_ahead`` loads each block's page ids one iteration before its K / V: the same reads in
    another order, so the same bits as the setting without it -- decode and verify tiles, pieces of many blocks,
    rows ending inside a block and on a page edge, a padded row."""
    page, max_pages = 8, 64  # 512 keys: pieces of several 32-key blocks
    q, kp, vp, table, slots, pos = make_case(b=4, t=t, group=3, d=16, page_size=page, max_pages=max_pages,
                                             lens=[500, 33, 256, 129], dummy=(1,))
    for base in (AttentionConfig(32, 4, 2, 4), AttentionConfig(32, 4, 2, 2), AttentionConfig(32, 4, 2, 32)):
        ahead = dataclasses.replace(base, ids_ahead=True)
        assert ahead.describe() == base.describe() + "i" and AttentionConfig.parse(ahead.describe()) == ahead
        want = paged_attention(q, kp, vp, table, slots, pos, 0.25, config=base)
        got = paged_attention(q, kp, vp, table, slots, pos, 0.25, config=ahead)
        assert torch.equal(got, want)
