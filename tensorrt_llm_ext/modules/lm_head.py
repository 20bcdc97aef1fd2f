"""TensorRT-LLM-style ``LMHead``: the output projection ``hidden [..., H] -> logits [..., V]``.

``TensorParallelMode.COLUMN`` splits the vocabulary by :func:`~tensorrt_llm_ext.mapping.vocab_shards`: at
tp > 1 every rank holds ``W = 1024 ceil(ceil(V / tp) / 1024)`` rows of the ``[V, H]`` weight (whole
1024-id blocks, so verification reads the logits once: docs/rejection_sampling.md, "Block-aligned LM head
shards") when the last rank still holds a real id, else ``W = ceil(V / tp)`` (small vocabularies; logged once
with the reason). ``shard_rule="ceil"`` keeps ``ceil(V / tp)`` for comparisons. The ids past ``V`` are zero
weight rows, all on the last rank (up to ``W - 1`` of them), so every shard has the same width and the padded
columns compute logit 0 -- not -inf: every consumer masks them by ``vocab_size`` (ids ``>= V``).
``gather_output=True`` all-gathers the shards and slices the padding off; without it ``forward`` returns this
rank's padded shard ``[..., W]`` (column ``j`` is global id ``vocab_start + j``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm_ext.distributed import allgather
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.mapping import Mapping, vocab_shards
from tensorrt_llm_ext.modules.linear import TensorParallelMode


class LMHead(nn.Module):
    """Vocab projection, replicated (``tensor_parallel_mode=None``) or COLUMN-parallel.

    Args:
        num_embeddings: the vocabulary size ``V`` (unpadded).
        embedding_dim: the hidden size ``H``.
        dtype, device: weight dtype/device.
        mapping: the rank layout (attention DP makes the head replicated, as in TensorRT-LLM).
        tensor_parallel_mode: ``COLUMN`` or ``None`` (ROW is not used for LM heads here).
        gather_output: COLUMN only: return the full ``[..., V]`` logits (all-gather + unpad).
        shard_rule: COLUMN only: ``"aligned"`` (default: whole 1024-id blocks per rank where possible) or
            ``"ceil"`` (``ceil(V / tp)``); see :func:`~tensorrt_llm_ext.mapping.vocab_shards`.

    Attributes: ``vocab_size`` (V), ``padded_vocab_size`` (``tp * shard_width``), ``shard_width``,
    ``vocab_start`` (this rank's first global id), ``num_valid_rows`` (its real rows), ``padding_size``,
    ``shards`` (the :class:`~tensorrt_llm_ext.mapping.VocabShards`), ``quantized`` (always False here).
    The forward is one ``F.linear`` plus, with ``gather_output``, one all-gather: CUDA-graph safe.
    """

    quantized = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        mapping: Mapping | None = None,
        tensor_parallel_mode: TensorParallelMode | None = None,
        gather_output: bool = False,
        shard_rule: str = "aligned",
    ):
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"LMHead: expected positive sizes, got V={num_embeddings}, H={embedding_dim}")
        mapping = mapping or Mapping()
        if mapping.enable_attention_dp:
            # As in TensorRT-LLM: with attention DP every rank decodes its own requests, so the head is
            # replicated (and vocab-parallel selection does not apply).
            tensor_parallel_mode, gather_output = None, False
        if tensor_parallel_mode not in (None, TensorParallelMode.COLUMN):
            raise ValueError(f"LMHead: tensor_parallel_mode must be COLUMN or None, got {tensor_parallel_mode!r}")
        if gather_output and tensor_parallel_mode != TensorParallelMode.COLUMN:
            raise ValueError("LMHead: gather_output needs tensor_parallel_mode=COLUMN")
        self.mapping = mapping
        self.tp_mode = tensor_parallel_mode
        self.tp_size = self.mapping.tp_size if tensor_parallel_mode is not None else 1
        self.tp_rank = self.mapping.tp_rank if tensor_parallel_mode is not None else 0
        self.gather_output = gather_output
        self.vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        try:
            self.shards = vocab_shards(num_embeddings, self.tp_size, shard_rule)
        except ValueError as e:
            raise ValueError(f"LMHead: {e}") from None
        if self.tp_size > 1:
            info_once(f"LMHead: V={num_embeddings} over tp={self.tp_size}: {self.shards.width} rows per rank "
                      f"({self.shards.rule}: {self.shards.reason})",
                      key=f"lm-head-shards-{num_embeddings}-{self.tp_size}-{shard_rule}")
        self.shard_width = self.shards.width
        self.padded_vocab_size = self.shards.padded_vocab_size
        self.padding_size = self.padded_vocab_size - num_embeddings
        self.vocab_start = self.shards.start(self.tp_rank)
        # Rows of this shard that are real vocabulary (the rest: zero padding, on the last rank only).
        self.num_valid_rows = self.shards.num_valid(self.tp_rank)
        self.weight = nn.Parameter(torch.zeros(self.shard_width, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)

    @property
    def vocab_size_padded(self) -> int:
        """TensorRT-LLM's name for ``padded_vocab_size``."""
        return self.padded_vocab_size

    @property
    def is_evenly_sharded(self) -> bool:
        """No padding row on any rank (an aligned layout pads even where ``V % tp == 0``)."""
        return self.padding_size == 0

    def load_weights(self, full_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the FULL ``[V, H]`` weight; padded rows stay zero."""
        if tuple(full_weight.shape) != (self.vocab_size, self.embedding_dim):
            raise ValueError(f"LMHead.load_weights: expected full weight [{self.vocab_size}, "
                             f"{self.embedding_dim}], got {tuple(full_weight.shape)}")
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: self.num_valid_rows].copy_(full_weight.narrow(0, self.vocab_start, self.num_valid_rows))

    def init_weights(self, generator: torch.Generator) -> None:
        """Deterministic init: the same FULL weight on every rank / TP size, then this rank's slice."""
        full = torch.randn(self.vocab_size, self.embedding_dim, generator=generator) / self.embedding_dim ** 0.5
        self.load_weights(full.to(self.weight.dtype))

    def shard_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> this rank's padded shard logits ``[..., shard_width]`` (no collective)."""
        if hidden.shape[-1] != self.embedding_dim:
            raise ValueError(f"LMHead: expected hidden [..., {self.embedding_dim}], got {tuple(hidden.shape)}")
        return F.linear(hidden, self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]`` with ``gather_output`` (or tp 1), else ``[..., shard_width]``."""
        y = self.shard_forward(hidden)
        if self.gather_output and self.tp_size > 1:
            y = allgather(y, self.mapping, dim=-1)
            if self.padding_size:
                y = y[..., : self.vocab_size]
        return y

    def extra_repr(self) -> str:
        mode = self.tp_mode.value if self.tp_mode is not None else "replicated"
        return (f"V={self.vocab_size}, H={self.embedding_dim}, {mode}, tp={self.tp_size}, "
                f"shard=[{self.vocab_start}, {self.vocab_start + self.shard_width}), "
                f"padding={self.padding_size}, rule={self.shards.rule}, gather_output={self.gather_output}")
