"""``trtllm-ext bench select``: the shard-reduce kernel of vocab-parallel selection.

Per TP size (shard width ``V / tp``) and row count R: the shard-select kernel (greedy keys, and keyed
Gumbel-max keys), ``torch.argmax`` on the same shard, and the gathered path's selection on the full row
(``torch.argmax`` over ``[R, V]``, plus our kernel on it), all under CUDA-graph replay with input sets
rotated beyond the L2. The floor is the shard read once at the measured copy bandwidth (a copy's
read+write rate is the ceiling for a pure read). The exchange (one ``[R]`` int64 all-reduce) and the
all-gather it replaces are not in this single-GPU table.

Two more tables sweep the schedules (``--tables``): the greedy kernel's (tile width x warps x resident
programs per SM) and the sampled kernel's (the same knobs, its own defaults), at a few shapes each, and
print the default lines to paste into ``kernels/shard_select.py`` (the schedule that is fastest summed
over the shapes). A schedule never changes a key. On CPU: a smoke run at tiny sizes (timings meaningless).
"""

from __future__ import annotations

import argparse

import torch

from tensorrt_llm_ext.argtypes import int_list, name_list, positive_int
from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
from tensorrt_llm_ext.kernels import shard_select as ss
from tensorrt_llm_ext.kernels.shard_select import shard_select_keys
from tensorrt_llm_ext.mapping import vocab_shards

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (tp, rows) of the greedy sweep: latency-bound, the 70% goal's shape, the 50% goal's shape.
_SWEEP_SHAPES = ((1, 8), (1, 64), (4, 256))
_SWEEP_BLOCKS = (2048, 4096, 8192)
_SWEEP_WARPS = (4, 8)
_SWEEP_PROGRAMS = (1, 2, 3, 4, 8)
# The sampled sweep: the gumbel/greedy goal's shapes (full vocabulary at 64 and 256 rows) and a TP 4 shard.
_SAMPLED_SHAPES = ((1, 64), (1, 256), (4, 256))
_SAMPLED_BLOCKS = (1024, 2048, 4096)
_SAMPLED_WARPS = (4, 8)
_SAMPLED_PROGRAMS = (2, 4, 8)
# The wide-multiply Philox (same words) is timed at these (block, warps) only: compiles are the sweep's cost.
_SAMPLED_WIDE_AT = ((2048, 4), (1024, 4))
_TABLES = ("main", "greedy", "sampled")


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=positive_int, default=200064)
    p.add_argument("--rows", type=int_list(), default="1,8,64,256")
    p.add_argument("--tp-sizes", type=int_list(), default="1,2,4,8")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--no-sweep", action="store_true", help="the main table only (same as --tables main)")
    p.add_argument("--tables", type=name_list(_TABLES), default=",".join(_TABLES),
                   help=f"comma-separated subset of {','.join(_TABLES)}: the goal table, the greedy schedule sweep, "
                        "the sampled schedule sweep")


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
    tables = set(getattr(args, "tables", ",".join(_TABLES)).split(","))
    if getattr(args, "no_sweep", False):
        tables = {"main"}
    if not tables <= set(_TABLES):
        raise ValueError(f"--tables: expected a subset of {','.join(_TABLES)}, got {','.join(sorted(tables))}")
    sweep_shapes, sweep_blocks = _SWEEP_SHAPES, _SWEEP_BLOCKS
    sweep_warps, sweep_programs = _SWEEP_WARPS, _SWEEP_PROGRAMS
    sampled_shapes, sampled_blocks = _SAMPLED_SHAPES, _SAMPLED_BLOCKS
    sampled_warps, sampled_programs = _SAMPLED_WARPS, _SAMPLED_PROGRAMS
    wide_at = _SAMPLED_WIDE_AT
    if timer.smoke:
        vocab, rows_list, tp_list = 2003, [1, 3], [1, 2]
        sweep_shapes, sweep_blocks, sweep_warps, sweep_programs = ((2, 3),), (256, 1024), (4,), (2,)
        sampled_shapes, sampled_blocks, sampled_warps, sampled_programs = ((2, 3),), (256,), (2, 4), (2,)
        wide_at = ((256, 4),)
    bw = measure_copy_bandwidth(device)
    elt = torch.tensor([], dtype=dtype).element_size()
    if "main" in tables:
        _main_table(timer, bw, dtype, args.dtype, vocab, elt, tp_list, rows_list)
    if "greedy" in tables:
        _sweep(timer, bw, dtype, vocab, elt, sampled=False, shapes=sweep_shapes, blocks=sweep_blocks,
               warps=sweep_warps, programs=sweep_programs)
    if "sampled" in tables:
        _sweep(timer, bw, dtype, vocab, elt, sampled=True, shapes=sampled_shapes, blocks=sampled_blocks,
               warps=sampled_warps, programs=sampled_programs, wide_at=wide_at)


