"""``trtllm-ext bench verify``: sharded rejection-sampling verification vs the gathered stock path.

Per TP width (the LM head's shard width, one GPU, shard-sized inputs) and batch B (K drafts): our
:func:`~tensorrt_llm_ext.speculative.verification.rejection_sample` on the shard (no exchange: the
collectives it would issue are listed separately as a count and bytes per rank), without and with exact
top-p; the HBM floor (target + draft logits of the owned columns read once at the measured copy
bandwidth); and the honest stock path on the gathered full vocabulary: temperature softmax of target and
draft, ``torch.sort``-based top-p of the target, the rejection test, the residual / bonus draw by
Gumbel-max, all torch ops. Everything under CUDA-graph replay with input sets rotated beyond the L2.
The default widths are TP 1 (the full vocabulary, V = 200064: no exchange, the peers' setting) and TP 4;
repeats and rotated sets are bounded so the default table targets 90 s on one H200.
On CPU: a smoke run at tiny sizes (timings meaningless).

``--profile`` prints the per-kernel time of one call instead (CUDA-graph replays under ``torch.profiler``;
on CPU the interpreter's launch list with counts, untimed), without and with top-p.

Shards are the LM head's by default (``--shard-width aligned``: ``1024 ceil(ceil(V / tp) / 1024)`` columns at TP > 1
where every rank keeps a real id, :func:`~tensorrt_llm_ext.mapping.vocab_shards`), where ``rejection_sample`` reads
the logits once (block statistics, combine, draw); ``--shard-width ceil`` times the head's ``shard_rule="ceil"``
width ``ceil(V / tp)``, where it takes the two-pass path. ``--two-pass`` also times the forced two-pass path on the
same rows (the same bits), in its own column, so one run measures both.

``--one-pass-stats`` times the one-pass block statistics (``kernels/block_stats.py``) alone against the two passes
of the previous definition (``verify_keys`` + ``verify_sums``), on block-aligned shards, at each ``--stats-configs``
schedule (warps, programs, prefetch: the same bits).

``--acceptance`` instead prints the mean acceptance length on the embedded model (the default runtime
config) at T = 0.7 and 1.0: strict acceptance with greedy drafts vs rejection sampling with sampled drafts.
Acceptance lengths are not timings, so the CPU numbers are meaningful; the engine runs its ``stock`` op
table on CPU (the same tokens as the fused one, bitwise, much faster under the interpreter).
"""

from __future__ import annotations

import argparse
import sys

import torch

from tensorrt_llm_ext.argtypes import int_list, positive_int
from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
from tensorrt_llm_ext.kernels import fixed_point_softmax as fps
from tensorrt_llm_ext.kernels.top_p import radix_rounds
from tensorrt_llm_ext.mapping import vocab_shards
from tensorrt_llm_ext.speculative.verification import (VerificationPlan, VerificationWorkspace, choose_passes,
                                                        column_plan, draw_plan, rejection_sample)
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def random_logits(b: int, k: int, width: int, scale: float, g: torch.Generator, device, dtype):
    """Target rows ``[b, k + 1, width]`` of ``N(0, scale^2)`` and draft rows ``[b, k, width]``: the target's first
    k rows plus ``N(0, (scale / 2)^2)`` noise (a draft close to its target, as a trained drafter is)."""
    tgt = (scale * torch.randn(b, k + 1, width, generator=g, device=device)).to(dtype)
    drf = (tgt[:, :k].float() + 0.5 * scale * torch.randn(b, k, width, generator=g, device=device)).to(dtype)
    return tgt, drf


