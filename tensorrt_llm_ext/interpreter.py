"""Switching the Triton interpreter on for the commands about the kernels themselves, before anything of this package
reads the environment (``_env`` reads it once, at import): a leaf module, importing nothing of the package."""

from __future__ import annotations

import os

__all__ = ["ensure_triton_interpreter"]


def ensure_triton_interpreter() -> None:
    """On a machine without CUDA, switch the Triton interpreter on (before any kernel module is imported) for
    the commands about the kernels themselves (the kernel benchmarks; tests/conftest.py does it for the
    suite). ``generate`` and ``serve`` never call it: on a CPU their step runs torch ops unless
    ``TRITON_INTERPRET=1`` is set explicitly."""
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        cuda = False
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
