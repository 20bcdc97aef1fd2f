"""A batch's rows written to their slots of a slot-indexed buffer: ``dst[index[b]] = src[b]``, one launch.

The sampled step stores each row's draft distribution (the Markov chain's biased logits, ``[B, K, V]``) at its
slot for the next step's verification. torch's ``index_copy_`` does it with its element-wise indexing kernel
(one offset computation per element, no vector loads): 84.8 us on the H200 for ``[32, 7, 128256]`` bf16 (57 MB
read and written, ~1.4 TB/s). Here each program streams ``BLOCK`` contiguous elements of one row (16-byte
vectors, the row's slot read once): the copy's bytes at the copy bandwidth, ~24 us at that shape.

A pure copy: the result is :func:`scatter_rows_reference`'s (``index_copy_``) bit for bit, for any dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_tensor, num_warps_for

__all__ = ["scatter_rows", "scatter_rows_reference"]

BLOCK = 8192  # elements per program: 32 per thread at 8 warps (four 16-byte vectors of bf16)


@triton.jit
def _scatter_rows_kernel(dst_ptr, src_ptr, index_ptr, row_elems, num_slots, stride_dst, stride_src,
                         BLOCK: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(index_ptr + b).to(tl.int64)
    # a slot outside the buffer writes nothing (the launcher's caller passes its own slots; no device assert in a
    # captured step)
    mask = (cols < row_elems) & (slot >= 0) & (slot < num_slots)
    x = tl.load(src_ptr + b.to(tl.int64) * stride_src + cols, mask=mask)
    tl.store(dst_ptr + slot * stride_dst + cols, x, mask=mask)


def _row_elems(name: str, t: torch.Tensor) -> int:
    """The elements of one row of ``t`` (along its first dim), which must lie contiguously from ``t.stride(0)``."""
    n = math.prod(t.shape[1:])
    if t.dim() < 1 or (t.shape[0] and n and not t[0].is_contiguous()):
        raise ValueError(f"scatter_rows {name}: expected rows that are each contiguous, got shape {tuple(t.shape)} "
                         f"with strides {tuple(t.stride())}")
    return n


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst[index[b]] = src[b]`` for every ``b``: ``dst.index_copy_(0, index, src)`` in one vectorised launch.

    Args:
        dst: ``[S, ...]`` whose rows are each contiguous (any row stride).
        index: ``[B]`` int32 / int64 distinct slots in ``[0, S)`` (a slot outside writes nothing).
        src: ``[B, ...]`` with ``dst``'s row shape and dtype, each row contiguous.

    Returns ``dst``. CUDA-graph safe (no allocation, no host sync).
    """
    check_tensor("scatter_rows index", index, shape=(src.shape[0],), device=dst.device)
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"scatter_rows index: expected int32 or int64, got {index.dtype}")
    check_tensor("scatter_rows src", src, dtype=dst.dtype, device=dst.device)
    if tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        raise ValueError(f"scatter_rows: src rows {tuple(src.shape[1:])} differ from dst rows {tuple(dst.shape[1:])}")
    row_elems = _row_elems("dst", dst)
    _row_elems("src", src)
    if src.shape[0] == 0 or row_elems == 0:
        return dst
    block = min(BLOCK, triton.next_power_of_2(row_elems))
    _scatter_rows_kernel[(src.shape[0], triton.cdiv(row_elems, block))](
        dst, src, index, row_elems, dst.shape[0], dst.stride(0), src.stride(0), BLOCK=block,
        num_warps=num_warps_for(block, elements_per_warp=1024))
    return dst


def scatter_rows_reference(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Eager twin of :func:`scatter_rows` (``index_copy_``)."""
    return dst.index_copy_(0, index.long(), src)
