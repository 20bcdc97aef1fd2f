"""Vocab-parallel target and draft token selection.

With a COLUMN-parallel LM head every TP rank holds the logits of its vocabulary shard. Instead of
all-gathering ``[R, V]`` and running the same selection on every rank, each rank reduces its shard to
one int64 selection key per row (:func:`tensorrt_llm_ext.kernels.shard_select.shard_select_keys`, one
launch) and the :class:`~tensorrt_llm_ext.distributed.PairExchange` (one all-reduce MAX over ``[R]``
int64) picks the winner. The chosen ids are exactly those of the gathered path: ``torch.argmax`` order
(first NaN, then the maximum, ties to the lowest global id) and, for sampling, the same keyed
Gumbel-max noise per global id at every TP size.

Layers, bottom up:

* functional: :func:`vocab_parallel_argmax`, :func:`gumbel_sample` and their gathered twins :func:`gathered_argmax`, :func:`gathered_gumbel_sample` (the reference that
  "bit-exact to the gathered path" is checked against);
* :class:`VocabShardedLogits`: a shard with the facts needed to index it;
* :class:`VocabParallelHead`: an eligible :class:`LMHead` + exchange;
* :class:`VocabParallelSelection`: the decision, made once after load, agreed across ranks, logged;
* :class:`VocabParallelSelector`: the component a worker holds, bound once after load;
* :class:`VocabParallelSelectionMixin`: the post-load hook that binds it on a worker.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from tensorrt_llm_ext.contract import MIN_TEMPERATURE, DraftModel, LanguageModelHead, LogitsProcessorLike, TargetModel
from tensorrt_llm_ext.distributed import PairExchange, agree_any, allgather
from tensorrt_llm_ext.distributed.low_latency import ExchangeStrategy
from tensorrt_llm_ext.kernels.common import is_capturing
from tensorrt_llm_ext.kernels.ordered_key import MAX_VOCAB
from tensorrt_llm_ext.kernels.shard_select import DRAFT_SALT, TARGET_SALT, shard_select_keys
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.modules.lm_head import LMHead
from tensorrt_llm_ext.modules.linear import TensorParallelMode
from tensorrt_llm_ext.modules.logits_processor import LogitsProcessor

__all__ = [
    "DRAFT_SALT", "TARGET_SALT", "SelectionMode", "SelectionParams", "VocabParallelHead",
    "VocabParallelSelection", "VocabParallelSelectionMixin", "VocabParallelSelector", "VocabShardedLogits",
    "gathered_argmax", "gathered_gumbel_sample", "gumbel_sample", "vocab_parallel_argmax",
]

_ID_MASK = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------------
# Functional layer
# ----------------------------------------------------------------------------------------------------
def _rows_2d(shard_logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(shard_logits, torch.Tensor) or shard_logits.dim() < 2:
        got = tuple(shard_logits.shape) if isinstance(shard_logits, torch.Tensor) else type(shard_logits).__name__
        raise ValueError(f"shard_logits: expected a tensor [R, V_shard] (or [..., V_shard]), got {got}")
    return shard_logits if shard_logits.dim() == 2 else shard_logits.reshape(-1, shard_logits.shape[-1])


def _check_exchange(exchange: PairExchange | None) -> bool:
    """True when a cross-rank exchange follows (tp > 1)."""
    if exchange is None:
        return False
    if not isinstance(exchange, PairExchange):
        raise ValueError(f"exchange: expected a PairExchange or None, got {type(exchange).__name__}")
    return not exchange.is_identity


def _select(shard_logits, vocab_start, vocab_size, exchange, temperatures, seeds, offsets, salt, out):
    x = _rows_2d(shard_logits)
    if x.shape[1] == 0:
        # No candidate: the key stays EMPTY_KEY and would decode to id -1 (one rank) or 0xFFFFFFFF
        # (after the exchange). Shards of an evenly split head all have the same width, so every rank
        # refuses alike.
        raise ValueError(f"shard_logits: the shard has no vocabulary columns (shape {tuple(shard_logits.shape)})")
    if out is not None and out.dim() != 1:
        out_flat = out.view(-1)  # [B, K] -> [B*K]; a view keeps the write in place
    else:
        out_flat = out
    if not _check_exchange(exchange):
        # This rank holds every candidate: the kernel writes ids directly.
        ids = shard_select_keys(x, vocab_start, vocab_size, temperatures, seeds, offsets, salt=salt,
                                out=out_flat, return_ids=True)
        return out if out is not None else ids
    keys = shard_select_keys(x, vocab_start, vocab_size, temperatures, seeds, offsets, salt=salt, out=out_flat)
    exchange.exchange_(keys)
    # id = 0xFFFFFFFF - (key & 0xFFFFFFFF) == ~key & 0xFFFFFFFF; in place, no EMPTY_KEY after the
    # exchange since the shards together cover the vocabulary.
    torch.bitwise_not(keys, out=keys)
    keys.bitwise_and_(_ID_MASK)
    return out if out is not None else keys


def vocab_parallel_argmax(
    shard_logits: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    exchange: PairExchange | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy ids over the whole vocabulary from this rank's shard: ``[R, V_shard] -> [R]`` int64.

    Equal to ``torch.argmax(gathered_logits[:, :vocab_size], -1)`` bit for bit (first NaN, max, lowest id).
    Padded columns (global id ``>= vocab_size``) never win. ``exchange=None`` (or tp 1): this rank holds
    the whole vocabulary. One kernel launch + one ``[R]`` int64 all-reduce MAX; ``out`` (``[R]`` int64)
    is written in place. CUDA-graph safe (see :func:`shard_select_keys` for the split scratch).
    """
    return _select(shard_logits, vocab_start, vocab_size, exchange, None, None, None, TARGET_SALT, out)


