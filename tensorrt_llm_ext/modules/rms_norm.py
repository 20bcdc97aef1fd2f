"""``RMSNorm`` module over the fused Triton kernel (eager twin where Triton cannot run).

Numerics are :mod:`tensorrt_llm_ext.kernels.rms_norm`'s: with ``residual=``, ``h = x + residual`` in
fp32, ``residual_out = h`` in the input dtype, the norm of the fp32 ``h`` -- the same epilogue the fused
all-reduce (``AllReduceFusionOp.RESIDUAL_RMS_NORM``) runs after its reduction.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorrt_llm_ext.kernels.rms_norm import rms_norm_nd


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, optionally after ``x + residual``.

    ``forward(x [..., H])`` -> ``[..., H]``; ``forward(x, residual=r)`` -> ``(out, residual_out)``, both
    ``[..., H]``. One kernel launch (Triton on CUDA or under TRITON_INTERPRET, else the eager twin).
    Allocates its outputs: CUDA-graph safe (allocation inside capture comes from the graph pool).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def load_weights(self, full_weight: torch.Tensor) -> None:
        if tuple(full_weight.shape) != (self.hidden_size,):
            raise ValueError(f"RMSNorm.load_weights: expected [{self.hidden_size}], got {tuple(full_weight.shape)}")
        with torch.no_grad():
            self.weight.copy_(full_weight)

    def init_weights(self, generator: torch.Generator) -> None:
        """Deterministic ``1 + 0.1 * N(0, 1)`` (not all ones, so a dropped weight multiply shows)."""
        self.load_weights(1.0 + 0.1 * torch.randn(self.hidden_size, generator=generator))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"RMSNorm: expected [..., {self.hidden_size}], got {tuple(x.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"RMSNorm: residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
        return rms_norm_nd(x, self.weight, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
