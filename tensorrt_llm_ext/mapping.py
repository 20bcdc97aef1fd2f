"""Rank layout, TensorRT-LLM style: ``world_size = tp_size * pp_size``, TP groups of consecutive ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    """Where this rank sits in the parallel layout.

    Only tensor parallelism (and the attention-DP flag that disables vocab-parallel selection and the
    drafter TP fusions) is used by this module; ``pp_size`` is kept so layouts read as in TensorRT-LLM.
    """

    world_size: int = 1
    rank: int = 0
    gpus_per_node: int = 8
    tp_size: int = 1
    pp_size: int = 1
    enable_attention_dp: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Mapping.{name} must be a positive int, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mapping.rank must be in [0, {self.world_size}), got {self.rank}")
        if self.world_size % self.tp_size != 0:
            raise ValueError(
                f"tp_size={self.tp_size} does not divide world_size={self.world_size}")
        if self.tp_size * self.pp_size != self.world_size:
            raise ValueError(
                f"world_size={self.world_size} must equal tp_size*pp_size={self.tp_size}*{self.pp_size}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_group(self) -> tuple[int, ...]:
        """Global ranks of this rank's TP group."""
        base = self.pp_rank * self.tp_size
        return tuple(range(base, base + self.tp_size))

    @property
    def local_rank(self) -> int:
        return self.rank % self.gpus_per_node

    @property
    def has_tp(self) -> bool:
        return self.tp_size > 1

    @property
    def is_plain_tp(self) -> bool:
        """TP > 1 without attention DP: the layout vocab-parallel selection and drafter fusion need."""
        return self.tp_size > 1 and not self.enable_attention_dp
