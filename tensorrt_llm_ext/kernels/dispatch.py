"""Where a Triton kernel can run: on CUDA tensors, or anywhere under the Triton interpreter."""

from __future__ import annotations

import torch

from tensorrt_llm_ext._env import ENV


def triton_runs_on(t: torch.Tensor) -> bool:
    """True when a Triton kernel can take ``t`` (CUDA, or CPU with TRITON_INTERPRET=1)."""
    return t.is_cuda or ENV.triton_interpret