def gumbel_sample(
    shard_logits: torch.Tensor,
    temperatures: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    exchange: PairExchange | None = None,
    *,
    salt: int = TARGET_SALT,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keyed Gumbel-max sampling from this rank's shard: ``[R, V_shard] -> [R]`` int64.

    ``token = argmax(div_rn(x, T) + G(seed, offset, global id, salt))`` per row, fp32; rows with
    ``temperatures <= 0`` are greedy (plain argmax), so a batch may mix greedy and sampled rows.
    ``temperatures`` ``[R]`` fp32, ``seeds`` / ``offsets`` ``[R]`` int64 (the request's seed and the
    position of the draw; change the offset per step). The draw depends on the global id only, hence is
    the same at every TP size. One launch + one collective; CUDA-graph safe.
    """
    _check_temperatures(temperatures)
    return _select(shard_logits, vocab_start, vocab_size, exchange, temperatures, seeds, offsets, salt, out)


def _check_temperatures(temperatures) -> None:
    # Below MIN_TEMPERATURE the scaled logits overflow fp32 (every positive logit ties at +inf): refused,
    # not silently drawn. One host read, skipped while a CUDA graph captures (no sync there; the engine
    # serves such requests greedy before they reach a slot).
    if not isinstance(temperatures, torch.Tensor) or temperatures.numel() == 0 or is_capturing(temperatures.device):
        return
    tiny = (temperatures > 0) & (temperatures < MIN_TEMPERATURE)
    if bool(tiny.any()):
        raise ValueError(f"temperatures: expected 0 (greedy) or >= {MIN_TEMPERATURE:g}, got "
                         f"{temperatures[tiny][:4].tolist()} (a smaller T overflows the scaled logits; serve it "
                         f"greedy, its T -> 0 limit)")


def _gather_full(shard_logits: torch.Tensor, vocab_size: int, mapping: Mapping | None) -> torch.Tensor:
    full = shard_logits if mapping is None or mapping.tp_size == 1 else allgather(shard_logits, mapping, dim=-1)
    if full.shape[-1] < vocab_size:
        raise ValueError(f"gathered logits: expected >= {vocab_size} columns, got {full.shape[-1]}")
    return full[..., :vocab_size]


def gathered_argmax(shard_logits: torch.Tensor, vocab_size: int, mapping: Mapping | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The gathered path: all-gather the shards, then the same kernel on the full row (no exchange)."""
    return vocab_parallel_argmax(_gather_full(shard_logits, vocab_size, mapping), 0, vocab_size, None, out=out)


def gathered_gumbel_sample(shard_logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                           offsets: torch.Tensor, vocab_size: int, mapping: Mapping | None = None, *,
                           salt: int = TARGET_SALT, out: torch.Tensor | None = None) -> torch.Tensor:
    """The gathered twin of :func:`gumbel_sample` (all-gather, then the same kernel, no exchange)."""
    full = _gather_full(shard_logits, vocab_size, mapping)
    return gumbel_sample(full, temperatures, seeds, offsets, 0, vocab_size, None, salt=salt, out=out)


# ----------------------------------------------------------------------------------------------------
# Shard logits and the head
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VocabShardedLogits:
    """This rank's vocabulary shard of some logits, with what is needed to index it.

    ``logits [..., shard_width]``: column ``j`` is global id ``vocab_start + j``; columns with global id
    ``>= vocab_size`` are padding (only the last shard has any) and never selected.
    """

    logits: torch.Tensor
    vocab_start: int
    vocab_size: int
    padded_vocab_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.logits, torch.Tensor) or self.logits.dim() < 1:
            raise ValueError("VocabShardedLogits.logits: expected a tensor [..., V_shard]")
        width = self.logits.shape[-1]
        if not 0 < self.vocab_size <= MAX_VOCAB:
            raise ValueError(f"VocabShardedLogits.vocab_size: expected in [1, {MAX_VOCAB}], got {self.vocab_size}")
        if not 0 <= self.vocab_start < self.vocab_size:
            raise ValueError(f"VocabShardedLogits.vocab_start: expected in [0, {self.vocab_size}), "
                             f"got {self.vocab_start}")
        if self.padded_vocab_size < self.vocab_size or self.padded_vocab_size % width != 0:
            raise ValueError(f"VocabShardedLogits.padded_vocab_size: expected >= vocab_size={self.vocab_size} "
                             f"and a multiple of the shard width {width}, got {self.padded_vocab_size}")
        if self.vocab_start % width != 0 or self.vocab_start + width > self.padded_vocab_size:
            raise ValueError(f"VocabShardedLogits: shard [{self.vocab_start}, {self.vocab_start + width}) is "
                             f"not a shard of the padded vocabulary [0, {self.padded_vocab_size})")

    @property
    def shard_width(self) -> int:
        return self.logits.shape[-1]

    @property
    def tp_size(self) -> int:
        return self.padded_vocab_size // self.shard_width


