"""The token selector a worker holds: bound once after load, then the step's target logits and tokens.

:class:`VocabParallelSelector` applies the :class:`~.selection_decision.VocabParallelSelection`: where a side
runs vocab-parallel it holds a :class:`~.vocab_parallel.VocabParallelHead` and selects from this rank's
shard with the pair exchange, else it selects from the gathered logits. :class:`SelectionParams` is one
batch's sampling inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm_ext.contract import LanguageModelHead, LogitsProcessorLike
from tensorrt_llm_ext.distributed import PairExchange
from tensorrt_llm_ext.distributed.low_latency import ExchangeStrategy
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.speculative.selection_decision import VocabParallelSelection
from tensorrt_llm_ext.speculative.vocab_parallel import (TARGET_SALT, VocabParallelHead, VocabShardedLogits,
                                                         gumbel_sample, vocab_parallel_argmax)

__all__ = ["SelectionParams", "VocabParallelSelector"]


@dataclass(frozen=True)
class SelectionParams:
    """One batch's selection inputs. ``temperatures=None``: all rows greedy.

    ``temperatures`` ``[R]`` fp32 (``0`` = greedy row), ``seeds`` / ``offsets`` ``[R]`` int64, device
    tensors prepared before capture (slot-indexed state).
    """

    temperatures: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    salt: int = TARGET_SALT


class VocabParallelSelector:
    """The component a worker holds: made bound (:meth:`bind`, once after load), then selects tokens.

    ``target_head`` / ``draft_head`` are set where that side runs vocab-parallel (None: gathered);
    ``exchange`` is the pair exchange both heads share (None when neither side is vocab-parallel).
    """

    def __init__(self, selection: VocabParallelSelection, lm_head: LanguageModelHead,
                 drafter_lm_head: LanguageModelHead | None, logits_processor: LogitsProcessorLike,
                 exchange: PairExchange | None):
        self.selection = selection
        self.lm_head = lm_head
        self.drafter_lm_head = drafter_lm_head
        self.logits_processor = logits_processor
        self.exchange = exchange
        self.target_head = VocabParallelHead(lm_head, exchange) if selection.target_enabled else None
        self.draft_head = VocabParallelHead(lm_head, exchange) if selection.draft_enabled else None

    @classmethod
    def bind(cls, mapping: Mapping, lm_head: LanguageModelHead, logits_processor: LogitsProcessorLike, *,
             mode: str = "auto", drafter_lm_head: LanguageModelHead | None = None, exchange: str = "nccl",
             max_exchange_rows: int = 0) -> VocabParallelSelector:
        """Decide (agreed across ranks) and bind the heads. Call once, on every rank, after load.

        ``exchange`` (``speculative_config.exchange``: auto | nccl | low_latency) picks the
        :class:`PairExchange` backend; ``max_exchange_rows`` is the most rows one exchange carries
        (``max_batch_size * (K + 1)`` for the worker's target rows).
        """
        strategy = ExchangeStrategy(exchange)  # a bad value fails before any collective
        selection = VocabParallelSelection.decide(mapping, lm_head, logits_processor, mode=mode,
                                                  drafter_lm_head=drafter_lm_head)
        pair = (PairExchange(mapping, strategy, max_rows=max_exchange_rows)
                if (selection.target_enabled or selection.draft_enabled) else None)
        return cls(selection, lm_head, drafter_lm_head, logits_processor, pair)

    def check_exchange(self) -> None:
        """Raise ``RuntimeError`` if the pair exchange timed out since load (no device sync; once per step)."""
        if self.exchange is not None:
            self.exchange.check_exchange()

    def target_logits(self, hidden_states: torch.Tensor,
                      row_indices: torch.Tensor | None = None) -> VocabShardedLogits | torch.Tensor:
        """The step's target logits: this rank's shard when bound vocab-parallel, else the processor's."""
        if self.target_head is not None:
            if row_indices is not None:
                hidden_states = hidden_states.index_select(0, row_indices)
            return self.target_head.shard_logits(hidden_states)
        return self.logits_processor(hidden_states, self.lm_head, row_indices)

    def select_tokens(self, logits: VocabShardedLogits | torch.Tensor, params: SelectionParams | None = None, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy / temperature-only Gumbel selection: ``[R, V_shard]`` shard or ``[R, V]`` full -> ``[R]``.

        CUDA-graph safe.
        """
        params = params or SelectionParams()
        if isinstance(logits, VocabShardedLogits):
            if self.target_head is None:
                raise ValueError("select_tokens: got shard logits but the target side is not vocab-parallel")
            x, start, vocab, exchange = self.target_head.unwrap(logits), logits.vocab_start, logits.vocab_size, \
                self.target_head.exchange
        else:
            x, start, vocab, exchange = logits, 0, logits.shape[-1], None
        if params.temperatures is None:
            return vocab_parallel_argmax(x, start, vocab, exchange, out=out)
        return gumbel_sample(x, params.temperatures, params.seeds, params.offsets, start, vocab, exchange,
                             salt=params.salt, out=out)

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The drafter's block logits: this rank's shard ``[..., V_shard]`` when the draft side is
        vocab-parallel (no gather), else the drafter head's full ``[..., V]`` logits."""
        if self.draft_head is not None:
            return self.draft_head.lm_head.shard_forward(hidden_states)
        return self.drafter_lm_head(hidden_states)

    @property
    def draft_exchange(self) -> PairExchange | None:
        """The exchange the Markov chain uses on a draft shard (None when drafts see the full vocabulary)."""
        return self.draft_head.exchange if self.draft_head is not None else None
