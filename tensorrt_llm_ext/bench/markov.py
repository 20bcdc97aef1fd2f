"""``trtllm-ext bench markov``: the DSpark Markov draft chain -- eager, exact and fused side by side.

Per batch size B (K block positions, vocabulary V, Markov rank r, bf16), under CUDA-graph replay with
the base-logit sets rotated beyond the L2:

* eager: the replicated eager chain (per step ``F.linear`` bias, add, ``torch.argmax``), the baseline;
* exact / fused: :func:`markov_chain_logits` in each mode (greedy);
* gemv: one ``torch.mm(h, w2.t())`` bias GEMV (what ``exact`` runs K times);
* HBM floor: K reads of ``markov_w2`` + the base logits read + the biased logits written, at the
  measured copy bandwidth; exact floor: K x gemv + the add/select traffic (base read, bias read, biased
  write per step) at that bandwidth.

Then the per-rank time on TP 2/4/8 shard widths (one GPU, shard-sized ``markov_w2``, no exchange): the
shard's ``markov_w2`` stays in the same memory across replays, so at TP >= 4 (<= 25.6 MB, below the
60 MiB L2) the K reads may be served from L2 -- the stretch goal, reported against the HBM floor.
On CPU: a smoke run at tiny sizes (timings meaningless).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
from tensorrt_llm_ext.speculative.markov_chain import MarkovWorkspace, markov_chain_logits


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=int, default=200064)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--draft-len", type=int, default=7)
    p.add_argument("--batch", default="1,4,8,32,64,128")
    p.add_argument("--tp-sizes", default="2,4,8")
    p.add_argument("--tp-batch", default="1,8,32,128")


def _eager_chain(base, anchors, w1, w2):
    """The replicated eager chain the fused modes replace (allocates; fine under graph capture's pool)."""
    prev, outs, toks = anchors, [], []
    for k in range(base.shape[1]):
        biased = base[:, k] + F.linear(w1[prev], w2).to(base.dtype)
        prev = torch.argmax(biased, dim=-1)
        outs.append(biased)
        toks.append(prev)
    return torch.stack(outs, dim=1), torch.stack(toks, dim=1)


def _measure(timer, B, K, width, w1, w2, bw, *, eager: bool):
    device, dtype = w2.device, w2.dtype
    V = w1.shape[0]
    elt = torch.tensor([], dtype=dtype).element_size()
    logit_bytes = B * K * width * elt
    n = rotation_count(2 * logit_bytes)
    g = torch.Generator(device=device).manual_seed(B * 7 + width)
    bases = [torch.randn(B, K, width, generator=g, device=device).to(dtype) for _ in range(n)]
    anchors = torch.randint(0, V, (B,), generator=g, device=device)
    res = {}
    if eager:
        res["eager"] = timer.time_graph([lambda x=x: _eager_chain(x, anchors, w1, w2) for x in bases])
    for mode in ("exact", "fused"):
        ws = MarkovWorkspace.allocate(B, K, w2, mode)
        outs = [torch.empty_like(x) for x in bases]
        res[mode] = timer.time_graph([
            lambda x=x, o=o, ws=ws, mode=mode: markov_chain_logits(x, anchors, w1, w2, mode=mode, out=o,
                                                                   workspace=ws)
            for x, o in zip(bases, outs)])
        del outs, ws
    h = w1[anchors].contiguous()
    bias = torch.empty(B, width, dtype=dtype, device=device)
    res["gemv"] = timer.time_graph([lambda: torch.mm(h, w2.t(), out=bias)])
    w2_bytes = w2.numel() * elt
    res["hbm_floor"] = floor_us(K * w2_bytes + 2 * logit_bytes, bw)
    res["exact_floor"] = K * res["gemv"] + floor_us(3 * logit_bytes, bw)
    return res


@register_benchmark("markov", "DSpark Markov chain: eager vs exact vs fused, HBM floor, TP shard widths", _add_args)
def run(args: argparse.Namespace) -> None:
    timer = BenchTimer()
    device = timer.device
    V, r, K = args.vocab, args.rank, args.draft_len
    batches = [int(b) for b in args.batch.split(",")]
    tps = [int(t) for t in args.tp_sizes.split(",")]
    tp_batches = [int(b) for b in args.tp_batch.split(",")]
    if timer.smoke:
        V, r, K, batches, tps, tp_batches = 2003, 32, 3, [1, 3], [2], [2]
    bw = measure_copy_bandwidth(device)
    g = torch.Generator(device=device).manual_seed(0)
    w1 = (torch.randn(V, r, generator=g, device=device) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(V, r, generator=g, device=device) * 0.05).to(torch.bfloat16)

    rows = []
    for B in batches:
        m = _measure(timer, B, K, V, w1, w2, bw, eager=True)
        rows.append([B, fmt(m["eager"]), fmt(m["exact"]), fmt(m["fused"]), fmt(m["gemv"]), fmt(m["hbm_floor"]),
                     fmt(m["exact_floor"]), fmt(m["exact"] / m["exact_floor"], 2),
                     fmt(m["fused"] / m["hbm_floor"], 2), fmt(m["eager"] / min(m["exact"], m["fused"]), 2)])
    print_table(
        f"Markov chain, V={V}, r={r}, K={K}, bf16, full vocabulary (us per chain)",
        ["B", "eager", "exact", "fused", "gemv x1", "HBM floor", "exact floor", "exact/floor", "fused/HBM",
         "eager/best"],
        rows,
        [f"copy bandwidth {fmt(bw / 1e12, 2)} TB/s (read+write). Goals: exact/floor <= 1.10; fused/HBM <= 1.15 "
         "at B <= 32, <= 1.3 at B = 128."],
    )

    rows = []
    for tp in tps:
        width = -(-V // tp)
        w2s = w2[:width].contiguous()  # shard-sized weight (values irrelevant to time)
        for B in tp_batches:
            m = _measure(timer, B, K, width, w1, w2s, bw, eager=False)
            rows.append([tp, width, B, fmt(m["exact"]), fmt(m["fused"]), fmt(m["gemv"]), fmt(m["hbm_floor"]),
                         fmt(m["exact"] / m["exact_floor"], 2), fmt(m["fused"] / m["hbm_floor"], 2)])
        del w2s
    print_table(
        f"Markov chain per rank on a vocab shard (one GPU, no exchange), r={r}, K={K}, bf16 (us per chain)",
        ["tp", "V_local", "B", "exact", "fused", "gemv x1", "HBM floor", "exact/floor", "fused/HBM"],
        rows,
        ["The shard's markov_w2 is not rotated: at tp >= 4 it fits the 60 MiB L2, so fused/HBM < 1 means the "
         "K reads were served from L2 (stretch goal). Add one [B] int64 all-reduce per step for the exchange."],
    )
