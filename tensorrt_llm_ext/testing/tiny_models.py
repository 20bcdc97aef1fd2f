"""The tiny model configuration for tests (it lives with the embedded configs: benchmarks use it too)."""

from tensorrt_llm_ext.configs.tiny_model import TINY_MODEL, tiny_model

__all__ = ["TINY_MODEL", "tiny_model"]