class VocabParallelHead:
    """An eligible COLUMN-parallel :class:`LMHead` plus the pair exchange of its TP group.

    Created once after load (by :class:`VocabParallelSelector`); every method is CUDA-graph safe.
    """

    def __init__(self, lm_head: LMHead, exchange: PairExchange):
        if not isinstance(lm_head, LMHead) or lm_head.tp_mode != TensorParallelMode.COLUMN:
            raise ValueError("VocabParallelHead: expected a COLUMN-parallel LMHead")
        if lm_head.quantized:
            raise ValueError("VocabParallelHead: a quantized LM head is not supported")
        if exchange.tp_size != lm_head.tp_size:
            raise ValueError(f"VocabParallelHead: exchange tp_size {exchange.tp_size} != "
                             f"head tp_size {lm_head.tp_size}")
        self.lm_head = lm_head
        self.exchange = exchange
        self.mapping = lm_head.mapping

    @property
    def vocab_start(self) -> int:
        return self.lm_head.vocab_start

    @property
    def vocab_size(self) -> int:
        return self.lm_head.vocab_size

    @property
    def padded_vocab_size(self) -> int:
        return self.lm_head.padded_vocab_size

    def wrap(self, shard: torch.Tensor) -> VocabShardedLogits:
        return VocabShardedLogits(shard, self.vocab_start, self.vocab_size, self.padded_vocab_size)

    def unwrap(self, shard: VocabShardedLogits | torch.Tensor) -> torch.Tensor:
        if isinstance(shard, VocabShardedLogits):
            if (shard.vocab_start, shard.vocab_size, shard.padded_vocab_size) != (
                    self.vocab_start, self.vocab_size, self.padded_vocab_size):
                raise ValueError(f"VocabParallelHead: shard [{shard.vocab_start}, +{shard.shard_width}) of "
                                 f"V={shard.vocab_size} is not this head's [{self.vocab_start}, "
                                 f"+{self.lm_head.shard_width}) of V={self.vocab_size}")
            return shard.logits
        if shard.shape[-1] != self.lm_head.shard_width:
            raise ValueError(f"VocabParallelHead: expected shard logits [..., {self.lm_head.shard_width}], "
                             f"got {tuple(shard.shape)}")
        return shard

    def shard_logits(self, hidden: torch.Tensor) -> VocabShardedLogits:
        """``hidden [..., H]`` -> this rank's shard ``[..., V_padded / tp]`` (no gather)."""
        return self.wrap(self.lm_head.shard_forward(hidden))

    def gather(self, shard: VocabShardedLogits | torch.Tensor) -> torch.Tensor:
        """The fallback: all-gather to the full ``[..., V]`` logits (padding sliced off)."""
        return _gather_full(self.unwrap(shard), self.vocab_size, self.mapping)


