"""``trtllm-ext bench exchange``: the low-latency tagged-word exchange on simulated peers (one GPU).

Per simulated TP size W (2/4/8) and row count R (1/8/64/128): one round of
:class:`~tensorrt_llm_ext.kernels.ll_exchange.SimulatedPeers` -- one launch in which every simulated
rank writes its ``2 R`` tagged words into each peer's slots and spins on its own -- under CUDA-graph
replay (many rounds per graph, as inside a captured decode step), checked for the right maximum and no
timeout. Beside it: an NCCL all-reduce MAX of the same ``R`` int64 keys on a world-size-1 group, also
graph-replayed, which moves nothing between GPUs and is therefore a *lower bound* of NCCL's per-call
cost (a real TP group only adds to it). The byte floor (every word written and read once at the
measured copy bandwidth) is listed to show the round is latency-bound, not bandwidth-bound.

A second table measures the timeout path: one rank alone, its peer never writing: the time per poll
(``N`` polls, no time bound) and how long a time-bounded wait really takes (the GPU-clock bound that
:data:`~tensorrt_llm_ext.kernels.ll_exchange.WAIT_TIMEOUT_S` sets, here a shorter one).

Simulated peers share one GPU's memory, so the numbers are not those of NVLink between GPUs; the real
multi-GPU path is tested in ``l0_dgx_h200`` and still has to be measured there.
On CPU nothing can be measured (the interpreter runs the simulated ranks one after another, so a round
cannot complete): the command says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tensorrt_llm_ext.argtypes import int_list, positive_int
from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark)
from tensorrt_llm_ext.kernels.ll_exchange import (WAIT_TIMEOUT_S, LLExchangeState, SimulatedPeers, ll_exchange)
from tensorrt_llm_ext.logger import logger

GOAL_US = 3.0


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=int_list(), default="2,4,8", help="simulated TP sizes")
    p.add_argument("--rows", type=int_list(), default="1,8,64,128", help="rows (selection keys) per exchange")
    p.add_argument("--polls", type=positive_int, default=200_000, help="polls of the timeout-path measurement")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _nccl_world1():
    """A world-size-1 NCCL process group (None, logged once, if it cannot be made)."""
    import torch.distributed as dist

    try:
        if not dist.is_initialized():
            store = dist.HashStore()
            dist.init_process_group("nccl", store=store, world_size=1, rank=0,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        return dist.group.WORLD
    except Exception as e:  # a build without NCCL: the table shows '-' in that column
        logger.warning(f"bench exchange: no world-size-1 NCCL group ({type(e).__name__}: {e}); NCCL column empty")
        return None


def _round_us(timer: BenchTimer, world: int, rows: int) -> tuple[float, bool]:
    sim = SimulatedPeers(world, rows, "cuda")
    g = torch.Generator(device="cuda").manual_seed(world * 1000 + rows)
    keys = torch.randint(-(2**62), 2**62, (world, rows), generator=g, device="cuda", dtype=torch.int64)
    out = torch.empty_like(keys)
    us = timer.time_graph([lambda: sim.exchange(keys, out=out)], min_calls_per_graph=64)
    torch.cuda.synchronize()
    ok = bool(torch.equal(out, keys.amax(0).expand(world, rows))) and sim.state.flag.tolist() == [0] * world
    return us, ok


def _nccl_us(timer: BenchTimer, group, rows: int) -> float:
    import torch.distributed as dist

    if group is None:
        return float("nan")
    keys = torch.zeros(rows, dtype=torch.int64, device="cuda")
    return timer.time_graph([lambda: dist.all_reduce(keys, op=dist.ReduceOp.MAX, group=group)],
                            min_calls_per_graph=64)


def _timeout_path(world: int, rows: int, polls: int, timeout_s: float) -> tuple[float, float]:
    """A rank whose peers never write (eager, after a warm launch): nanoseconds per poll (a poll bound,
    no time bound) and the seconds a time-bounded wait of ``timeout_s`` (no poll bound) really took."""
    sim = SimulatedPeers(world, rows, "cuda")
    st = LLExchangeState(buf_ptrs=sim.state.buf_ptrs, epoch=sim.state.epoch[:1], flag=sim.state.flag[:1],
                         world=world, slot_rows=rows, rank_base=0)
    keys = torch.zeros(1, rows, dtype=torch.int64, device="cuda")
    ll_exchange(keys, st, spin_limit=10, out=keys)  # warm: compile and load
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ll_exchange(keys, st, spin_limit=polls, timeout_s=1000, out=keys)
    torch.cuda.synchronize()
    ns = (time.perf_counter() - t0) * 1e9 / polls
    t0 = time.perf_counter()
    ll_exchange(keys, st, timeout_s=timeout_s, out=keys)
    torch.cuda.synchronize()
    return ns, time.perf_counter() - t0


@register_benchmark("exchange", "low-latency tagged-word exchange on simulated peers vs an NCCL all-reduce lower bound",
                    _add_args)
def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():  # exit 1: a script reading the exit code must not take this for a table
        print("error: bench exchange: needs a CUDA GPU -- the simulated peers spin across programs, which the Triton "
              "interpreter runs one after another, so a round cannot complete on CPU. Nothing was measured.",
              file=sys.stderr)
        return 1
    timer = BenchTimer()
    bw = measure_copy_bandwidth()
    group = _nccl_world1()
    rows_list, worlds = _ints(args.rows), _ints(args.worlds)
    table = []
    for w in worlds:
        for r in rows_list:
            us, ok = _round_us(timer, w, r)
            nccl = _nccl_us(timer, group, r)
            words_bytes = w * (w - 1) * r * 2 * 8 * 2  # each word written once and read once
            table.append([w, r, fmt(us, 2), fmt(nccl, 2), fmt(us / nccl, 2) if nccl == nccl else "-",
                          fmt(floor_us(words_bytes, bw), 3), "yes" if us <= GOAL_US else "no",
                          "ok" if ok else "WRONG"])
    print_table(
        "Low-latency exchange, simulated peers on one GPU (µs per round, CUDA-graph replay)",
        ["W", "rows", "LL round µs", "NCCL ws=1 µs", "LL / NCCL", "byte floor µs", f"≤{GOAL_US:g} µs", "check"],
        table,
        notes=["NCCL ws=1: all-reduce MAX of the same rows int64 on a world-size-1 group (moves nothing: a lower "
               "bound of NCCL's per-call cost). Simulated peers share one GPU: not an NVLink measurement."])
    polls = []
    bound = 0.5  # a shorter stand-in for WAIT_TIMEOUT_S: the same clock check, a quicker benchmark
    for w in (2, max(worlds)):
        for r in (1, max(rows_list)):
            ns, waited = _timeout_path(w, r, args.polls, bound)
            polls.append([w, r, args.polls, fmt(ns, 1), fmt(waited, 3), fmt(waited / bound, 3)])
    print_table(
        "Timeout path: cost of one poll, and a time-bounded wait (peer never writes)",
        ["W", "rows", "polls", "ns per poll", f"wait, timeout_s={bound:g} (s)", "wait / timeout"], polls,
        notes=[f"The default bound is WAIT_TIMEOUT_S = {WAIT_TIMEOUT_S:g} s by the GPU clock, whatever a poll costs."])
    return 1 if any(row[-1] == "WRONG" for row in table) else 0  # a wrong round is not a measurement
