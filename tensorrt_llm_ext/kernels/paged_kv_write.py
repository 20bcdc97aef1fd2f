"""RoPE of q and k plus the store of k and v into the target's paged cache: one launch per layer.

Per token (one program): ``q`` and ``k`` rotated (rotate-half / NeoX, fp32 arithmetic on the model-dtype
inputs with fp32 ``cos`` / ``sin``), the rotated ``q`` stored in the model dtype for
:func:`~tensorrt_llm_ext.kernels.paged_attention.paged_attention`, ``k`` and ``v`` stored at
``pool[page_table[slot, pos // page_size], pos % page_size]``; a position past the table (``pos // page_size
>= max_pages``) goes to the scratch page (the last one). Replaces the eager rotation's dozen elementwise
launches and the two index-put scatters.

Bytes: each q / k / v element read once and written once; at B = 1 it is a latency-bound launch of ``B * T``
programs. The eager twin (:func:`paged_kv_write_reference`) rotates with the same fp32 formula; the kernel's
products may be fused (FMA) on the GPU, so the two agree to fp32 rounding before the cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import INT_DTYPES, check_tensor
from tensorrt_llm_ext.kernels.rope import apply_rope

__all__ = ["paged_kv_write", "paged_kv_write_reference", "page_slots"]


@triton.jit
def _rope_rows(x_ptr, cos, sin, rows, rows_ok, i, i_ok, HALF: tl.constexpr, stride_h):
    mask = rows_ok[:, None] & i_ok[None, :]
    x1 = tl.load(x_ptr + rows[:, None] * stride_h + i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + rows[:, None] * stride_h + HALF + i[None, :], mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _paged_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, table_ptr, k_pool_ptr, v_pool_ptr, q_out_ptr,
    t_len, num_heads, num_kv_heads, max_pages, page_size, scratch_page,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cn, stride_pb, stride_tab,
    stride_kp, stride_kt, stride_kvh, stride_vp, stride_vt, stride_vvh, stride_on, stride_oh,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)  # token row b * T + t
    b = n // t_len
    t = n % t_len
    pos = tl.load(pos_ptr + b * stride_pb + t).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pidx = pos // page_size
    page = tl.load(table_ptr + slot * stride_tab + tl.minimum(pidx, max_pages - 1)).to(tl.int64)
    page = tl.where(pidx < max_pages, page, scratch_page)
    off = pos % page_size
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_ptr + n * stride_cn + i, mask=i_ok, other=0.0)
    sin = tl.load(sin_ptr + n * stride_cn + i, mask=i_ok, other=0.0)
    hq = tl.arange(0, BLOCK_H)
    hq_ok = hq < num_heads
    q1, q2 = _rope_rows(q_ptr + n * stride_qn, cos, sin, hq, hq_ok, i, i_ok, HALF, stride_qh)
    qo = q_out_ptr + n * stride_on + hq[:, None] * stride_oh + i[None, :]
    qmask = hq_ok[:, None] & i_ok[None, :]
    tl.store(qo, q1.to(q_out_ptr.dtype.element_ty), mask=qmask)
    tl.store(qo + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=qmask)
    hk = tl.arange(0, BLOCK_KVH)
    hk_ok = hk < num_kv_heads
    kmask = hk_ok[:, None] & i_ok[None, :]
    k1, k2 = _rope_rows(k_ptr + n * stride_kn, cos, sin, hk, hk_ok, i, i_ok, HALF, stride_kh)
    ko = k_pool_ptr + page * stride_kp + off * stride_kt + hk[:, None] * stride_kvh + i[None, :]
    tl.store(ko, k1.to(k_pool_ptr.dtype.element_ty), mask=kmask)
    tl.store(ko + HALF, k2.to(k_pool_ptr.dtype.element_ty), mask=kmask)
    vin = v_ptr + n * stride_vn + hk[:, None] * stride_vh + i[None, :]
    vo = v_pool_ptr + page * stride_vp + off * stride_vt + hk[:, None] * stride_vvh + i[None, :]
    tl.store(vo, tl.load(vin, mask=kmask, other=0.0).to(v_pool_ptr.dtype.element_ty), mask=kmask)
    tl.store(vo + HALF, tl.load(vin + HALF, mask=kmask, other=0.0).to(v_pool_ptr.dtype.element_ty), mask=kmask)


def _check(q, k, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool):
    check_tensor("paged_kv_write q [B, T, H, D]", q, shape=(None, None, None, None), unit_last_stride=True)
    b, t, h, d = q.shape
    kvh = k.shape[2] if k.dim() == 4 else -1
    check_tensor("paged_kv_write k [B, T, KVH, D]", k, shape=(b, t, None, d), unit_last_stride=True, dtype=q.dtype)
    check_tensor("paged_kv_write v [B, T, KVH, D]", v, shape=(b, t, kvh, d), unit_last_stride=True, dtype=q.dtype)
    check_tensor("paged_kv_write cos [B, T, D/2]", cos, shape=(b, t, d // 2), dtype=torch.float32, contiguous=True)
    check_tensor("paged_kv_write sin [B, T, D/2]", sin, shape=(b, t, d // 2), dtype=torch.float32, contiguous=True)
    check_tensor("paged_kv_write positions [B, T]", positions, shape=(b, t), dtype=INT_DTYPES, unit_last_stride=True)
    check_tensor("paged_kv_write slot_ids [B]", slot_ids, shape=(b,), dtype=INT_DTYPES)
    check_tensor("paged_kv_write page_table", page_table, shape=(None, None), dtype=torch.int32, unit_last_stride=True)
    check_tensor("paged_kv_write k_pool", k_pool, shape=(None, None, kvh, d), unit_last_stride=True)
    check_tensor("paged_kv_write v_pool", v_pool, shape=tuple(k_pool.shape), unit_last_stride=True,
                 dtype=k_pool.dtype)
    if d % 2:
        raise ValueError(f"paged_kv_write: head_dim must be even (RoPE), got {d}")
    # The kernel addresses each token row as b * T + t with one stride: T and B must fold into one dimension.
    for name, x in (("q", q), ("k", k), ("v", v)):
        if b > 1 and t > 1 and x.stride(0) != x.stride(1) * t:
            raise ValueError(f"paged_kv_write {name}: [B, T] must fold into one row dimension, got stride "
                             f"{list(x.stride())}")


def _row_stride(x: torch.Tensor) -> int:
    """The stride between token rows ``b * T + t`` (a size-1 dimension's own stride is arbitrary)."""
    return x.stride(0) if x.shape[1] == 1 else x.stride(1)


def paged_kv_write(q, k, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool,
                   q_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``q`` / ``k`` (NeoX RoPE) and write ``k`` / ``v`` into the pools; returns the rotated ``q``.

    Args:
        q: ``[B, T, H, D]``; k, v: ``[B, T, KVH, D]`` (views of one QKV output are fine: unit last stride,
            ``[B, T]`` foldable into one row dimension).
        cos, sin: ``[B, T, D/2]`` fp32.
        positions: ``[B, T]`` int; slot_ids: ``[B]`` int; page_table: ``[num_slots, max_pages]`` int32.
        k_pool, v_pool: ``[num_pages + 1, page_size, KVH, D]``, written in place.
        q_out: optional ``[B, T, H, D]`` output (``q``'s dtype).

    CUDA-graph safe.
    """
    _check(q, k, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool)
    b, t, h, d = q.shape
    kvh = k.shape[2]
    if q_out is None:
        q_out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
    check_tensor("paged_kv_write q_out", q_out, shape=(b, t, h, d), dtype=q.dtype, device=q.device, contiguous=True)
    if b * t == 0:
        return q_out
    half = d // 2
    _paged_kv_write_kernel[(b * t,)](
        q, k, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool, q_out,
        t, h, kvh, page_table.shape[1], k_pool.shape[1], k_pool.shape[0] - 1,
        _row_stride(q), q.stride(2), _row_stride(k), k.stride(2), _row_stride(v), v.stride(2), d // 2,
        positions.stride(0), page_table.stride(0), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), h * d, q_out.stride(2),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=triton.next_power_of_2(h),
        BLOCK_KVH=triton.next_power_of_2(kvh), num_warps=1 if h * d <= 1024 else 4,
    )
    return q_out


def page_slots(positions: torch.Tensor, slot_ids: torch.Tensor, page_table: torch.Tensor, page_size: int,
               scratch_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page [B, T], offset [B, T])`` int64 where each token's K/V lives (the scratch page past the table)."""
    pos = positions.long()
    pidx = pos // page_size
    width = page_table.shape[1]
    page = page_table[slot_ids.long()[:, None], pidx.clamp(max=width - 1)].long()
    page = torch.where(pidx < width, page, torch.full_like(page, scratch_page))
    return page, pos % page_size


def paged_kv_write_reference(q, k, v, cos, sin, positions, slot_ids, page_table, k_pool, v_pool) -> torch.Tensor:
    """Eager twin of :func:`paged_kv_write`: writes the pools in place, returns the rotated ``q`` in fp32
    (the eager attention takes it unrounded, as the target's eager path always did)."""
    page, off = page_slots(positions, slot_ids, page_table, k_pool.shape[1], k_pool.shape[0] - 1)
    k_pool[page, off] = apply_rope(k, cos, sin).to(k_pool.dtype)
    v_pool[page, off] = v.to(v_pool.dtype)
    return apply_rope(q, cos, sin)
