"""TP collectives with TensorRT-LLM's names: ``AllReduce`` with fusion ops, ``allgather``.

The fused norm after the reduction is the Triton kernel of :mod:`tensorrt_llm_ext.kernels.rms_norm`
(eager twin where Triton cannot run). Strategies other than NCCL are accepted for config compatibility
and resolve to the torch.distributed all-reduce (NCCL on GPU, gloo on CPU), logged once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tensorrt_llm_ext.distributed.communicator import tp_group
from tensorrt_llm_ext.kernels.rms_norm import rms_norm_nd
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.mapping import Mapping


class AllReduceStrategy(enum.IntEnum):
    NCCL = 0
    MIN_LATENCY = 1
    UB = 2
    AUTO = 3
    ONESHOT = 4
    TWOSHOT = 5
    MNNVL = 7
    NCCL_SYMMETRIC = 8


class AllReduceFusionOp(enum.IntEnum):
    NONE = 0
    RESIDUAL_RMS_NORM = 1
    RMS_NORM = 9


@dataclass
class AllReduceParams:
    """What to fuse after the reduction (TensorRT-LLM's AllReduceParams, the fields used here)."""

    fusion_op: AllReduceFusionOp = AllReduceFusionOp.NONE
    residual: torch.Tensor | None = None  # [rows, hidden], RESIDUAL_RMS_NORM only
    norm_weight: torch.Tensor | None = None  # [hidden]
    eps: float = 1e-6
    enable_allreduce: bool = True  # False: only the fused epilogue (e.g. tp 1)


def _all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """In-place SUM over ``group``; gloo lacks bf16/fp16 sums on some builds, so it reduces in fp32."""
    if x.is_cuda or x.dtype == torch.float32:
        dist.all_reduce(x, group=group)
        return x
    tmp = x.float()
    dist.all_reduce(tmp, group=group)
    x.copy_(tmp)
    return x


class AllReduce(torch.nn.Module):
    """All-reduce over the TP group with an optional fused (residual add +) RMSNorm epilogue.

    ``forward(x, all_reduce_params)`` returns the reduced tensor (NONE), the normed tensor (RMS_NORM)
    or ``(normed, residual_out)`` (RESIDUAL_RMS_NORM). At tp 1 the reduction is skipped and only the
    epilogue runs. Output shapes equal ``x``'s.
    """

    def __init__(self, mapping: Mapping, strategy: AllReduceStrategy = AllReduceStrategy.AUTO):
        super().__init__()
        self.mapping = mapping
        self.strategy = strategy
        if strategy not in (AllReduceStrategy.AUTO, AllReduceStrategy.NCCL):
            info_once(f"AllReduceStrategy.{strategy.name} is not implemented here; using NCCL/gloo "
                      "through torch.distributed", key=f"allreduce-strategy-{strategy.name}")

    def forward(self, x: torch.Tensor, all_reduce_params: AllReduceParams | None = None):
        p = all_reduce_params or AllReduceParams()
        if p.enable_allreduce and self.mapping.tp_size > 1:
            x = _all_reduce_(x.contiguous(), tp_group(self.mapping))
        if p.fusion_op == AllReduceFusionOp.NONE:
            return x
        if p.norm_weight is None:
            raise ValueError(f"AllReduceFusionOp.{p.fusion_op.name} needs norm_weight")
        residual = None
        if p.fusion_op == AllReduceFusionOp.RESIDUAL_RMS_NORM:
            if p.residual is None:
                raise ValueError("AllReduceFusionOp.RESIDUAL_RMS_NORM needs residual")
            residual = p.residual
        elif p.fusion_op != AllReduceFusionOp.RMS_NORM:
            raise ValueError(f"unsupported fusion op {p.fusion_op!r}")
        return rms_norm_nd(x, p.norm_weight, p.eps, residual=residual)


# torch >= 2.13 deprecates all_gather_into_tensor for all_gather_single (same arguments); the GPU image
# (torch 2.11) has only the former.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def allgather(x: torch.Tensor, mapping: Mapping, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's ``x`` along ``dim`` (rank order). Identity at tp 1.

    ``x`` must have the same shape on every rank; the result has ``tp_size`` times its size on ``dim``.
    """
    if mapping.tp_size == 1:
        return x
    group = tp_group(mapping)
    x = x.contiguous()
    flat = torch.empty((mapping.tp_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(flat, x, group=group)
    dim = dim % x.dim()
    if dim == 0:
        return flat
    return torch.cat(flat.chunk(mapping.tp_size, dim=0), dim=dim)