def _number(low: float, high: float, low_open: bool = False):
    """An argparse type: a finite number in [low, high] ((low, high] with ``low_open``); a NaN top-p or a negative
    temperature would label a table with a setting no kernel ran (or fail on a GPU after the earlier rows)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"expected a number in {'(' if low_open else '['}{low:g}, {high:g}], "
                                             f"got {text}")
        return value

    return parse


def _number_list(low: float, high: float):
    """An argparse type: comma-separated numbers, each as :func:`_number` takes it; returns the text."""
    one = _number(low, high)

    def parse(text: str) -> str:
        for item in text.split(","):
            one(item.strip())
        return text

    return parse


def _stats_configs(text: str) -> str:
    """``--stats-configs``: comma-separated WARPS/PROGRAMS/PREFETCH, integers >= 1 (WARPS 0: the library's rule;
    PREFETCH 0 or 1)."""
    for item in text.split(","):
        parts = item.strip().split("/")
        try:
            warps, programs, prefetch = (int(v) for v in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected WARPS/PROGRAMS/PREFETCH items, got {text!r}") from None
        if warps < 0 or programs < 1 or prefetch not in (0, 1):
            raise argparse.ArgumentTypeError(f"expected WARPS >= 0, PROGRAMS >= 1, PREFETCH 0 or 1, got {item!r}")
    return text


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=positive_int, default=200064)
    p.add_argument("--draft-len", type=positive_int, default=7)
    p.add_argument("--batch-sizes", type=int_list(), default="1,8,32,128")
    p.add_argument("--tp-sizes", type=int_list(), default="1,4",
                   help="TP sizes whose shard width to time on one GPU (1 = the full vocabulary, no exchange)")
    p.add_argument("--shard-width", default="aligned", choices=("aligned", "ceil"),
                   help="the LM head's shard rule: aligned (default): 1024 ceil(ceil(V / tp) / 1024) columns at TP > 1 "
                        "where every rank keeps a real id (one read of the logits); ceil: ceil(V / tp) (the two-pass "
                        "path)")
    p.add_argument("--two-pass", action="store_true",
                   help="also time the forced two-pass path on the same rows (column 'two-pass us')")
    p.add_argument("--top-p", type=_number(0.0, 1.0, low_open=True), default=0.95)
    p.add_argument("--temperature", type=_number(0.0, 1e6), default=1.0)
    p.add_argument("--logit-scale", type=_number(0.0, 1e6, low_open=True), default=1.0,
                   help="the random logits' standard deviation (1: standard normal rows, the table's default; 4: the "
                        "scale of bench step's random-weight LM head, where top-p keeps a small part of a row); every "
                        "column of the run, peers included, reads the same rows")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--block-size", type=positive_int, default=1024, help="columns per tile of every verification kernel")
    p.add_argument("--num-splits", type=positive_int, default=32, help="column chunks (programs) per row, at most")
    p.add_argument("--target-programs", type=positive_int, default=None,
                   help="programs per call the column plan aims at (default: the library's)")
    p.add_argument("--no-stock", action="store_true", help="skip the gathered stock baseline")
    p.add_argument("--acceptance", action="store_true",
                   help="mean acceptance length on the embedded model: strict vs rejection sampling (no timing)")
    p.add_argument("--temperatures", type=_number_list(0.0, 1e6), default="0.7,1.0", help="temperatures of --acceptance")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per request of --acceptance")
    p.add_argument("--seeds", type=positive_int, default=4, help="seeds per prompt of --acceptance")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel time of one call (GPU: torch.profiler; CPU: the launch list with counts)")
    p.add_argument("--one-pass-stats", action="store_true",
                   help="time the one-pass block statistics (kernels/block_stats.py) against verify_keys + verify_sums "
                        "on block-aligned shards instead")
    p.add_argument("--stats-configs", type=_stats_configs, default="4/512/0",
                   help="--one-pass-stats: block_stats schedules WARPS/PROGRAMS/PREFETCH, comma-separated (a row each): "
                        "warps per program (0: the library's rule, stats_num_warps), programs per call the chunks aim "
                        "at (column_plan's target_programs), 1 to load the next tile before this one's reductions")


# Reference columns (issue 28, H200, 2026-12-02, torch 2.11, triton 3.6, bf16, K = 7, T = 1, CUDA graph, medians;
# us per call at B = 1 / 8 / 32 / 128): the peers measured in the same run as our kernels then, and the goals.
_REF_BATCHES = (1, 8, 32, 128)
PEERS = {  # (tp of the width at V = 200064, "none" | "top_p") -> {peer: [us at _REF_BATCHES]}
    (4, "none"): {"vLLM MRv2": [29, 25, 46, 119], "FlashInfer": [47, 65, 122, 377]},
    (4, "top_p"): {"vLLM MRv2": [75, 223, 358, 1333], "FlashInfer": [94, 135, 279, 930]},
    (1, "none"): {"vLLM MRv2": [22, 45, 112, 378], "FlashInfer": [123, 209, 447, 1385]},
    (1, "top_p"): {"vLLM MRv2": [135, 726, 1335, 5126], "FlashInfer": [228, 473, 961, 3342]},
}
GOALS = {  # the goals, us per call at _REF_BATCHES (TP 1 with top-p: half the best peer)
    (4, "none"): [12, 15, 30, 90], (4, "top_p"): [30, 45, 100, 300],
    (1, "none"): [22, 45, 112, 378], (1, "top_p"): [67.5, 236.5, 480.5, 1671],
}


def reference_us(table: dict, tp: int, mode: str, batch: int, vocab: int, k: int, dtype: str) -> dict[str, float]:
    """The issue's published numbers for this row (empty unless it is one of the measured settings)."""
    if vocab != 200064 or k != 7 or dtype != "bf16" or batch not in _REF_BATCHES or (tp, mode) not in table:
        return {}
    row = table[(tp, mode)]
    i = _REF_BATCHES.index(batch)
    return {name: us[i] for name, us in row.items()} if isinstance(row, dict) else {"goal": row[i]}


