"""The attention block's entry in one launch: RMSNorm, the QKV product, q / k norms, RoPE and the paged K/V store.

For the few rows of a decode / verify step this replaces three launches (input norm, QKV GEMM, RoPE + KV
write; five with Qwen3's q / k norms) with one. One program per (head of the fused ``[q | k | v]`` output, column
chunk, ``BLOCK_M`` rows): it computes the same columns of the head's two halves (``i`` and ``D/2 + i``) as two
accumulators over ``K`` -- so the rotate-half pairs meet in registers -- with the input rows normalized in the
prologue (:func:`~tensorrt_llm_ext.kernels.fused_linear._row_rstd`, the numerics of
:mod:`~tensorrt_llm_ext.kernels.rms_norm`), then:

* adds the bias and rounds to the model dtype (the bits a QKV GEMM would hand on);
* q / k heads with ``qk_norm``: the per-head RMSNorm over ``D`` (Qwen3), rounded as the norm kernel rounds;
* q / k heads: NeoX RoPE in fp32 from fp32 ``cos`` / ``sin`` (the numerics of
  :mod:`~tensorrt_llm_ext.kernels.paged_kv_write`);
* q heads stored to ``q_out [M, H, D]``; k / v heads stored at ``pool[page_table[slot, pos // page_size],
  pos % page_size]`` (the scratch page, the pool's last, past the table).

Each output row depends on its own input row only (the rows of a tile never mix), as in
:mod:`~tensorrt_llm_ext.kernels.fused_linear`. The eager twin (:func:`fused_qkv_rope_reference`) composes
``rms_norm_reference``, ``F.linear``, the q / k norms and ``paged_kv_write_reference``; agreement is that of
its parts (fp32 to ``1e-5``; 16-bit within a unit or two in the last place of the stored values).

Programmatic dependent launch as in :mod:`~tensorrt_llm_ext.kernels.fused_linear`: before ``gdc_wait()`` the weight
rows brought to L2 (the few-row form's first K block, and the dot tiles' with ``DOT_PEEL_FIRST_BLOCK``, into
registers), and (``EARLY_EPILOGUE``) positions,
cos / sin, slots and each k / v row's page too -- step inputs that no launch of the forward writes (cos / sin come
from torch ops before the embedding; the attention kernel reads positions and slots before its wait on the same
ground) -- so that after the wait only ``x``'s round trip and the pipelined loop's remain; the norm prologue
unrolled as there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import INT_DTYPES, check_tensor, programmatic_launch
from tensorrt_llm_ext.kernels import fused_linear as _fl
from tensorrt_llm_ext.kernels.fused_linear import (GEMV_MAX_ROWS, GEMV_MAX_TILE, WEIGHT_PREFETCH, _prefetch_rows_l2,
                                                   _products, _row_rstd, dot_block_m, dot_k_split, dot_settings,
                                                   norm_unroll, prefetch_lines, stage_block_k)
from tensorrt_llm_ext.kernels.paged_kv_write import paged_kv_write_reference
from tensorrt_llm_ext.kernels.rms_norm import rms_norm_reference

__all__ = ["fused_qkv_rope", "fused_qkv_rope_reference", "qkv_chunks", "qkv_settings"]

# The early step inputs (cos / sin tiles, pages) are held across the product: only for tiles of at most this many
# elements (BLOCK_M x BLOCK_HALF; SmolLM2's 16 x 16 decode tile holds 2 registers each). A 64 x 64 tile would hold
# 32 more registers through the loop (the Qwen3-like 8B shape's q / k-norm tiles spilled 28-56 B with them, sm_90).
EARLY_MAX_TILE = 1024


@triton.jit
def _head_norm(y1, y2, w_ptr, i, i_ok, head_dim, eps):
    """Per-row RMSNorm over one head's two halves (fp32 in, the model dtype's two roundings, fp32 out)."""
    dt = w_ptr.dtype.element_ty
    rstd = tl.math.rsqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / head_dim + eps)
    w1 = tl.load(w_ptr + i, mask=i_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + head_dim // 2 + i, mask=i_ok, other=0.0).to(tl.float32)
    n1 = (y1 * rstd[:, None]).to(dt).to(tl.float32)
    n2 = (y2 * rstd[:, None]).to(dt).to(tl.float32)
    return (n1 * w1[None, :]).to(dt).to(tl.float32), (n2 * w2[None, :]).to(dt).to(tl.float32)


@triton.jit
def _rope_and_page(cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr, rows, row_ok, i, mask, head, num_heads,
                   num_kv_heads, t_len, stride_pb, stride_cm, stride_tab, max_pages, page_size, scratch_page):
    """The epilogue's step inputs of a program's rows: ``cos`` / ``sin`` (q / k heads, else zeros), and for k / v
    heads the page and the offset in it that each row's position is stored at (the scratch page past the table)."""
    b = rows // t_len
    pos = tl.load(pos_ptr + b * stride_pb + rows % t_len, mask=row_ok, other=0).to(tl.int64)
    rotate = head < num_heads + num_kv_heads
    cos = tl.load(cos_ptr + rows[:, None] * stride_cm + i[None, :], mask=mask & rotate, other=0.0)
    sin = tl.load(sin_ptr + rows[:, None] * stride_cm + i[None, :], mask=mask & rotate, other=0.0)
    kv_row = row_ok & (head >= num_heads)
    slot = tl.load(slot_ptr + b, mask=kv_row, other=0).to(tl.int64)
    pidx = pos // page_size
    page = tl.load(table_ptr + slot * stride_tab + tl.minimum(pidx, max_pages - 1), mask=kv_row,
                   other=scratch_page).to(tl.int64)
    page = tl.where(pidx < max_pages, page, scratch_page)
    return cos, sin, page, pos % page_size