# ----------------------------------------------------------------------------------------------------
# The decision, made once after load
# ----------------------------------------------------------------------------------------------------
class SelectionMode(str, enum.Enum):
    AUTO = "auto"  # vocab-parallel where eligible, else the gathered path (reason logged)
    ON = "on"  # like AUTO, but an ineligible target is an error instead of a fallback
    OFF = "off"  # always the gathered path


class _Check(enum.Enum):
    """Eligibility checks in the order they are evaluated; the first that fails is the reason."""

    MODE_OFF = "vocab-parallel selection is off (mode='off')"
    TP_ONE = "tp_size == 1: nothing is gathered, nothing to gain"
    ATTENTION_DP = "attention DP: the head is not vocab-sharded over a plain TP group"
    HEAD_NOT_COLUMN = "the LM head is not a COLUMN-parallel LMHead with gather_output"
    HEAD_QUANTIZED = "the LM head is quantized"
    HEAD_UNEVEN = "the LM head is unevenly sharded (vocab % tp != 0, padded last shard)"
    VOCAB_TOO_LARGE = "vocab >= 2^32 does not fit the int64 selection key"
    CUSTOM_LOGITS_PROCESSOR = "the model has its own logits processor (not the plain LogitsProcessor)"
    DRAFTER_OWN_HEAD = "the drafter does not draft through the target's LM head"


_HEAD_CHECKS = (_Check.HEAD_NOT_COLUMN, _Check.HEAD_QUANTIZED, _Check.HEAD_UNEVEN, _Check.VOCAB_TOO_LARGE)


def _head_failures(lm_head) -> dict[_Check, bool]:
    if not isinstance(lm_head, LMHead):
        return {_Check.HEAD_NOT_COLUMN: True, _Check.HEAD_QUANTIZED: False, _Check.HEAD_UNEVEN: False,
                _Check.VOCAB_TOO_LARGE: False}
    return {
        _Check.HEAD_NOT_COLUMN: lm_head.tp_mode != TensorParallelMode.COLUMN or not lm_head.gather_output,
        _Check.HEAD_QUANTIZED: bool(lm_head.quantized),
        _Check.HEAD_UNEVEN: not lm_head.is_evenly_sharded,
        _Check.VOCAB_TOO_LARGE: lm_head.padded_vocab_size > MAX_VOCAB,
    }


def local_target_failures(mapping: Mapping, lm_head, logits_processor, *, mode: str = "auto") -> dict[_Check, bool]:
    """This rank's target-side checks (no collective); ``True`` = the check fails here."""
    mode = SelectionMode(mode)
    failures = {
        _Check.MODE_OFF: mode == SelectionMode.OFF,
        _Check.TP_ONE: mapping.tp_size == 1,
        _Check.ATTENTION_DP: mapping.enable_attention_dp,
    }
    failures.update(_head_failures(lm_head))
    failures.update({
        # Exactly the plain class: a subclass may transform the logits.
        _Check.CUSTOM_LOGITS_PROCESSOR: type(logits_processor) is not LogitsProcessor,
    })
    return failures


def local_draft_failures(mapping: Mapping, lm_head, drafter_lm_head, *, mode: str = "auto") -> dict[_Check, bool]:
    """This rank's draft-side checks: the drafter drafts greedily through the target's own (eligible) head."""
    mode = SelectionMode(mode)
    failures = {
        _Check.MODE_OFF: mode == SelectionMode.OFF,
        _Check.TP_ONE: mapping.tp_size == 1,
        _Check.ATTENTION_DP: mapping.enable_attention_dp,
        _Check.DRAFTER_OWN_HEAD: drafter_lm_head is None or drafter_lm_head is not lm_head,
    }
    failures.update(_head_failures(lm_head))
    return failures


# Checks whose inputs are identical on every rank by construction need no agreement.
_UNIFORM = {_Check.MODE_OFF, _Check.TP_ONE, _Check.ATTENTION_DP}


