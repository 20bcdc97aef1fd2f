"""Decode / verify / prefill attention of the target over its paged KV cache: one kernel, an eager twin.

Layout (one layer): ``k_pool, v_pool [num_pages + 1, page_size, kv_heads, D]`` (the last page is the
SCRATCH page: never handed out, it absorbs writes of padding rows and of positions past a request's pages),
``page_table [num_slots, max_pages]`` int32 page ids (unallocated entries hold the scratch page id). A query
at absolute position ``p`` of the request on slot ``s`` attends the keys at positions ``0 .. p`` of that slot
(causal by absolute position, so the rule inside a verified block of K+1 rows is the same rule).

The kernel (:func:`paged_attention`): one program per (request, KV head, query tile, sequence split).
GQA: the ``G = num_heads / kv_heads`` query heads of one KV head and the ``T`` query rows of the request
form the ``T * G`` rows of one tile (decode T = 1, verify T = K + 1), so every key/value page is read once
per KV head. bf16 / fp16 operands into ``tl.dot``, fp32 accumulation, online softmax in base 2. Only the
pages below the tile's last position are read (the loop bound is the largest query position of the tile,
read on the device: no host sync, CUDA-graph capturable per ``[B, T]``).

Split along the sequence (decode / verify tiles, ``T * G <= 64`` rows): the key range is cut into pieces, one
program each -- verify tiles in fixed ``SPLIT_TOKENS`` pieces, decode tiles (``T = 1``) in
``AttentionConfig.pieces`` equal runs of whole ``BLOCK_N`` blocks sized from the row's own length (many short
pieces for a short context, few long ones for a long one) -- and the same launch merges them: each live piece stores its
partial ``(o, lse)``, then counts its arrival on the tile's int32 counter (:func:`tile_counters`: a barrier,
then an acq_rel atomic at GPU scope); the last to arrive merges the pieces each row uses and resets the
counter to zero for the next launch. A tile whose keys fit one piece (a short context) writes its output
directly, with neither partials nor atomics. The number of pieces is fixed by the table width (``max_pages *
page_size``) and the settings, never by the batch (but for the settings of decode steps of more than 16 and more than
32 requests, :data:`DECODE_CONFIGS_BY_BATCH`): programs past a tile's length exit at once. Prefill tiles
(``T * G > 64``) take the whole key range in one program (flash-attention style) and write the output directly.

Programmatic dependent launch (Hopper, :func:`~tensorrt_llm_ext.kernels.common.programmatic_launch`): positions,
slots and, for a split tile, the piece's first block (page ids, and K / V of the keys below the request's first
query position: written by earlier steps) are read before ``gdc_wait()``; q and the step's own K / V (written by
the previous kernel) after it. A decode piece of one block thus waits on no memory round trip but q's and the
new key's.

Per-row determinism (what makes speculative output equal the target's own decode): a row's result depends
only on its own position, its keys and the step shape. Key blocks are aligned to absolute positions; a block
a row does not see (beyond its position, iterated because another row of its tile reaches further) adds an
exact zero to the row's sums and leaves its running max unchanged (``alpha = exp2(0) = 1``); the merge reads
exactly the ``ceil((p + 1) / SPLIT_TOKENS)`` pieces of the row's own keys, in order, whichever program merges
(and the merge of one piece is the identity, bit for bit, so a row whose keys fit one piece gets the same bits
in a tile that merges and in one that writes directly). Fully masked rows never
produce NaN (the running max is replaced by 0 while it is ``-inf``).

Cost (decode, per layer, SmolLM2-135M shape: 3 KV heads x 64 dims, bf16): each KV token is 768 B (K and
V), read once; at context 1k and B = 1 that is 0.77 MB, 0.18 us at 4.3 TB/s, so a B = 1 step is launch and
latency bound: 3 heads x 8 pieces = 24 programs of 128 keys (2 blocks of 64), one launch. At
B = 32 / context 4k it is 100 MB per layer (23 us floor) over 3 x 32 x 32 = 3072 programs: bandwidth bound.
The partials cost ``B * T * H * pieces * (D + 1) * 4`` bytes written and read once (under 6% of the KV
bytes at D = 64 and G = 3).

The eager twin (:func:`paged_attention_reference`) gathers each row's page-table span into a contiguous key
range and runs an fp32 masked softmax: agreement is within bf16 rounding of the probabilities (the kernel
feeds ``p`` to the second product in the value dtype), bitwise with neither.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import (INT_DTYPES, check_tensor, programmatic_launch,
                                             refuse_allocation_while_capturing, sm_count)
from tensorrt_llm_ext.kernels.fused_linear import _prefetch_l2

__all__ = ["CONFIG_CANDIDATES", "DECODE_CONFIGS", "DECODE_CONFIGS_BY_BATCH", "SPLIT_TOKENS",
           "AttentionConfig", "decode_config", "one_block_form", "paged_attention", "paged_attention_reference",
           "piece_blocks", "split_plan", "tile_counters"]

SPLIT_TOKENS = 128  # keys per sequence piece of a decode / verify tile (a fixed parameter, never per batch)
MAX_SPLIT_ROWS = 64  # tiles of at most this many rows (T * G) are split along the sequence
MERGE_UNROLL = 4  # pieces whose partials the merging program loads at once
# Programs per SM of the register prefetch at head dim 64 (128 registers x 128 threads: 4 of 65536 registers;
# 96 registers, 5 per SM, without it): AttentionConfig.prefetch -1 takes registers up to this many programs per SM.
REGISTER_PREFETCH_PER_SM = 4
# Query-tile elements (BLOCK_M x BLOCK_D) up to which the register prefetch fits beside q and the accumulator (a 32 x
# 128 verify tile spilled 48 B at 255 registers under Triton 3.6; 16 x 128 and 32 x 64 do not spill); larger: L2.
REGISTER_PREFETCH_MAX_TILE = 2048
PREFETCH_BLOCKS = 2  # key blocks of a piece brought to L2 before the programmatic wait (AttentionConfig.prefetch 2)
# The grid's split axis runs from the last piece to the first. The grid covers the widest table, so most programs of a
# short context are pieces past its keys (at B = 32, 1k keys of a 4k table: 2,304 of 3,072), which exit before the
# programmatic wait; scheduled first (blocks leave in grid order), they run out while the previous kernel still
# holds the SMs instead of after the live pieces' first wave. No bit changes (the merge's order is the pieces'
# order, whichever program merges). Measured (H100, fifteenth session, graph replay of the forward at 1k keys):
# [64, 1] 2046 -> 1871 us, [32, 1] 1131 -> 1094, [4, 8] 859 -> 841 (docs/target_forward.md).
LAST_PIECE_FIRST = True
# Whether the one-block form (`one_block_form`) keeps the setting's prefetch: its piece's one block (page ids, then
# K / V lines to L2) read before the programmatic wait, so that after it a program's first round trip is q's and the
# step's new key's; at 128 registers (4 programs per SM), as without it (fifteenth session, sm_90 compile). Measured
# (H100, graph replay at 1k keys): [1, 1] 506 -> 488 us, [32, 1] 1125 -> 1094, [4, 8] 865 -> 841.
ONE_BLOCK_PREFETCH = True
# (Measured and removed, nineteenth session: a decode piece's loop bringing the block two ahead of the one it reads to
# L2 made one layer's attention at 8k keys 1.19-1.24x slower on the H100 -- B = 32 88.9 vs 74.7 us, B = 64 173.5 vs
# 139.9 -- and the [32, 1] forward at 8k 3376 vs 2844 us; docs/target_forward.md.)
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_pool_ptr, v_pool_ptr, table_ptr, slot_ptr, pos_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
    t_len, group, num_heads, head_dim, num_m_tiles, max_pages, page_size, scratch_page, split_len, num_splits,
    min_blocks, scale_log2,
    stride_qb, stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_tab, stride_pb, stride_ob, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    ROW_PIECES: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, MERGE_UNROLL: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, PREFETCH_BLOCKS: tl.constexpr, LAST_FIRST: tl.constexpr,
    IDS_AHEAD: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    piece = tl.program_id(2)
    if LAST_FIRST:  # the grid's last pieces (past most rows' keys) scheduled first: see LAST_PIECE_FIRST
        piece = num_splits - 1 - piece
    b = pid // num_m_tiles
    m_tile = pid % num_m_tiles
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < t_len * group
    t = rows // group
    head = kvh * group + rows % group
    # The row's position and its slot: independent loads, both in flight at once.
    pos = tl.load(pos_ptr + b.to(tl.int64) * stride_pb + t, mask=row_ok, other=-1).to(tl.int32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    kv_len = tl.max(pos, axis=0) + 1
    if ROW_PIECES:
        # Decode tiles (one query position): the pieces cut the row's own keys in num_splits equal runs of whole
        # BLOCK_N blocks (a function of the row's length only), so a short context runs as many short pieces and
        # a long one as few long ones; a piece holds at least min_blocks blocks (fewer, longer pieces where
        # short ones would only add partials and merges).
        split_len = tl.maximum(tl.cdiv(kv_len, num_splits * BLOCK_N), min_blocks) * BLOCK_N
    start = piece * split_len
    end = kv_len  # an unsplit (prefill) tile: every key of the tile, in its one program
    if SPLIT:
        end = tl.minimum(start + split_len, kv_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    if PREFETCH == 1:
        # Before the programmatic wait, a split tile's first block in registers (its page ids and K / V stream in
        # while the previous kernel runs): keys below the request's first query position were written by earlier
        # steps and the page table before the forward; only this step's keys (at or past it) are read after the
        # wait. (A split tile holds all of its request's rows; a prefill tile, which sees only some of the step's
        # positions, never prefetches.)
        fresh = tl.min(tl.where(row_ok, pos, kv_len), axis=0)
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < end
        old = j < fresh
        page, off = _block_pages(table_ptr, slot, stride_tab, j, j_ok, max_pages, page_size, scratch_page)
        k, v = _block_kv(k_pool_ptr, v_pool_ptr, page, off, kvh, d, j_ok & old, d_ok, stride_kp, stride_kt,
                         stride_kh, stride_vp, stride_vt, stride_vh)
    else:  # placeholders: read only under PREFETCH == 1
        fresh, j, j_ok, old, page, off, k, v = 0, 0, 0, 0, 0, 0, 0, 0
    if PREFETCH == 2:
        # Before the wait, the piece's first PREFETCH_BLOCKS blocks brought to L2 (no registers held: the pipelined
        # loop below reads them after the wait; L2 is where this step's K / V writes land, so any key may be
        # prefetched).
        for i in tl.static_range(PREFETCH_BLOCKS):
            jp = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
            jp_ok = jp < end
            pg, po = _block_pages(table_ptr, slot, stride_tab, jp, jp_ok, max_pages, page_size, scratch_page)
            _prefetch_l2(k_pool_ptr + pg * stride_kp + po * stride_kt + kvh * stride_kh, jp_ok)
            _prefetch_l2(v_pool_ptr + pg * stride_vp + po * stride_vt + kvh * stride_vh, jp_ok)
    if PREFETCH == 1:
        # The register form waits and loads q before the branch (inside it, a 32-row verify tile spills 8 B at 168
        # registers under Triton 3.6); it runs where the grid is small, so its empty pieces cost little.
        q = _wait_and_load_q(q_ptr, b, t, head, d, row_ok, d_ok, stride_qb, stride_qt, stride_qh, DOT_DTYPE, PDL)
    # Otherwise a piece past the tile's keys (the grid covers the widest table; its prefetch above is all masked
    # off) exits here, with no programmatic wait and no q: at B = 32 and 1k keys 15 of a tile's 32 decode programs.
    if start < kv_len:
        if PREFETCH != 1:
            q = _wait_and_load_q(q_ptr, b, t, head, d, row_ok, d_ok, stride_qb, stride_qt, stride_qh, DOT_DTYPE, PDL)
        _attend_piece(q, pos, slot, row_ok, t, head, d, d_ok, b, pid, kvh, piece, start, end, kv_len, split_len,
                      fresh, j, j_ok, old, page, off, k, v,
                      k_pool_ptr, v_pool_ptr, table_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
                      t_len, num_heads, head_dim, max_pages, page_size, scratch_page, num_splits, scale_log2,
                      stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tab,
                      stride_ob, stride_ot, stride_oh,
                      BLOCK_M, BLOCK_N, BLOCK_D, SPLIT, DOT_DTYPE, PRECISION, MERGE_UNROLL, PREFETCH, IDS_AHEAD)


@triton.jit
def _wait_and_load_q(q_ptr, b, t, head, d, row_ok, d_ok, stride_qb, stride_qt, stride_qh, DOT_DTYPE: tl.constexpr,
                     PDL: tl.constexpr):
    """The tile's queries, after the programmatic wait (q and this step's K / V are written by the previous
    kernel)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return q.to(DOT_DTYPE)


