"""Vocab-parallel token selection: the functional ops and the shard types they run on.

With a COLUMN-parallel LM head every TP rank holds the logits of its vocabulary shard. Instead of
all-gathering ``[R, V]`` and running the same selection on every rank, each rank reduces its shard to
one int64 selection key per row (:func:`tensorrt_llm_ext.kernels.shard_select.shard_select_keys`, one
launch) and the :class:`~tensorrt_llm_ext.distributed.PairExchange` (one all-reduce MAX over ``[R]``
int64) picks the winner. The chosen ids are exactly those of the gathered path: ``torch.argmax`` order
(first NaN, then the maximum, ties to the lowest global id) and, for sampling, the same keyed
Gumbel-max noise per global id at every TP size.

Here: :func:`vocab_parallel_argmax`, :func:`gumbel_sample` and their gathered twins :func:`gathered_argmax`,
:func:`gathered_gumbel_sample` (the reference that "bit-exact to the gathered path" is checked against);
:class:`VocabShardedLogits`, a shard with the facts needed to index it; :class:`VocabParallelHead`, an
eligible :class:`LMHead` + exchange. Whether a worker selects this way is decided once after load
(:mod:`.selection_decision`); the worker selects through its :mod:`.token_selector`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm_ext.distributed import PairExchange, allgather
from tensorrt_llm_ext.kernels.ordered_key import MAX_VOCAB
from tensorrt_llm_ext.kernels.shard_select import DRAFT_SALT, TARGET_SALT, shard_select_keys
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.modules.lm_head import LMHead
from tensorrt_llm_ext.modules.linear import TensorParallelMode
from tensorrt_llm_ext.speculative.value_checks import check_row_values

__all__ = [
    "DRAFT_SALT", "TARGET_SALT", "VocabParallelHead", "VocabShardedLogits", "gather_vocab", "gathered_argmax",
    "gathered_gumbel_sample", "gumbel_sample", "vocab_parallel_argmax",
]

_ID_MASK = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------------
# Functional ops
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
    if isinstance(temperatures, torch.Tensor):
        check_row_values(temperatures)
    return _select(shard_logits, vocab_start, vocab_size, exchange, temperatures, seeds, offsets, salt, out)


def gather_vocab(shard_logits: torch.Tensor, vocab_size: int, mapping: Mapping | None) -> torch.Tensor:
    """The full ``[..., vocab_size]`` logits from every rank's shard (all-gather at tp > 1, padding sliced off)."""
    full = shard_logits if mapping is None or mapping.tp_size == 1 else allgather(shard_logits, mapping, dim=-1)
    if full.shape[-1] < vocab_size:
        raise ValueError(f"gathered logits: expected >= {vocab_size} columns, got {full.shape[-1]}")
    return full[..., :vocab_size]


def gathered_argmax(shard_logits: torch.Tensor, vocab_size: int, mapping: Mapping | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The gathered path: all-gather the shards, then the same kernel on the full row (no exchange)."""
    return vocab_parallel_argmax(gather_vocab(shard_logits, vocab_size, mapping), 0, vocab_size, None, out=out)


def gathered_gumbel_sample(shard_logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                           offsets: torch.Tensor, vocab_size: int, mapping: Mapping | None = None, *,
                           salt: int = TARGET_SALT, out: torch.Tensor | None = None) -> torch.Tensor:
    """The gathered twin of :func:`gumbel_sample` (all-gather, then the same kernel, no exchange)."""
    full = gather_vocab(shard_logits, vocab_size, mapping)
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
        return gather_vocab(self.unwrap(shard), self.vocab_size, self.mapping)
