"""Per-rank decisions made identical on every rank before anyone acts on them.

A fallback that one rank takes alone leaves its peers waiting in a collective it never joins; agree
first (one tiny all-reduce over the CPU group), then branch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tensorrt_llm_ext.distributed.communicator import tp_cpu_group
from tensorrt_llm_ext.mapping import Mapping


def _reduce_flag(mapping: Mapping, flag: bool, op) -> bool:
    group = tp_cpu_group(mapping)
    if group is None:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=op, group=group)
    return bool(t.item())


def agree_all(mapping: Mapping, flag: bool) -> bool:
    """True on every rank iff ``flag`` is True on every rank of the TP group (all-reduce MIN)."""
    return _reduce_flag(mapping, flag, dist.ReduceOp.MIN)


def agree_any(mapping: Mapping, flag: bool) -> bool:
    """True on every rank iff ``flag`` is True on any rank of the TP group (all-reduce MAX)."""
    return _reduce_flag(mapping, flag, dist.ReduceOp.MAX)


def agree_codes(mapping: Mapping, code: int) -> list[int]:
    """Every TP rank's ``code`` (a small non-negative int), identical on every rank: ``[tp_size]``.

    One all-reduce SUM of a one-hot ``[tp_size]`` vector over the CPU group, so each rank can word the
    same log line (which rank failed first, and why) without a pickled collective.
    """
    group = tp_cpu_group(mapping)
    if group is None:
        return [int(code)]
    t = torch.zeros(mapping.tp_size, dtype=torch.int64)
    t[mapping.tp_rank] = int(code)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [int(c) for c in t.tolist()]


def gather_objects(mapping: Mapping, obj) -> list:
    """``obj`` of every rank of the TP group, in rank order (one pickled all-gather over the CPU group;
    ``[obj]`` at tp 1). For host-side checks made once per batch, never inside a step."""
    group = tp_cpu_group(mapping)
    if group is None:
        return [obj]
    out = [None] * mapping.tp_size
    dist.all_gather_object(out, obj, group=group)
    return out
