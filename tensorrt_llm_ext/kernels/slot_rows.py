"""Rows moved between a batch and a slot-indexed buffer, one vectorised launch each way.

``scatter_rows(dst, index, src)``: ``dst[index[b]] = src[b]``; ``gather_rows(src, index, out)``: ``out[b] =
src[index[b]]``. The sampled step stores each row's draft distribution (the Markov chain's biased logits, ``[B, K,
V]``) at its slot and reads it back at the next step's verification. torch's ``index_copy_`` runs its element-wise
indexing kernel (one offset computation per element, no vector loads): 84.8 us on the H200 for ``[32, 7, 128256]``
bf16 (57 MB read and written); ``index_select`` of a few rows runs its small-index kernel: 30 us on the H100 at
``[8, 7, 128256]`` (14 MB, ~1 TB/s). Here each program streams ``BLOCK`` contiguous elements of one row (16-byte
vectors, the row's slot read once): the copy's bytes at the copy bandwidth (the H100's scatter at the B = 32 shape:
37.2 us, 2 x 57 MB at its ~2.95 TB/s floor of ~39 us).

Pure copies: the results are the twins' (``index_copy_`` / ``index_select``) bit for bit, for any dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_tensor, num_warps_for

__all__ = ["gather_rows", "gather_rows_reference", "scatter_rows", "scatter_rows_reference"]

BLOCK = 8192  # elements per program: 32 per thread at 8 warps (four 16-byte vectors of bf16)


@triton.jit
def _slot_rows_kernel(slotted_ptr, batch_ptr, index_ptr, row_elems, num_slots, stride_slot, stride_batch,
                      GATHER: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(index_ptr + b).to(tl.int64)
    # a slot outside the buffer moves nothing (the callers pass their own slots; no device assert in a captured
    # step): a scatter writes nothing, a gather leaves its row as it was
    mask = (cols < row_elems) & (slot >= 0) & (slot < num_slots)
    slotted = slotted_ptr + slot * stride_slot + cols
    batch = batch_ptr + b.to(tl.int64) * stride_batch + cols
    if GATHER:
        tl.store(batch, tl.load(slotted, mask=mask), mask=mask)
    else:
        tl.store(slotted, tl.load(batch, mask=mask), mask=mask)


def _row_elems(name: str, t: torch.Tensor) -> int:
    """The elements of one row of ``t`` (along its first dim), which must lie contiguously from ``t.stride(0)``."""
    n = math.prod(t.shape[1:])
    if t.dim() < 1 or (t.shape[0] and n and not t[0].is_contiguous()):
        raise ValueError(f"{name}: expected rows that are each contiguous, got shape {tuple(t.shape)} with strides "
                         f"{tuple(t.stride())}")
    return n


def _launch(fn: str, slotted: torch.Tensor, index: torch.Tensor, batch: torch.Tensor, gather: bool) -> None:
    check_tensor(f"{fn} index", index, shape=(batch.shape[0],), device=slotted.device)
    if index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn} index: expected int32 or int64, got {index.dtype}")
    batch_name = "out" if gather else "src"
    check_tensor(f"{fn} {batch_name}", batch, dtype=slotted.dtype, device=slotted.device)
    if tuple(batch.shape[1:]) != tuple(slotted.shape[1:]):
        raise ValueError(f"{fn}: {batch_name} rows {tuple(batch.shape[1:])} differ from the slotted buffer's rows "
                         f"{tuple(slotted.shape[1:])}")
    row_elems = _row_elems(f"{fn} {'src' if gather else 'dst'}", slotted)
    _row_elems(f"{fn} {batch_name}", batch)
    if batch.shape[0] == 0 or row_elems == 0:
        return
    block = min(BLOCK, triton.next_power_of_2(row_elems))
    _slot_rows_kernel[(batch.shape[0], triton.cdiv(row_elems, block))](
        slotted, batch, index, row_elems, slotted.shape[0], slotted.stride(0), batch.stride(0), GATHER=gather,
        BLOCK=block, num_warps=num_warps_for(block, elements_per_warp=1024))


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst[index[b]] = src[b]`` for every ``b``: ``dst.index_copy_(0, index, src)`` in one vectorised launch.

    Args:
        dst: ``[S, ...]`` whose rows are each contiguous (any row stride).
        index: ``[B]`` int32 / int64 distinct slots in ``[0, S)`` (a slot outside writes nothing).
        src: ``[B, ...]`` with ``dst``'s row shape and dtype, each row contiguous.

    Returns ``dst``. CUDA-graph safe (no allocation, no host sync).
    """
    _launch("scatter_rows", dst, index, src, gather=False)
    return dst


def scatter_rows_reference(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Eager twin of :func:`scatter_rows` (``index_copy_``)."""
    return dst.index_copy_(0, index.long(), src)


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[b] = src[index[b]]`` for every ``b``: ``torch.index_select(src, 0, index, out=out)`` in one vectorised
    launch. ``src [S, ...]`` and ``out [B, ...]`` (same row shape and dtype) with each row contiguous; ``index [B]``
    int32 / int64 slots in ``[0, S)`` (a slot outside leaves its ``out`` row unwritten). Returns ``out``.
    CUDA-graph safe."""
    _launch("gather_rows", src, index, out, gather=True)
    return out


def gather_rows_reference(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Eager twin of :func:`gather_rows` (``index_select``)."""
    return torch.index_select(src, 0, index.long(), out=out)
