"""Token ``Embedding`` (replicated on every TP rank).

A vocab-parallel embedding would save ``V * H * (tp - 1) / tp`` bytes per rank at the price of one
all-reduce per lookup; the drafter's block has ``B * K`` tokens, so the replicated table is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm_ext.mapping import Mapping


class Embedding(nn.Module):
    """``ids [...] int64 -> [..., H]``; the whole ``[V, H]`` table on every rank. CUDA-graph safe."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None, mapping: Mapping | None = None):
        super().__init__()
        self.mapping = mapping or Mapping()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def load_weights(self, full_weight: torch.Tensor) -> None:
        if tuple(full_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"Embedding.load_weights: expected [{self.num_embeddings}, {self.embedding_dim}], "
                             f"got {tuple(full_weight.shape)}")
        with torch.no_grad():
            self.weight.copy_(full_weight)

    def init_weights(self, generator: torch.Generator) -> None:
        self.load_weights(torch.randn(self.num_embeddings, self.embedding_dim, generator=generator))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, replicated"