@triton.jit
def _attend_piece(q, pos, slot, row_ok, t, head, d, d_ok, b, pid, kvh, piece, start, end, kv_len, split_len,
                  fresh, j, j_ok, old, page, off, k, v,
                  k_pool_ptr, v_pool_ptr, table_ptr, out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
                  t_len, num_heads, head_dim, max_pages, page_size, scratch_page, num_splits, scale_log2,
                  stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_tab,
                  stride_ob, stride_ot, stride_oh,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, MERGE_UNROLL: tl.constexpr,
                  PREFETCH: tl.constexpr, IDS_AHEAD: tl.constexpr):
    """One piece of keys ``start .. end`` of a tile: the online softmax over its blocks, then its output (one
    live piece) or its partials and, for the last piece of the tile to arrive, the merge. ``PREFETCH == 1``: the
    first block's ``page, off, k, v`` were read before the wait. ``IDS_AHEAD``: each block's page ids are loaded
    one iteration earlier (loop-carried), so a block's K / V loads wait on no load of their own iteration -- the
    same reads in another order, the same bits."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = start
    if PREFETCH == 1:
        if start + BLOCK_N > fresh:  # the first block holds keys of this step: those now, over the others
            k, v = _block_kv(k_pool_ptr, v_pool_ptr, page, off, kvh, d, j_ok & ~old, d_ok, stride_kp, stride_kt,
                             stride_kh, stride_vp, stride_vt, stride_vh, k, v)
        m_i, l_i, acc = _attend_block(q, k, v, j, j_ok, pos, m_i, l_i, acc, scale_log2, DOT_DTYPE, PRECISION)
        first = start + BLOCK_N
    if IDS_AHEAD:  # the first block's ids before the loop; each iteration then loads the next block's
        jn = first + tl.arange(0, BLOCK_N)
        ids_next = _block_page_ids(table_ptr, slot, stride_tab, jn, jn < end, max_pages, page_size, scratch_page)
    for n0 in range(first, end, BLOCK_N):
        jb = n0 + tl.arange(0, BLOCK_N)
        jb_ok = jb < end
        if IDS_AHEAD:
            # Only the int32 ids cross the iteration (the offsets follow from jb, the widening is this block's):
            # the loop-carried registers of the earlier form, int64 ids and offsets, spilled on sm_90.
            pg, po = ids_next.to(tl.int64), (jb % page_size).to(tl.int64)
            jn = jb + BLOCK_N  # the next block's ids in flight with this block's K / V (masked past the piece)
            ids_next = _block_page_ids(table_ptr, slot, stride_tab, jn, jn < end, max_pages, page_size,
                                       scratch_page)
        else:
            pg, po = _block_pages(table_ptr, slot, stride_tab, jb, jb_ok, max_pages, page_size, scratch_page)
        # V is issued with K (both wait on the page ids only), not after the scores.
        kb, vb = _block_kv(k_pool_ptr, v_pool_ptr, pg, po, kvh, d, jb_ok, d_ok, stride_kp, stride_kt, stride_kh,
                           stride_vp, stride_vt, stride_vh)
        m_i, l_i, acc = _attend_block(q, kb, vb, jb, jb_ok, pos, m_i, l_i, acc, scale_log2, DOT_DTYPE, PRECISION)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    out_rows = out_ptr + b.to(tl.int64) * stride_ob + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_mask = row_ok[:, None] & d_ok[None, :]
    # Pieces holding some key of this tile (1 for a prefill tile, which takes the whole range), at most the grid's:
    # rows past the table (a ragged prefill block's padding) would count pieces no program runs, and the tile's
    # counter would never come back to zero for the next launch.
    live = tl.minimum((kv_len + split_len - 1) // split_len, num_splits) if SPLIT else 1
    if live > 1:
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        prow = ((b.to(tl.int64) * t_len + t) * num_heads + head) * num_splits
        tl.store(part_lse_ptr + prow + piece, lse, mask=row_ok)
        tl.store(part_o_ptr + (prow + piece)[:, None] * head_dim + d[None, :], o, mask=out_mask)
        # The last live piece of the tile to finish merges the tile's pieces (no second launch). The
        # barrier orders every thread's partial stores before the release; the acquire orders the reads.
        tl.debug_barrier()
        counter = counter_ptr + pid * tl.num_programs(1) + kvh
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == live - 1:
            tl.store(counter, 0)  # ready for the next launch (graph replays reuse the counters)
            _merge_pieces(part_o_ptr, part_lse_ptr, prow, pos, row_ok, d, d_ok, out_rows, out_mask, head_dim,
                          split_len, live, BLOCK_M, BLOCK_D, MERGE_UNROLL)
    else:
        # One piece: the merge of one piece is the identity, bit for bit (weight exp2(0) = 1, sums 0 + 1
        # and 0 + 1 * o), so the output is written directly.
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _block_page_ids(table_ptr, slot, stride_tab, j, j_ok, max_pages, page_size, scratch_page):
    """The table's page ids (its int32) of keys ``j`` of the slot (the scratch page past the table)."""
    pidx = j // page_size
    return tl.load(table_ptr + slot * stride_tab + pidx, mask=j_ok & (pidx < max_pages), other=scratch_page)


