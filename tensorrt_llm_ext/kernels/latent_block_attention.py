"""Single-latent (MLA-style) attention of a draft block over the paged drafter context, one launch per layer.

Every position stores ONE latent ``c [d_c]`` per drafter layer in the paged pool (shared by all heads);
keys and values are up-projected per head (``k = W_uk c``, ``v = W_uv c``) and rotate-half RoPE is applied
to q and k at their absolute positions. A draft block of ``K`` positions attends to

* the request's context latents, positions ``0 .. ctx_len-1``, read through the cache's block table
  (position ``p`` lives at ``pool[block_table[slot, p // page_size], p % page_size]``), and
* the block's own latents (stored at the :class:`~tensorrt_llm_ext.contract.DraftBlockPlacement`
  pages/offsets; attention uses the computed values, so a position whose page is unallocated still
  attends its block),

bidirectionally within the block and without a causal mask over the context. A dummy row
(``seq_lens == 0``) sees nothing and yields zeros (finite).

Two implementations of the same function:

* :func:`latent_block_attention_reference`, the eager twin (the drafter's original path): stores the
  block latents, gathers the whole table span ``[B, max_pages * page_size, d_c]``, up-projects every
  gathered latent (keys and values rounded to the model dtype by ``F.linear``), RoPE, a masked fp32
  softmax. About 40 small launches per layer.
* :func:`latent_block_attention`, one Triton launch, grid ``(B, heads)``. Per program: RoPE on the
  block's ``K`` queries in registers; a loop over the live context only (``ctx_len`` read on the device,
  no padding span) in tiles of ``BLOCK_N`` positions loaded through the block table; per tile the key
  up-projection ``[BLOCK_N, d_c] x [d_c, D]`` on tensor cores (model dtype in, fp32 accumulate), RoPE on
  the keys, scores, an online (flash) softmax in fp32; the **value up-projection is absorbed**: the
  program accumulates ``sum_j p_j c_j`` in latent space ``[K, d_c]`` and multiplies by ``W_uv`` once at
  the end (``K * d_c * D`` instead of ``ctx_len * d_c * D`` per head). The block's own latents are the
  last tile, and the head-0 program stores them into the pool (the only pool write).

Numerics: the kernel keeps keys and values in fp32 where the twin rounds them to the model dtype, sums
in another order (online softmax) and, for 16-bit inputs, runs its fp32-operand products (scores,
``p @ c``, the final ``W_uv``) in TF32 (10-bit mantissa, finer than the twin's bf16 rounding of keys and
values). fp32 inputs use IEEE fp32 products: kernel and twin then agree to ~1e-5. bf16: within a few
bf16 ulps of the O(1) outputs (tests hold ``atol = rtol = 2e-2`` on CPU and on the H200); bitwise is
not promised. The block-latent store is bitwise (a copy).

Preconditions (the worker's bookkeeping guarantees them): no block destination aliases a context
position ``< ctx_len`` of any row (the block is placed after the advertised context), and real rows do
not share pages. Graph safety: given ``out=`` the launcher allocates nothing, never syncs and branches
on shapes only; the per-``(head_dim, theta, device)`` RoPE frequency table is cached on first use
(:data:`_INV_FREQ`), so the first call must happen outside a capture (warm-up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.contract import DraftBlockPlacement
from tensorrt_llm_ext.kernels.common import (INT_DTYPES, check_devices, check_int, check_tensor, num_warps_for,
                                             refuse_allocation_while_capturing, triton_runs_on)
from tensorrt_llm_ext.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq

__all__ = ["ATTENTION_SCHEDULES", "AttentionSchedule", "attention_schedule", "gather_context_latents",
           "latent_block_attention", "latent_block_attention_reference", "masked_softmax_attention",
           "single_latent_block_attention", "write_block_latents"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Scratch cache: the fp32 RoPE frequency table ``[D/2]`` per (head_dim, theta, device), built outside capture
# on the first call (warm-up) and reused by every later call and captured graph.
_INV_FREQ: dict[tuple[int, float, str], torch.Tensor] = {}


@triton.jit
def _attend_tile(lat, kpos, kvalid, q1r, q2r, m_i, l_i, acc, wk_ptr, stride_w, row0, inv_freq, f, f_ok, c, c_ok,
                 scale, HALF: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of latents ``lat [N, BLOCK_C]`` at positions ``kpos [N]`` into the online softmax state."""
    wmask = c_ok[:, None] & f_ok[None, :]
    # W_uk rows of this head, transposed to [BLOCK_C, BLOCK_HALF]: the two rotate-half halves of the key.
    wk1 = tl.load(wk_ptr + (row0 + f)[None, :] * stride_w + c[:, None], mask=wmask, other=0.0).to(DOT_DTYPE)
    wk2 = tl.load(wk_ptr + (row0 + HALF + f)[None, :] * stride_w + c[:, None], mask=wmask, other=0.0).to(DOT_DTYPE)
    lat_d = lat.to(DOT_DTYPE)
    k1 = tl.dot(lat_d, wk1, input_precision=PRECISION)  # [N, BLOCK_HALF] fp32
    k2 = tl.dot(lat_d, wk2, input_precision=PRECISION)
    ang = kpos.to(tl.float32)[:, None] * inv_freq[None, :]
    kc = tl.cos(ang)
    ks = tl.sin(ang)
    k1r = k1 * kc - k2 * ks
    k2r = k2 * kc + k1 * ks
    s = tl.dot(q1r, tl.trans(k1r), input_precision=PRECISION)
    s += tl.dot(q2r, tl.trans(k2r), input_precision=PRECISION)  # [BLOCK_M, N]
    s = tl.where(kvalid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep every term 0, never NaN
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # Value up-projection absorbed: accumulate the probability-weighted latents, W_uv comes once at the end.
    acc = acc * alpha[:, None] + tl.dot(p, lat.to(tl.float32), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _finish(acc, l_i, wv_ptr, stride_wv, row0, out_ptr, b, hd, m, f, f_ok, c, c_ok, qmask, stride_ob, stride_ok,
            stride_oh, HALF: tl.constexpr, PRECISION: tl.constexpr):
    """Normalise the latent-space accumulator and apply ``W_uv`` (the absorbed value up-projection)."""
    o_lat = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no valid key is all zeros
    wmask = c_ok[:, None] & f_ok[None, :]
    wv1 = tl.load(wv_ptr + (row0 + f)[None, :] * stride_wv + c[:, None], mask=wmask, other=0.0).to(tl.float32)
    wv2 = tl.load(wv_ptr + (row0 + HALF + f)[None, :] * stride_wv + c[:, None], mask=wmask, other=0.0).to(tl.float32)
    o1 = tl.dot(o_lat, wv1, input_precision=PRECISION)
    o2 = tl.dot(o_lat, wv2, input_precision=PRECISION)
    o_row = out_ptr + b * stride_ob + m[:, None] * stride_ok + hd * stride_oh
    tl.store(o_row + f[None, :], o1.to(out_ptr.dtype.element_ty), mask=qmask)
    tl.store(o_row + HALF + f[None, :], o2.to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _live_context(ctx_lens_ptr, seq_lens_ptr, b, max_ctx):
    """Row ``b``'s attended context positions: its ``ctx_len`` capped at the table span, 0 for a dummy row."""
    live = tl.load(seq_lens_ptr + b) > 0
    n_ctx = tl.minimum(tl.maximum(tl.load(ctx_lens_ptr + b), 0), max_ctx)
    return live, tl.where(live, n_ctx, 0)


@triton.jit
def _split_len(n_ctx, n_splits, BLOCK_N: tl.constexpr):
    """Context positions per split: the row's live tiles over the splits, whole tiles (0 without context). The
    splits ``sp < cdiv(n_ctx, split_len)`` hold context; the last split also holds the block; the others none."""
    return tl.cdiv(tl.cdiv(n_ctx, BLOCK_N), n_splits) * BLOCK_N


@triton.jit(do_not_specialize=["k_len", "page_size", "max_pages", "n_splits"])
def _latent_block_attention_kernel(
    q_ptr, blk_ptr, pool_ptr, bt_ptr, slot_ptr, ctx_lens_ptr, seq_lens_ptr, pos_ptr, page_ids_ptr, page_off_ptr,
    wk_ptr, wv_ptr, inv_freq_ptr, out_ptr, part_ptr,
    k_len, d_c, page_size, max_pages, scale, n_splits,
    stride_qb, stride_qk, stride_qh, stride_bb, stride_bk, stride_pp, stride_po, stride_bt,
    stride_wk, stride_wv, stride_ob, stride_ok, stride_oh, stride_place,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr, STORE_BLOCK: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # Grid (B, heads, splits). Split s attends context positions [s * split_len, (s + 1) * split_len) of
    # the live context (split_len: the row's live tiles over the splits, whole tiles); the last split also
    # attends the block's own latents (and stores them). Without SPLIT (one split) the program finishes the
    # row itself; with it, each split that holds context or the block writes its online-softmax state (m, l, acc)
    # to part_ptr and _latent_block_attention_combine_kernel merges them (an empty split writes nothing: the
    # combine reads only the splits that hold something, from the same _split_len).
    b = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)
    sp = tl.program_id(2)
    row0 = hd * (2 * HALF)  # first W row of this head
    slot = tl.load(slot_ptr + b).to(tl.int64)
    live, n_ctx = _live_context(ctx_lens_ptr, seq_lens_ptr, b, max_pages * page_size)

    m = tl.arange(0, BLOCK_M)
    m_ok = m < k_len
    f = tl.arange(0, BLOCK_HALF)
    f_ok = f < HALF
    c = tl.arange(0, BLOCK_C)
    c_ok = c < d_c
    inv_freq = tl.load(inv_freq_ptr + f, mask=f_ok, other=0.0)

    qpos = tl.load(pos_ptr + b * stride_place + m, mask=m_ok, other=0)
    qmask = m_ok[:, None] & f_ok[None, :]
    q_row = q_ptr + b * stride_qb + m[:, None] * stride_qk + hd * stride_qh
    q1 = tl.load(q_row + f[None, :], mask=qmask, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + HALF + f[None, :], mask=qmask, other=0.0).to(tl.float32)
    ang = qpos.to(tl.float32)[:, None] * inv_freq[None, :]
    qc = tl.cos(ang)
    qs = tl.sin(ang)
    q1r = q1 * qc - q2 * qs
    q2r = q2 * qc + q1 * qs

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    bt_row = bt_ptr + slot * stride_bt
    # The live context only: a data-dependent trip count read on the device (graph safe, no padding span).
    # Splits share the row's LIVE context (whole tiles each, sized on the device): a table span far past the
    # context (max_seq_len pages per slot) leaves no split idle, and a graph replays for any context.
    split_len = _split_len(n_ctx, n_splits, BLOCK_N)
    lo = sp * split_len
    hi = tl.minimum(n_ctx, lo + split_len)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.maximum(tl.load(bt_row + n // page_size, mask=n_ok, other=0), 0).to(tl.int64)
        lat_ptrs = pool_ptr + page[:, None] * stride_pp + (n % page_size).to(tl.int64)[:, None] * stride_po + c[None, :]
        lat = tl.load(lat_ptrs, mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        m_i, l_i, acc = _attend_tile(lat, n, n_ok, q1r, q2r, m_i, l_i, acc, wk_ptr, stride_wk, row0, inv_freq, f,
                                     f_ok, c, c_ok, scale, HALF, DOT_DTYPE, PRECISION)

    # The block's own latents: the last tile (of the last split), at the block's RoPE positions.
    bmask = m_ok[:, None] & c_ok[None, :]
    if sp == n_splits - 1:
        blk = tl.load(blk_ptr + b * stride_bb + m[:, None] * stride_bk + c[None, :], mask=bmask, other=0.0)
        m_i, l_i, acc = _attend_tile(blk, qpos, m_ok & live, q1r, q2r, m_i, l_i, acc, wk_ptr, stride_wk, row0,
                                     inv_freq, f, f_ok, c, c_ok, scale, HALF, DOT_DTYPE, PRECISION)
        if STORE_BLOCK:
            if hd == 0:
                dpage = tl.load(page_ids_ptr + b * stride_place + m, mask=m_ok, other=-1)
                doff = tl.load(page_off_ptr + b * stride_place + m, mask=m_ok, other=0)
                dst = pool_ptr + tl.maximum(dpage, 0).to(tl.int64)[:, None] * stride_pp \
                    + doff.to(tl.int64)[:, None] * stride_po + c[None, :]
                tl.store(dst, blk.to(pool_ptr.dtype.element_ty), mask=bmask & (dpage >= 0)[:, None])
    if SPLIT:
        if (lo < hi) | (sp == n_splits - 1):
            # part[(b * heads + hd) * n_splits + sp] = (m [BLOCK_M], l [BLOCK_M], acc [BLOCK_M, BLOCK_C]), fp32.
            rec = part_ptr + ((b * tl.num_programs(1) + hd) * n_splits + sp) * (BLOCK_M * (BLOCK_C + 2))
            tl.store(rec + m, m_i)
            tl.store(rec + BLOCK_M + m, l_i)
            tl.store(rec + 2 * BLOCK_M + m[:, None] * BLOCK_C + c[None, :], acc)
    else:
        _finish(acc, l_i, wv_ptr, stride_wv, row0, out_ptr, b, hd, m, f, f_ok, c, c_ok, qmask, stride_ob, stride_ok,
                stride_oh, HALF, PRECISION)


@triton.jit
def _merge_split(rec, m, c, m_safe, l_i, acc, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """One split's state ``rec`` into the merged ``(l, acc)`` at the common max ``m_safe``."""
    w = tl.exp(tl.load(rec + m) - m_safe)  # a split whose rows saw no key (m = -inf) weighs 0
    l_i += w * tl.load(rec + BLOCK_M + m)
    acc += w[:, None] * tl.load(rec + 2 * BLOCK_M + m[:, None] * BLOCK_C + c[None, :])
    return l_i, acc


@triton.jit(do_not_specialize=["k_len", "n_splits", "max_ctx"])
def _latent_block_attention_combine_kernel(
    part_ptr, wv_ptr, out_ptr, ctx_lens_ptr, seq_lens_ptr, k_len, d_c, n_splits, max_ctx, stride_wv, stride_ob,
    stride_ok, stride_oh,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (B, heads): merge the states of the splits that hold context (``sp < used``) and of the last one (the
    block's) in split order, then ``W_uv``. The splits between hold nothing (the attention kernel wrote nothing
    there): skipping them skips terms that were exact zeros, so the bits are those of a merge over every split,
    at a short context's cost (a 64-token context at B = 1: 5 of 16 splits)."""
    b = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1)
    row0 = hd * (2 * HALF)
    m = tl.arange(0, BLOCK_M)
    f = tl.arange(0, BLOCK_HALF)
    f_ok = f < HALF
    c = tl.arange(0, BLOCK_C)
    c_ok = c < d_c
    qmask = (m < k_len)[:, None] & f_ok[None, :]
    _, n_ctx = _live_context(ctx_lens_ptr, seq_lens_ptr, b, max_ctx)
    used = tl.cdiv(n_ctx, tl.maximum(_split_len(n_ctx, n_splits, BLOCK_N), 1))
    rec_len = BLOCK_M * (BLOCK_C + 2)
    base = part_ptr + (b * tl.num_programs(1) + hd) * n_splits * rec_len
    # Every split's max in one load (the max is exact in any order).
    s = tl.arange(0, SPLITS)
    s_ok = ((s < used) | (s == n_splits - 1)) & (s < n_splits)
    m_s = tl.load(base + s[:, None] * rec_len + m[None, :], mask=s_ok[:, None], other=float("-inf"))
    m_all = tl.max(m_s, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for sp in range(0, used):
        l_i, acc = _merge_split(base + sp * rec_len, m, c, m_safe, l_i, acc, BLOCK_M, BLOCK_C)
    if used < n_splits:
        l_i, acc = _merge_split(base + (n_splits - 1) * rec_len, m, c, m_safe, l_i, acc, BLOCK_M, BLOCK_C)
    _finish(acc, l_i, wv_ptr, stride_wv, row0, out_ptr, b, hd, m, f, f_ok, c, c_ok, qmask, stride_ob, stride_ok,
            stride_oh, HALF, PRECISION)


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    key = (head_dim, float(theta), str(device))
    t = _INV_FREQ.get(key)
    if t is None:
        refuse_allocation_while_capturing("latent_block_attention (RoPE table; call once before capture)", device)
        t = _INV_FREQ[key] = rope_inv_freq(head_dim, theta, device)
    return t


def _check(q, block_latents, pool_layer, block_table, slot_ids, placement, k_up_weight, v_up_weight, out):
    check_tensor("q", q, dtype=FLOAT_DTYPES, unit_last_stride=True)
    if q.dim() != 4:
        raise ValueError(f"q: expected shape [B, K, h, D], got {list(q.shape)}")
    b, k, h, d = q.shape
    if d % 2:
        raise ValueError(f"q: head_dim must be even (rotate-half RoPE), got {d}")
    check_tensor("pool_layer", pool_layer, dtype=FLOAT_DTYPES, unit_last_stride=True)
    if pool_layer.dim() != 3:
        raise ValueError(f"pool_layer: expected shape [num_pages, page_size, d_c], got {list(pool_layer.shape)}")
    d_c = pool_layer.shape[2]
    check_tensor("block_latents", block_latents, shape=(b, k, d_c), dtype=pool_layer.dtype, unit_last_stride=True)
    check_tensor("block_table", block_table, shape=(None, None), dtype=torch.int32, unit_last_stride=True)
    check_tensor("slot_ids", slot_ids, shape=(b,), dtype=INT_DTYPES, contiguous=True)
    for name in ("positions", "page_ids", "page_offsets"):
        check_tensor(f"placement.{name}", getattr(placement, name), shape=(b, k), dtype=torch.int32, contiguous=True)
    for name in ("ctx_lens", "seq_lens"):
        check_tensor(f"placement.{name}", getattr(placement, name), shape=(b,), dtype=torch.int32, contiguous=True)
    for name, w in (("k_up_weight", k_up_weight), ("v_up_weight", v_up_weight)):
        check_tensor(name, w, shape=(h * d, d_c), dtype=pool_layer.dtype, unit_last_stride=True)
    if out is not None:
        check_tensor("out", out, shape=(b, k, h, d), dtype=q.dtype, unit_last_stride=True)
    check_devices(q.device, block_latents=block_latents, pool_layer=pool_layer, block_table=block_table,
                  slot_ids=slot_ids, positions=placement.positions, page_ids=placement.page_ids,
                  page_offsets=placement.page_offsets, ctx_lens=placement.ctx_lens, seq_lens=placement.seq_lens,
                  k_up_weight=k_up_weight, v_up_weight=v_up_weight, **({} if out is None else {"out": out}))
    if not triton_runs_on(q):
        raise ValueError(f"latent_block_attention: Triton cannot run on {q.device} (CUDA, or CPU with "
                         "TRITON_INTERPRET=1); use latent_block_attention_reference")


@dataclass(frozen=True)
class AttentionSchedule:
    """One row of the per-B schedule table of :func:`latent_block_attention` (``None``: the launcher's
    default). ``split_k``: context splits per (row, head) -- programs in all ``B * heads * split_k``, plus one
    combine launch when ``split_k > 1``."""

    max_batch: int | None  # inclusive upper bound of the batch sizes this row covers; None: every larger B
    block_n: int = 32
    num_warps: int | None = None
    num_stages: int | None = None
    split_k: int = 1
    max_latent: int | None = None  # inclusive upper bound of the latent widths d_c this row covers; None: any

    def __post_init__(self):
        check_int("AttentionSchedule.block_n", self.block_n, lo=16, hi=1025)
        if self.block_n & (self.block_n - 1):
            raise ValueError(f"AttentionSchedule.block_n: expected a power of two, got {self.block_n}")
        check_int("AttentionSchedule.split_k", self.split_k, lo=1, hi=257)
        if self.max_latent is not None:
            check_int("AttentionSchedule.max_latent", self.max_latent, lo=1)
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) is not None:
                check_int(f"AttentionSchedule.{name}", getattr(self, name), lo=1, hi=17)

    def describe(self) -> str:
        return (f"n{self.block_n}/w{self.num_warps or 'auto'}/s{self.num_stages or 'auto'}/k{self.split_k}")


# Per-(B, d_c) schedule: the first row whose max_batch >= B and max_latent >= d_c. Latent <= 256: the fastest
# per B of `trtllm-ext bench drafter --tables attention` on the H200 (2026-12-04, 8 heads x 64, K 7, context 512;
# docs/drafter_block_attention.md): B = 1 split 16 ways (19.9 us vs 72.7 unsplit), B <= 8 split 4 (35.4 vs 72.9),
# larger B unsplit (86.7 vs 87.1). Latent 512, the same sweep's second call: B = 1 split 16 at 8 warps (35.7 us vs
# 116-130 unsplit), B <= 8 split 4 at 4 warps (55.6 vs 70.8 at 8 warps), larger B unsplit at 4 warps (162.5 vs
# 226.1 at 8 warps at B = 32) -- faster although 4 warps spill 644-932 B there where 8 warps spill 112-136 B
# (sm_90, Triton 3.6.0).
ATTENTION_SCHEDULES: tuple[AttentionSchedule, ...] = (
    AttentionSchedule(1, block_n=16, num_warps=4, split_k=16, max_latent=256),
    AttentionSchedule(8, block_n=32, num_warps=4, split_k=4, max_latent=256),
    AttentionSchedule(None, block_n=32, num_warps=4, split_k=1, max_latent=256),
    AttentionSchedule(1, block_n=16, num_warps=8, split_k=16),
    AttentionSchedule(8, block_n=16, num_warps=4, split_k=4),
    AttentionSchedule(None, block_n=16, num_warps=4, split_k=1),
)


def attention_schedule(batch_size: int, schedules: tuple[AttentionSchedule, ...] | None = None,
                       latent_dim: int | None = None) -> AttentionSchedule:
    """The row of ``schedules`` (default :data:`ATTENTION_SCHEDULES`, read at call time) that covers
    ``batch_size`` and ``latent_dim`` (None: any row's latent bound); the last row covers everything else."""
    if schedules is None:
        schedules = ATTENTION_SCHEDULES
    for sch in schedules:
        if ((sch.max_batch is None or batch_size <= sch.max_batch) and
                (latent_dim is None or sch.max_latent is None or latent_dim <= sch.max_latent)):
            return sch
    return schedules[-1]


# Scratch cache of the split-K partials (fp32 ``[B * heads * split_k * BLOCK_M * (BLOCK_C + 2)]``), one per
# device, grown only outside capture. Outgrown buffers are kept for the graphs that captured them.
_PARTIALS: dict[str, torch.Tensor] = {}
_RETIRED_PARTIALS: list[torch.Tensor] = []


def _partials(device: torch.device, numel: int) -> torch.Tensor:
    cached = _PARTIALS.get(str(device))
    if cached is not None and cached.numel() >= numel:
        return cached
    refuse_allocation_while_capturing("latent_block_attention (split-K partials; run one eager call with the "
                                      "largest batch first)", device)
    if cached is not None:
        _RETIRED_PARTIALS.append(cached)
    buf = _PARTIALS[str(device)] = torch.empty(max(numel, 1 << 16), dtype=torch.float32, device=device)
    return buf


def latent_block_attention(
    q: torch.Tensor,
    block_latents: torch.Tensor,
    pool_layer: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    placement: DraftBlockPlacement,
    k_up_weight: torch.Tensor,
    v_up_weight: torch.Tensor,
    rope_theta: float,
    scale: float,
    *,
    store_block_latents: bool = True,
    out: torch.Tensor | None = None,
    schedule: AttentionSchedule | None = None,
) -> torch.Tensor:
    """Fused block attention over the paged single-latent context; see the module docstring.

    Args:
        q: ``[B, K, h, D]`` queries before RoPE (``h`` = this rank's heads; D even), unit last stride.
        block_latents: ``[B, K, d_c]`` the block's own latents, pool dtype.
        pool_layer: ``[num_pages, page_size, d_c]``, one drafter layer of the pool; the block latents are
            written in place at ``placement.page_ids / page_offsets`` where ``page_ids >= 0`` (when
            ``store_block_latents``), nothing else is written.
        block_table: ``[num_slots, max_pages]`` int32 physical page ids (negative entries read as page 0;
            they lie past ``ctx_len`` in practice).
        slot_ids: ``[B]`` int32/int64 rows of ``block_table``.
        placement: block positions (RoPE and query positions) ``[B, K]``, pages/offsets ``[B, K]``,
            ``ctx_lens`` ``[B]`` (context positions attended, capped at ``max_pages * page_size``),
            ``seq_lens`` ``[B]`` (0 = dummy row: output zeros), all int32.
        k_up_weight, v_up_weight: ``[h * D, d_c]`` per-head up-projections, pool dtype.
        rope_theta, scale: RoPE base; softmax scale.
        out: optional ``[B, K, h, D]`` output in ``q``'s dtype (required inside a CUDA-graph capture).
        schedule: tile width, warps, stages and context split (default: the row of
            :data:`ATTENTION_SCHEDULES` for B and d_c). Results depend on it only by rounding (the online softmax
            sums in tile and split order); the block-latent store never does.

    Returns ``out``. One launch (two with ``split_k > 1``: the splits, then their combine). CUDA-graph safe
    with ``out=`` once warmed up at the largest B (the RoPE table and the split-K partials are cached).
    """
    _check(q, block_latents, pool_layer, block_table, slot_ids, placement, k_up_weight, v_up_weight, out)
    b, k, h, d = q.shape
    if schedule is None:
        schedule = attention_schedule(b, latent_dim=pool_layer.shape[2])
    elif not isinstance(schedule, AttentionSchedule):
        raise ValueError(f"schedule: expected an AttentionSchedule, got {type(schedule).__name__}")
    block_n = schedule.block_n
    num_pages, page_size, d_c = pool_layer.shape
    inv_freq = _inv_freq(d, rope_theta, q.device)
    if out is None:
        refuse_allocation_while_capturing("latent_block_attention", q.device)
        out = torch.empty_like(q)
    if b == 0:
        return out
    block_c = max(16, triton.next_power_of_2(d_c))
    block_m = max(16, triton.next_power_of_2(k))
    interpret = not q.is_cuda
    # The interpreter's tl.dot is wrong on bf16 (it multiplies the raw bits): upcast there. On the GPU the
    # key up-projection takes the model dtype (exact products, fp32 accumulate) and fp32-operand products
    # run in TF32 for 16-bit models, IEEE for fp32 ones.
    fp32_model = pool_layer.dtype == torch.float32
    dot_dtype = tl.float32 if (interpret or fp32_model) else (tl.bfloat16 if pool_layer.dtype == torch.bfloat16
                                                               else tl.float16)
    precision = "ieee" if fp32_model else "tf32"
    num_warps = schedule.num_warps or num_warps_for(block_n * block_c, elements_per_warp=2048, min_warps=4)
    launch = {"num_warps": num_warps}
    if schedule.num_stages is not None:
        launch["num_stages"] = schedule.num_stages
    # The split count is a shape (capped at the table span's tiles); each row's split boundaries are set on the
    # device from its live context.
    max_ctx = block_table.shape[1] * page_size
    tiles = max(1, triton.cdiv(max_ctx, block_n))
    splits = max(1, min(schedule.split_k, tiles))
    part = _partials(q.device, b * h * splits * block_m * (block_c + 2)) if splits > 1 else out
    _latent_block_attention_kernel[(b, h, splits)](
        q, block_latents, pool_layer, block_table, slot_ids, placement.ctx_lens, placement.seq_lens,
        placement.positions, placement.page_ids, placement.page_offsets, k_up_weight, v_up_weight, inv_freq, out,
        part, k, d_c, page_size, block_table.shape[1], float(scale), splits,
        q.stride(0), q.stride(1), q.stride(2), block_latents.stride(0), block_latents.stride(1),
        pool_layer.stride(0), pool_layer.stride(1), block_table.stride(0),
        k_up_weight.stride(0), v_up_weight.stride(0), out.stride(0), out.stride(1), out.stride(2),
        placement.positions.stride(0),
        HALF=d // 2, BLOCK_HALF=max(16, triton.next_power_of_2(d // 2)), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_C=block_c, STORE_BLOCK=store_block_latents, DOT_DTYPE=dot_dtype, PRECISION=precision,
        SPLIT=splits > 1, **launch,
    )
    if splits > 1:
        _latent_block_attention_combine_kernel[(b, h)](
            part, v_up_weight, out, placement.ctx_lens, placement.seq_lens, k, d_c, splits, max_ctx,
            v_up_weight.stride(0), out.stride(0), out.stride(1), out.stride(2), HALF=d // 2,
            BLOCK_HALF=max(16, triton.next_power_of_2(d // 2)), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_C=block_c,
            SPLITS=triton.next_power_of_2(splits), PRECISION=precision, num_warps=4,
        )
    return out


# -- the eager twin (the drafter's original path) ---------------------------------------------------------------
def write_block_latents(pool_layer: torch.Tensor, placement: DraftBlockPlacement, latents: torch.Tensor) -> None:
    """Store the block's own latents at the placement: ``pool_layer[page_ids, page_offsets] = latents``.

    Args:
        pool_layer: ``[num_pages, page_size, d_c]``, one drafter layer of the pool (written in place).
        placement: ``page_ids`` / ``page_offsets`` ``[B, K]`` int32; ``page_ids < 0`` (unallocated page,
            dummy row) means "do not store".
        latents: ``[B, K, d_c]`` (cast to the pool dtype).

    Writes exactly the destinations with ``page_ids >= 0``, nothing else. CUDA-graph safe: no mask
    compaction; skipped entries are redirected to the first stored entry's destination with that
    entry's value (identical bits, so the duplicate index is harmless), or, when nothing is stored,
    to slot ``[0, 0]`` with its own current value.
    """
    num_pages, page_size, d_c = pool_layer.shape
    flat = pool_layer.view(num_pages * page_size, d_c)
    valid = (placement.page_ids >= 0).reshape(-1)
    dest = (placement.page_ids.long().clamp_min(0) * page_size + placement.page_offsets.long()).reshape(-1)
    vals = latents.reshape(-1, d_c).to(pool_layer.dtype)
    # index_select with a [1] index, never tensor[0-dim tensor] (that converts to a Python int: a host
    # sync, which fails under CUDA-graph capture).
    first = torch.argmax(valid.to(torch.int32)).view(1)  # first stored entry (0 if none)
    any_valid = valid.index_select(0, first)  # [1]
    sink_idx = torch.where(any_valid, dest.index_select(0, first), torch.zeros_like(first))  # [1]
    sink_val = torch.where(any_valid.unsqueeze(1), vals.index_select(0, first), flat[:1])  # [1, d_c]
    idx = torch.where(valid, dest, sink_idx)
    flat[idx] = torch.where(valid.unsqueeze(1), vals, sink_val)


def gather_context_latents(pool_layer: torch.Tensor, block_table: torch.Tensor, slot_ids: torch.Tensor,
                           ctx_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather every request's context latents through the block table.

    Returns ``latents [B, P, d_c]`` (``P = max_pages * page_size``; position ``p`` of request ``b`` is
    ``pool[block_table[slot, p // page_size], p % page_size]``) and ``valid [B, P]`` (``p < ctx_len``).
    Unallocated (negative) table entries are read as page 0 and masked out.
    """
    page_size = pool_layer.shape[1]
    table = block_table[slot_ids.long()].long().clamp_min(0)  # [B, max_pages]
    b, max_pages = table.shape
    pos = torch.arange(max_pages * page_size, device=pool_layer.device)
    pages = table[:, pos // page_size]  # [B, P]
    latents = pool_layer[pages, (pos % page_size).expand(b, -1)]  # [B, P, d_c]
    valid = pos.unsqueeze(0) < ctx_lens.long().unsqueeze(1)
    return latents, valid


def masked_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """``q [B, K, h, D]``, ``k/v [B, S, h, D]``, ``valid [B, S]`` bool -> ``[B, K, h, D]`` fp32.

    Softmax in fp32 over the valid keys only; a row with no valid key returns zeros (never NaN).
    """
    scores = torch.einsum("bkhd,bshd->bhks", q.float(), k.float()) * scale
    mask = valid[:, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max) * mask
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("bhks,bshd->bkhd", p, v.float())


def single_latent_block_attention(q: torch.Tensor, block_latents: torch.Tensor, ctx_latents: torch.Tensor,
                                  ctx_valid: torch.Tensor, placement: DraftBlockPlacement, k_up_weight: torch.Tensor,
                                  v_up_weight: torch.Tensor, rope_theta: float, scale: float) -> torch.Tensor:
    """Attention of the block's queries over gathered context + block latents (eager).

    Args:
        q: ``[B, K, h, D]`` queries before RoPE (``h`` = this rank's heads).
        block_latents: ``[B, K, d_c]``, the block's latents (as stored at the placement).
        ctx_latents, ctx_valid: from :func:`gather_context_latents`, ``[B, P, d_c]`` / ``[B, P]``.
        placement: RoPE positions of the block (``positions``) and ``seq_lens`` (0 = dummy row).
        k_up_weight, v_up_weight: ``[h * D, d_c]`` per-head up-projections of this rank's heads.

    Returns ``[B, K, h, D]`` in ``q``'s dtype. Context keys take RoPE at their position index.
    """
    b, kk, h, d = q.shape
    p = ctx_latents.shape[1]
    ctx_pos = torch.arange(p, device=q.device).expand(b, p)
    lat = torch.cat((ctx_latents.to(q.dtype), block_latents.to(q.dtype)), dim=1)  # [B, P+K, d_c]
    pos = torch.cat((ctx_pos, placement.positions.long()), dim=1)  # [B, P+K]
    keys = torch.nn.functional.linear(lat, k_up_weight).view(b, p + kk, h, d)
    vals = torch.nn.functional.linear(lat, v_up_weight).view(b, p + kk, h, d)
    cos, sin = rope_cos_sin(pos, d, rope_theta)
    keys = apply_rope(keys, cos, sin)
    qcos, qsin = rope_cos_sin(placement.positions, d, rope_theta)
    qr = apply_rope(q, qcos, qsin)
    live = (placement.seq_lens > 0).unsqueeze(1)  # [B, 1]: a dummy row sees nothing
    valid = torch.cat((ctx_valid & live, live.expand(b, kk)), dim=1)
    return masked_softmax_attention(qr, keys, vals, valid, scale).to(q.dtype)


def latent_block_attention_reference(
    q: torch.Tensor,
    block_latents: torch.Tensor,
    pool_layer: torch.Tensor,
    block_table: torch.Tensor,
    slot_ids: torch.Tensor,
    placement: DraftBlockPlacement,
    k_up_weight: torch.Tensor,
    v_up_weight: torch.Tensor,
    rope_theta: float,
    scale: float,
    *,
    store_block_latents: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager twin of :func:`latent_block_attention` (same arguments, same writes): store the block latents,
    gather the whole table span, up-project every gathered latent, masked fp32 softmax. Any device;
    capturable (its allocations land in the graph's pool); context capped at ``max_pages * page_size``."""
    if store_block_latents:
        write_block_latents(pool_layer, placement, block_latents)
    ctx, valid = gather_context_latents(pool_layer, block_table, slot_ids, placement.ctx_lens)
    o = single_latent_block_attention(q, block_latents, ctx, valid, placement, k_up_weight, v_up_weight, rope_theta,
                                      scale)
    if out is None:
        return o
    out.copy_(o)
    return out
