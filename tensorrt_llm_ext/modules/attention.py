"""Attention helpers the models use: RoPE and the drafter's paged single-latent block attention.

The implementations live under :mod:`tensorrt_llm_ext.kernels`: the eager RoPE helpers in
:mod:`~tensorrt_llm_ext.kernels.rope`, the block attention (fused kernel and its eager twin, with the
eager pieces of the twin) in :mod:`~tensorrt_llm_ext.kernels.latent_block_attention`. This module names
them for model code and picks the block-attention implementation a drafter uses
(:func:`resolve_block_attention`, once at build).
"""

from __future__ import annotations

from typing import Callable

import torch

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.kernels.latent_block_attention import (gather_context_latents, latent_block_attention,
                                                             latent_block_attention_reference,
                                                             masked_softmax_attention, single_latent_block_attention,
                                                             write_block_latents)
from tensorrt_llm_ext.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from tensorrt_llm_ext.logger import info_once

__all__ = ["BLOCK_ATTENTION_BACKENDS", "apply_rope", "gather_context_latents", "latent_block_attention",
           "latent_block_attention_reference", "masked_softmax_attention", "resolve_block_attention", "rope_cos_sin",
           "rope_inv_freq", "single_latent_block_attention", "write_block_latents"]

BLOCK_ATTENTION_BACKENDS = {"fused": latent_block_attention, "eager": latent_block_attention_reference}


def resolve_block_attention(requested: str, device: torch.device | str | None, owner: str = "drafter"
                            ) -> tuple[str, Callable]:
    """``(name, fn)`` of the block attention for parameters on ``device``.

    ``requested``: ``"auto"`` (fused where Triton runs: CUDA, or CPU under ``TRITON_INTERPRET=1``; eager
    otherwise), ``"fused"`` (refused where Triton cannot run) or ``"eager"``. Logged once per choice.
    """
    dev = torch.device(device if device is not None else "cpu")
    triton_ok = dev.type == "cuda" or ENV.triton_interpret
    if requested not in ("auto", *BLOCK_ATTENTION_BACKENDS):
        raise ValueError(f"{owner}: attention_backend must be 'auto', 'fused' or 'eager', got {requested!r}")
    if requested == "fused" and not triton_ok:
        raise ValueError(f"{owner}: attention_backend='fused' needs CUDA or TRITON_INTERPRET=1, parameters are on {dev}")
    name = requested if requested != "auto" else ("fused" if triton_ok else "eager")
    why = "requested" if requested != "auto" else ("Triton runs on " + dev.type if triton_ok else
                                                   f"Triton cannot run on {dev.type} (no TRITON_INTERPRET)")
    info_once(f"{owner} block attention: {name} ({why})", key=f"block-attention-{owner}-{name}-{dev.type}-{requested}")
    return name, BLOCK_ATTENTION_BACKENDS[name]
