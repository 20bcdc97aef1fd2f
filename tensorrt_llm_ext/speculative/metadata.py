"""Speculative-decoding metadata whose slot-indexed sampling state every CUDA-graph view shares.

A worker keeps one base :class:`SpecMetadata` and one shallow-copied view per CUDA-graph batch size.
Sampling state indexed by sequence slot (rejection-sampling draft logits, the occurrence-penalty
counts) must be one buffer: the drafter writes a request's draft logits in the step that drafts
them and the verifier reads them in the next step, which may run under another batch size's graph or
eagerly. If a view allocated its own copy (a view created before the base's first ``prepare()``, e.g.
when CUDA-graph capture is the first speculative forward), the two would silently disagree.

So the slot buffers are allocated on the base, sized by the slot pool (never by a batch size), before a
view is copied; a view resolves them through its base.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch


@dataclass
class SpecMetadata:
    """Per-worker speculative metadata (base) or its per-batch-size CUDA-graph view.

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
    use_penalties: bool = False  # allocate penalty_state
    draft_logits_dtype: torch.dtype = torch.float32
    draft_logits_width: int = 0  # W (0 -> vocab_size)

    # View fields: None / False on the base.
    batch_size: int | None = None  # the CUDA-graph batch size of a view
    is_cuda_graph: bool = False

    # Slot-indexed sampling state, shared by the base and every view.
    # [S, K, W] draft_logits_dtype: the logits each slot's drafts were sampled from (the rejection
    # sampler's q), written by the step that drafts them, read by the next step's verification.
    draft_logits: torch.Tensor | None = None
    batch_slot_ids: torch.Tensor | None = None  # [R] int32, slot of each row of the current step
    penalty_state: torch.Tensor | None = None  # [S, V] int32, occurrence counts per slot

    # Per-step buffers of this object (a view's are its own; prepared in prepare()).
    draft_tokens: torch.Tensor | None = None  # [R, K] int32
    num_accepted: torch.Tensor | None = None  # [R] int32

    _base: SpecMetadata | None = field(default=None, repr=False)
    _views: dict[int, SpecMetadata] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_num_requests", "max_draft_len", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SpecMetadata.{name} must be an int >= 1, got {v!r}")
        if self.draft_logits_width == 0:
            self.draft_logits_width = self.vocab_size
        if self.num_seq_slots == 0:
            self.num_seq_slots = self.max_num_requests
        if self.num_seq_slots < self.max_num_requests:
            raise ValueError(f"num_seq_slots ({self.num_seq_slots}) must be >= max_num_requests "
                             f"({self.max_num_requests})")

    @property
    def base(self) -> SpecMetadata:
        return self._base if self._base is not None else self

    def _ensure_slot_buffers(self) -> None:
        """Allocate the slot-indexed state once, on the base; a view then links the base's tensors."""
        base = self.base
        s, k, v, dev = base.num_seq_slots, base.max_draft_len, base.vocab_size, base.device
        if base.use_rejection_sampling and base.draft_logits is None:
            base.draft_logits = torch.zeros((s, k, base.draft_logits_width), dtype=base.draft_logits_dtype,
                                            device=dev)
        if base.batch_slot_ids is None:
            base.batch_slot_ids = torch.zeros((base.max_num_requests,), dtype=torch.int32, device=dev)
        if base.use_penalties and base.penalty_state is None:
            base.penalty_state = torch.zeros((s, v), dtype=torch.int32, device=dev)
        if base is not self:
            self.draft_logits = base.draft_logits
            self.batch_slot_ids = base.batch_slot_ids
            self.penalty_state = base.penalty_state

    def allocate_draft_logits(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Turn on the rejection-sampling draft logits ``[S, K, width]`` once the worker knows its layout
        (after load, before any capture); views created earlier link it on their next ``prepare()``."""
        base = self.base
        if base.draft_logits is not None:
            if base.draft_logits.shape[-1] != width or base.draft_logits.dtype != dtype:
                raise ValueError(f"SpecMetadata.draft_logits: already [.., {base.draft_logits.shape[-1]}] "
                                 f"{base.draft_logits.dtype}, asked for [.., {width}] {dtype}")
            return base.draft_logits
        base.use_rejection_sampling = True
        base.draft_logits_width = width
        base.draft_logits_dtype = dtype
        base._ensure_slot_buffers()
        for view in base._views.values():
            view.draft_logits = base.draft_logits
        return base.draft_logits

    def prepare(self) -> None:
        """Allocate what is missing; safe to call twice (nothing is reallocated or cleared)."""
        self._ensure_slot_buffers()
        if self.draft_tokens is None:
            self.draft_tokens = torch.zeros((self.max_num_requests, self.max_draft_len), dtype=torch.int32,
                                            device=self.device)
        if self.num_accepted is None:
            self.num_accepted = torch.ones((self.max_num_requests,), dtype=torch.int32, device=self.device)

    def create_cuda_graph_metadata(self, batch_size: int) -> SpecMetadata:
        """The view for one CUDA-graph batch size (cached; the same object on a second call).

        The base's slot buffers are allocated first, so the shallow copy shares them; per-step
        buffers are shared too when the base was prepared, else the view allocates its own in prepare().
        """
        if self._base is not None:
            return self._base.create_cuda_graph_metadata(batch_size)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= self.max_num_requests:
            raise ValueError(f"batch_size must lie in [1, max_num_requests={self.max_num_requests}], got {batch_size!r}")
        if batch_size in self._views:
            return self._views[batch_size]
        self._ensure_slot_buffers()
        view = copy.copy(self)
        view.batch_size = batch_size
        view.is_cuda_graph = True
        view._base = self
        view._views = {}
        self._views[batch_size] = view
        return view
