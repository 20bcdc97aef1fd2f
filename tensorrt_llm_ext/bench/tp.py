"""``trtllm-ext bench tp --tp N``: the TP paths side by side, measured on N MPI-launched ranks.

The command starts N ranks itself (:class:`~tensorrt_llm_ext.runtime.ranks.MpiPool`, one GPU per rank,
NCCL; gloo on CPU as a smoke run whose timings are meaningless). Every rank runs the same measurements
in the same order; the table shows, per cell, the MAXIMUM over ranks of each rank's median (a TP step
waits for its slowest rank). Sections:

1. selection (bf16): vocab-parallel (shard kernel + :class:`PairExchange`, one ``[R]`` int64 all-reduce
   MAX) vs the gathered path (all-gather of the shard logits, then the same kernel over the full row),
   greedy and keyed Gumbel sampling, rows 1..256, V = 200064, 129280 and 129281 on the LM head's shards
   (:func:`~tensorrt_llm_ext.mapping.vocab_shards`: whole 1024-id blocks, the last shard padded; 129280 divides
   by 2/4/8, 129281 does not);
2. the Markov chain on a vocabulary shard with the exchange (exact and fused modes) vs the replicated
   full-vocabulary chain (the exact mode, and the eager reference chain) that every rank would run;
3. the drafter with TP fusion (:class:`DSparkDrafter`) vs without (:class:`DSparkDrafterNoFusion`):
   context projection and block decode;
4. the whole DSpark step per rank (``bench step``'s model and worker stages), fused vs stock op table.

Timing: :meth:`BenchTimer.time_graph` (CUDA-graph replay, collectives captured). Before timing a variant
every rank test-captures it once and the ranks agree (:func:`agree_all`) on the outcome, so they all take
the same branch; where capture fails anywhere, the variant is timed eagerly (``time_eager``) on every
rank and the table says so. Never a rank alone in a collective.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field

import torch

from tensorrt_llm_ext.argtypes import name_list, positive_int, seconds
from tensorrt_llm_ext.bench.harness import (TABLES, BenchTimer, fmt, print_table, register_benchmark,
                                            rotation_count)
from tensorrt_llm_ext.mapping import vocab_shards
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

# Drafter sizes on GPU: fc [4096, 3*4096] bf16 is 100 MB (above the 60 MiB L2, like a real drafter's
# fc), 2 layers, weights drawn on the device (initialises in well under a second).
GPU_DRAFTER = dict(hidden_size=4096, target_hidden_size=4096, num_capture_layers=3, num_layers=2, num_heads=32,
                   head_dim=128, latent_dim=512, intermediate_size=11008, vocab_size=32000, markov_rank=64,
                   mask_token_id=31999)
TINY_DRAFTER = dict(hidden_size=64, target_hidden_size=40, num_capture_layers=3, num_layers=2, num_heads=4,
                    head_dim=16, latent_dim=32, intermediate_size=96, vocab_size=1031, markov_rank=8,
                    mask_token_id=1030)


@dataclass(frozen=True)
class TpSizes:
    """What every rank measures (plain data: shipped to the ranks)."""

    select_vocabs: tuple[int, ...] = (200064, 129280, 129281)
    select_rows: tuple[int, ...] = (1, 8, 64, 256)
    markov_vocab: int = 200064
    markov_rank: int = 256
    draft_len: int = 7
    markov_batches: tuple[int, ...] = (1, 8, 32, 128)
    drafter: dict = field(default_factory=lambda: dict(GPU_DRAFTER))
    ctx_rows: tuple[int, ...] = (1, 64, 512)
    block_batches: tuple[int, ...] = (1, 8, 32)
    ctx_len: int = 256  # context positions every block attends to
    page_size: int = 64
    step_vocab: int = 128256  # the whole-step section: bench step's model at this vocabulary
    step_batches: tuple[int, ...] = (1, 8, 32)
    step_tiny: bool = False  # the tiny test model instead of bench step's GPU model


def sizes_for(tiny: bool, quick: bool) -> TpSizes:
    """Full sizes, ``--quick`` (first and last of each list) or ``--tiny`` (CPU smoke sizes)."""
    if tiny:
        s = TpSizes(select_vocabs=(2048, 2003), select_rows=(1, 3), markov_vocab=2003, markov_rank=16,
                    draft_len=3, markov_batches=(1, 2), drafter=dict(TINY_DRAFTER), ctx_rows=(1, 5),
                    block_batches=(1, 2), ctx_len=6, page_size=4, step_vocab=516, step_batches=(1, 2),
                    step_tiny=True)
    else:
        s = TpSizes()
    if quick:
        ends = lambda xs: tuple(dict.fromkeys((xs[0], xs[-1])))  # noqa: E731
        s = TpSizes(**{**asdict(s), "select_rows": ends(s.select_rows), "markov_batches": ends(s.markov_batches),
                       "ctx_rows": ends(s.ctx_rows), "block_batches": ends(s.block_batches),
                       "step_batches": ends(s.step_batches)})
    return s


# ----------------------------------------------------------------------------------------------------
# Per rank
# ----------------------------------------------------------------------------------------------------
_PEER_FAILED = "graph capture failed on another rank"


class _AgreedTimer:
    """``BenchTimer`` for collectives: a variant is graph-timed only if every rank captured it."""

    def __init__(self, mapping, reps: int, calls_per_rep: int):
        self.mapping = mapping
        self.bt = BenchTimer(reps=reps, calls_per_rep=calls_per_rep)
        self.eager: dict[str, str] = {}  # label -> why it was timed eagerly

    @property
    def smoke(self) -> bool:
        return self.bt.smoke

    def _probe(self, fns) -> None:
        """Warm up (compile, lazy NCCL/cuBLAS setup) and capture one graph that is never replayed: a
        capture enqueues nothing on the peers, so a rank whose capture fails leaves nobody waiting."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            for fn in fns:
                fn()
        del graph

    def time(self, label: str, fns) -> float:
        """Microseconds per call of ``fns`` (round-robin); NaN on CPU (one smoke call)."""
        from tensorrt_llm_ext.distributed import agree_all

        if self.smoke:
            return self.bt.time_graph(fns)
        if label not in self.eager:
            err = None
            try:
                self._probe(fns)
            except Exception as e:  # report, agree, fall back together
                err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
            if not agree_all(self.mapping, err is None):
                self.eager[label] = err or _PEER_FAILED
        if label in self.eager:
            return self.bt.time_eager(fns)
        return self.bt.time_graph(fns)