def _main_table(timer, bw, dtype, dtype_name, vocab, elt, tp_list, rows_list) -> None:
    """The goal table: greedy and sampled kernel, torch.argmax and the gathered path per (tp, rows)."""
    device = timer.device
    table = []
    full_cache: dict[int, tuple[float, float]] = {}
    for tp in tp_list:
        width = vocab_shards(vocab, tp).width  # the LM head's split (block-aligned where it can be)
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
        f"bench select: shard selection, {dtype_name}, V={vocab}",
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


def _sweep(timer, bw, dtype, vocab, elt, *, sampled, shapes, blocks, warps, programs, wide_at=()) -> None:
    """Time every (tile, warps, programs/SM) at each shape (and the wide-multiply Philox at ``wide_at``);
    mark the launcher's default and print the defaults to paste (least time summed over the shapes)."""
    device = timer.device
    kind = "sampled" if sampled else "greedy"
    rows_out, totals = [], {}
    for tp, rows in shapes:
        width = vocab_shards(vocab, tp).width  # the LM head's split (block-aligned where it can be)
        start = (tp - 1) * width
        n_valid = min(width, vocab - start)
        shard_bytes = rows * width * elt
        shards = _sets(rows, width, dtype, device, rotation_count(shard_bytes))
        keys = torch.empty(rows, dtype=torch.int64, device=device)
        samp = {}
        if sampled:
            samp = dict(temperatures=torch.ones(rows, dtype=torch.float32, device=device),
                        seeds=torch.arange(rows, dtype=torch.int64, device=device),
                        offsets=torch.arange(rows, dtype=torch.int64, device=device))
        fl = floor_us(shard_bytes, bw)
        d_block = ss.default_block(n_valid, dtype, sampled)
        d_warps = ss.default_warps(d_block, sampled)
        d_splits = ss.plan_splits(rows, n_valid, device, d_block,
                                  programs_per_sm=ss._SAMPLED_PROGRAMS_PER_SM if sampled else ss._PROGRAMS_PER_SM)[0]
        reference = None
        # 8192-column tiles at 4 warps spill on sm90 (255 registers): not worth a timing.
        grid = [(b, w, p, False) for b in blocks for w in warps for p in programs if (b, w) != (8192, 4)]
        grid += [(b, w, p, True) for b, w in wide_at for p in programs]
        for block, nw, progs, wide in grid:
            splits, _ = ss.plan_splits(rows, n_valid, device, block, programs_per_sm=progs)
            kw = dict(out=keys, block_size=block, num_splits=splits, num_warps=nw, **samp)
            if sampled:
                kw["wide_mul"] = wide
            # Eager call first: the scratch for this row count exists before capture; and the key
            # must not depend on the schedule.
            shard_select_keys(shards[0], start, vocab, **kw)
            if reference is None:
                reference = keys.clone()
            elif not torch.equal(keys, reference):
                raise RuntimeError(f"bench select: {kind} keys depend on the schedule "
                                   f"(block {block}, warps {nw}, splits {splits})")
            t = timer.time_graph([lambda x=x, kw=kw: shard_select_keys(x, start, vocab, **kw) for x in shards])
            is_default = (block == d_block and nw == d_warps and splits == d_splits
                          and wide == (sampled and ss._SAMPLED_WIDE_MUL))
            totals[(block, nw, progs, wide)] = totals.get((block, nw, progs, wide), 0.0) + t
            rows_out.append([tp, rows, block, nw, progs, "yes" if wide else "", splits, fmt(t, 2),
                             _pct(fl, t), "*" if is_default else ""])
        del shards
    best = min(totals, key=totals.get) if totals else None
    paste = ""
    if best is not None:
        block, nw, progs, wide = best
        if sampled:
            paste = (f"fastest summed over the shapes: _SAMPLED_TILE_COLUMNS = {block}; _SAMPLED_WARPS = {nw}; "
                     f"_SAMPLED_PROGRAMS_PER_SM = {progs}; _SAMPLED_WIDE_MUL = {wide}")
        else:
            paste = (f"fastest summed over the shapes: _TILE_BYTES = {block * elt} ({block} columns); "
                     f"default_warps -> {nw}; _PROGRAMS_PER_SM = {progs}")
    print_table(
        f"bench select: {kind} schedule sweep, {_dtype_name(dtype)}, V={vocab}",
        ["tp", "rows", "block", "warps", "programs/SM", "wide mul", "splits/row", f"{kind} us", "% of floor",
         "default"],
        rows_out,
        notes=["block = columns per tile; programs/SM = the one-wave target of plan_splits; wide mul = Philox by "
               "32x32->64-bit multiplies (sampled only; same words); * = the launcher's default schedule. Every "
               "schedule gave the same keys (checked).", paste],
    )


def _dtype_name(dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)
