"""tensorrt_llm_ext: tensor-parallel one-model speculative decoding for TensorRT-LLM-style serving."""

__version__ = "0.1.0"
