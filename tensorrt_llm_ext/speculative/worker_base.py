"""Speculative worker base: owns ``forward``, holds the token selector.

TensorRT-LLM's shape: the base class owns ``forward`` (checks, profiling range) and calls the abstract
``_forward_impl`` of the concrete worker; a subclass that overrides ``forward`` is refused at class
creation. Token selection lives in one composable component, the
:class:`~tensorrt_llm_ext.speculative.token_selector.VocabParallelSelector` in
:attr:`~VocabParallelSelectionMixin.token_selector`, bound ONCE by the mixin's post-load hook
(:meth:`VocabParallelSelectionMixin.post_load`): target side first, then the draft side once the drafter
has taken over the target's LM head. The decision is agreed across ranks, logged identically on every
rank, and stored in the selector only.

NVTX: :func:`nvtx_range` marks each stage of a step. The ``nvtx`` package is optional (the GPU machine may
lack it): without it the ranges are no-ops, logged once.
"""

from __future__ import annotations

import abc
import contextlib

import torch

from tensorrt_llm_ext.contract import DraftModel, TargetModel
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.speculative.selection_decision import VocabParallelSelection
from tensorrt_llm_ext.speculative.token_selector import VocabParallelSelector

try:  # optional: ranges become no-ops without the package
    import nvtx as _nvtx
except Exception:  # pragma: no cover - depends on the machine
    _nvtx = None


@contextlib.contextmanager
def _null_range():
    yield


def nvtx_range(name: str):
    """A context manager marking ``name`` on the NVTX timeline (no-op without the ``nvtx`` package)."""
    if _nvtx is None:
        info_once("nvtx package not installed: NVTX ranges are no-ops", key="nvtx-missing")
        return _null_range()
    return _nvtx.annotate(name, domain="tensorrt_llm_ext")


class VocabParallelSelectionMixin:
    """The worker mixin that binds token selection once, after model load.

    :meth:`post_load` (once, on every rank) lets the drafter take over the target's LM head, binds the
    :class:`VocabParallelSelector` into :attr:`token_selector` -- target side first, then the draft side
    against that head -- and calls the worker's :meth:`_on_bound` hook. The decision lives in the
    selector alone; the worker calls the selector directly.
    """

    mapping: Mapping
    target: TargetModel
    drafter: DraftModel
    max_exchange_rows: int  # rows one pair exchange carries (the step's B * (K + 1))
    token_selector: VocabParallelSelector | None = None  # bound by post_load, vocab-parallel or gathered

    def post_load(self, *, vocab_parallel_mode: str = "auto", exchange: str = "nccl") -> VocabParallelSelection:
        """Bind once after load (a few tiny CPU collectives at tp > 1); calling it twice is an error.

        ``vocab_parallel_mode`` is ``speculative_config.vocab_parallel_selection`` (auto | on | off),
        ``exchange`` is ``speculative_config.exchange`` (the pair exchange's backend).
        """
        if self.token_selector is not None:
            raise RuntimeError(f"{type(self).__name__}.post_load: already bound (the decision is made once)")
        self.drafter.take_over_lm_head(self.target.lm_head)
        self.token_selector = VocabParallelSelector.bind(
            self.mapping, self.target.lm_head, self.target.logits_processor, mode=vocab_parallel_mode,
            drafter_lm_head=self.drafter.lm_head, exchange=exchange, max_exchange_rows=self.max_exchange_rows)
        self._on_bound()
        return self.token_selector.selection

    def _on_bound(self) -> None:
        """Hook for subclasses: build what depends on the selection decision (buffers, chain)."""

    @property
    def selection(self) -> VocabParallelSelection | None:
        """The decision (None before :meth:`post_load`)."""
        return None if self.token_selector is None else self.token_selector.selection


class SpecWorkerBase(VocabParallelSelectionMixin, abc.ABC):
    """Base of one-model speculative workers.

    Args:
        mapping: the rank layout.
        target, drafter: the loaded models (called only through the contract's protocols).
        draft_len: ``K``, drafts per request and step.
        max_batch_size: rows of the largest step.

    :meth:`post_load` (the mixin's) binds token selection once; the pair exchange is sized for the step's
    ``B * (K + 1)`` target rows.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            raise TypeError(f"{cls.__name__} must not override forward(); implement _forward_impl() instead")

    def __init__(self, mapping: Mapping, target: TargetModel, drafter: DraftModel, draft_len: int,
                 max_batch_size: int):
        if draft_len < 1 or max_batch_size < 1:
            raise ValueError(f"SpecWorkerBase: need draft_len >= 1 and max_batch_size >= 1, got {draft_len}, "
                             f"{max_batch_size}")
        self.mapping = mapping
        self.target = target
        self.drafter = drafter
        self.draft_len = draft_len
        self.max_batch_size = max_batch_size
        self.max_exchange_rows = max_batch_size * (draft_len + 1)

    # -- the step ------------------------------------------------------------------------------------
    def forward(self, batch_size: int) -> dict[str, torch.Tensor]:
        """Run one speculative step over rows ``[0, batch_size)`` of the step buffers.

        Returns TensorRT-LLM's one-model worker dict: ``logits``, ``new_tokens [B, K+1]``,
        ``new_tokens_lens [B]``, ``next_draft_tokens [B, K]``, ``next_new_tokens [B, K+1]``.
        """
        if self.token_selector is None:
            raise RuntimeError(f"{type(self).__name__}.forward: call post_load() once after load first")
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"batch_size must lie in [1, {self.max_batch_size}], got {batch_size}")
        # A low-latency exchange that timed out in an earlier step raises here (a host read, no sync).
        self.token_selector.check_exchange()
        with nvtx_range(f"{type(self).__name__}.step"):
            return self._forward_impl(batch_size)

    @abc.abstractmethod
    def _forward_impl(self, batch_size: int) -> dict[str, torch.Tensor]:
        ...