def _gen(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _select_section(mapping, dev, sizes: TpSizes, timer: _AgreedTimer, out: dict) -> None:
    from tensorrt_llm_ext.distributed import PairExchange
    from tensorrt_llm_ext.speculative.vocab_parallel import (gathered_argmax, gathered_gumbel_sample, gumbel_sample,
                                                             vocab_parallel_argmax)

    tp, rank = mapping.tp_size, mapping.tp_rank
    ex = PairExchange(mapping)
    for vocab in sizes.select_vocabs:
        split = vocab_shards(vocab, tp)  # the LM head's split: the last shard holds tp*width - V pad columns
        width, start = split.width, split.start(rank)
        for rows in sizes.select_rows:
            n = 1 if timer.smoke else rotation_count(rows * width * 2)
            g = _gen(dev, vocab * 1009 + rows * 31 + rank)
            shards = [torch.randn(rows, width, generator=g, device=dev).to(torch.bfloat16) for _ in range(n)]
            keys = torch.empty(rows, dtype=torch.int64, device=dev)
            gathered = torch.empty(rows, dtype=torch.int64, device=dev)
            temps = torch.ones(rows, dtype=torch.float32, device=dev)
            seeds = torch.arange(rows, dtype=torch.int64, device=dev) + 17
            offsets = torch.arange(rows, dtype=torch.int64, device=dev)
            t = {
                "vp_argmax": timer.time("select: vocab-parallel argmax", [
                    lambda x=x: vocab_parallel_argmax(x, start, vocab, ex, out=keys) for x in shards]),
                "gathered_argmax": timer.time("select: gathered argmax", [
                    lambda x=x: gathered_argmax(x, vocab, mapping, out=gathered) for x in shards]),
                "vp_sample": timer.time("select: vocab-parallel sample", [
                    lambda x=x: gumbel_sample(x, temps, seeds, offsets, start, vocab, ex, out=keys) for x in shards]),
                "gathered_sample": timer.time("select: gathered sample", [
                    lambda x=x: gathered_gumbel_sample(x, temps, seeds, offsets, vocab, mapping, out=gathered)
                    for x in shards]),
            }
            # The same ids as the gathered path, on this rank's timed inputs (collectives: every rank).
            a = vocab_parallel_argmax(shards[0], start, vocab, ex).clone()
            b = gathered_argmax(shards[0], vocab, mapping).clone()
            sa = gumbel_sample(shards[0], temps, seeds, offsets, start, vocab, ex).clone()
            sb = gathered_gumbel_sample(shards[0], temps, seeds, offsets, vocab, mapping).clone()
            equal = bool(torch.equal(a, b) and torch.equal(sa, sb))
            out["select"].append(dict(vocab=vocab, width=width, pad=tp * width - vocab, rows=rows, t=t, equal=equal))
            del shards


def _markov_section(mapping, dev, sizes: TpSizes, timer: _AgreedTimer, out: dict) -> None:
    from tensorrt_llm_ext.distributed import PairExchange
    from tensorrt_llm_ext.speculative.markov_chain import (MarkovWorkspace, markov_chain_logits,
                                                           markov_chain_logits_reference)

    tp, rank = mapping.tp_size, mapping.tp_rank
    V, r, K = sizes.markov_vocab, sizes.markov_rank, sizes.draft_len
    ex = PairExchange(mapping)
    g = _gen(dev, 7)  # same seed on every rank: the same full weights and inputs everywhere
    w1 = (torch.randn(V, r, generator=g, device=dev) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(V, r, generator=g, device=dev) * 0.05).to(torch.bfloat16)
    split = vocab_shards(V, tp)  # the LM head's split, as the drafter's Markov rows follow it
    width, start, valid = split.width, split.start(rank), split.num_valid(rank)
    w2_shard = torch.zeros(width, r, dtype=w2.dtype, device=dev)  # padded rows are zero, as in the drafter
    w2_shard[:valid].copy_(w2[start:start + valid])
    for B in sizes.markov_batches:
        n = 1 if timer.smoke else rotation_count(2 * B * K * V * 2)
        gi = _gen(dev, 1000 + B)
        fulls = [torch.randn(B, K, V, generator=gi, device=dev).to(torch.bfloat16) for _ in range(n)]
        anchors = torch.randint(0, V, (B,), generator=gi, device=dev)
        shards = []
        for f in fulls:
            s = torch.zeros(B, K, width, dtype=f.dtype, device=dev)
            s[..., :valid].copy_(f[..., start:start + valid])
            shards.append(s)
        t, tokens = {}, {}
        for mode in ("exact", "fused"):
            ws = MarkovWorkspace.allocate(B, K, w2_shard, mode)
            outs = [torch.empty_like(s) for s in shards]
            run = [lambda s=s, o=o, ws=ws, mode=mode: markov_chain_logits(
                s, anchors, w1, w2_shard, vocab_start=start, vocab_size=V, exchange=ex, mode=mode, out=o,
                workspace=ws) for s, o in zip(shards, outs)]
            t[f"shard_{mode}"] = timer.time(f"markov: shard {mode} + exchange", run)
            tokens[mode] = run[0]()[1].clone()
            del outs, ws
        ws = MarkovWorkspace.allocate(B, K, w2, "exact")
        outs = [torch.empty_like(f) for f in fulls]
        run = [lambda f=f, o=o, ws=ws: markov_chain_logits(f, anchors, w1, w2, mode="exact", out=o, workspace=ws)
               for f, o in zip(fulls, outs)]
        t["repl_exact"] = timer.time("markov: replicated exact", run)
        ref = run[0]()[1].clone()
        del outs, ws
        t["repl_eager"] = timer.time("markov: replicated eager", [
            lambda f=f: markov_chain_logits_reference(f, anchors, w1, w2) for f in fulls])
        match = {m: float((tokens[m] == ref).float().mean().item()) for m in tokens}
        out["markov"].append(dict(B=B, width=width, t=t, match=match))
        del fulls, shards


def _device_state_dict(cfg, seed: int, dtype, dev) -> dict:
    """FULL drafter weights drawn on the device (same seed on every rank: the same full weights)."""
    from tensorrt_llm_ext.models.dspark_drafter import generate_full_state_dict

    return generate_full_state_dict(cfg, seed, dtype, device=dev)


def _block_inputs(cfg, B: int, K: int, ctx_len: int, page_size: int, dev):
    """B live requests, each with ``ctx_len`` context positions in its own pages, then the K-block."""
    from tensorrt_llm_ext.contract import DraftBlockPlacement, DrafterBlockInputs, PagedLatentCache

    g = _gen(dev, 99 + B)
    max_pages = -(-(ctx_len + K) // page_size)
    pool = (torch.randn(cfg.num_layers, B * max_pages, page_size, cfg.latent_dim, generator=g, device=dev)
            * 0.5).to(torch.bfloat16)
    table = torch.arange(B * max_pages, dtype=torch.int32, device=dev).view(B, max_pages)
    slots = torch.arange(B, dtype=torch.int32, device=dev)
    positions = (ctx_len + torch.arange(K, device=dev)).expand(B, K).to(torch.int32).contiguous()
    page_ids = torch.gather(table, 1, (positions // page_size).long()).to(torch.int32)
    ctx_lens = torch.full((B,), ctx_len, dtype=torch.int32, device=dev)
    ids = torch.full((B, K), cfg.mask_token_id, dtype=torch.int64, device=dev)
    ids[:, 0] = torch.randint(0, cfg.vocab_size, (B,), generator=g, device=dev)
    placement = DraftBlockPlacement(positions, page_ids, (positions % page_size).contiguous(), ctx_lens,
                                    ctx_lens + K)
    return DrafterBlockInputs(ids, slots, placement, PagedLatentCache(pool, table))


def _drafter_section(mapping, dev, sizes: TpSizes, timer: _AgreedTimer, out: dict) -> None:
    from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafter, DSparkDrafterConfig, DSparkDrafterNoFusion

    cfg = DSparkDrafterConfig(**sizes.drafter)
    sd = _device_state_dict(cfg, 3, torch.bfloat16, dev)
    models = {}
    for name, cls in (("fusion", DSparkDrafter), ("no_fusion", DSparkDrafterNoFusion)):
        m = cls(cfg, mapping, dtype=torch.bfloat16, device=dev)
        m.load_full_state_dict(sd)
        models[name] = m
    del sd
    out["drafter_plans"] = {k: str(m.tp_plan) for k, m in models.items()}
    F_in = cfg.fc_in_features
    for N in sizes.ctx_rows:
        n = 1 if timer.smoke else rotation_count(N * F_in * 2)
        g = _gen(dev, 500 + N)
        feats = [torch.randn(N, F_in, generator=g, device=dev).to(torch.bfloat16) for _ in range(n)]
        t = {k: timer.time(f"drafter: context projection ({k})", [lambda f=f, m=m: m.project_context(f)
                                                                   for f in feats])
             for k, m in models.items()}
        out["drafter"].append(dict(stage="context projection", size=N, rows=N, t=t))
        del feats
    K = sizes.draft_len
    for B in sizes.block_batches:
        t = {}
        for k, m in models.items():
            inputs = _block_inputs(cfg, B, K, sizes.ctx_len, sizes.page_size, dev)
            t[k] = timer.time(f"drafter: block decode ({k})", [lambda m=m, i=inputs: m.forward_block(i)])
            del inputs
        out["drafter"].append(dict(stage="block decode", size=B, rows=B * K, t=t))
    del models


def _step_section(mapping, dev, sizes: TpSizes, timer: _AgreedTimer, out: dict) -> None:
    """The whole DSpark step on this rank, fused vs stock op table (bench step's worker stages)."""
    from tensorrt_llm_ext.bench.step import GPU_MODEL, StepStages, cpu_model, setup_rows
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine

    model = cpu_model() if sizes.step_tiny else dict(GPU_MODEL)
    model.update({"model.target.vocab_size": sizes.step_vocab, "speculative_config.max_draft_len": sizes.draft_len,
                  "max_batch_size": max(sizes.step_batches), "tensor_parallel_size": mapping.tp_size})
    eng = Engine(load_config(**model), mapping, device=dev)
    fused, stock = eng.worker("speculative", sampling=False), eng.worker("stock", sampling=False)
    out["step_selection"] = fused.selection.describe()
    for b in sizes.step_batches:
        ctx0 = setup_rows(eng, b, 8 if sizes.step_tiny else 64)
        snapshot = [x.clone() for x in eng.state.mutable_tensors()]
        t, tokens = {}, {}
        for name, worker in (("fused", fused), ("stock", stock)):
            stages = StepStages(eng, worker, b, ctx0)
            t[name] = timer.time(f"step: {name} B={b}", [stages.step])
            for dst, src in zip(eng.state.mutable_tensors(), snapshot):
                dst.copy_(src)
            tokens[name] = stages.step()["new_tokens"][:b].cpu()
            for dst, src in zip(eng.state.mutable_tensors(), snapshot):
                dst.copy_(src)
        out["step"].append(dict(B=b, t=t, equal=bool(torch.equal(tokens["fused"].long(), tokens["stock"].long()))))
        for slot in range(b):
            eng.pages.free(slot)
    del eng


def _rank_main(tp: int, sizes_dict: dict, sections: list[str], reps: int, calls_per_rep: int) -> dict:
    """MPI rank entry: join the TP group, run every section in the same order on every rank."""
    # NCCL reads this at communicator creation: keep NVLink multicast (NVLS) off, as the device README asks.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    from tensorrt_llm_ext.distributed import backend_name, comm_device, init_from_mpi

    mapping = init_from_mpi(tp_size=tp)
    dev = comm_device()
    if dev.type != "cuda":
        torch.set_num_threads(1)  # the ranks share the CPU cores
    sizes = TpSizes(**sizes_dict)
    timer = _AgreedTimer(mapping, reps, calls_per_rep)
    out: dict = dict(rank=mapping.rank, backend=backend_name(), smoke=timer.smoke,
                     device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                     select=[], markov=[], drafter=[], drafter_plans={}, step=[])
    with torch.no_grad():
        if "select" in sections:
            _select_section(mapping, dev, sizes, timer, out)
        if "markov" in sections:
            _markov_section(mapping, dev, sizes, timer, out)
        if "drafter" in sections:
            _drafter_section(mapping, dev, sizes, timer, out)
        if "step" in sections:
            _step_section(mapping, dev, sizes, timer, out)
    out["eager"] = dict(timer.eager)
    return out


# ----------------------------------------------------------------------------------------------------
# Launcher and tables
# ----------------------------------------------------------------------------------------------------
SECTIONS = ("select", "markov", "drafter", "step")  # what _rank_main runs, in this order


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=positive_int, default=2, help="ranks to launch (one GPU each)")
    p.add_argument("--quick", action="store_true", help="fewer sizes (first and last of each list)")
    p.add_argument("--tiny", action="store_true", help="CPU smoke sizes (tiny vocabularies and drafter)")
    p.add_argument("--sections", type=name_list(SECTIONS), default=",".join(SECTIONS))
    p.add_argument("--reps", type=positive_int, default=10, help="timed repetitions per variant (median)")
    p.add_argument("--calls-per-rep", type=positive_int, default=10, help="graph replays per repetition")
    p.add_argument("--timeout", type=seconds, default=900.0, help="seconds before a rank is declared hung")


def _max_over_ranks(results: list[dict], section: str, i: int, key: str) -> float:
    vals = [r[section][i]["t"][key] for r in results]
    return float("nan") if any(v != v for v in vals) else max(vals)


def _ratio(a: float, b: float) -> str:
    return fmt(a / b, 2) if a == a and b == b and b > 0 else "-"


def run_tp(args: argparse.Namespace, pool=None) -> list[str]:
    """Launch ``args.tp`` ranks (or use ``pool``), measure, print the tables; returns their text."""
    from tensorrt_llm_ext.interpreter import ensure_triton_interpreter
    from tensorrt_llm_ext.runtime.ranks import MpiPool

    ensure_triton_interpreter()  # a CPU smoke run: before the ranks import any kernel module
    tp = args.tp
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if torch.cuda.is_available() and torch.cuda.device_count() < tp:
        raise ValueError(f"--tp {tp} needs {tp} GPUs (one per rank), found {torch.cuda.device_count()}")
    sizes = sizes_for(args.tiny, args.quick)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    own = pool is None
    if own:
        pool = MpiPool(tp, env={"NCCL_NVLS_ENABLE": "0"}).start()  # the ranks keep NVLink multicast off
    try:
        results = pool.run(_rank_main, tp, asdict(sizes), sections, args.reps, args.calls_per_rep,
                           timeout=args.timeout)
    finally:
        if own:
            pool.shutdown()
    return _tables(args, tp, sizes, results)


def _tables(args, tp: int, sizes: TpSizes, results: list[dict]) -> list[str]:
    r0 = results[0]
    smoke = r0["smoke"]
    eager: dict[str, str] = {}
    for r in results:  # keep the failing rank's own error over its peers' "failed on another rank"
        for label, why in r["eager"].items():
            if label not in eager or why != _PEER_FAILED:
                eager[label] = f"rank {r['rank']}: {why}" if why != _PEER_FAILED else why
    head = (f"TP {tp}, backend {r0['backend']}, ranks on {', '.join(sorted({r['device'] for r in results}))}. "
            "Each time is the MAXIMUM over ranks of the per-rank median (a TP step waits for the slowest rank), "
            "us per call.")
    timing = ("CPU gloo smoke run: every variant ran once, timings meaningless ('-')." if smoke else
              "Timed under CUDA-graph replay (collectives captured), median of repetitions, inputs rotated past "
              "the 60 MiB L2 where noted.")

    def how(prefix: str) -> str:
        fell = {k: v for k, v in eager.items() if k.startswith(prefix)}
        if not fell:
            return ""
        return "EAGER timing (graph capture failed, agreed on every rank): " + "; ".join(
            f"{k} ({v})" for k, v in sorted(fell.items()))

    texts = []
    if r0["select"]:
        rows = []
        for i, e in enumerate(r0["select"]):
            t = {k: _max_over_ranks(results, "select", i, k) for k in e["t"]}
            equal = all(r["select"][i]["equal"] for r in results)
            rows.append([e["vocab"], e["width"], e["pad"], e["rows"], fmt(t["vp_argmax"], 2),
                         fmt(t["gathered_argmax"], 2), _ratio(t["gathered_argmax"], t["vp_argmax"]),
                         fmt(t["vp_sample"], 2), fmt(t["gathered_sample"], 2),
                         _ratio(t["gathered_sample"], t["vp_sample"]), "yes" if equal else "NO"])
        notes = [head, timing,
                 "vp = vocab_parallel_argmax / gumbel_sample on this rank's [rows, shard width] bf16 shard + the "
                 "PairExchange (one [rows] int64 all-reduce MAX) + id decode; gathered = gathered_argmax / "
                 "gathered_gumbel_sample: all-gather of the shard logits, then the same kernel over the full row. "
                 "pad = padded columns of the last shard (tp * width - V). sample: T=1, keyed Gumbel-max. "
                 "ids equal: vp ids == gathered ids (argmax and sample) on every rank. Shard inputs rotated "
                 "past the L2.",
                 "Shards are the LM head's (whole 1024-id blocks where every rank keeps a real id, so the last "
                 "shard is padded even where V % tp == 0). Vocabularies that divide by this TP (vocab-parallel "
                 "selection is eligible): " + (", ".join(f"V={v}" for v in sizes.select_vocabs if v % tp == 0)
                                               or "none")
                 + "; that do not: " + (", ".join(f"V={v}" for v in sizes.select_vocabs if v % tp) or "none")
                 + " (129280, DeepSeek-V3's vocabulary, divides by tp 2/4/8; 129281 stands in for one that does not)."]
        if how("select"):
            notes.append(how("select"))
        texts.append(print_table(f"bench tp: vocab-parallel vs gathered selection, bf16, TP {tp}",
                                 ["V", "shard width", "pad", "rows", "vp argmax", "gathered argmax", "gathered/vp",
                                  "vp sample", "gathered sample", "gathered/vp sample", "ids equal"], rows, notes))
    if r0["markov"]:
        rows = []
        for i, e in enumerate(r0["markov"]):
            t = {k: _max_over_ranks(results, "markov", i, k) for k in e["t"]}
            best = min(t["shard_exact"], t["shard_fused"]) if not smoke else float("nan")
            match = {m: min(r["markov"][i]["match"][m] for r in results) for m in e["match"]}
            rows.append([e["B"], e["width"], fmt(t["shard_exact"]), fmt(t["shard_fused"]), fmt(t["repl_exact"]),
                         fmt(t["repl_eager"]), _ratio(t["repl_exact"], best), _ratio(t["repl_eager"], best),
                         f"{100 * match['exact']:.1f}% / {100 * match['fused']:.1f}%"])
        notes = [head, timing,
                 f"V={sizes.markov_vocab}, r={sizes.markov_rank}, K={sizes.draft_len}, bf16, greedy. shard exact / "
                 "shard fused = markov_chain_logits on this rank's [B, K, V_local] shard and [V_local, r] markov_w2 "
                 "rows with the PairExchange each step (K all-reduces of [B] int64); replicated exact = the exact "
                 "mode on the full vocabulary, no exchange; replicated eager = markov_chain_logits_reference on the "
                 "full vocabulary (what every rank runs without the shard chain). repl/best = replicated time over "
                 "the faster shard mode. Base-logit sets rotated past the L2; weights are not.",
                 "tokens = repl: share of draft tokens equal to the replicated exact chain (minimum over ranks), "
                 "shard exact / shard fused; below 100% only at near-ties (bias GEMM sum order differs between "
                 "shard and full width, and fused rounds its bias once from another order)."]
        if how("markov"):
            notes.append(how("markov"))
        texts.append(print_table(f"bench tp: vocab-shard Markov chain vs replicated chain, TP {tp}",
                                 ["B", "V_local", "shard exact", "shard fused", "repl exact", "repl eager",
                                  "repl exact/best", "repl eager/best", "tokens = repl (exact / fused)"],
                                 rows, notes))
    if r0["drafter"]:
        rows = []
        for i, e in enumerate(r0["drafter"]):
            t = {k: _max_over_ranks(results, "drafter", i, k) for k in e["t"]}
            label = f"N={e['size']}" if e["stage"] == "context projection" else f"B={e['size']}, K={sizes.draft_len}"
            rows.append([e["stage"], label, e["rows"], fmt(t["fusion"]), fmt(t["no_fusion"]),
                         _ratio(t["no_fusion"], t["fusion"])])
        d = sizes.drafter
        notes = [head, timing,
                 f"drafter config: hidden {d['hidden_size']}, fc input {d['num_capture_layers']}*"
                 f"{d['target_hidden_size']}={d['num_capture_layers'] * d['target_hidden_size']}, "
                 f"{d['num_layers']} layers, {d['num_heads']} heads x {d['head_dim']}, latent {d['latent_dim']}, "
                 f"MLP {d['intermediate_size']}, vocab {d['vocab_size']}, bf16; block decode attends to "
                 f"{sizes.ctx_len} context positions per request (page size {sizes.page_size}).",
                 "fusion = DSparkDrafter (fc split over input features + all-reduce fused with hidden_norm; "
                 "o_proj/down_proj all-reduces fused with residual add + RMSNorm); no fusion = "
                 "DSparkDrafterNoFusion (whole fc replicated, reduced projections, separate add and norm). "
                 "context projection = project_context on [N, F] features (rotated past the L2); block decode = "
                 "forward_block (eager reference attention, same in both) on one input set.",
                 "plans: " + " | ".join(f"{k}: {v}" for k, v in r0["drafter_plans"].items())]
        if how("drafter"):
            notes.append(how("drafter"))
        texts.append(print_table(f"bench tp: drafter with vs without TP fusion, TP {tp}",
                                 ["stage", "size", "rows", "fusion", "no fusion", "no fusion/fusion"], rows, notes))
    if r0["step"]:
        rows = []
        for i, e in enumerate(r0["step"]):
            t = {k: _max_over_ranks(results, "step", i, k) for k in e["t"]}
            equal = all(r["step"][i]["equal"] for r in results)
            rows.append([e["B"], fmt(t["fused"]), fmt(t["stock"]), _ratio(t["stock"], t["fused"]),
                         "yes" if equal else "NO"])
        notes = [head, timing,
                 f"bench step's model at V={sizes.step_vocab}, K={sizes.draft_len}, greedy rows; fused / stock = the "
                 "same DSparkWorker with the fused / the stock op table (stock: gathered logits + torch.argmax, eager "
                 "acceptance/bookkeeping/store chains, F.linear + add + torch.argmax Markov chain); whole "
                 "worker.forward(B) per rank. tokens equal: the step's accepted tokens agree between the tables on "
                 "every rank.", r0["step_selection"]]
        if how("step"):
            notes.append(how("step"))
        texts.append(print_table(f"bench tp: whole DSpark step, fused vs stock op table, TP {tp}",
                                 ["B", "fused step", "stock step", "stock/fused", "tokens equal"], rows, notes))
    out_path = getattr(args, "out", None)
    if out_path:
        with open(out_path, "a") as f:
            for text in texts:
                f.write(text + "\n")
    return texts


@register_benchmark("tp", "TP paths side by side on N MPI ranks: vocab-parallel vs gathered selection, shard vs "
                          "replicated Markov chain, drafter with vs without TP fusion", add_args=_add_args)
def run(args: argparse.Namespace) -> int:
    """Exit codes as ``generate --tp N``'s: 2 for a TP size this host cannot run, 128 + the signal when the job
    was interrupted, 1 when a rank failed (one error line naming it and its log, not a traceback)."""
    import sys

    from tensorrt_llm_ext.runtime.launch import tp_gpu_error
    from tensorrt_llm_ext.runtime.ranks import RankJobError, RankJobInterrupted

    too_few = tp_gpu_error(args.tp)
    if too_few:
        print(f"error: bench tp: {too_few}", file=sys.stderr)
        return 2
    first = len(TABLES)
    try:
        run_tp(args)
    except RankJobInterrupted as e:
        print(f"error: bench tp: the {args.tp}-rank job was {e.headline} (rank logs: {e.log_dir})", file=sys.stderr)
        return 128 + e.signum
    except RankJobError as e:
        print(f"error: bench tp: the {args.tp}-rank job failed: {e}", file=sys.stderr)
        return 1
    # A row whose paths disagree ("ids equal" / "tokens equal": NO) is a wrong result, not a timing.
    differ = [t["title"] for t in TABLES[first:] if any(row[-1] == "NO" for row in t["rows"])]
    for title in differ:
        print(f"error: bench tp: the paths gave different ids in '{title}' (rows marked NO)", file=sys.stderr)
    return 1 if differ else 0
