"""Block-table decode: the KV manager's encoded page offsets -> physical page ids, in place, one launch.

``o`` decodes as ``max(o, 0) // divisor`` into a fixed-shape int32 table, plus the number of valid
(non-negative) entries per request. CUDA-graph safe with ``out=`` and ``num_blocks_out=``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import (
    check_devices,
    check_int,
    check_tensor,
    num_warps_for,
    refuse_allocation_while_capturing,
)


@triton.jit(do_not_specialize=["divisor"])
def _decode_block_table_kernel(
    src_ptr, dst_ptr, count_ptr, max_blocks, divisor, stride_s, stride_d, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, max_blocks, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < max_blocks
        # Load then store the same elements in one program: safe when dst aliases src.
        o = tl.load(src_ptr + row * stride_s + cols, mask=m, other=-1)
        count += (o >= 0).to(tl.int32)
        tl.store(dst_ptr + row * stride_d + cols, tl.maximum(o, 0) // divisor, mask=m)
    tl.store(count_ptr + row, tl.sum(count, axis=0))


def _decode_checks(encoded_offsets, divisor):
    check_int("divisor", divisor, lo=1, hi=2**31)
    check_tensor("encoded_offsets [B, max_blocks]", encoded_offsets, shape=(None, None), dtype=torch.int32)


def decode_block_table(
    encoded_offsets: torch.Tensor,
    divisor: int,
    out: torch.Tensor | None = None,
    *,
    num_blocks_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the KV manager's encoded block offsets into page ids, in one launch.

    ``table = max(o, 0) // divisor``; ``num_blocks[b] = count(o[b, :] >= 0)``. A negative entry means
    "unallocated" (it decodes to 0, a valid-looking id, so consumers must bound reads by
    ``num_blocks``). The count does not assume allocation is a prefix: it counts every non-negative
    entry (the KV manager allocates prefixes, where the count is the prefix length).

    Args:
        encoded_offsets: ``[B, max_blocks]`` int32, last dim contiguous.
        divisor: int >= 1 (offset units per block); otherwise ``ValueError``.
        out: optional ``[B, max_blocks]`` int32; may be ``encoded_offsets`` itself (in place).
        num_blocks_out: optional ``[B]`` int32, contiguous.

    Returns:
        ``(table [B, max_blocks] int32, num_blocks [B] int32)``. CUDA-graph safe with both outputs given.
    """
    _decode_checks(encoded_offsets, divisor)
    b, max_blocks = encoded_offsets.shape
    device = encoded_offsets.device
    if out is None or num_blocks_out is None:
        refuse_allocation_while_capturing("decode_block_table")
    if out is None:
        out = torch.empty_like(encoded_offsets)
    if num_blocks_out is None:
        num_blocks_out = torch.empty((b,), dtype=torch.int32, device=device)
    # The kernel reads and writes a row at ptr + column: rows may be strided, columns may not.
    check_tensor("encoded_offsets", encoded_offsets, unit_last_stride=True)
    check_tensor("out", out, shape=(b, max_blocks), dtype=torch.int32, unit_last_stride=True)
    # The kernel writes the count of row i at element i: a strided view would be written as if dense.
    check_tensor("num_blocks_out", num_blocks_out, shape=(b,), dtype=torch.int32, contiguous=True)
    check_devices(device, out=out, num_blocks_out=num_blocks_out)
    if b == 0:
        return out, num_blocks_out
    block = max(16, min(1024, triton.next_power_of_2(max(max_blocks, 1))))
    _decode_block_table_kernel[(b,)](
        encoded_offsets, out, num_blocks_out, max_blocks, divisor,
        encoded_offsets.stride(0), out.stride(0), BLOCK=block, num_warps=num_warps_for(block),
    )
    return out, num_blocks_out


def decode_block_table_reference(
    encoded_offsets: torch.Tensor, divisor: int, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`decode_block_table` (the count is taken before an in-place decode)."""
    _decode_checks(encoded_offsets, divisor)
    num_blocks = (encoded_offsets >= 0).sum(-1, dtype=torch.int32)
    decoded = torch.div(encoded_offsets.clamp(min=0), divisor, rounding_mode="floor")
    if out is None:
        return decoded.to(torch.int32), num_blocks
    out.copy_(decoded)
    return out, num_blocks

