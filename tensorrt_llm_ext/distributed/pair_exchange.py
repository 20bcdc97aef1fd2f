"""The exact ``(value, global index)`` exchange of vocab-parallel selection.

Every rank reduces its vocabulary shard to one int64 selection key per row (see
:mod:`tensorrt_llm_ext.kernels.ordered_key`: order-preserving value bits in the high word,
``0xFFFFFFFF - global id`` in the low word). The TP winner is then the plain maximum, taken with one
all-reduce MAX over int64: exact for any value (NaN first, ties to the lowest global id) and any
vocabulary below 2^32 -- no low-precision reduction anywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tensorrt_llm_ext.distributed.communicator import tp_group
from tensorrt_llm_ext.kernels.ordered_key import key_to_id_torch
from tensorrt_llm_ext.mapping import Mapping


class PairExchange:
    """One all-reduce MAX of int64 selection keys over the TP group (no-op at tp 1).

    CUDA-graph safe: in place, no allocation, no host sync.
    """

    def __init__(self, mapping: Mapping):
        self.mapping = mapping
        self._group = tp_group(mapping)

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
        if self._group is not None:
            dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=self._group)
        return keys

    def winner_ids(self, keys: torch.Tensor) -> torch.Tensor:
        """Exchange ``keys`` in place and decode the winning global ids (int64 ``[R]``)."""
        return key_to_id_torch(self.exchange_(keys))