@triton.jit
def _fused_qkv_rope_kernel(
    x_ptr, w_ptr, bias_ptr, norm_w_ptr, qn_w_ptr, kn_w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr,
    k_pool_ptr, v_pool_ptr, q_out_ptr,
    m, k, t_len, num_heads, num_kv_heads, chunks, max_pages, page_size, scratch_page, eps, qk_eps,
    stride_xm, stride_wn, stride_cm, stride_pb, stride_tab, stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh, stride_om, stride_oh,
    HALF: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, GEMV: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, WEIGHT_LINE: tl.constexpr, K_UNROLL: tl.constexpr, EARLY: tl.constexpr,
    PEEL: tl.constexpr, KSPLIT: tl.constexpr,
):
    head = tl.program_id(0) // chunks  # 0 .. H-1: q heads, then KVH k heads, then KVH v heads
    chunk = tl.program_id(0) % chunks  # which BLOCK_HALF columns of each half (a whole head with q / k norms)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    rows = rows.to(tl.int64)
    i = chunk * BLOCK_HALF + tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    c1 = head * (2 * HALF) + i  # the head's first-half output columns; the second half is HALF further
    w1_rows = c1.to(tl.int64) * stride_wn
    w2_rows = (c1 + HALF).to(tl.int64) * stride_wn
    mask = row_ok[:, None] & i_ok[None, :]
    if EARLY:  # step inputs no kernel of the step writes: read before the wait, off the chain after it
        cos, sin, page, off = _rope_and_page(cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr, rows, row_ok, i, mask,
                                             head, num_heads, num_kv_heads, t_len, stride_pb, stride_cm, stride_tab,
                                             max_pages, page_size, scratch_page)
    k_begin = 0
    w1_first = 0  # the first K block's weights (PEEL), else unused
    w2_first = 0
    if PDL:
        # Programmatic dependent launch: the first K block of the weights streams in while the previous kernel
        # finishes (PEEL: into registers, as fused_linear's); x (and, unless EARLY, the step inputs) after the wait.
        if PEEL:
            kk0 = tl.arange(0, BLOCK_K)
            w_mask0 = (kk0 < k)[:, None] & i_ok[None, :]
            w1_first = tl.load(w_ptr + w1_rows[None, :] + kk0[:, None], mask=w_mask0, other=0.0)
            w2_first = tl.load(w_ptr + w2_rows[None, :] + kk0[:, None], mask=w_mask0, other=0.0)
            k_begin = BLOCK_K
        if PREFETCH_LINES > 0:  # the rest of both halves' weight rows to L2 (read by the loop after the wait)
            _prefetch_rows_l2(w_ptr, w1_rows, i_ok, k_begin, k, WEIGHT_LINE, PREFETCH_LINES)
            _prefetch_rows_l2(w_ptr, w2_rows, i_ok, k_begin, k, WEIGHT_LINE, PREFETCH_LINES)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        rstd = _row_rstd(x_ptr, rows, row_ok, stride_xm, k, eps, BLOCK_M, BLOCK_K, K_UNROLL)
    else:
        rstd = tl.full([BLOCK_M], 1.0, tl.float32)  # unused
    acc1, acc2 = _products(x_ptr, rows, row_ok, stride_xm, k, rstd, norm_w_ptr, w_ptr, w1_rows, w_ptr, w2_rows, i_ok,
                           w1_first, w2_first, k_begin, True, True, NORM, GEMV, DOT_DTYPE, PRECISION, PEEL, KSPLIT,
                           BLOCK_M, BLOCK_HALF, BLOCK_K)
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + c1, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + c1 + HALF, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    dt = q_out_ptr.dtype.element_ty
    y1 = acc1.to(dt).to(tl.float32)
    y2 = acc2.to(dt).to(tl.float32)
    if not EARLY:
        cos, sin, page, off = _rope_and_page(cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr, rows, row_ok, i, mask,
                                             head, num_heads, num_kv_heads, t_len, stride_pb, stride_cm, stride_tab,
                                             max_pages, page_size, scratch_page)
    if head < num_heads + num_kv_heads:  # q or k: (norm and) rotate
        if QK_NORM:
            if head < num_heads:
                y1, y2 = _head_norm(y1, y2, qn_w_ptr, i, i_ok, 2 * HALF, qk_eps)
            else:
                y1, y2 = _head_norm(y1, y2, kn_w_ptr, i, i_ok, 2 * HALF, qk_eps)
        r1 = y1 * cos - y2 * sin
        r2 = y2 * cos + y1 * sin
        y1, y2 = r1, r2
    if head < num_heads:
        qo = q_out_ptr + rows[:, None] * stride_om + head * stride_oh + i[None, :]
        tl.store(qo, y1.to(dt), mask=mask)
        tl.store(qo + HALF, y2.to(dt), mask=mask)
    else:
        if head < num_heads + num_kv_heads:
            dst = k_pool_ptr + page * stride_kp + off * stride_kt + (head - num_heads) * stride_kh
        else:
            dst = v_pool_ptr + page * stride_vp + off * stride_vt + (head - num_heads - num_kv_heads) * stride_vh
        tl.store(dst[:, None] + i[None, :], y1.to(dt), mask=mask)  # the pools hold the model dtype
        tl.store(dst[:, None] + HALF + i[None, :], y2.to(dt), mask=mask)


