"""The tiny model configuration for tests (it lives with the embedded configs: benchmarks use it too)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tensorrt_llm_ext.configs.tiny_model import TINY_MODEL, tiny_model

__all__ = ["TINY_MODEL", "export_tiny_target", "tiny_model"]


def export_tiny_target(path: str | Path) -> Path:
    """The tiny model exported to ``path`` as a target alone (no ``dspark_drafter`` directory), as an imported
    checkpoint is before ``train-drafter``."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.export import export_model

    path = Path(path)
    export_model(load_config(**tiny_model()), path)
    shutil.rmtree(path / "dspark_drafter")
    return path
