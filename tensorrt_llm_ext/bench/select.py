"""``trtllm-ext bench select``: the shard-reduce kernel of vocab-parallel selection.

Per TP size (shard width ``V / tp``) and row count R: the shard-select kernel (greedy keys, and keyed
Gumbel-max keys), ``torch.argmax`` on the same shard, and the gathered path's selection on the full row
(``torch.argmax`` over ``[R, V]``, plus our kernel on it), all under CUDA-graph replay with input sets
rotated beyond the L2. The floor is the shard read once at the measured copy bandwidth (a copy's
read+write rate is the ceiling for a pure read). The exchange (one ``[R]`` int64 all-reduce) and the
all-gather it replaces are not in this single-GPU table.

A second table sweeps the greedy kernel's schedule (tile width x resident programs per SM, the two knobs
of ``kernels/shard_select.py``) at a few shapes, so one run says whether the defaults are the best.
On CPU: a smoke run at tiny sizes (timings meaningless).
"""

from __future__ import annotations

import argparse

import torch

from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
from tensorrt_llm_ext.kernels import shard_select as ss
from tensorrt_llm_ext.kernels.shard_select import shard_select_keys

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (tp, rows) of the schedule sweep: latency-bound, the 70% goal's shape, the 50% goal's shape.
_SWEEP_SHAPES = ((1, 8), (1, 64), (4, 256))
_SWEEP_BLOCKS = (2048, 4096, 8192)
_SWEEP_PROGRAMS = (1, 2, 4, 8)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--tp-sizes", default="1,2,4,8")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--no-sweep", action="store_true", help="skip the schedule sweep table")


def _sets(rows: int, width: int, dtype, device, n: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(rows * 131 + width)
    return [torch.randn(rows, width, generator=g, device=device).to(dtype) for _ in range(n)]


def _pct(floor: float, t: float) -> str:
    return fmt(100 * floor / t if t == t else float("nan"), 0)


@register_benchmark("select", "vocab-parallel shard selection kernel vs torch.argmax (shard and gathered row)",
                    _add_args)
def run(args: argparse.Namespace) -> None:
    timer = BenchTimer()
    device = timer.device
    dtype = _DTYPES[args.dtype]
    vocab = args.vocab
    rows_list = [int(r) for r in args.rows.split(",")]
    tp_list = [int(t) for t in args.tp_sizes.split(",")]
    sweep_shapes, sweep_blocks, sweep_programs = _SWEEP_SHAPES, _SWEEP_BLOCKS, _SWEEP_PROGRAMS
    if timer.smoke:
        vocab, rows_list, tp_list = 2003, [1, 3], [1, 2]
        sweep_shapes, sweep_blocks, sweep_programs = ((2, 3),), (256, 1024), (2,)
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
                tp, rows, width, fmt(shard_bytes / 2**20, 2), fmt(fl, 2), fmt(t_kernel, 2), _pct(fl, t_kernel),
                fmt(t_gumbel, 2), _pct(fl, t_gumbel), fmt(t_gumbel / t_kernel, 2), fmt(t_argmax, 2),
                fmt(t_argmax / t_kernel, 2), fmt(t_full_argmax, 2), fmt(t_full_kernel, 2),
                fmt(t_full_argmax / t_kernel, 2),
            ])
    print_table(
        f"bench select: shard selection, {args.dtype}, V={vocab}",
        ["tp", "rows", "shard width", "shard MiB", "floor us", "greedy us", "greedy % of floor", "gumbel us",
         "gumbel % of floor", "gumbel/greedy", "argmax(shard) us", "argmax/greedy", "gathered argmax(V) us",
         "greedy(V) us", "gathered/greedy"],
        table,
        notes=[
            f"copy bandwidth (read+write) {fmt(bw / 1e12, 2)} TB/s; floor = shard read once at that rate.",
            "greedy = greedy keys of the last (padded) shard; gumbel = keyed Gumbel-max keys (T=1, all rows "
            "sampled); argmax(shard) = torch.argmax on the same shard (the stock op); gathered = selection on "
            "the full [R, V] row after an all-gather (gather not timed).",
            "Goals: greedy >= 70% of floor at >= 64 rows on the full vocabulary (tp 1) and >= 50% at 256 rows "
            "on tp 2/4 shards; gumbel/greedy <= 2 at >= 64 rows; argmax/greedy >= 1 everywhere.",
        ],
    )
    if args.no_sweep:
        return
    sweep = []
    for tp, rows in sweep_shapes:
        width = -(-vocab // tp)
        start = (tp - 1) * width
        n_valid = min(width, vocab - start)
        shard_bytes = rows * width * elt
        shards = _sets(rows, width, dtype, device, rotation_count(shard_bytes))
        keys = torch.empty(rows, dtype=torch.int64, device=device)
        fl = floor_us(shard_bytes, bw)
        default_block = ss.default_block(n_valid, dtype)
        default_plan = ss.plan_splits(rows, n_valid, device, default_block)
        for block in sweep_blocks:
            for progs in sweep_programs:
                splits, _ = ss.plan_splits(rows, n_valid, device, block, programs_per_sm=progs)
                # Eager call first: the scratch for this row count exists before capture.
                shard_select_keys(shards[0], start, vocab, out=keys, block_size=block, num_splits=splits)
                t = timer.time_graph([
                    lambda x=x, b=block, s=splits: shard_select_keys(x, start, vocab, out=keys, block_size=b,
                                                                     num_splits=s) for x in shards])
                is_default = block == default_block and splits == default_plan[0]
                sweep.append([tp, rows, block, progs, splits, fmt(t, 2), _pct(fl, t), "*" if is_default else ""])
        del shards
    print_table(
        f"bench select: greedy schedule sweep, {args.dtype}, V={vocab}",
        ["tp", "rows", "block", "programs/SM", "splits/row", "greedy us", "% of floor", "default"],
        sweep,
        notes=["block = columns per tile (ss._TILE_BYTES sets the default); programs/SM = the one-wave target of "
               "plan_splits (ss._PROGRAMS_PER_SM is the default); * = the launcher's default schedule. The key "
               "never depends on the schedule."],
    )