def _first_agreed_failure(mapping: Mapping, failures: dict[_Check, bool]) -> _Check | None:
    """The first check that fails on ANY rank; every rank walks the same checks, so the same collectives."""
    for check, failed in failures.items():
        if check in _UNIFORM or mapping.tp_size == 1:
            if failed:
                return check
            continue
        if agree_any(mapping, failed):
            return check
    return None


@dataclass(frozen=True)
class VocabParallelSelection:
    """Whether target and draft token selection run vocab-parallel, and why (identical on every rank)."""

    target_enabled: bool
    draft_enabled: bool
    target_reason: str
    draft_reason: str
    tp_size: int = 1

    @classmethod
    def decide(cls, mapping: Mapping, lm_head, logits_processor, *, mode: str = "auto",
               drafter_lm_head=None) -> "VocabParallelSelection":
        """Decide once after load (a few tiny CPU collectives when tp > 1: call on every rank).

        Target side first (plain ``LogitsProcessor`` only), then the draft
        side (only once the drafter has taken over the target's head). ``mode='on'`` raises instead of
        falling back for the target side.
        """
        mode = SelectionMode(mode)
        t_fail = _first_agreed_failure(mapping, local_target_failures(mapping, lm_head, logits_processor, mode=mode))
        if t_fail is not None and mode == SelectionMode.ON:
            raise ValueError(f"vocab-parallel selection forced on (mode='on') but not possible: {t_fail.value}")
        d_fail = _first_agreed_failure(mapping, local_draft_failures(mapping, lm_head, drafter_lm_head, mode=mode))
        decision = cls(
            target_enabled=t_fail is None,
            draft_enabled=d_fail is None,
            target_reason="eligible" if t_fail is None else t_fail.value,
            draft_reason="eligible" if d_fail is None else d_fail.value,
            tp_size=mapping.tp_size,
        )
        logger.info(decision.describe())
        return decision

    def describe(self) -> str:
        t = "vocab-parallel" if self.target_enabled else f"gathered ({self.target_reason})"
        d = "vocab-parallel" if self.draft_enabled else f"gathered ({self.draft_reason})"
        return f"token selection at tp={self.tp_size}: target {t}; draft {d}"


# ----------------------------------------------------------------------------------------------------
# Per batch
# ----------------------------------------------------------------------------------------------------
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


class VocabParallelSelectionMixin:
    """The worker mixin that binds token selection once, after model load.

    :meth:`post_load` (once, on every rank) lets the drafter take over the target's LM head, binds the
    :class:`VocabParallelSelector` into :attr:`vocab_parallel` -- target side first, then the draft side
    against that head -- and calls the worker's :meth:`_on_bound` hook. The decision lives in the
    selector alone; the worker calls the selector directly.
    """

    mapping: Mapping
    target: TargetModel
    drafter: DraftModel
    max_exchange_rows: int  # rows one pair exchange carries (the step's B * (K + 1))
    vocab_parallel: VocabParallelSelector | None = None

    def post_load(self, *, vocab_parallel_mode: str = "auto", exchange: str = "nccl") -> VocabParallelSelection:
        """Bind once after load (a few tiny CPU collectives at tp > 1); calling it twice is an error.

        ``vocab_parallel_mode`` is ``speculative_config.vocab_parallel_selection`` (auto | on | off),
        ``exchange`` is ``speculative_config.exchange`` (the pair exchange's backend).
        """
        if self.vocab_parallel is not None:
            raise RuntimeError(f"{type(self).__name__}.post_load: already bound (the decision is made once)")
        self.drafter.take_over_lm_head(self.target.lm_head)
        self.vocab_parallel = VocabParallelSelector.bind(
            self.mapping, self.target.lm_head, self.target.logits_processor, mode=vocab_parallel_mode,
            drafter_lm_head=self.drafter.lm_head, exchange=exchange, max_exchange_rows=self.max_exchange_rows)
        self._on_bound()
        return self.vocab_parallel.selection

    def _on_bound(self) -> None:
        """Hook for subclasses: build what depends on the selection decision (buffers, chain)."""

    @property
    def selection(self) -> VocabParallelSelection | None:
        """The decision (None before :meth:`post_load`)."""
        return None if self.vocab_parallel is None else self.vocab_parallel.selection