def qkv_chunks(heads: int, half: int, whole_heads: bool, sms: int = 132, gemv: bool = False) -> tuple[int, int]:
    """``(BLOCK_HALF, chunks)``: each head's halves cut into ``chunks`` column blocks of ``BLOCK_HALF`` (>= 16, the
    dot's minimum; >= 2 in the few-row form, ``gemv``), halved while there are fewer than two programs per SM (an
    8B layer's 48 heads of 128 would stream 50 MB through 48 programs; SmolLM2's 15 heads of 64, 30 programs at
    16). ``whole_heads`` (per-head q / k norms): one chunk, the whole head."""
    block = max(16, triton.next_power_of_2(half))
    if not whole_heads:
        while block > (2 if gemv else 16) and heads * triton.cdiv(half, block) < 2 * sms:
            block //= 2
    return block, triton.cdiv(half, block)


def qkv_settings(m: int, heads: int, half: int, k: int, whole_heads: bool, elem_bytes: int = 2,
                 sms: int = 132) -> tuple[int, int, int, int, bool]:
    """``(BLOCK_M, BLOCK_HALF, chunks, BLOCK_K, gemv)``: the few-row form (``m <= GEMV_MAX_ROWS``) takes a
    ``BLOCK_K`` covering ``K`` where the two ``[BLOCK_M, BLOCK_HALF, BLOCK_K]`` products fit ``GEMV_MAX_TILE``;
    larger steps the 16-row dot tiles. Shape-only."""
    gemv = m <= GEMV_MAX_ROWS
    block_m = triton.next_power_of_2(max(1, m)) if gemv else dot_block_m(m)
    block_half, chunks = qkv_chunks(heads, half, whole_heads, sms, gemv)
    if gemv:
        block_k = min(triton.next_power_of_2(k), 2048)
        while block_k > 16 and 2 * block_m * block_half * block_k > GEMV_MAX_TILE:
            block_k //= 2
    else:
        block_k = stage_block_k(k, block_m, 2 * block_half, elem_bytes)
    return block_m, block_half, chunks, block_k, gemv


