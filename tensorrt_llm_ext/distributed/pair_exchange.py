"""The exact ``(value, global index)`` exchange of vocab-parallel selection.

Every rank reduces its vocabulary shard to one int64 selection key per row (see
:mod:`tensorrt_llm_ext.kernels.ordered_key`: order-preserving value bits in the high word,
``0xFFFFFFFF - global id`` in the low word). The TP winner is then the plain maximum, taken with one
all-reduce MAX over int64: exact for any value (NaN first, ties to the lowest global id) and any
vocabulary below 2^32 -- no low-precision reduction anywhere.

Two backends take the same maximum (``strategy``, read once at construction):

* ``nccl``: ``dist.all_reduce(keys, MAX)`` on the TP group.
* ``low_latency`` (:mod:`tensorrt_llm_ext.distributed.low_latency`): tagged words written straight into
  the peers' symmetric memory, one kernel, no NCCL launch; set up in agreed steps on every rank, and
  NCCL on every rank when it cannot be (``auto`` tries it, ``low_latency`` asks for it: both fall back).
  Exchanges of more rows than its buffer holds go through NCCL (decided on the shape, the same on every
  rank). A round whose peer never writes sets a flag in pinned host memory; :meth:`check_exchange`
  raises on it.

Rejection-sampling verification needs a few more small exact collectives over the same group:
:meth:`PairExchange.max_` / :meth:`PairExchange.sum_` (integer all-reduce, in place) and
:meth:`PairExchange.gather_ranks` (every rank's tensor stacked ``[tp, ...]``). Every collective adds the
bytes this rank sends to :attr:`PairExchange.bytes_sent` on the host (no device sync), so a test can show
that the sharded paths move per-row partials only, never a vocabulary row.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tensorrt_llm_ext.distributed.communicator import tp_group
from tensorrt_llm_ext.distributed.low_latency import (ExchangeStrategy, LowLatencyExchange,
                                                      setup_low_latency_exchange)
from tensorrt_llm_ext.distributed.ops import all_gather_flat
from tensorrt_llm_ext.kernels.ordered_key import key_to_id_torch
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.mapping import Mapping


class PairExchange:
    """The TP-wide MAX of int64 selection keys (no-op at tp 1).

    Args:
        mapping: the rank layout.
        strategy: ``"nccl"`` (default), ``"auto"`` or ``"low_latency"`` (see the module docs). Anything
            but ``"nccl"`` at tp > 1 runs collectives over the CPU group: construct on every TP rank.
        max_rows: the most rows one exchange carries (sizes the low-latency buffer).

    CUDA-graph safe: in place, no allocation, no host sync.
    """

    def __init__(self, mapping: Mapping, strategy: ExchangeStrategy | str = ExchangeStrategy.NCCL,
                 max_rows: int = 0):
        self.mapping = mapping
        self._group = tp_group(mapping)
        # Bytes this rank contributed to collectives so far (host counter, counted per call; 0 at tp 1).
        self.bytes_sent = 0
        try:
            self.strategy = ExchangeStrategy(strategy)
        except ValueError:
            raise ValueError(f"PairExchange: strategy must be one of "
                             f"{[s.value for s in ExchangeStrategy]}, got {strategy!r}") from None
        self.low_latency: LowLatencyExchange | None = None
        self.backend_reason = "exchange='nccl'"
        if self.strategy != ExchangeStrategy.NCCL and self._group is not None:
            self.low_latency, self.backend_reason = setup_low_latency_exchange(mapping, max_rows,
                                                                               strategy=self.strategy)

    @property
    def backend(self) -> str:
        """``"low_latency"`` or ``"nccl"`` (identical on every rank)."""
        return "low_latency" if self.low_latency is not None else "nccl"

    @property
    def tp_size(self) -> int:
        return self.mapping.tp_size

    @property
    def is_identity(self) -> bool:
        return self.mapping.tp_size == 1

    def exchange_(self, keys: torch.Tensor) -> torch.Tensor:
        """Replace each rank's ``[R]`` int64 keys by the TP-wide maximum, in place; returns ``keys``."""
        if keys.dtype != torch.int64:
            raise ValueError(f"PairExchange expects int64 selection keys, got {keys.dtype}")
        if not keys.is_contiguous():
            raise ValueError("PairExchange expects contiguous keys")
        if self._group is None:
            return keys
        ll = self.low_latency
        if ll is not None:
            if keys.numel() <= ll.max_rows:
                return ll.exchange_(keys)
            info_once(f"PairExchange: {keys.numel()} rows exceed the low-latency buffer ({ll.max_rows} rows); "
                      "this exchange uses the NCCL all-reduce", key=f"pair-exchange-rows-{keys.numel()}")
        dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=self._group)
        return keys

    def check_exchange(self) -> None:
        """Raise ``RuntimeError`` naming the exchange if a low-latency round timed out (no device sync;
        call once per step). A no-op on the NCCL backend, whose timeouts raise by themselves."""
        if self.low_latency is not None:
            self.low_latency.check_exchange()

    def winner_ids(self, keys: torch.Tensor) -> torch.Tensor:
        """Exchange ``keys`` in place and decode the winning global ids (int64 ``[R]``)."""
        return key_to_id_torch(self.exchange_(keys))

    # ------------------------------------------------------------------------------------------------
    # Small exact collectives of rejection-sampling verification (integer only: exact in any order)
    # ------------------------------------------------------------------------------------------------
    def _check_int_tensor(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"PairExchange.{name}: expected an int32/int64 tensor, got {got}")
        if not t.is_contiguous():
            raise ValueError(f"PairExchange.{name}: expected a contiguous tensor")

    def _count(self, t: torch.Tensor) -> None:
        if self._group is not None:
            self.bytes_sent += t.numel() * t.element_size()

    def _all_reduce_int_(self, name: str, t: torch.Tensor, op) -> torch.Tensor:
        self._check_int_tensor(name, t)
        if self._group is not None:
            self._count(t)
            dist.all_reduce(t, op=op, group=self._group)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise TP-wide maximum of an int32/int64 tensor, in place; returns ``t``."""
        return self._all_reduce_int_("max_", t, dist.ReduceOp.MAX)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise TP-wide sum of an int32/int64 tensor, in place (exact: integer adds); returns ``t``."""
        return self._all_reduce_int_("sum_", t, dist.ReduceOp.SUM)

    def gather_ranks(self, t: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``t`` stacked in TP-rank order: ``[*S] -> [tp, *S]`` (``out`` written in place).

        At tp 1 this is ``t[None]`` (copied into ``out`` when given). CUDA-graph safe with ``out=``.
        """
        self._check_int_tensor("gather_ranks", t)
        shape = (self.tp_size, *t.shape)
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != t.dtype or not out.is_contiguous():
                raise ValueError(f"PairExchange.gather_ranks: out expected contiguous {list(shape)} {t.dtype}, "
                                 f"got {list(out.shape)} {out.dtype}")
        if self._group is None:
            return t.unsqueeze(0) if out is None else out.copy_(t.unsqueeze(0))
        if out is None:
            out = torch.empty(shape, dtype=t.dtype, device=t.device)
        self._count(t)
        all_gather_flat(out.view(-1), t.view(-1), group=self._group)
        return out
