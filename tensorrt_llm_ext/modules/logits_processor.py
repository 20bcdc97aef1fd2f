"""The plain ``LogitsProcessor`` (TensorRT-LLM style): pick the rows to decode, apply the LM head.

Vocab-parallel selection is only bound for a model whose processor is exactly this class: a model that
installs its own processor (a head transform, a hyper-connection collapse, ...) changes the logits in
ways the shard path would skip, so it keeps the gathered logits.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorrt_llm_ext.modules.lm_head import LMHead


class LogitsProcessor(nn.Module):
    """``hidden [T, H]`` (optionally the rows ``row_indices [R]``) -> ``lm_head(hidden) [R, V or V_shard]``.

    ``row_indices`` are the token rows to decode (e.g. the last token of each context request and every
    generation token); ``None`` keeps all rows. CUDA-graph safe when the head is.
    """

    def forward(self, hidden_states: torch.Tensor, lm_head: LMHead,
                row_indices: torch.Tensor | None = None) -> torch.Tensor:
        if row_indices is not None:
            hidden_states = hidden_states.index_select(0, row_indices)
        return lm_head(hidden_states)
