"""TensorRT-LLM-style layers: linear (TP column/row), RMSNorm, embedding, attention helpers, LM head."""
