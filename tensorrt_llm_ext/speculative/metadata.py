"""Speculative-decoding metadata: the slot-indexed sampling state of one worker.

Sampling state indexed by sequence slot (the rejection-sampling draft logits) must be ONE buffer: the
drafter writes a request's draft logits in the step that drafts them and the verifier reads them in the
next step, which may run under another batch size's CUDA graph or eagerly. Upstream kept a shallow-copied
metadata view per graph batch size, and a view created before the base's first ``prepare()`` allocated
its own copy, so drafter and verifier silently disagreed. Here a worker holds one :class:`SpecMetadata`
and every captured graph reads its tensors directly: there is no per-batch-size copy to fall out of step.
The slot buffers are sized by the slot pool, never by a batch size, and allocated before any capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecMetadata:
    """Per-worker speculative metadata.

    Shape letters: S slots (``num_seq_slots``), K ``max_draft_len``, V ``vocab_size``, R
    ``max_num_requests``; W ``draft_logits_width`` (this rank's shard width when verification is
    vocab-sharded, else V).
    """

    max_num_requests: int  # R, rows of the largest step
    max_draft_len: int  # K
    vocab_size: int  # V
    num_seq_slots: int = 0  # S, size of the sequence-slot pool (0 -> max_num_requests)
    device: torch.device | str = "cpu"
    use_rejection_sampling: bool = True  # allocate draft_logits
    draft_logits_dtype: torch.dtype = torch.float32
    draft_logits_width: int = 0  # W (0 -> vocab_size)

    # Slot-indexed sampling state.
    # [S, K, W] draft_logits_dtype: the logits each slot's drafts were sampled from (the rejection
    # sampler's q), written by the step that drafts them, read by the next step's verification.
    draft_logits: torch.Tensor | None = None
    batch_slot_ids: torch.Tensor | None = None  # [R] int32, slot of each row of the current step
    num_accepted: torch.Tensor | None = None  # [R] int32, accepted tokens of each row of the last step

    def __post_init__(self) -> None:
        for name in ("max_num_requests", "max_draft_len", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SpecMetadata.{name}: expected an int >= 1, got {v!r}")
        if self.draft_logits_width == 0:
            self.draft_logits_width = self.vocab_size
        if self.num_seq_slots == 0:
            self.num_seq_slots = self.max_num_requests
        if self.num_seq_slots < self.max_num_requests:
            raise ValueError(f"SpecMetadata.num_seq_slots: expected >= max_num_requests={self.max_num_requests}, "
                             f"got {self.num_seq_slots}")

    def allocate_draft_logits(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Turn on the rejection-sampling draft logits ``[S, K, width]`` once the worker knows its layout
        (after load, before any capture); asking again for the same layout returns the same buffer."""
        if self.draft_logits is not None:
            if self.draft_logits.shape[-1] != width or self.draft_logits.dtype != dtype:
                raise ValueError(f"SpecMetadata.draft_logits: already [.., {self.draft_logits.shape[-1]}] "
                                 f"{self.draft_logits.dtype}, asked for [.., {width}] {dtype}")
            return self.draft_logits
        self.use_rejection_sampling = True
        self.draft_logits_width = width
        self.draft_logits_dtype = dtype
        self.prepare()
        return self.draft_logits

    def prepare(self) -> None:
        """Allocate what is missing; safe to call twice (nothing is reallocated or cleared)."""
        s, k, r, dev = self.num_seq_slots, self.max_draft_len, self.max_num_requests, self.device
        if self.use_rejection_sampling and self.draft_logits is None:
            self.draft_logits = torch.zeros((s, k, self.draft_logits_width), dtype=self.draft_logits_dtype,
                                            device=dev)
        if self.batch_slot_ids is None:
            self.batch_slot_ids = torch.zeros((r,), dtype=torch.int32, device=dev)
        if self.num_accepted is None:
            self.num_accepted = torch.ones((r,), dtype=torch.int32, device=dev)
