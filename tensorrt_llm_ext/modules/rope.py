"""Rotary embeddings of a target model: plain RoPE and the scaled variants of Hugging Face checkpoints.

The scaled variants only change the inverse frequencies (and, for YaRN, a factor on ``cos``/``sin``), so
they are computed once on the host at build time and the rotation stays the eager
:func:`~tensorrt_llm_ext.kernels.rope.apply_rope` of every other model here. Supported ``rope_type``\\ s:

* ``linear``: ``inv_freq / factor`` (position interpolation);
* ``llama3`` (Llama 3.1 / 3.2 / 3.3): long wavelengths (``> original_max_position_embeddings /
  low_freq_factor``) divided by ``factor``, short ones (``< ... / high_freq_factor``) kept, a linear blend
  in between;
* ``yarn``: per-dimension blend of interpolated and extrapolated frequencies over the correction range
  ``[low, high]`` of ``beta_fast`` / ``beta_slow`` rotations, ``cos``/``sin`` scaled by the attention
  factor (``0.1 ln(factor) + 1`` unless given, or the ``mscale`` / ``mscale_all_dim`` ratio).

Plain RoPE (``scaling=None``) gives exactly the bits of :func:`~tensorrt_llm_ext.kernels.rope.rope_cos_sin`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tensorrt_llm_ext.kernels.rope import rope_inv_freq

ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A Hugging Face ``rope_scaling`` / ``rope_parameters`` entry this module computes (see the module doc)."""

    rope_type: str  # one of ROPE_SCALING_TYPES
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn: the pre-training context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None -> from factor (and mscale / mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range outwards to whole dimensions

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {ROPE_SCALING_TYPES}, got {self.rope_type!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and not (self.original_max_position_embeddings or 0) >= 1:
            raise ValueError(f"RopeScaling({self.rope_type}) needs original_max_position_embeddings >= 1, "
                             f"got {self.original_max_position_embeddings}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"RopeScaling(llama3) needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor}, {self.high_freq_factor}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def scaled_rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
                         device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq fp32 [head_dim // 2], attention_factor)`` of plain or scaled RoPE (see the module doc)."""
    inv_freq = rope_inv_freq(head_dim, theta, device)
    if scaling is None:
        return inv_freq, 1.0
    s = scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor, 1.0
    if s.rope_type == "llama3":
        old = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, out), 1.0
    # yarn
    dim = head_dim

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(s.factor)
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """``cos_sin(positions [...]) -> (cos, sin)`` fp32 ``[..., head_dim // 2]`` for :func:`apply_rope`.

    The inverse frequencies are a non-persistent buffer computed at build (no state-dict entry); the call
    allocates its outputs only: CUDA-graph safe.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        inv_freq, self.attention_factor = scaled_rope_inv_freq(head_dim, theta, scaling, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def cos_sin_table(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos_sin`` of positions ``0 .. num_positions - 1``: fp32 ``[num_positions, head_dim // 2]`` each, row
        ``p`` bit for bit ``cos_sin(p)`` (the same element-wise ops on the same fp32 angles), for a step that gathers
        its rows instead of computing them (``kernels/decode_step.py``). Build it outside a graph capture."""
        return self.cos_sin(torch.arange(num_positions, dtype=torch.int64, device=self.inv_freq.device))