@triton.jit
def _block_pages(table_ptr, slot, stride_tab, j, j_ok, max_pages, page_size, scratch_page):
    """Page ids and in-page offsets of keys ``j`` of the slot (the scratch page past the table)."""
    page = _block_page_ids(table_ptr, slot, stride_tab, j, j_ok, max_pages, page_size, scratch_page)
    return page.to(tl.int64), (j % page_size).to(tl.int64)


@triton.jit
def _block_kv(k_pool_ptr, v_pool_ptr, page, off, kvh, d, j_mask, d_ok, stride_kp, stride_kt, stride_kh, stride_vp,
              stride_vt, stride_vh, k_other=0.0, v_other=0.0):
    """One block's K ``[BLOCK_D, BLOCK_N]`` (transposed for the product) and V ``[BLOCK_N, BLOCK_D]``; keys
    outside ``j_mask`` read as ``k_other`` / ``v_other`` (zeros, or the tiles already loaded: a predicated load
    into the same registers)."""
    k = tl.load(k_pool_ptr + page[None, :] * stride_kp + off[None, :] * stride_kt + kvh * stride_kh + d[:, None],
                mask=j_mask[None, :] & d_ok[:, None], other=k_other)
    v = tl.load(v_pool_ptr + page[:, None] * stride_vp + off[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                mask=j_mask[:, None] & d_ok[None, :], other=v_other)
    return k, v


@triton.jit
def _attend_block(q, k, v, j, j_ok, pos, m_i, l_i, acc, scale_log2, DOT_DTYPE: tl.constexpr,
                  PRECISION: tl.constexpr):
    """One key block of the online softmax (base 2): keys past a row's position add exact zeros."""
    s = tl.dot(q, k.to(DOT_DTYPE), input_precision=PRECISION) * scale_log2
    visible = (j[None, :] <= pos[:, None]) & j_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no NaN
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_pieces(part_o_ptr, part_lse_ptr, prow, pos, row_ok, d, d_ok, out_rows, out_mask, head_dim, split_len,
                  live, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr):
    """Merge each row's own ``ceil((pos + 1) / split_len)`` pieces in piece order, one pass with a running max
    (UNROLL pieces' loads in flight at once). A piece past a row's own is an exact identity step (weight 0,
    rescale exp2(0) = 1), so a row's bits never depend on the pieces its tile's other rows use; a row of one
    piece gets exactly that piece's ``o`` (weight exp2(0) = 1 on zero sums)."""
    used = tl.minimum((pos + split_len) // split_len, live)  # a row past the table: the pieces that exist
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s0 in range(0, live, UNROLL):
        for u in tl.static_range(UNROLL):
            s = s0 + u
            ok = row_ok & (s < used)
            lse = tl.load(part_lse_ptr + prow + s, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(part_o_ptr + (prow + s)[:, None] * head_dim + d[None, :], mask=ok[:, None] & d_ok[None, :],
                        other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m - m_use)
            w = tl.math.exp2(lse - m_use)
            den = den * alpha + w
            acc = acc * alpha[:, None] + w[:, None] * o
            m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class AttentionConfig:
    """Launch settings of the split (decode / verify) tiles: keys per inner iteration (dividing the piece),
    warps, software-pipeline stages, and ``pieces``: how a decode tile (``T = 1``) cuts its keys -- ``pieces``
    equal runs of whole ``block_n`` blocks sized from the row's own length (``0``: fixed ``SPLIT_TOKENS`` pieces,
    the verify tiles' rule), each at least ``min_blocks`` blocks long (so a short context runs fewer pieces,
    each with more than one block to pipeline, and fewer partials to merge); ``prefetch``: what a split tile
    reads before the programmatic wait (no bit of the result changes) -- 0 nothing, 1 its first block's page ids
    and K / V in registers (the keys of earlier steps; 32 more registers at head dim 64), 2 its first
    ``PREFETCH_BLOCKS`` blocks brought to L2, -1 by the grid (1 while it fits at the register form's occupancy,
    else 2). Suffixes of :meth:`describe`: ``r``, ``l``, ``a``. ``ids_ahead`` (suffix ``i``): a block's page ids
    loaded one iteration before its K / V (no bit changes). Prefill tiles keep 64 keys and 4 warps."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    pieces: int = 16
    min_blocks: int = 1
    prefetch: int = 0
    ids_ahead: bool = False

    def __post_init__(self) -> None:
        if self.block_n not in (16, 32, 64, 128) or SPLIT_TOKENS % self.block_n:
            raise ValueError(f"AttentionConfig.block_n must be 16, 32, 64 or 128 (dividing {SPLIT_TOKENS}), got "
                             f"{self.block_n}")
        if self.num_warps not in (1, 2, 4, 8) or not 1 <= self.num_stages <= 5:
            raise ValueError(f"AttentionConfig: num_warps in 1/2/4/8 and num_stages in 1..5, got {self.num_warps}, "
                             f"{self.num_stages}")
        if not 0 <= self.pieces <= 256:
            raise ValueError(f"AttentionConfig.pieces must be in 0..256 (0: fixed {SPLIT_TOKENS}-key pieces), got "
                             f"{self.pieces}")
        if not 1 <= self.min_blocks <= 64:
            raise ValueError(f"AttentionConfig.min_blocks must be in 1..64, got {self.min_blocks}")
        if self.prefetch not in (-1, 0, 1, 2):
            raise ValueError(f"AttentionConfig.prefetch must be -1 (auto), 0 (none), 1 (registers) or 2 (L2), got "
                             f"{self.prefetch}")

    @classmethod
    def parse(cls, text: str) -> "AttentionConfig":
        """The inverse of :meth:`describe` (``n64w4s2p32m3``, ``n64w4s2f``)."""
        import re

        hit = re.fullmatch(r"n(\d+)w(\d+)s(\d+)(?:f|p(\d+)(?:m(\d+))?)([rla]?)(i?)", text.strip())
        if hit is None:
            raise ValueError(f"AttentionConfig: {text!r} is not of the form n64w4s2p32m3ri / n64w4s2f")
        n, w, st, p, mb, pf, ahead = hit.groups()
        return cls(int(n), int(w), int(st), int(p or 0), int(mb or 1), " rl".find(pf or " "), ahead == "i")

    def describe(self) -> str:
        return (f"n{self.block_n}w{self.num_warps}s{self.num_stages}" + (f"p{self.pieces}" if self.pieces else "f")
                + (f"m{self.min_blocks}" if self.pieces and self.min_blocks > 1 else "")
                + " rla"[self.prefetch].strip() + ("i" if self.ids_ahead else ""))


# The settings a split launch uses per head dim (every row's bits follow from them: fixed, never per batch but at
# DECODE_CONFIGS_BY_BATCH's boundaries below; the prefetch, which changes no bit, may follow the grid); `bench target`
# times CONFIG_CANDIDATES at every (B, C) (docs/target_forward.md). Head dim 64 (SmolLM2, H200, 2026-12-04, seventh session's
# sweep with FlashInfer in the run): 128 keys per block, 4 warps, 2 stages, a decode row's keys in 32 pieces of whole
# blocks, the first two blocks brought to L2 before the programmatic wait ("n128w4s2p32l": within 1.2x of FlashInfer's
# decode at 7 of 8 shapes, where 64-key blocks ("p32a") were at 6: B = 1 C = 8k 12.8 us vs 14.5, +0.4 us at B = 1 C =
# 1k); where every piece is one block the model launches it with one stage, prefetching that block (`one_block_form`,
# same bits). Head dim 128: 3 stages, 16 pieces (8 KV heads: as many programs as SmolLM2's 3 at p32; not yet timed; the
# 8B shape runs the unfused layer, without programmatic launch, so without prefetch).
DECODE_CONFIGS: dict[int, AttentionConfig] = {64: AttentionConfig(128, 4, 2, 32, prefetch=2),
                                              128: AttentionConfig(64, 4, 3, 16)}
# Decode steps of more requests take fewer, longer pieces (head dims listed): from 17 requests at most 4 pieces a row,
# from 33 at most 2 -- about one wave of programs, B x KVH x pieces ~ 384 at SmolLM2's 3 KV heads (~3 decode tiles per
# SM on 132 SMs, the two-stage tile's occupancy), where the table's 32 one-block pieces of a 1k-key row run 768 / 1536
# programs in two / four waves, each a full latency chain. Measured (seventeenth session, graph replay of the forward,
# us): [32, 1] 1 / 2 / 4 / 8k keys 1041 -> 1019, 1537 -> 1348 (H200), 2114 -> 1795, 3323 -> 2762 (H100); [64, 1] 1k
# / 8k 1696 -> 1591, 5684 -> 4934 (H100; against the sixteenth session's pieces of at least 3 blocks, which had taken
# 1824 -> 1650 on the H200). Below 17 requests the table's pieces stay (B = 16: 4 pieces +3-4 %, B = 8: 16 pieces
# -7 % at 4k keys but +3 % at 2k; B = 1 loses with any fewer). Each entry is (first batch, settings), in order; the
# rule changes a row's bits with the batch only at 16 -> 17 and 32 -> 33 requests: graph buckets' boundaries under the
# default power-of-two buckets (cuda_graph_config.batch_sizes), as FUSED_MAX_ROWS's, so a step padded to its bucket
# gives the eager step's bits; configured buckets that straddle 16 or 32 do not.
DECODE_CONFIGS_BY_BATCH: dict[int, tuple[tuple[int, AttentionConfig], ...]] = {
    64: ((17, AttentionConfig(128, 4, 2, 4, prefetch=2)), (33, AttentionConfig(128, 4, 2, 2, prefetch=2)))}
# The benchmark's sweep around it (fourteenth session, docs/target_forward.md). Per program at T = 1 (sm_90, Triton
# 3.6.0): the model's setting 148 registers x 4 warps (3 programs per SM: B = 32 C = 1k's 768 one-block pieces in two
# waves); without prefetch 168, one stage 128 (4); 64-key blocks 90-96 (5); 32-key blocks at 2 warps 96-122 (8-10),
# at 4 warps 80 (6); 64-key blocks at 2 warps, one stage 147 (6). Each with the pieces of the model's 1k-key row (8
# of 128 keys): `p32m2` / `p32m4`; and `p8`, the fastest measured at B >= 32 and 1k keys (15.0 us vs 22.9 for `p32a`,
# seventh session).
CONFIG_CANDIDATES = (AttentionConfig(128, 4, 2, 32, prefetch=2), AttentionConfig(128, 4, 1, 32),
                     AttentionConfig(64, 4, 2, 32, 2), AttentionConfig(64, 4, 2, 32, 2, prefetch=2),
                     AttentionConfig(64, 4, 2, 8), AttentionConfig(32, 2, 2, 32, 4),
                     AttentionConfig(32, 2, 2, 32, 4, prefetch=2), AttentionConfig(32, 4, 2, 32, 4),
                     AttentionConfig(32, 2, 3, 32, 4), AttentionConfig(64, 2, 1, 32, 2),
                     AttentionConfig(128, 4, 2, 4, prefetch=2), AttentionConfig(128, 4, 2, 2, prefetch=2),
                     AttentionConfig(128, 4, 2, 32, prefetch=2, ids_ahead=True),
                     AttentionConfig(128, 4, 2, 4, prefetch=2, ids_ahead=True),
                     AttentionConfig(128, 4, 2, 2, prefetch=2, ids_ahead=True))
# (the 11th and 12th: DECODE_CONFIGS_BY_BATCH[64]; the last three: the model's three settings with each block's page
# ids loaded one iteration ahead -- built 2026-12-07, thirty-sixth session, for the long pieces of B >= 32 at 8k keys
# on the H200 (1.34x the K / V floor at B = 32, goal 1.3x), where a block's K / V loads waited on its own page-id load
# each iteration; 142 registers and no spill on sm_90 since only the int32 ids cross the iteration; not yet timed)


PREFILL_CONFIG = AttentionConfig(64, 4, 3)  # unsplit (prefill) tiles: 64 rows x 64 keys


def piece_blocks(cfg: AttentionConfig, row_pieces: int, width: int, splits: int) -> int:
    """``block_n`` blocks in the widest piece of a split launch: fixed pieces (a verify tile's, ``row_pieces`` 0)
    are ``SPLIT_TOKENS`` keys; a decode tile's follow from the table ``width`` (the longest row a launch can hold),
    as the kernel sizes them."""
    if row_pieces:
        return max(triton.cdiv(width, splits * cfg.block_n), cfg.min_blocks)
    return SPLIT_TOKENS // cfg.block_n


def one_block_form(cfg: AttentionConfig, row_pieces: int, width: int, splits: int) -> AttentionConfig:
    """The model's launch of split tiles whose every piece is one ``block_n`` block (:func:`piece_blocks`): one
    pipeline stage, else ``cfg``; the prefetch stays (``ONE_BLOCK_PREFETCH``; the launch brings at most a piece's
    blocks to L2). With one block per piece a second stage is never filled, and its buffers cost occupancy: at head
    dim 64, 128-key blocks, the 24-row verify tile takes 142 registers instead of 220 (3 programs per SM instead of
    2), the decode tile with its block's L2 prefetch 128 (4 per SM) instead of 144.
    Stages and prefetch change when keys are read, never a bit of the result (bitwise on the H200, 2026-12-05), so
    the form may follow the table. Measured (H200, docs/target_forward.md, fourteenth session, without the
    prefetch): the `[32, 1]` forward at 1k keys 1385.9 -> 1243.7 us, the `[32, 8]` / `[64, 8]` verify forwards
    12-19 % faster; where a piece holds two blocks (8k keys) the second stage pays (the same launch 2-12 % slower),
    so it stays there."""
    if piece_blocks(cfg, row_pieces, width, splits) > 1:
        return cfg
    return replace(cfg, num_stages=1, prefetch=cfg.prefetch if ONE_BLOCK_PREFETCH else 0)


def decode_config(head_dim: int, batch: int = 1) -> AttentionConfig:
    """The settings for ``head_dim`` at a decode step of ``batch`` requests: the last entry of
    :data:`DECODE_CONFIGS_BY_BATCH` whose first batch ``batch`` reaches, else :data:`DECODE_CONFIGS` (the default
    settings for a head dim no table lists)."""
    cfg = DECODE_CONFIGS.get(head_dim, AttentionConfig())
    for first, by_batch in DECODE_CONFIGS_BY_BATCH.get(head_dim, ()):
        if batch >= first:
            cfg = by_batch
    return cfg


_COUNTERS: dict[torch.device, torch.Tensor] = {}
# Outgrown counters are kept, never freed: a graph captured while one was current still counts on it at replay
# (each launch leaves it zeroed, so it stays valid), as shard_select's scratch and latent attention's partials.
_RETIRED_COUNTERS: list[torch.Tensor] = []
MIN_COUNTERS = 1 << 16  # (request, KV head) tiles of a split launch: B * KVH up to 65536 without growing


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """The per-device int32 arrival counters of split tiles (zero between launches: each tile's merging
    program resets its own). Allocated zeroed once, outside any capture, and grown only outside one (a graph
    keeps their address); a launch inside a capture that needs more raises :class:`CaptureAllocationError`.
    Launches on one device must not run concurrently on two streams (they share the counters)."""
    device = torch.device(device)
    have = _COUNTERS.get(device)
    if have is None or have.numel() < n:
        refuse_allocation_while_capturing(f"paged_attention tile counters ({n} tiles)", device)
        if have is not None:
            _RETIRED_COUNTERS.append(have)
        have = torch.zeros(max(n, MIN_COUNTERS, 0 if have is None else 2 * have.numel()), dtype=torch.int32,
                           device=device)
        _COUNTERS[device] = have
    return have


def split_plan(num_rows: int, max_pages: int, page_size: int, row_pieces: int = 0,
               block_n: int = 64) -> tuple[int, int, int]:
    """``(BLOCK_M, num_m_tiles, num_splits)`` of a step with ``num_rows = T * G`` rows per (request, KV head),
    from fixed parameters only (the step shape, the table width and the config), never from the lengths in use.
    ``row_pieces`` (decode tiles, ``T = 1``): the keys are cut in that many runs of whole ``block_n`` blocks
    (fewer where the table is narrower); ``0``: fixed ``SPLIT_TOKENS`` pieces."""
    if num_rows <= MAX_SPLIT_ROWS:
        block_m = max(16, triton.next_power_of_2(num_rows))
        width = max_pages * page_size
        pieces = min(row_pieces, triton.cdiv(width, block_n)) if row_pieces else triton.cdiv(width, SPLIT_TOKENS)
        return block_m, 1, max(1, pieces)
    return MAX_SPLIT_ROWS, triton.cdiv(num_rows, MAX_SPLIT_ROWS), 1


def _check(q, k_pool, v_pool, page_table, slot_ids, positions):
    check_tensor("paged_attention q [B, T, H, D]", q, shape=(None, None, None, None), unit_last_stride=True,
                 dtype=(torch.bfloat16, torch.float16, torch.float32))
    b, t, h, d = q.shape
    check_tensor("paged_attention k_pool [pages + 1, page_size, KVH, D]", k_pool, shape=(None, None, None, d),
                 unit_last_stride=True, device=q.device)
    check_tensor("paged_attention v_pool [pages + 1, page_size, KVH, D]", v_pool, shape=tuple(k_pool.shape),
                 unit_last_stride=True, dtype=k_pool.dtype, device=q.device)
    check_tensor("paged_attention page_table [slots, max_pages]", page_table, shape=(None, None),
                 dtype=torch.int32, unit_last_stride=True, device=q.device)
    check_tensor("paged_attention slot_ids [B]", slot_ids, shape=(b,), dtype=INT_DTYPES, device=q.device)
    check_tensor("paged_attention positions [B, T]", positions, shape=(b, t), dtype=INT_DTYPES,
                 unit_last_stride=True, device=q.device)
    if h % k_pool.shape[2]:
        raise ValueError(f"paged_attention: num_heads={h} must be a multiple of kv_heads={k_pool.shape[2]}")


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, page_table: torch.Tensor,
                    slot_ids: torch.Tensor, positions: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, config: AttentionConfig | None = None,
                    programmatic: bool | None = None) -> torch.Tensor:
    """Causal attention of ``q`` over the paged cache (see the module doc).

    Args:
        q: ``[B, T, H, D]`` bf16 / fp16 / fp32 (already rotated), unit last stride.
        k_pool, v_pool: ``[num_pages + 1, page_size, KVH, D]`` one layer's pools (the K/V of this step's
            tokens already written); ``H % KVH == 0``.
        page_table: ``[num_slots, max_pages]`` int32 page ids (the scratch page where unallocated).
        slot_ids: ``[B]`` int slot of each row; positions: ``[B, T]`` int absolute query positions.
        scale: the softmax scale (``1 / sqrt(D)``).
        out: optional ``[B, T, H, D]`` of ``q``'s dtype.
        config: the split tiles' launch settings (default: :func:`decode_config` of ``D`` and ``B``; the
            benchmark's comparison passes others).
        programmatic: launch with programmatic dependent launch (None: where
            :func:`~tensorrt_llm_ext.kernels.common.programmatic_launch` allows it). The fused layer's chain
            gains from it; between cuBLAS launches (the unfused layer) it cost ~1.5 us per layer on the H200.

    Returns ``out``. CUDA-graph safe (the split partials come from the capture's pool like any torch op).

    Example::

        o = paged_attention(q, k_pool, v_pool, table, slots, positions, 1 / math.sqrt(64))
    """
    _check(q, k_pool, v_pool, page_table, slot_ids, positions)
    b, t, h, d = q.shape
    kvh = k_pool.shape[2]
    group = h // kvh
    if out is None:
        out = torch.empty_like(q)
    check_tensor("paged_attention out", out, shape=tuple(q.shape), dtype=q.dtype, device=q.device,
                 unit_last_stride=True)
    if b == 0 or t == 0:
        return out
    cfg = config or decode_config(d, b)
    row_pieces = cfg.pieces if t == 1 else 0  # decode tiles: pieces sized from the row's own length
    block_m, m_tiles, splits = split_plan(t * group, page_table.shape[1], k_pool.shape[1], row_pieces, cfg.block_n)
    width = page_table.shape[1] * k_pool.shape[1]  # the widest row the table holds
    if splits == 1:
        cfg = PREFILL_CONFIG
    elif config is None:
        cfg = one_block_form(cfg, row_pieces, width, splits)
    interpret = not q.is_cuda
    fp32 = q.dtype == torch.float32 or k_pool.dtype == torch.float32
    # The interpreter's tl.dot is wrong on 16-bit operands: upcast there. On the GPU 16-bit operands go
    # straight to the tensor cores (fp32 accumulate); fp32 models use IEEE products.
    dot_dtype = tl.float32 if (interpret or fp32) else (tl.bfloat16 if k_pool.dtype == torch.bfloat16
                                                         else tl.float16)
    precision = "ieee" if fp32 else "tf32"
    block_d = max(16, triton.next_power_of_2(d))
    pdl = programmatic_launch(q) and programmatic is not False
    # The first block's prefetch overlaps the previous kernel only under programmatic launch (without it the
    # extra registers cost occupancy for nothing); the interpreter runs the register form so the CPU tests cover
    # its reads. Split tiles only (a prefill tile sees only some of the step's positions).
    prefetch = cfg.prefetch
    if prefetch < 0:
        # Auto: the prefetch changes when keys are read, never a bit of the result, so it may follow the grid: in
        # registers while the whole grid fits at the register form's occupancy, else to L2 (no registers held).
        sms = sm_count(q.device, cpu=132)
        prefetch = 1 if b * m_tiles * kvh * splits <= REGISTER_PREFETCH_PER_SM * sms else 2
    if prefetch == 1 and block_m * block_d > REGISTER_PREFETCH_MAX_TILE:
        prefetch = 2  # the register form needs a query tile small enough to hold a block too
    prefetch = prefetch if splits > 1 and (pdl or (interpret and prefetch == 1)) else 0
    if splits > 1:
        part_o = torch.empty(b * t * h * splits * d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b * t * h * splits, dtype=torch.float32, device=q.device)
        counters = tile_counters(q.device, b * m_tiles * kvh)
    else:
        part_o = part_lse = out
        counters = page_table
    _paged_attention_kernel[(b * m_tiles, kvh, splits)](
        q, k_pool, v_pool, page_table, slot_ids, positions, out, part_o, part_lse, counters,
        t, group, h, d, m_tiles, page_table.shape[1], k_pool.shape[1], k_pool.shape[0] - 1, SPLIT_TOKENS, splits,
        cfg.min_blocks, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), page_table.stride(0), positions.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, SPLIT=splits > 1,
        ROW_PIECES=splits > 1 and row_pieces > 0,
        DOT_DTYPE=dot_dtype, PRECISION=precision,
        # the merge's order is fixed (piece order); more pieces' loads in flight where the partial tiles are small
        # (16 rows x 64: SmolLM2's decode; 16 x 128 spilled 40 B under Triton 3.7.1)
        MERGE_UNROLL=2 * MERGE_UNROLL if block_m * block_d <= 1024 else MERGE_UNROLL,
        PDL=pdl, PREFETCH=prefetch, LAST_FIRST=LAST_PIECE_FIRST and splits > 1,
        PREFETCH_BLOCKS=min(PREFETCH_BLOCKS, piece_blocks(cfg, row_pieces, width, splits)),
        IDS_AHEAD=cfg.ids_ahead,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    return out


def paged_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              page_table: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """Eager twin of :func:`paged_attention`: gathers each row's table span (``max_pages * page_size`` keys),
    masks keys past each query's position, fp32 softmax; returns ``[B, T, H, D]`` in ``q``'s dtype.

    Per row, only that row's query, position and keys enter its result (the CPU path of the target)."""
    _check(q, k_pool, v_pool, page_table, slot_ids, positions)
    b, t, h, d = q.shape
    kvh = k_pool.shape[2]
    g = h // kvh
    pages = page_table[slot_ids.long()].long()  # [B, max_pages]
    keys = k_pool[pages].flatten(1, 2).float()  # [B, S, KVH, D]
    vals = v_pool[pages].flatten(1, 2).float()
    qg = q.float().view(b, t, kvh, g, d)
    scores = torch.einsum("btngd,bsnd->bngts", qg, keys) * scale  # [B, KVH, G, T, S]
    key_pos = torch.arange(keys.shape[1], device=q.device)
    causal = key_pos[None, None, :] <= positions.long()[:, :, None]  # [B, T, S]
    scores = scores.masked_fill(~causal[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("bngts,bsnd->btngd", probs, vals).reshape(b, t, h, d)
    return o.to(q.dtype)