def _check(x, qkv_weight, qkv_bias, norm_weight, q_norm_weight, k_norm_weight, cos, sin, positions, slot_ids,
           page_table, k_pool, v_pool, num_heads):
    check_tensor("fused_qkv_rope x [B, T, K]", x, shape=(None, None, None), contiguous=True,
                 dtype=(torch.bfloat16, torch.float16, torch.float32))
    b, t, k = x.shape
    kvh, d = (k_pool.shape[2], k_pool.shape[3]) if k_pool.dim() == 4 else (None, None)
    check_tensor("fused_qkv_rope k_pool [pages + 1, page_size, KVH, D]", k_pool, shape=(None, None, None, None),
                 contiguous=True, dtype=x.dtype, device=x.device)
    check_tensor("fused_qkv_rope v_pool", v_pool, shape=tuple(k_pool.shape), contiguous=True, dtype=x.dtype,
                 device=x.device)
    check_tensor("fused_qkv_rope qkv_weight [(H + 2 KVH) * D, K]", qkv_weight, shape=((num_heads + 2 * kvh) * d, k),
                 unit_last_stride=True, dtype=x.dtype, device=x.device)
    if d % 2:
        raise ValueError(f"fused_qkv_rope: head_dim must be even (RoPE), got {d}")
    if qkv_bias is not None:
        check_tensor("fused_qkv_rope qkv_bias", qkv_bias, shape=(qkv_weight.shape[0],), contiguous=True,
                     dtype=x.dtype, device=x.device)
    if norm_weight is not None:
        check_tensor("fused_qkv_rope norm_weight [K]", norm_weight, shape=(k,), contiguous=True, dtype=x.dtype,
                     device=x.device)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("fused_qkv_rope: q_norm_weight and k_norm_weight go together")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(f"fused_qkv_rope {name} [D]", w, shape=(d,), contiguous=True, dtype=x.dtype, device=x.device)
    check_tensor("fused_qkv_rope cos [B, T, D/2]", cos, shape=(b, t, d // 2), dtype=torch.float32, contiguous=True)
    check_tensor("fused_qkv_rope sin [B, T, D/2]", sin, shape=(b, t, d // 2), dtype=torch.float32, contiguous=True)
    check_tensor("fused_qkv_rope positions [B, T]", positions, shape=(b, t), dtype=INT_DTYPES, unit_last_stride=True)
    check_tensor("fused_qkv_rope slot_ids [B]", slot_ids, shape=(b,), dtype=INT_DTYPES, contiguous=True)
    check_tensor("fused_qkv_rope page_table [slots, max_pages]", page_table, shape=(None, None), dtype=torch.int32,
                 unit_last_stride=True)
    if num_heads % kvh:
        raise ValueError(f"fused_qkv_rope: num_heads={num_heads} must be a multiple of kv_heads={kvh}")
    return b, t, k, kvh, d


def fused_qkv_rope(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                   norm_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slot_ids: torch.Tensor, page_table: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor, num_heads: int, q_norm_weight: torch.Tensor | None = None,
                   k_norm_weight: torch.Tensor | None = None, qk_eps: float = 1e-6,
                   q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Norm, QKV product, (q / k norms,) RoPE, K/V store: returns the rotated ``q [B, T, H, D]``.

    Args:
        x: ``[B, T, K]`` the layer's input (the residual stream when ``norm_weight`` is given), contiguous.
        qkv_weight: ``[(H + 2 KVH) * D, K]`` the q rows, the k rows, the v rows; qkv_bias: ``[(H + 2 KVH) * D]``.
        norm_weight: ``[K]`` input RMSNorm weight (None: ``x`` is already normalized); eps: its epsilon.
        cos, sin: ``[B, T, D/2]`` fp32; positions: ``[B, T]`` int; slot_ids: ``[B]`` int;
        page_table: ``[num_slots, max_pages]`` int32.
        k_pool, v_pool: ``[num_pages + 1, page_size, KVH, D]`` one layer's pools, written in place.
        q_norm_weight, k_norm_weight: ``[D]`` per-head norms (Qwen3), both or neither; qk_eps: their epsilon.
        q_out: optional ``[B, T, H, D]`` of ``x``'s dtype.

    CUDA-graph safe (allocates only ``q_out``, from the capture's pool).
    """
    b, t, k, kvh, d = _check(x, qkv_weight, qkv_bias, norm_weight, q_norm_weight, k_norm_weight, cos, sin,
                             positions, slot_ids, page_table, k_pool, v_pool, num_heads)
    if q_out is None:
        q_out = torch.empty(b, t, num_heads, d, dtype=x.dtype, device=x.device)
    check_tensor("fused_qkv_rope q_out", q_out, shape=(b, t, num_heads, d), dtype=x.dtype, device=x.device,
                 contiguous=True)
    m = b * t
    if m == 0:
        return q_out
    half = d // 2
    block_m, block_half, chunks, block_k, gemv = qkv_settings(m, num_heads + 2 * kvh, half, k,
                                                              q_norm_weight is not None, x.element_size())
    dot_dtype, precision = dot_settings(x, qkv_weight)
    pdl = programmatic_launch(x)
    ksplit = 1 if gemv else dot_k_split(block_m, block_k, 2 * block_half)
    peel = pdl and (gemv or (_fl.DOT_PEEL_FIRST_BLOCK and ksplit == 1))
    dummy = qkv_weight
    _fused_qkv_rope_kernel[((num_heads + 2 * kvh) * chunks, triton.cdiv(m, block_m))](
        x, qkv_weight, qkv_bias if qkv_bias is not None else dummy, norm_weight if norm_weight is not None else dummy,
        q_norm_weight if q_norm_weight is not None else dummy, k_norm_weight if k_norm_weight is not None else dummy,
        cos, sin, positions, slot_ids, page_table, k_pool, v_pool, q_out,
        m, k, t, num_heads, kvh, chunks, page_table.shape[1], k_pool.shape[1], k_pool.shape[0] - 1, float(eps),
        float(qk_eps),
        k, qkv_weight.stride(0), half, positions.stride(0), page_table.stride(0),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        num_heads * d, d,
        HALF=half, NORM=norm_weight is not None, HAS_BIAS=qkv_bias is not None, QK_NORM=q_norm_weight is not None,
        BLOCK_M=block_m, BLOCK_HALF=block_half, BLOCK_K=block_k,
        DOT_DTYPE=dot_dtype, PRECISION=precision, GEMV=gemv, PDL=pdl,
        PEEL=peel, KSPLIT=ksplit,
        PREFETCH_LINES=prefetch_lines(k, block_k if peel else 0, qkv_weight.element_size(), pdl and WEIGHT_PREFETCH),
        WEIGHT_LINE=128 // qkv_weight.element_size(),
        K_UNROLL=norm_unroll(k, block_k) if norm_weight is not None else 0,
        EARLY=_fl.EARLY_EPILOGUE and block_m * block_half <= EARLY_MAX_TILE,
        num_warps=8 if block_m >= 64 or gemv else 4, num_stages=_fl.DOT_STAGES, launch_pdl=pdl,
    )
    return q_out


def fused_qkv_rope_reference(x, qkv_weight, qkv_bias, norm_weight, eps, cos, sin, positions, slot_ids, page_table,
                             k_pool, v_pool, num_heads, q_norm_weight=None, k_norm_weight=None, qk_eps=1e-6):
    """Eager twin of :func:`fused_qkv_rope` (writes the pools in place; returns ``q`` in ``x``'s dtype)."""
    b, t, k, kvh, d = _check(x, qkv_weight, qkv_bias, norm_weight, q_norm_weight, k_norm_weight, cos, sin,
                             positions, slot_ids, page_table, k_pool, v_pool, num_heads)
    h = x
    if norm_weight is not None:
        h, _ = rms_norm_reference(x.reshape(b * t, k), norm_weight, eps)
    qkv = F.linear(h.reshape(b, t, k), qkv_weight, qkv_bias)
    q = qkv[..., :num_heads * d].reshape(b, t, num_heads, d)
    kk = qkv[..., num_heads * d:(num_heads + kvh) * d].reshape(b, t, kvh, d)
    v = qkv[..., (num_heads + kvh) * d:].reshape(b, t, kvh, d)
    if q_norm_weight is not None:
        q = rms_norm_reference(q.reshape(-1, d), q_norm_weight, qk_eps)[0].view(b, t, num_heads, d)
        kk = rms_norm_reference(kk.reshape(-1, d), k_norm_weight, qk_eps)[0].view(b, t, kvh, d)
    q = paged_kv_write_reference(q, kk, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool)
    return q.to(x.dtype)
