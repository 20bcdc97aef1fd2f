"""Value checks of the selection and verification entry points that read the device (opt-in).

The values a step reads per row (temperatures, top-p, draft ids) come from slots filled from a checked
:class:`~tensorrt_llm_ext.contract.SamplingParams`, so serving does not read them back: like FlashInfer's
``check_nan``, these checks run only with ``TLLM_EXT_CHECK_VALUES=1`` (``ENV.check_values``, read once; the test
suite turns it on) and never while a CUDA graph captures. Each refusal names the argument, as the host-side
checks of the launchers do.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.contract import MIN_TEMPERATURE
from tensorrt_llm_ext.kernels.common import is_capturing

__all__ = ["check_row_values"]


def check_row_values(temperatures: torch.Tensor | None, top_p: torch.Tensor | None = None,
                     draft_tokens: torch.Tensor | None = None, vocab_size: int | None = None) -> None:
    """Refuse (``ValueError`` naming the argument) a temperature below 0 or in ``(0, MIN_TEMPERATURE)`` (the
    scaled logits would overflow fp32: such a request is served greedy before it reaches a slot), a top-p
    outside ``(0, 1]`` and a draft id outside ``[0, vocab_size)``. A no-op unless ``ENV.check_values``."""
    if not ENV.check_values:
        return
    t = temperatures
    if t is not None and t.numel() and not is_capturing(t.device):
        if not bool((t >= 0).all()):
            raise ValueError(f"temperatures: expected values >= 0 (0 = greedy), got {t.tolist()}")
        tiny = (t > 0) & (t < MIN_TEMPERATURE)
        if bool(tiny.any()):
            raise ValueError(f"temperatures: expected 0 (greedy) or >= {MIN_TEMPERATURE:g}, got "
                             f"{t[tiny][:4].tolist()} (a smaller T overflows the scaled logits; serve it greedy, "
                             f"its T -> 0 limit)")
    if top_p is not None and top_p.numel() and not is_capturing(top_p.device):
        if not bool(((top_p > 0) & (top_p <= 1)).all()):
            raise ValueError(f"top_p: expected values in (0, 1], got {top_p.tolist()}")
    if draft_tokens is not None and draft_tokens.numel() and not is_capturing(draft_tokens.device):
        bad = (draft_tokens < 0) | (draft_tokens >= vocab_size)
        if bool(bad.any()):
            raise ValueError(f"draft_tokens: expected global ids in [0, {vocab_size}), got "
                             f"{draft_tokens[bad][:8].tolist()}")
