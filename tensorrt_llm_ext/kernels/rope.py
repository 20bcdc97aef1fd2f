"""Eager rotate-half (NeoX) RoPE helpers shared by the models and the attention kernels' eager twins.

Torch only (no kernel): the fused attention kernels rotate in registers from the same ``inv_freq``
(:func:`rope_inv_freq`), so the kernel and its twin start from identical frequencies.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_cos_sin", "rope_inv_freq"]


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``1 / theta^(2i / rotary_dim)`` for ``i < rotary_dim / 2``: fp32 ``[rotary_dim // 2]``."""
    if rotary_dim % 2 != 0:
        raise ValueError(f"rope_inv_freq: rotary_dim must be even, got {rotary_dim}")
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [...]`` int -> ``(cos, sin)`` fp32 ``[..., rotary_dim // 2]``."""
    inv_freq = rope_inv_freq(rotary_dim, theta, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE in fp32. ``x [..., n_heads, D]``, ``cos/sin [..., D/2]`` -> fp32 ``x``."""
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
