"""RMSNorm with an optional fused residual add: the norm half of the fused all-reduce.

Numerics (eager twin and kernel alike, TensorRT-LLM's RMSNorm): ``h = x + residual`` in fp32,
``residual_out = h`` cast to the input dtype, ``out = weight * (h * rsqrt(mean(h^2) + eps))`` with the
normalized value cast to the input dtype before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import (check_tensor, num_warps_for,
                                             triton_runs_on)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    hidden, stride_x, stride_r, stride_o, stride_ro, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_out_ptr + row * stride_ro + cols, h.to(residual_out_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(h * h, axis=0) / hidden
    # Round the normalized value to the output dtype first (as the eager twin does), multiply in fp32.
    normed = (h * tl.math.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_tensor("rms_norm x [rows, hidden]", x, shape=(None, None), unit_last_stride=True)
    check_tensor("rms_norm weight [hidden]", weight, shape=(x.shape[1],))
    if residual is not None:
        check_tensor("rms_norm residual [rows, hidden]", residual, shape=tuple(x.shape), unit_last_stride=True)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused ``(x + residual) -> RMSNorm`` in one launch.

    Args:
        x: ``[rows, hidden]`` (any float dtype; leading dims flattened by the caller).
        weight: ``[hidden]``.
        residual: optional ``[rows, hidden]``; when given, ``residual_out = x + residual``.
        out, residual_out: optional preallocated ``[rows, hidden]`` outputs of ``x``'s dtype with unit
            last stride (rows may be strided); CUDA-graph safe when given.

    Returns:
        ``(out, residual_out)``; ``residual_out`` is None without a residual. May alias ``residual``.
    """
    _check(x, weight, residual)
    rows, hidden = x.shape
    # Allocating the outputs here is capture-safe: like any torch op inside a captured forward, they come
    # from the graph's private pool (the models call this without out= inside captured steps).
    if out is None:
        out = torch.empty_like(x)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x)
    # Rows are written through their stride; a strided last dimension would be written as if dense.
    check_tensor("out", out, shape=tuple(x.shape), dtype=x.dtype, device=x.device, unit_last_stride=True)
    if residual_out is not None:
        check_tensor("residual_out", residual_out, shape=tuple(x.shape), dtype=x.dtype, device=x.device,
                     unit_last_stride=True)
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else out
    _rms_norm_kernel[(rows,)](
        x, r, weight, out, ro, hidden, x.stride(0), r.stride(0), out.stride(0), ro.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block, max_warps=16),
    )
    return out, residual_out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eager twin of :func:`rms_norm`."""
    h = x.float()
    residual_out = None
    if residual is not None:
        h = h + residual.float()
        residual_out = h.to(x.dtype)
    var = h.pow(2).mean(-1, keepdim=True)
    normed = (h * torch.rsqrt(var + eps)).to(x.dtype)
    return weight * normed, residual_out


def rms_norm_nd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` on ``[..., hidden]`` inputs: the kernel where Triton runs, else the eager twin.

    Returns ``out`` without a residual, ``(out, residual_out)`` with one; shapes equal ``x``'s.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = residual.reshape(-1, shape[-1]) if residual is not None else None
    if triton_runs_on(x2):
        out, res_out = rms_norm(x2.contiguous(), weight, eps, residual=r2.contiguous() if r2 is not None else None)
    else:
        out, res_out = rms_norm_reference(x2, weight, eps, residual=r2)
    if residual is None:
        return out.reshape(shape)
    return out.reshape(shape), res_out.reshape(shape)
