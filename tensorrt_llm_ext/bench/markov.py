"""``trtllm-ext bench markov``: the DSpark Markov draft chain -- eager, exact and fused side by side.

One run answers what the fused step's schedule table and the auto mode's table need (K block
positions, vocabulary V, Markov rank r, bf16, CUDA-graph replay with the base-logit sets rotated
beyond the L2):

1. Full vocabulary, per batch size B:

   * eager: the replicated eager chain (per step ``F.linear`` bias, add, ``torch.argmax``), the baseline;
   * exact; fused with the column order the same every step (``same``) and alternating (``alt``, the
     default): :func:`markov_chain_logits`, greedy, with the per-B schedule of ``fused_config``;
   * gemv: one ``torch.mm(h, w2.t())`` bias GEMV (what ``exact`` runs K times);
   * HBM floor: K reads of ``markov_w2`` + the base logits read + the biased logits written, at the
     measured copy bandwidth; exact floor: K x gemv + the add/select traffic (base read, bias read,
     biased write per step) at that bandwidth;
   * the mode ``auto`` picks at B (``AUTO_MODE_TABLE``) and the mode measured faster.

2. Schedule variants of the fused step per B (alternating order): the table's row and up to
   ``--variants`` others (the 64-row tile first -- the wgmma-sized shape, one shape for every B -- then
   tile width, warps, programs, cache hints), so ``FUSED_SCHEDULES`` can be filled from this run. A
   ``block_b`` is one table for all B (it is part of the bitwise contract): compare it across every B.

3. ``--tables sweep``: the schedule grid the table is filled from (one ``block_b`` per table, so both
   tile shapes at every B): 16-row tiles (block_n, warps, stages, programs per SM) and 64-row tiles at
   8 warps (block_n 32/64, programs per SM 1/2/4 -- the persistent grid -- and 3 stages), each timed per
   B, with the fastest per B and the ``FUSED_SCHEDULES`` rows to paste for each ``block_b`` (consecutive
   B with the same winner merged), and which ``block_b`` is faster summed over B.

4. Per rank on TP 2/4/8 shard widths (one GPU, shard-sized ``markov_w2``, no exchange): exact, fused
   same / alt. The shard's ``markov_w2`` is not rotated, so at TP >= 4 (<= 25.6 MB, below the 60 MiB
   L2) the K reads may be served from L2 -- the stretch goal, reported against the HBM floor.

On CPU: a smoke run at tiny sizes (timings meaningless).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from tensorrt_llm_ext.argtypes import int_list, name_list, positive_int
from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
from tensorrt_llm_ext.kernels.markov_fused_step import FusedConfig, fused_config, fused_grid
from tensorrt_llm_ext.mapping import vocab_shards
from tensorrt_llm_ext.speculative.markov_chain import (AUTO_MODE_TABLE, MarkovWorkspace, auto_mode_for,
                                                       markov_chain_logits)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=positive_int, default=200064)
    p.add_argument("--rank", type=positive_int, default=256)
    p.add_argument("--draft-len", type=positive_int, default=7)
    p.add_argument("--batch", type=int_list(), default="1,4,8,32,64,128")
    p.add_argument("--tp-sizes", type=int_list(), default="2,4,8")
    p.add_argument("--tp-batch", type=int_list(), default="1,8,32,128")
    p.add_argument("--variants", type=int, default=2, choices=range(5),
                   help="fused schedule variants timed per B besides the table's row (0-4)")
    p.add_argument("--tables", type=name_list(_TABLES), default="main,tp",
                   help=f"comma-separated subset of {','.join(_TABLES)}: the chain per B with its schedule "
                        "variants, the schedule sweep (prints FUSED_SCHEDULES rows), the TP shards")


_TABLES = ("main", "sweep", "tp")
# The sweep grid: (block_b, block_n, warps, stages, programs per SM). 64-row tiles run at 8 warps only
# (compiled for sm90: 4 warps spill, and so does block_n 128).
SWEEP_GRID: tuple[tuple[int, int, int, int, int], ...] = (
    (16, 64, 4, 2, 2), (16, 64, 4, 2, 4), (16, 64, 4, 2, 8), (16, 64, 4, 3, 4), (16, 128, 8, 2, 4), (16, 32, 4, 2, 8),
    (64, 64, 8, 2, 1), (64, 64, 8, 2, 2), (64, 64, 8, 2, 4), (64, 64, 8, 3, 2), (64, 32, 8, 2, 2), (64, 32, 8, 2, 4),
)


def sweep_configs(sms: int, block_b: int | None = None) -> list[tuple[FusedConfig, int]]:
    """``(config, programs per SM)`` of :data:`SWEEP_GRID` at ``sms`` SMs (one ``block_b``, or both)."""
    return [(FusedConfig(n, w, st, p * sms, block_b=b), p) for b, n, w, st, p in SWEEP_GRID
            if block_b is None or b == block_b]


def schedule_rows(best: dict[int, tuple[FusedConfig, int]], block_b: int) -> str:
    """``FUSED_SCHEDULES`` source for one ``block_b`` from the fastest config per measured B: consecutive B
    with the same winner share a row, whose ``max_batch`` is the largest of them (the last row: None)."""
    rows: list[list] = []
    for B in sorted(best):
        cfg, progs = best[B]
        key = (cfg.block_n, cfg.num_warps, cfg.num_stages, progs)
        if rows and rows[-1][1] == key:
            rows[-1][0] = B
        else:
            rows.append([B, key])
    out = []
    for i, (B, (n, w, st, p)) in enumerate(rows):
        bound = "None" if i == len(rows) - 1 else str(B)
        out.append(f"FusedSchedule({bound}, block_n={n}, num_warps={w}, num_stages={st}, programs_per_sm={p}"
                   f"{'' if block_b == 16 else f', block_b={block_b}'}),")
    return " ".join(out)


def auto_table_source(faster: dict[int, str]) -> str:
    """``AUTO_MODE_TABLE`` source from the mode measured faster per B (consecutive B merged, the last row
    covering every larger B)."""
    rows: list[list] = []
    for B in sorted(faster):
        if rows and rows[-1][1] == faster[B]:
            rows[-1][0] = B
        else:
            rows.append([B, faster[B]])
    parts = [f'({"None" if i == len(rows) - 1 else B}, "{m}")' for i, (B, m) in enumerate(rows)]
    return f"AUTO_MODE_TABLE = ({', '.join(parts)}{',' if len(parts) == 1 else ''})"


def _eager_chain(base, anchors, w1, w2):
    """The replicated eager chain the fused modes replace (allocates; fine under graph capture's pool)."""
    prev, outs, toks = anchors, [], []
    for k in range(base.shape[1]):
        biased = base[:, k] + F.linear(w1[prev], w2).to(base.dtype)
        prev = torch.argmax(biased, dim=-1)
        outs.append(biased)
        toks.append(prev)
    return torch.stack(outs, dim=1), torch.stack(toks, dim=1)


def schedule_variants(batch_size: int, table: FusedConfig, n: int) -> list[FusedConfig]:
    """Up to ``n`` schedules other than ``table`` worth timing at ``batch_size``: the 64-row tile with the
    table's other fields first (the tile shape at every B), then schedule-only variants."""
    p = table.programs

    def cfg(block_n, warps, programs, stages=2, hints=False, block_b=table.block_b):
        return FusedConfig(block_n, warps, stages, max(1, programs), cache_hints=hints, block_b=block_b)

    # 64-row tiles at 8 warps (compiled for sm90 with triton 3.7: wgmma; 4 warps spill, block_n 128 spills too).
    cands = [cfg(64, 8, p, block_b=64), cfg(32, 8, p, block_b=64)]
    if batch_size <= 16:
        cands += [cfg(128, 8, p // 2), cfg(64, 4, p, stages=3, hints=True)]
    else:
        cands += [cfg(64, 4, 2 * p), cfg(128, 8, p)]
    cands.append(cfg(table.block_n, table.num_warps, table.programs, stages=table.num_stages,
                     hints=not table.cache_hints))
    out = []
    for c in cands:
        if c != table and c not in out:
            out.append(c)
    return out[:n]


class _Case:
    """Rotated input sets of one shape, reused by every variant measured at that shape."""

    def __init__(self, B, K, width, w1, w2, seed):
        device, dtype = w2.device, w2.dtype
        self.elt = torch.tensor([], dtype=dtype).element_size()
        self.logit_bytes = B * K * width * self.elt
        n = rotation_count(2 * self.logit_bytes)
        g = torch.Generator(device=device).manual_seed(seed)
        self.bases = [torch.randn(B, K, width, generator=g, device=device).to(dtype) for _ in range(n)]
        self.outs = [torch.empty_like(x) for x in self.bases]
        self.anchors = torch.randint(0, w1.shape[0], (B,), generator=g, device=device)
        self.B, self.K, self.w1, self.w2 = B, K, w1, w2

    def chain(self, timer, mode, order="alternate", config=None):
        ws = MarkovWorkspace.allocate(self.B, self.K, self.w2, mode)
        return timer.time_graph([
            lambda x=x, o=o: markov_chain_logits(x, self.anchors, self.w1, self.w2, mode=mode, out=o, workspace=ws,
                                                 order=order, config=config)
            for x, o in zip(self.bases, self.outs)])

    def eager(self, timer):
        return timer.time_graph([lambda x=x: _eager_chain(x, self.anchors, self.w1, self.w2) for x in self.bases])

    def gemv(self, timer):
        h = self.w1[self.anchors].contiguous()
        bias = torch.empty(self.B, self.w2.shape[0], dtype=self.w2.dtype, device=self.w2.device)
        return timer.time_graph([lambda: torch.mm(h, self.w2.t(), out=bias)])

    def floors(self, bw, gemv_us):
        w2_bytes = self.w2.numel() * self.elt
        hbm = floor_us(self.K * w2_bytes + 2 * self.logit_bytes, bw)
        return hbm, self.K * gemv_us + floor_us(3 * self.logit_bytes, bw)


def _ratio(a, b, digits=2):
    return fmt(a / b, digits)


@register_benchmark("markov", "DSpark Markov chain: eager vs exact vs fused (orders, schedules), HBM floor, TP shards",
                    _add_args)
def run(args: argparse.Namespace) -> None:
    timer = BenchTimer(reps=7, calls_per_rep=5)  # few iterations: the whole run stays near 3 minutes
    device = timer.device
    V, r, K = args.vocab, args.rank, args.draft_len
    batches = [int(b) for b in args.batch.split(",")]
    tps = [int(t) for t in args.tp_sizes.split(",")]
    tp_batches = [int(b) for b in args.tp_batch.split(",")]
    if timer.smoke:
        V, r, K, batches, tps, tp_batches = 2003, 32, 3, [1, 20], [2], [2]
    interpret = timer.smoke
    bw = measure_copy_bandwidth(device)
    g = torch.Generator(device=device).manual_seed(0)
    w1 = (torch.randn(V, r, generator=g, device=device) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(V, r, generator=g, device=device) * 0.05).to(torch.bfloat16)

    tables = set(args.tables.split(","))
    if not tables <= set(_TABLES):
        raise ValueError(f"--tables: expected a subset of {','.join(_TABLES)}, got {args.tables}")
    if "main" in tables:
        _main(timer, args, bw, V, r, K, batches, w1, w2, interpret)
    if "sweep" in tables:
        _sweep(timer, bw, V, r, K, batches, w1, w2, interpret)
    if "tp" in tables:
        _tp(timer, bw, V, r, K, tps, tp_batches, w1, w2)


def _main(timer, args, bw, V, r, K, batches, w1, w2, interpret):
    device = w2.device
    faster_by_b: dict[int, str] = {}
    rows, sched_rows = [], []
    for B in batches:
        case = _Case(B, K, V, w1, w2, seed=B * 7 + V)
        m = {"eager": case.eager(timer), "exact": case.chain(timer, "exact"),
             "same": case.chain(timer, "fused", order="same"), "alt": case.chain(timer, "fused"),
             "gemv": case.gemv(timer)}
        hbm, exact_floor = case.floors(bw, m["gemv"])
        fused = min(m["same"], m["alt"])
        faster = "-" if timer.smoke else ("fused" if m["alt"] <= m["exact"] else "exact")
        faster_by_b[B] = "fused" if m["alt"] <= m["exact"] else "exact"
        rows.append([B, fmt(m["eager"]), fmt(m["exact"]), fmt(m["same"]), fmt(m["alt"]), fmt(m["gemv"]), fmt(hbm),
                     fmt(exact_floor), _ratio(m["exact"], exact_floor), _ratio(m["alt"], hbm),
                     _ratio(m["alt"], m["same"], 3), _ratio(m["eager"], min(m["exact"], fused)),
                     auto_mode_for(AUTO_MODE_TABLE, B), faster])
        table_cfg = fused_config(r, interpret, device, B)
        for i, cfg in enumerate([table_cfg] + schedule_variants(B, table_cfg, args.variants)):
            us = m["alt"] if i == 0 else case.chain(timer, "fused", config=cfg)
            row_tiles, n_progs = fused_grid(B, V, cfg)[:2]
            sched_rows.append([B, "table" if i == 0 else f"variant {i}", cfg.describe(), f"{row_tiles}x{n_progs}",
                               fmt(us), _ratio(us, hbm), _ratio(us, m["alt"], 3)])
        del case
    print_table(
        f"Markov chain, V={V}, r={r}, K={K}, bf16, full vocabulary (us per chain)",
        ["B", "eager", "exact", "fused same", "fused alt", "gemv x1", "HBM floor", "exact floor", "exact/floor",
         "alt/HBM", "alt/same", "eager/best", "auto", "faster"],
        rows,
        [(f"copy bandwidth {fmt(bw / 1e12, 2)} TB/s (read+write). 'fused same' scans markov_w2 forwards every step, "
         "'fused alt' (the default) backwards at odd steps. Goals: exact/floor <= 1.10; fused/HBM <= 1.15 at "
         "B <= 32, <= 1.3 at B = 64 and 128. 'auto' is the mode the auto table picks here; 'faster' the one "
         "measured faster (exact vs fused alt): fill AUTO_MODE_TABLE from it.",
         f"to paste (speculative/markov_chain.py): {auto_table_source(faster_by_b)}")],
    )
    print_table(
        f"Fused step schedules, V={V}, r={r}, K={K}, bf16, alternating order (us per chain)",
        ["B", "row", "config", "row tiles x programs", "fused", "fused/HBM", "vs table"],
        sched_rows,
        [("config: b<rows per tile>/n<block_n>/w<warps>/s<stages>/p<programs>[/ch cache hints]. For one b every "
         "schedule gives the same bits (tests); b is one value for the whole table (compare b64 against b16 "
         "at every B before switching), the rest may be filled per B from the fastest.")],
    )


def _sweep(timer, bw, V, r, K, batches, w1, w2, interpret):
    """Every config of :data:`SWEEP_GRID` at every B; the fastest per B and block_b, and the rows to paste."""
    device = w2.device
    sms = 1 if interpret else torch.cuda.get_device_properties(device).multi_processor_count
    configs = sweep_configs(sms)
    if interpret:
        configs = [(dataclasses.replace(c, num_stages=1, programs=2), 2) for c, _ in configs[:1]] + [
            (dataclasses.replace(c, num_stages=1, programs=2), 2) for c, _ in configs if c.block_b == 64][:1]
    rows, best = [], {16: {}, 64: {}}
    for B in batches:
        case = _Case(B, K, V, w1, w2, seed=B * 7 + V)
        hbm = case.floors(bw, 0.0)[0]
        for cfg, progs in configs:
            us = case.chain(timer, "fused", config=cfg)
            row_tiles, n_progs = fused_grid(B, V, cfg)[:2]
            rows.append([B, cfg.block_b, cfg.describe(), progs, f"{row_tiles}x{n_progs}", fmt(us), _ratio(us, hbm)])
            cur = best[cfg.block_b].get(B)
            if cur is None or us < cur[2]:
                best[cfg.block_b][B] = (cfg, progs, us)
        del case
    for row in rows:
        cfg_best = best[row[1]][row[0]]
        row.append("*" if cfg_best[0].describe() == row[2] else "")
    notes = ["config: b<rows per tile>/n<block_n>/w<warps>/s<stages>/p<programs>; * = fastest of its block_b at "
             "that B. Within one block_b every config gives the same bits (tests); block_b is one value for the "
             "whole table."]
    totals = {b: sum(v[2] for v in best[b].values()) for b in best if best[b]}
    if totals:
        per_b = ", ".join(f"B={B}: b16/b64 {_ratio(best[16][B][2], best[64][B][2])}" for B in batches
                          if B in best[16] and B in best[64])
        notes.append("summed over B (fastest of each): " + ", ".join(f"b{b} {fmt(t)} us" for b, t in totals.items())
                     + (f"; {per_b}" if per_b else ""))
    for b in (16, 64):
        if best[b]:
            src = schedule_rows({B: v[:2] for B, v in best[b].items()}, b)
            notes.append(f"to paste for block_b={b} (kernels/markov_fused_step.py FUSED_SCHEDULES = (...)): {src}")
    print_table(f"Fused step schedule sweep, V={V}, r={r}, K={K}, bf16, alternating order (us per chain)",
                ["B", "block_b", "config", "programs/SM", "row tiles x programs", "fused", "fused/HBM", "best"],
                rows, notes)


def _tp(timer, bw, V, r, K, tps, tp_batches, w1, w2):
    rows = []
    for tp in tps:
        width = vocab_shards(V, tp).width  # the LM head's split (block-aligned where it can be)
        w2s = w2[:width].contiguous()  # shard-sized weight (values irrelevant to time)
        for B in tp_batches:
            case = _Case(B, K, width, w1, w2s, seed=B * 7 + width)
            m = {"exact": case.chain(timer, "exact"), "same": case.chain(timer, "fused", order="same"),
                 "alt": case.chain(timer, "fused"), "gemv": case.gemv(timer)}
            hbm, exact_floor = case.floors(bw, m["gemv"])
            rows.append([tp, width, B, fmt(m["exact"]), fmt(m["same"]), fmt(m["alt"]), fmt(m["gemv"]), fmt(hbm),
                         _ratio(m["exact"], exact_floor), _ratio(m["same"], hbm), _ratio(m["alt"], hbm),
                         _ratio(m["alt"], m["same"], 3)])
            del case
        del w2s
    print_table(
        f"Markov chain per rank on a vocab shard (one GPU, no exchange), r={r}, K={K}, bf16 (us per chain)",
        ["tp", "V_local", "B", "exact", "fused same", "fused alt", "gemv x1", "HBM floor", "exact/floor", "same/HBM",
         "alt/HBM", "alt/same"],
        rows,
        [("The shard's markov_w2 is not rotated: at tp >= 4 it fits the 60 MiB L2, so fused/HBM < 1 means the "
         "K reads were served from L2 (stretch goal: <= 0.7 at TP 4, B <= 8). Add one [B] int64 all-reduce per "
         "step for the exchange.")],
    )