def stock_verify(target, draft, tokens, temps, top_p, u_accept):
    """The gathered stock verification (full vocabulary, torch ops): returns (tokens [B, K+1], num [B])."""
    b, k1, v = target.shape
    k = k1 - 1
    t = temps.view(b, 1, 1)
    p = torch.softmax(target.float() / t, dim=-1)
    if top_p is not None:
        sp, si = torch.sort(p, dim=-1, descending=True)
        drop = (torch.cumsum(sp, -1) - sp) > top_p.view(b, 1, 1)
        sp = sp.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, si, sp)
        p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(draft.float() / t, dim=-1)
    pd = p[:, :k].gather(-1, tokens[..., None])[..., 0]
    qd = q.gather(-1, tokens[..., None])[..., 0]
    acc = u_accept * qd < pd
    n_acc = torch.cumprod(acc.int(), -1).sum(-1)  # leading accepted
    res = torch.clamp(p[:, :k] - q, min=0.0)
    res = torch.cat([res, p[:, k:]], dim=1)  # row K: the bonus distribution
    dist = res.gather(1, n_acc.view(b, 1, 1).expand(b, 1, v))[:, 0]
    g = -torch.log(-torch.log(torch.rand_like(dist).clamp_(1e-10, 1.0 - 1e-7)))
    emitted = torch.argmax(torch.log(dist) + g, dim=-1)
    out = torch.cat([tokens, emitted[:, None]], 1)
    return out, n_acc + 1


def flashinfer_verify():
    """FlashInfer's verification at our inputs, when ``flashinfer`` imports on a CUDA machine: ``(make, None)``
    with ``make(target, draft, tokens, temperature, top_p) -> callable`` (temperature softmax of target and draft,
    ``top_p_renorm_probs`` of the target when ``top_p`` is set, ``chain_speculative_sampling``: the peer's
    own pipeline from logits), else ``(None, why)``."""
    if not torch.cuda.is_available():
        return None, "FlashInfer needs CUDA"
    try:
        import flashinfer.sampling as fis
    except Exception as e:  # not installed, or built for another torch / CUDA
        return None, f"flashinfer does not import here ({type(e).__name__}: {str(e)[:120]})"

    def make(target, draft, tokens, temperature: float, top_p: float | None):
        ids = tokens.to(torch.int32)

        def call():
            p = torch.softmax(target.float() / temperature, dim=-1)
            if top_p is not None:
                p = fis.top_p_renorm_probs(p.view(-1, p.shape[-1]), top_p).view_as(p)
            q = torch.softmax(draft.float() / temperature, dim=-1)
            return fis.chain_speculative_sampling(q, ids, p)
        return call
    return make, None


