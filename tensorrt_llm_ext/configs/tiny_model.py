"""The one tiny embedded-model configuration that CPU benchmark smoke runs and the CPU tests share.

Small enough for the Triton interpreter on 2 cores: a 2-layer Llama-like target (hidden 32) and a 1-layer
DSpark drafter, K = 3, fp32. fp32 because eager steps run at the live batch size, so a speculative run and
its reference see different GEMM shapes; fp32 keeps shape-dependent rounding far below any logit gap.
Callers override what their test is about (vocabulary, K, batch, lengths) with :func:`tiny_model`.
"""

from __future__ import annotations

TINY_MODEL: dict[str, object] = {
    "model.dtype": "float32",
    "model.target.vocab_size": 517, "model.target.hidden_size": 32, "model.target.head_dim": 8,
    "model.target.num_layers": 2, "model.target.capture_layers": [0, 1], "model.target.intermediate_size": 64,
    "model.drafter.num_layers": 1, "model.drafter.latent_dim": 16, "model.drafter.head_dim": 8,
    "model.drafter.intermediate_size": 64, "speculative_config.max_draft_len": 3,
    "speculative_config.markov_rank": 32, "max_batch_size": 4, "max_seq_len": 48,
    "kv_cache_config.tokens_per_block": 8,
}


def tiny_model(**overrides) -> dict[str, object]:
    """:data:`TINY_MODEL` with dotted-key ``overrides`` (pass them as ``**{"model.target.vocab_size": 516}``)."""
    return {**TINY_MODEL, **overrides}
