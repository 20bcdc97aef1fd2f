"""SiLU-and-multiply of a fused gate-up GEMM output: ``silu(gate) * up`` in one launch.

Numerics (kernel and eager twin): ``silu(g) = g / (1 + exp(-g))`` in fp32, rounded to the input dtype (as
``F.silu`` on a 16-bit tensor returns it), then the product with ``up`` in fp32, rounded once. The kernel's
``exp`` is the GPU's, so the two agree within one unit in the last place of the input dtype per rounding
(two units in all; the Triton interpreter truncates its 16-bit casts, also within one unit each). Bytes: the ``[N, 2I]`` input read once, ``[N, I]`` written once (one launch instead of
``F.silu`` + ``mul``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_tensor, num_warps_for

__all__ = ["silu_mul", "silu_mul_reference"]

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [N, 2I]`` (gate columns then up columns, unit last stride) -> ``[N, I]`` of ``x``'s dtype.

    ``out``: optional ``[N, I]`` with unit last stride. CUDA-graph safe (allocates only its output, from the
    capture's pool like any torch op)."""
    check_tensor("silu_mul x [N, 2I]", x, shape=(None, None), unit_last_stride=True)
    n, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"silu_mul x: expected an even number of columns (gate then up), got {two_i}")
    inter = two_i // 2
    if out is None:
        out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    check_tensor("silu_mul out", out, shape=(n, inter), dtype=x.dtype, device=x.device, unit_last_stride=True)
    if n == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                                                     num_warps=num_warps_for(block, elements_per_warp=128))
    return out


def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Eager twin of :func:`silu_mul` (``F.silu(gate) * up``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