def shard_width(vocab: int, tp: int, rule: str = "aligned") -> int:
    """The shard width timed at TP ``tp``: the LM head's under ``rule`` (:func:`~tensorrt_llm_ext.mapping.vocab_shards`;
    TP 1 owns every id from 0: aligned as it is)."""
    return vocab_shards(vocab, tp, rule).width


def exchange_volume(batch: int, k: int, tp: int, top_p: bool, splits: int = 1,
                    dtype: torch.dtype = torch.bfloat16, sub: int = 1, passes: str = "one") -> tuple[int, int]:
    """(exchange rounds, bytes this rank sends) of one sharded rejection_sample call at TP ``tp`` with ``splits``
    column chunks per row and ``sub`` draw sub-chunks per chunk (``verification.draw_plan``), on the one-pass or
    the two-pass path."""
    plan = VerificationPlan(batch * (k + 1), batch * k, batch, splits, tp, top_p, radix_rounds(dtype), sub=sub,
                            passes=passes)
    rounds = plan.exchanges()
    return len(rounds), 8 * sum(words for _, words in rounds)


def _profile(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """Per-kernel time of one rejection_sample call at each ``--batch-sizes`` (GPU: torch.profiler over
    CUDA-graph replays of one call; CPU: the interpreter's launch list with counts at one tiny size)."""
    vocab, k = args.vocab, args.draft_len
    batches = [int(x) for x in args.batch_sizes.split(",")]
    tp = int(args.tp_sizes.split(",")[-1])
    block, splits = args.block_size, args.num_splits
    if device.type != "cuda":
        vocab, k, batches, tp, block, splits = 1031, 2, batches[:1], 2, 1024, 2  # the aligned shard: 1024 ids
    width = shard_width(vocab, tp, args.shard_width)
    passes = choose_passes(None, width, tp, 0 if tp == 1 else width, block)
    for b in batches:
        g = torch.Generator(device=device).manual_seed(5)
        tgt, drf = random_logits(b, k, width, args.logit_scale, g, device, dtype)
        tokens = torch.randint(0, width, (b, k), generator=g, device=device)
        temps = torch.full((b,), args.temperature, device=device)
        seeds = torch.arange(b, dtype=torch.int64, device=device)
        offsets = torch.zeros(b, dtype=torch.int64, device=device)
        ws = VerificationWorkspace.for_verification(b, k, width, device=device, block_size=block, num_splits=splits,
                                                  **_plan_kw(args))
        out = (torch.empty(b, k + 1, dtype=torch.int64, device=device),
               torch.empty(b, dtype=torch.int32, device=device))
        for name, top_p in (("no top-p", None), (f"top-p {args.top_p}", torch.full((b,), args.top_p, device=device))):
            def call(top_p=top_p):
                return rejection_sample(tgt, drf, tokens, temperatures=temps, seeds=seeds, offsets=offsets,
                                        top_p=top_p, vocab_size=width, out=out, workspace=ws)

            s_eff, _ = column_plan(b * (2 * k + 1), width, block, splits, **_plan_kw(args))
            title = (f"bench verify --profile: one rejection_sample call, {name}, B={b}, V_local={width}, K={k}, "
                     f"block {block}, {s_eff} column chunks per row, {passes} pass(es)")
            if device.type == "cuda":
                rows = _profile_cuda(call)
                headers = ["kernel", "launches per call", "us per call"]
                total = sum(float(r[2]) for r in rows)
                notes = [f"{sum(r[1] for r in rows)} launches per call in all, {fmt(total, 2)} us of kernel time."]
            else:
                rows = _launch_list(call)
                headers = ["kernel", "launches per call", "us per call (CPU: not timed)"]
                notes = [f"{sum(r[1] for r in rows)} launches per call in all."]
            print_table(title, headers, rows, notes=notes)


def _one_pass_stats(args: argparse.Namespace, timer: BenchTimer, device: torch.device, dtype: torch.dtype) -> None:
    """``--one-pass-stats``: one read of the logits (``block_stats``: keys, block maxima and mass bins) against
    today's two (``verify_keys`` + ``verify_sums`` without top-p), on the same rows of the last block-aligned shard
    (``1024 ceil(ceil(V / tp) / 1024)`` columns), each launch planned as a call at that B would plan it."""
    from tensorrt_llm_ext.kernels.block_stats import STAT_BLOCK, STATS_COLS, block_stats, stats_num_warps
    from tensorrt_llm_ext.kernels.common import sm_count

    vocab, k = args.vocab, args.draft_len
    batches = [int(x) for x in args.batch_sizes.split(",")]
    tps = [int(x) for x in args.tp_sizes.split(",")]
    block, splits = args.block_size, args.num_splits
    configs = [tuple(int(v) for v in c.split("/")) for c in args.stats_configs.split(",")]  # checked by its type
    if timer.smoke:
        vocab, k, batches, tps, block, splits = 3079, 2, [1], [1, 2], 256, 2
    bw = measure_copy_bandwidth(device)
    elt = torch.tensor([], dtype=dtype).element_size()
    for tp in tps:  # a table per TP width, so a run cut short keeps the widths it finished
        table = []
        width = STAT_BLOCK * -(-(-(-vocab // tp)) // STAT_BLOCK)  # whole blocks at TP 1 too: the kernel's own form
        start = (tp - 1) * width
        for b in batches:
            rt, rq = b * (k + 1), b * k
            s2, _ = column_plan(rt + rq, width, block, splits)
            plans = {(w, n, f): column_plan(rt + rq, width, STAT_BLOCK, splits, target_programs=n)[0]
                     for w, n, f in configs}
            g = torch.Generator(device=device).manual_seed(b * 11 + tp)
            n_sets = rotation_count((rt + rq) * width * elt, max_sets=16) if not timer.smoke else 1
            sets = [((args.logit_scale * torch.randn(rt, width, generator=g, device=device)).to(dtype),
                     (args.logit_scale * torch.randn(rq, width, generator=g, device=device)).to(dtype))
                    for _ in range(n_sets)]
            tokens = torch.randint(start, vocab, (b, k), generator=g, device=device)
            temps = torch.full((b,), args.temperature, device=device)
            keys2 = torch.empty(rt + rq, s2, 2, dtype=torch.int64, device=device)
            sums = torch.empty(fps.sums_layout(rt, rq, s2, False)[1], dtype=torch.int64, device=device)

            def two(t, d):
                fps.verify_keys(t, d, start, vocab, out=keys2, block_size=block, num_splits=s2)
                fps.verify_sums(t, d, keys2, temps, start, vocab, tokens=tokens, row_div=k + 1, row_div_q=k,
                                out=sums, block_size=block, num_splits=s2)

            def one(t, d, w, f, s1, keys1, stats):
                block_stats(t, d, temps, start, vocab, tokens=tokens, row_div=k + 1, row_div_q=k, keys_out=keys1,
                            stats_out=stats, num_splits=s1, num_warps=w or None, prefetch=f)

            t2 = timer.time_graph([lambda s=s: two(*s) for s in sets])
            fl = floor_us((rt + rq) * width * elt, bw)
            for (w, _, f), s1 in plans.items():
                keys1 = torch.empty(rt + rq, s1, 2, dtype=torch.int64, device=device)
                stats = torch.empty(rt + rq, s1, STATS_COLS, dtype=torch.int64, device=device)
                t1 = timer.time_graph([lambda s=s: one(*s, w, f, s1, keys1, stats) for s in sets])
                chunk = fps.plan_chunks(width, STAT_BLOCK, s1)[1]
                warps = w or f"rule: {stats_num_warps(rt + rq, s1, chunk, sm_count(device))}"
                table.append([tp, width, b, s2, f"{warps}{' prefetch' if f else ''}", s1, fmt(fl, 2), fmt(t2, 2),
                              fmt(t1, 2), fmt(t2 / t1, 2), fmt(t1 / fl, 2)])
        print_table(
            f"bench verify --one-pass-stats: block statistics vs verify_keys + verify_sums, tp {tp}, {args.dtype}, "
            f"V={vocab}, K={k}",
            ["tp", "aligned width", "B", "chunks (two-pass)", "warps (one pass)", "chunks (one pass)", "floor us",
             "keys + sums us", "one pass us", "two / one", "one / floor"],
            table,
            notes=[f"copy bandwidth {fmt(bw / 1e12, 2)} TB/s; floor = the rows of the last aligned shard read once; no "
                   "top-p; keys + sums = the two passes of the previous definition (the whole call on aligned shards: "
                   "bench verify, docs/rejection_sampling.md)."])


def _plan_kw(args: argparse.Namespace) -> dict[str, int]:
    """The column plan's ``target_programs`` when ``--target-programs`` gives one (else the library's default)."""
    return {} if args.target_programs is None else {"target_programs": args.target_programs}


def capture_graph(call) -> "torch.cuda.CUDAGraph":
    """``call`` warmed up on a side stream, then captured in a CUDA graph (returned, not replayed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        call()
    return graph


def _profile_cuda(call, replays: int = 20) -> list[list[object]]:
    from torch.profiler import ProfilerActivity, profile

    graph = capture_graph(call)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.count:
            rows.append([ev.key[:60], ev.count // replays, fmt(ev.device_time_total / replays, 2)])
    return sorted(rows, key=lambda r: -float(r[2]))


def _launch_list(call) -> list[list[object]]:
    """The kernels one call launches under the Triton interpreter, in order of first launch, with counts."""
    from triton.runtime.interpreter import InterpretedFunction

    counts: dict[str, int] = {}
    run = InterpretedFunction.run

    def counted(self, *a, **kw):
        counts[self.fn.__name__] = counts.get(self.fn.__name__, 0) + 1
        return run(self, *a, **kw)

    InterpretedFunction.run = counted
    try:
        call()
    finally:
        InterpretedFunction.run = run
    return [[name, n, "-"] for name, n in counts.items()]


def acceptance(args: argparse.Namespace) -> int:
    """Mean acceptance length (tokens per step) of strict acceptance vs rejection sampling."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.launch import DEFAULT_PROMPTS
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.requests import Request

    temps = [float(x) for x in args.temperatures.split(",")]
    mode = "speculative" if torch.cuda.is_available() else "stock"
    base = load_config()
    vocab = base.model.target.vocab_size
    prompts = [[t % vocab for t in p] for p in DEFAULT_PROMPTS]
    room = base.max_seq_len - max(map(len, prompts))
    if args.max_new_tokens > room:  # every request would be rejected: a table of '-' and exit 0
        print(f"error: bench verify: --max-new-tokens {args.max_new_tokens}: expected at most {room} (max_seq_len "
              f"{base.max_seq_len} - the longest prompt's {base.max_seq_len - room} tokens)", file=sys.stderr)
        return 2
    rows, unmeasured = [], []
    engines = {rs: Engine(load_config(**{"speculative_config.use_rejection_sampling": rs})) for rs in (False, True)}
    for t in temps:
        reqs = [Request(list(p), max_new_tokens=args.max_new_tokens,
                        sampling=SamplingParams(temperature=t, seed=1000 * s + i))
                for s in range(args.seeds) for i, p in enumerate(prompts)]
        mal = {rs: engines[rs].generate(reqs, mode)[1].mean_acceptance_length for rs in (False, True)}
        rows.append([t, len(reqs), fmt(mal[False], 3), fmt(mal[True], 3), fmt(mal[True] / mal[False], 2)])
        unmeasured += [f"T={t:g}"] if mal[False] != mal[False] or mal[True] != mal[True] else []
    k = base.speculative_config.max_draft_len
    print_table(
        f"bench verify --acceptance: embedded model (V={vocab}, K={k}, {base.model.drafter_init} drafter), "
        f"{args.max_new_tokens} tokens per request, engine op table '{mode}'",
        ["T", "requests", "strict, greedy drafts", "rejection sampling, sampled drafts", "ratio"], rows,
        notes=[f"mean acceptance length = tokens emitted per speculative step (1 .. K+1 = {k + 1}).",
               "Not a timing: the same on CPU and GPU up to the model dtype (CPU float32, CUDA bfloat16)."])
    if unmeasured:  # a row with no speculative step measured nothing: not exit 0
        print(f"error: bench verify --acceptance: no step measured at {', '.join(unmeasured)} (see the log's "
              "rejected lines)", file=sys.stderr)
        return 1
    return 0


@register_benchmark("verify", "sharded rejection-sampling verification (+ exact top-p) vs the gathered stock path",
                    _add_args)
def run(args: argparse.Namespace) -> int | None:
    if args.acceptance:
        return acceptance(args)
    # Bounded so the default table (2 widths x 4 batch sizes x 2 modes + the stock baseline) stays near a
    # minute on one H200: few replays per sample, at most 16 rotated input sets.
    timer = BenchTimer(reps=7, calls_per_rep=10)
    # The gathered stock path takes milliseconds per call at large B: few replays per sample keep the run short.
    stock_timer = BenchTimer(reps=3, calls_per_rep=2)
    device = timer.device
    dtype = _DTYPES[args.dtype]
    if args.profile:
        _profile(args, device, dtype)
        return
    if args.one_pass_stats:
        _one_pass_stats(args, timer, device, dtype)
        return
    vocab, k = args.vocab, args.draft_len
    batches = [int(x) for x in args.batch_sizes.split(",")]
    tps = [int(x) for x in args.tp_sizes.split(",")]
    block, splits = args.block_size, args.num_splits
    if timer.smoke:
        vocab, k, batches, tps, block, splits = 1031, 2, [1, 2], [1, 2], 1024, 2
    bw = measure_copy_bandwidth(device)
    elt = torch.tensor([], dtype=dtype).element_size()
    rows = []
    stock_cache: dict[tuple[int, bool], float] = {}
    fi_make, fi_why = flashinfer_verify()
    fi_errors: list[str] = []
    for tp in tps:
        width = shard_width(vocab, tp, args.shard_width)
        # the path of a rank of this TP size (rank 1 where there is one: its vocab_start is the shard width)
        passes = choose_passes(None, width, tp, 0 if tp == 1 else width, block)
        for b in batches:
            shard_bytes = b * (2 * k + 1) * width * elt
            n_sets = rotation_count(shard_bytes, max_sets=16) if not timer.smoke else 1
            g = torch.Generator(device=device).manual_seed(b * 7 + tp)
            sets = []
            for _ in range(n_sets):
                sets.append(random_logits(b, k, width, args.logit_scale, g, device, dtype))
            tokens = torch.randint(0, width, (b, k), generator=g, device=device)
            temps = torch.full((b,), args.temperature, device=device)
            seeds = torch.arange(b, dtype=torch.int64, device=device)
            offsets = torch.zeros(b, dtype=torch.int64, device=device)
            top_p = torch.full((b,), args.top_p, device=device)
            ws = VerificationWorkspace.for_verification(b, k, width, device=device, block_size=block, num_splits=splits,
                                                  **_plan_kw(args))
            out = (torch.empty(b, k + 1, dtype=torch.int64, device=device),
                   torch.empty(b, dtype=torch.int32, device=device))
            res, fi, two = {}, {}, {}
            for name, tp_arg in (("none", None), ("top_p", top_p)):
                # the call at tp 1 on the shard's columns: the path is the one a rank of this TP size takes
                fns = [lambda s=s, a=tp_arg: rejection_sample(
                    s[0], s[1], tokens, temperatures=temps, seeds=seeds, offsets=offsets, top_p=a,
                    vocab_size=width, out=out, workspace=ws, passes=passes) for s in sets]
                res[name] = timer.time_graph(fns)
                if args.two_pass:  # the forced two-pass path on the same rows
                    res2 = [lambda s=s, a=tp_arg: rejection_sample(
                        s[0], s[1], tokens, temperatures=temps, seeds=seeds, offsets=offsets, top_p=a,
                        vocab_size=width, out=out, workspace=ws, passes="two") for s in sets]
                    two[name] = timer.time_graph(res2)
                if fi_make is not None:  # the peer on the same inputs, in the same run
                    try:
                        fi[name] = timer.time_graph([fi_make(s[0], s[1], tokens, args.temperature,
                                                             args.top_p if tp_arg is not None else None)
                                                     for s in sets])
                    except Exception as e:  # an API or capture failure is reported, not fatal
                        fi[name] = float("nan")
                        fi_errors.append(f"tp {tp} B={b} {name}: {type(e).__name__}: {str(e)[:160]}")
            del sets
            fl = floor_us(shard_bytes, bw)
            for name in ("none", "top_p"):
                key = (b, name == "top_p")
                if not args.no_stock and key not in stock_cache:
                    full_bytes = b * (2 * k + 1) * vocab * elt
                    n_full = rotation_count(full_bytes, max_sets=4) if not timer.smoke else 1
                    fulls = [random_logits(b, k, vocab, args.logit_scale, g, device, dtype) for _ in range(n_full)]
                    ftok = torch.randint(0, vocab, (b, k), generator=g, device=device)
                    u = torch.rand(b, k, generator=g, device=device)
                    stock_cache[key] = stock_timer.time_graph([
                        lambda s=s: stock_verify(s[0], s[1], ftok, temps, top_p if key[1] else None, u)
                        for s in fulls], min_calls_per_graph=1)
                    del fulls
                stock = stock_cache.get(key, float("nan"))
                ours = res[name]
                s_eff, chunk = column_plan(b * (2 * k + 1), width, block, splits, **_plan_kw(args))
                sub = draw_plan(b, s_eff, chunk, block, splits, **_plan_kw(args))
                calls, nbytes = (exchange_volume(b, k, tp, name == "top_p", s_eff, dtype, sub, passes) if tp > 1
                                 else (0, 0))
                peers = reference_us(PEERS, tp, name, b, vocab, k, args.dtype)
                goal = reference_us(GOALS, tp, name, b, vocab, k, args.dtype).get("goal")
                rows.append([tp, width, passes, b, name, fmt(fl, 2), fmt(ours, 2),
                             fmt(two[name], 2) if name in two else "-", fmt(ours / fl, 2),
                             fmt(goal, 1) if goal else "-",
                             fmt(peers["vLLM MRv2"], 0) if peers else "-",
                             fmt(peers["FlashInfer"], 0) if peers else "-",
                             fmt(fi[name], 1) if name in fi else "-",
                             fmt(stock, 1), fmt(stock / ours, 1), f"{calls} / {nbytes}"])
            print(f"bench verify: tp {tp} B={b} done", file=sys.stderr, flush=True)
    print_table(
        f"bench verify: rejection_sample per rank, {args.dtype}, V={vocab}, K={k}, T={args.temperature}, "
        f"top-p {args.top_p}, block {block}, splits {splits}",
        ["tp", "shard width", "passes", "B", "top-p", "floor us", "ours us", "two-pass us", "ours/floor", "goal us",
         "vLLM MRv2 us (issue)",
         "FlashInfer us (issue)", "FlashInfer us (this run)", "stock(V) us", "stock/ours", "exchanges (rounds / bytes per rank)"],
        rows,
        notes=[
            f"copy bandwidth (read+write) {fmt(bw / 1e12, 2)} TB/s; floor = target + draft logits of the owned "
            "columns read once at that rate.",
            f"logits: target rows N(0, {args.logit_scale:g}^2), draft rows the target's plus N(0, "
            f"{args.logit_scale / 2:g}^2) (--logit-scale); every column of this run reads the same rows.",
            "ours = one rank's kernels on shard-sized inputs, exchange latency not included (listed as calls and "
            "bytes), on the path a rank of that TP size takes ('passes': one read of the logits on block-aligned "
            "shards, --shard-width); two-pass us = the same call forced onto the two-pass path (--two-pass); stock = gathered full-vocabulary softmax + torch.sort top-p + rejection test + Gumbel draw.",
            "goal, vLLM MRv2, FlashInfer: issue 28's goals and the peers' numbers measured on the H200 on "
            "2026-12-02 (same settings: V = 200064, K = 7, bf16, T = 1, top-p 0.95); reference columns, not "
            "measured by this run. Exchange rounds: 3 without top-p, 6 with it (bf16 logits).",
            "FlashInfer us (this run): its softmax + top_p_renorm_probs + chain_speculative_sampling on the same "
            "inputs, timed in this run " + (f"({'; '.join(fi_errors)})" if fi_errors else "")
            + (f"-- not measured: {fi_why}" if fi_why else "")
            + "; vLLM's rejection sampler is not timed here (its reference column only).",
        ],
    )
