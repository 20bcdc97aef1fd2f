"""Plain data types shared by drafter models and speculative workers.

A leaf module: torch and dataclasses only -- no kernel, no communication import. Models depend on this
module alone; workers fill these types and hand them to models.

Shape letters: B requests, K draft length (block length), V vocabulary, r Markov rank, L drafter
layers, d_c latent width, tp TP size.

Paged single-latent drafter context (the semantics every owner of these types follows)
--------------------------------------------------------------------------------------
For a request, ``ctx_len`` counts the positions whose drafter context latent is stored in the paged
pool (positions ``0 .. ctx_len-1``); it equals the position of the *anchor*, the last accepted token,
whose target hidden state is not yet known. A generation step verifies ``[anchor, d_0 .. d_{K-1}]`` at
positions ``ctx_len .. ctx_len+K``; strict acceptance yields ``n_acc`` in ``[1, K+1]`` tokens. The target
hidden states of the first ``n_acc`` verified positions become context: latent ``j < n_acc`` is stored at
position ``ctx_len + j``, then ``ctx_len += n_acc``. The bonus token (last accepted token) is the next
anchor at position ``ctx_len`` (advanced). The draft block holds ``K`` positions
``ctx_len .. ctx_len+K-1`` (input ids ``[anchor, MASK, ..., MASK]``); its own latents are placed in the
pages right after the context (:class:`DraftBlockPlacement`) and overwritten by real context later.
Page ``p`` of a request holds positions ``p*page_size .. (p+1)*page_size-1``; the physical page id comes
from the request's block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class DraftBlockPlacement:
    """Where the draft block's own positions live in the paged latent pool.

    Computed by the worker's fused bookkeeping kernel (one owner of paging) and consumed by the
    drafter's block decode, which must not re-derive it.
    """

    positions: torch.Tensor  # [B, K] int32, absolute position (also the RoPE position) of each block token
    page_ids: torch.Tensor  # [B, K] int32, physical page holding that position's latent
    page_offsets: torch.Tensor  # [B, K] int32, slot inside the page
    ctx_lens: torch.Tensor  # [B] int32, context positions visible to the block (before the block)
    seq_lens: torch.Tensor  # [B] int32, ctx_lens + K (0 for a dummy slot)


@dataclass(frozen=True)
class PagedLatentCache:
    """The drafter's paged single-latent (MLA-style) context cache."""

    pool: torch.Tensor  # [L, num_pages, page_size, d_c], latents of every drafter layer
    block_table: torch.Tensor  # [num_slots, max_pages] int32, physical page ids (>= 0 where allocated)

    @property
    def page_size(self) -> int:
        return self.pool.shape[2]


@dataclass(frozen=True)
class DrafterBlockInputs:
    """Inputs of one drafter block decode (generation requests of a step)."""

    block_input_ids: torch.Tensor  # [B, K] int64: [anchor, MASK * (K-1)]
    slot_ids: torch.Tensor  # [B] int32, rows of the cache's block table
    placement: DraftBlockPlacement
    cache: PagedLatentCache


@dataclass(frozen=True)
class MarkovHeadWeights:
    """The DSpark vanilla Markov head, as exposed by a drafter; the worker runs the chain.

    ``markov_w1`` is indexed by the previous token (a global vocab id) and is whole on every rank;
    ``markov_w2`` holds this rank's vocabulary rows ``[vocab_start, vocab_start + V_local)`` (the whole
    vocabulary on a single rank or a replicated head).
    """

    markov_w1: torch.Tensor  # [V, r]
    markov_w2: torch.Tensor  # [V_local, r]
    vocab_start: int
    vocab_size: int  # V, the real (unpadded) vocabulary

    @property
    def rank(self) -> int:
        return self.markov_w1.shape[1]


@dataclass(frozen=True)
class DrafterTPFusions:
    """What a drafter class declares it supports under plain TP (tp > 1, no attention DP).

    Declared as the class attribute ``tp_fusions``; resolved once into a :class:`DrafterTPPlan` when
    the drafter is built under a Mapping.
    """

    fc_input_split: bool = False  # fc split along input features, all-reduce with hidden_norm fused
    residual_norm_fusion: bool = False  # o_proj/down_proj all-reduce fused with residual add + RMSNorm


NO_TP_FUSIONS = DrafterTPFusions()


@dataclass(frozen=True)
class DrafterTPPlan:
    """The resolved, immutable TP plan of one built drafter (observable by tests and logs)."""

    fc_input_split: bool
    residual_norm_fusion: bool
    reason: str  # why the plan is what it is (logged once at load)


class DrafterCapabilities:
    """Mixin for drafter classes: the declaration the worker and the TP plan read, never probed."""

    tp_fusions: ClassVar[DrafterTPFusions] = NO_TP_FUSIONS
