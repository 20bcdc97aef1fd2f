"""TensorRT-LLM-style tensor-parallel ``Linear``.

``TensorParallelMode.COLUMN`` splits the output features (weight ``[out/tp, in]``); ``ROW`` splits the
input features (weight ``[out, in/tp]``) and expects this rank's slice of the input. A row-parallel
linear either all-reduces its output (``reduce_output=True``) or returns the un-reduced partial sum
(``reduce_output=False``) so the caller can fuse the all-reduce with what follows (residual add +
RMSNorm, see :class:`tensorrt_llm_ext.distributed.AllReduceParams`).

All forwards are allocation-only (``F.linear`` plus, where asked, one collective): no host sync, no
data-dependent branch -- CUDA-graph safe when the collective is.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm_ext.distributed import AllReduce, AllReduceParams, allgather
from tensorrt_llm_ext.mapping import Mapping


class TensorParallelMode(str, enum.Enum):
    COLUMN = "column"
    ROW = "row"

    @classmethod
    def split_dim(cls, mode: "TensorParallelMode") -> int:
        """The dim of the ``[out, in]`` weight that ``mode`` splits."""
        return 0 if mode == cls.COLUMN else 1


def shard_range(full: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``tp_rank``'s even slice of ``full`` (``full % tp_size == 0``)."""
    if full % tp_size != 0:
        raise ValueError(f"cannot split {full} evenly over tp_size={tp_size}")
    size = full // tp_size
    return tp_rank * size, (tp_rank + 1) * size


