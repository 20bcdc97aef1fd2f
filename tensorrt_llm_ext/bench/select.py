"""``trtllm-ext bench select``: the shard-reduce kernel of vocab-parallel selection.

Per TP size (shard width ``V / tp``) and row count R: the shard-select kernel (greedy keys, and keyed
Gumbel-max keys), ``torch.argmax`` on the same shard, and the gathered path's selection on the full row
(``torch.argmax`` over ``[R, V]``, plus our kernel on it), all under CUDA-graph replay with input sets
rotated beyond the L2. The floor is the shard read once at the measured copy bandwidth (a copy's
read+write rate is the ceiling for a pure read). The exchange (one ``[R]`` int64 all-reduce) and the
all-gather it replaces are not in this single-GPU table.
On CPU: a smoke run at tiny sizes (timings meaningless).
"""

from __future__ import annotations

import argparse

import torch

from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
from tensorrt_llm_ext.kernels.shard_select import shard_select_keys

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--tp-sizes", default="1,2,4,8")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))


def _sets(rows: int, width: int, dtype, device, n: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(rows * 131 + width)
    return [torch.randn(rows, width, generator=g, device=device).to(dtype) for _ in range(n)]


@register_benchmark("select", "vocab-parallel shard selection kernel vs torch.argmax (shard and gathered row)",
                    _add_args)
def run(args: argparse.Namespace) -> None:
    timer = BenchTimer()
    device = timer.device
    dtype = _DTYPES[args.dtype]
    vocab = args.vocab
    rows_list = [int(r) for r in args.rows.split(",")]
    tp_list = [int(t) for t in args.tp_sizes.split(",")]
    if timer.smoke:
        vocab, rows_list, tp_list = 2003, [1, 3], [1, 2]
    bw = measure_copy_bandwidth(device)
    elt = torch.tensor([], dtype=dtype).element_size()
    table = []
    full_cache: dict[int, tuple[float, float]] = {}
    for tp in tp_list:
        width = -(-vocab // tp)
        start = (tp - 1) * width  # the last shard: padded when V % tp != 0
        for rows in rows_list:
            shard_bytes = rows * width * elt
            n = rotation_count(shard_bytes)
            shards = _sets(rows, width, dtype, device, n)
            keys = torch.empty(rows, dtype=torch.int64, device=device)
            temps = torch.ones(rows, dtype=torch.float32, device=device)
            seeds = torch.arange(rows, dtype=torch.int64, device=device)
            offsets = torch.arange(rows, dtype=torch.int64, device=device)
            # One eager call allocates the split scratch outside capture.
            shard_select_keys(shards[0], start, vocab, out=keys)
            t_kernel = timer.time_graph([lambda x=x: shard_select_keys(x, start, vocab, out=keys) for x in shards])
            t_gumbel = timer.time_graph([
                lambda x=x: shard_select_keys(x, start, vocab, temps, seeds, offsets, out=keys) for x in shards])
            t_argmax = timer.time_graph([lambda x=x: torch.argmax(x, dim=-1) for x in shards])
            del shards
            if rows not in full_cache:
                full_bytes = rows * vocab * elt
                fulls = _sets(rows, vocab, dtype, device, rotation_count(full_bytes))
                shard_select_keys(fulls[0], 0, vocab, out=keys)
                full_cache[rows] = (
                    timer.time_graph([lambda x=x: torch.argmax(x, dim=-1) for x in fulls]),
                    timer.time_graph([lambda x=x: shard_select_keys(x, 0, vocab, out=keys) for x in fulls]),
                )
                del fulls
            t_full_argmax, t_full_kernel = full_cache[rows]
            fl = floor_us(shard_bytes, bw)
            table.append([
                tp, rows, width, fmt(shard_bytes / 2**20, 2), fmt(fl, 2), fmt(t_kernel, 2),
                fmt(100 * fl / t_kernel if t_kernel == t_kernel else float("nan"), 0), fmt(t_gumbel, 2),
                fmt(t_argmax, 2), fmt(t_argmax / t_kernel, 2), fmt(t_full_argmax, 2), fmt(t_full_kernel, 2),
                fmt(t_full_argmax / t_kernel, 2),
            ])
    print_table(
        f"bench select: shard selection, {args.dtype}, V={vocab}",
        ["tp", "rows", "shard width", "shard MiB", "floor us", "kernel us", "% of floor", "gumbel us",
         "argmax(shard) us", "argmax/kernel", "gathered argmax(V) us", "kernel(V) us", "gathered/kernel"],
        table,
        notes=[
            f"copy bandwidth (read+write) {fmt(bw / 1e12, 2)} TB/s; floor = shard read once at that rate.",
            "kernel = greedy keys of the last (padded) shard; gumbel = keyed Gumbel-max keys (T=1, all rows "
            "sampled); gathered = selection on the full [R, V] row after an all-gather (gather not timed).",
            "Goal: >= 70% of floor at >= 64 rows, <= 8 us at <= 8 rows, never slower than argmax(shard).",
        ],
    )
