"""Where a Triton kernel can run (CUDA, or anywhere under the interpreter), and whether a graph is capturing."""

from __future__ import annotations

import torch

from tensorrt_llm_ext._env import ENV


def triton_runs_on(t: torch.Tensor) -> bool:
    """True when a Triton kernel can take ``t`` (CUDA, or CPU with TRITON_INTERPRET=1)."""
    return t.is_cuda or ENV.triton_interpret


def is_capturing(device: torch.device | str | None = None) -> bool:
    """True while the current CUDA stream is capturing a graph (never on a CPU device / CPU machine).

    Launchers use it to refuse allocation during capture.
    """
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