def init_linear_weight_(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Deterministic fan-in scaled normal init of a FULL ``[out, in]`` weight (fp32 draw, then cast).

    Drawn on the CPU in fp32 from ``generator`` so every rank and every TP size gets the same full
    weight; slice it afterwards with :meth:`Linear.load_weights`.
    """
    draw = torch.randn(weight.shape, generator=generator, dtype=torch.float32) / math.sqrt(weight.shape[1])
    with torch.no_grad():
        weight.copy_(draw.to(weight.dtype))
    return weight


class Linear(nn.Module):
    """``y = x @ W^T (+ b)`` with an optional tensor-parallel split.

    Args:
        in_features, out_features: the FULL (unsharded) sizes.
        bias: add a bias (column: sharded with the outputs; row: whole, added once -- after the
            all-reduce, or on TP rank 0 only when ``reduce_output=False`` so the sum holds it once).
        dtype, device: parameter dtype/device.
        mapping: the rank layout; ``None`` or ``tensor_parallel_mode=None`` means replicated.
        tensor_parallel_mode: ``COLUMN``, ``ROW`` or ``None``.
        gather_output: COLUMN only: all-gather the outputs to ``[..., out_features]``.
        reduce_output: ROW only: all-reduce the partial outputs (``False``: return partials).

    Shapes: ``x [..., in_local]`` -> ``[..., out_local]`` (``in_local = in/tp`` for ROW,
    ``out_local = out/tp`` for COLUMN without ``gather_output``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        mapping: Mapping | None = None,
        tensor_parallel_mode: TensorParallelMode | None = None,
        gather_output: bool = False,
        reduce_output: bool = True,
    ):
        super().__init__()
        self.mapping = mapping or Mapping()
        self.tp_mode = tensor_parallel_mode
        tp_size = self.mapping.tp_size if tensor_parallel_mode is not None else 1
        self.tp_size = tp_size
        self.tp_rank = self.mapping.tp_rank if tensor_parallel_mode is not None else 0
        if gather_output and tensor_parallel_mode != TensorParallelMode.COLUMN:
            raise ValueError("gather_output needs tensor_parallel_mode=COLUMN")
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.reduce_output = reduce_output
        local_in, local_out = in_features, out_features
        if tensor_parallel_mode == TensorParallelMode.COLUMN:
            if out_features % tp_size != 0:
                raise ValueError(f"column-parallel Linear: out_features={out_features} must be divisible "
                                 f"by tp_size={tp_size}")
            local_out = out_features // tp_size
        elif tensor_parallel_mode == TensorParallelMode.ROW:
            if in_features % tp_size != 0:
                raise ValueError(f"row-parallel Linear: in_features={in_features} must be divisible "
                                 f"by tp_size={tp_size}")
            local_in = in_features // tp_size
        elif tensor_parallel_mode is not None:
            raise ValueError(f"tensor_parallel_mode must be COLUMN, ROW or None, got {tensor_parallel_mode!r}")
        self.local_in_features = local_in
        self.local_out_features = local_out
        self.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=dtype, device=device),
                                   requires_grad=False)
        bias_rows = local_out if tensor_parallel_mode == TensorParallelMode.COLUMN else out_features
        self.bias = (nn.Parameter(torch.zeros(bias_rows, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        needs_ar = tensor_parallel_mode == TensorParallelMode.ROW and tp_size > 1 and reduce_output
        self.all_reduce = AllReduce(self.mapping) if needs_ar else None

    # -- weights -------------------------------------------------------------------------------
    def _slice(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp_mode is None or self.tp_size == 1:
            return full
        start, end = shard_range(full.shape[dim], self.tp_size, self.tp_rank)
        return full.narrow(dim, start, end - start)

    def load_weights(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of the FULL ``[out, in]`` weight (and ``[out]`` bias)."""
        if tuple(full_weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"Linear.load_weights: expected full weight "
                             f"[{self.out_features}, {self.in_features}], got {tuple(full_weight.shape)}")
        dim = TensorParallelMode.split_dim(self.tp_mode) if self.tp_mode is not None else 0
        with torch.no_grad():
            self.weight.copy_(self._slice(full_weight, dim))
            if self.bias is not None:
                if full_bias is None or tuple(full_bias.shape) != (self.out_features,):
                    raise ValueError(f"Linear.load_weights: expected full bias [{self.out_features}], "
                                     f"got {None if full_bias is None else tuple(full_bias.shape)}")
                b = self._slice(full_bias, 0) if self.tp_mode == TensorParallelMode.COLUMN else full_bias
                self.bias.copy_(b)
            elif full_bias is not None:
                raise ValueError("Linear.load_weights: got a bias for a Linear built without one")

    def init_weights(self, generator: torch.Generator) -> None:
        """Deterministic init: draw the FULL weight (same on every rank/TP size), then slice."""
        full = init_linear_weight_(torch.empty(self.out_features, self.in_features), generator)
        full_bias = None
        if self.bias is not None:
            full_bias = torch.randn(self.out_features, generator=generator) * 0.02
        self.load_weights(full, full_bias)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, all_reduce_params: AllReduceParams | None = None):
        """``x [..., in_local]`` -> ``[..., out_local]`` (see the class docstring).

        ``all_reduce_params`` (ROW with ``reduce_output=True`` only) fuses an epilogue into the
        all-reduce, as TensorRT-LLM's ``Linear`` does; the return is then the AllReduce's.
        """
        if x.shape[-1] != self.local_in_features:
            raise ValueError(f"Linear: expected input [..., {self.local_in_features}], got {tuple(x.shape)}")
        if self.tp_mode == TensorParallelMode.ROW:
            # Bias once: after the reduction, or on rank 0 only when the caller reduces.
            add_bias_here = self.bias is not None and (not self.reduce_output and self.tp_rank == 0
                                                       or self.tp_size == 1)
            y = F.linear(x, self.weight, self.bias if add_bias_here else None)
            if self.all_reduce is not None:
                if self.bias is not None and all_reduce_params is not None:
                    raise ValueError("Linear: a fused all-reduce epilogue with a row bias is not supported")
                y = self.all_reduce(y, all_reduce_params=all_reduce_params)
                if self.bias is not None:
                    y = y + self.bias
            elif all_reduce_params is not None:
                raise ValueError("Linear: all_reduce_params needs a row-parallel Linear that reduces "
                                 "(tp > 1, reduce_output=True)")
            return y
        if all_reduce_params is not None:
            raise ValueError("Linear: all_reduce_params applies to row-parallel Linears only")
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output and self.tp_size > 1:
            y = allgather(y, self.mapping, dim=-1)
        return y

    def extra_repr(self) -> str:
        mode = self.tp_mode.value if self.tp_mode is not None else "replicated"
        return (f"in={self.in_features}, out={self.out_features}, {mode}, tp={self.tp_size}, "
                f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}")
