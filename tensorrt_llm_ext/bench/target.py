"""``trtllm-ext bench target``: the target forward per decode step against its floor (CUDA-graph replay).

Per model shape (``--shapes``: the embedded ``smollm2-135m`` and ``llama-8b`` shapes with random weights drawn
on the device, or ``--model DIR`` a checkpoint), batch size B and context C (every row a live request whose
cache holds C tokens), each a CUDA graph replayed (median):

* ``decode fwd``: the target forward of one token per row (``[B, 1]``);
* ``verify fwd``: the forward of a K+1 block per row (``[B, K+1]``, the speculative step's verification and the
  shape of the lossless reference decode, mode ``reference``);
* ``target-only step``: the engine's non-speculative decode step (the ``[B, 1]`` forward, the head, greedy
  selection; what ``Engine.generate(mode="target_only")`` and ``serve --no-speculation`` replay);
* ``attn``: the paged decode attention of one layer (``T = 1``), rotated over the layers' pools, against its
  KV-bytes floor, and FlashInfer's paged decode at the same shape when ``flashinfer`` imports (else a line
  saying why the column is absent);
* ``decode no-PDL``: ``decode fwd`` with programmatic dependent launch off (``TLLM_EXT_PDL=0``; on by default
  on Hopper: the fused layer's kernels and the attention start while the previous kernel finishes);
* ``floor``: the bytes a decode step must read (every weight but the embedding once, plus ``B * C`` tokens of
  K/V) at the measured copy bandwidth; ``launches``: kernels of one eager ``[1, 1]`` decode forward;
* ``decode fused`` / ``decode unfused`` / ``verify fused`` / ``verify unfused``: both forwards with each layer
  (``layer_kernels = "fused"``: five launches per layer; ``"unfused"``: cuBLAS GEMMs and separate norm / RoPE /
  SiLU-mul launches); ``decode fwd`` / ``verify fwd`` repeat the one the model picks (fused up to
  ``FUSED_MAX_ROWS`` rows): the comparison that sets that threshold; ``launches dec/ver/step``: kernels of one
  eager ``[B, 1]`` / ``[B, K+1]`` forward and of one eager target-only step (forward, head, selection and the step's
  bookkeeping);
* a second table: the decode attention with each of ``CONFIG_CANDIDATES`` (the split tiles' launch settings),
  the best against the K/V floor: what sets ``DECODE_CONFIGS``.

``--spec-shapes`` (default ``llama-8b``): the speculative step (:meth:`DSparkWorker.forward`: verify forward,
selection, acceptance, drafter block decode and Markov chain) next to the target-only step and the verify
forward at the same rows: what the drafter and the step's tail cost where the target's forward dominates.

The caches are filled by placing the rows, not by prefilling them (a step's cost does not depend on the
values, and a 64 x 8k prefill of an 8B shape would take most of the run): ``ctx_lens`` / ``ref_lens`` are
set to C, and every replay restores them. On CPU: a smoke run of a tiny shape (timings printed as "-").
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark)

SHAPES = {
    # SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152.
    "smollm2-135m": {"model.target.vocab_size": 49152, "model.target.hidden_size": 576,
                     "model.target.num_layers": 30, "model.target.num_heads": 9, "model.target.num_kv_heads": 3,
                     "model.target.head_dim": 64, "model.target.intermediate_size": 1536,
                     "model.target.capture_layers": [1, 15, 28]},
    # Llama-3.1-8B: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary 128256.
    "llama-8b": {"model.target.vocab_size": 128256, "model.target.hidden_size": 4096,
                 "model.target.num_layers": 32, "model.target.num_heads": 32, "model.target.num_kv_heads": 8,
                 "model.target.head_dim": 128, "model.target.intermediate_size": 14336,
                 "model.target.capture_layers": [1, 16, 29]},
}
_DRAFTER = {"model.drafter_init": "random", "model.drafter.num_layers": 1, "model.drafter.num_heads": 8,
            "model.drafter.head_dim": 64, "model.drafter.latent_dim": 256, "model.drafter.intermediate_size": 2816,
            "speculative_config.markov_rank": 256}


def _add_args(p: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default=None, help="a checkpoint directory (instead of --shapes)")
    p.add_argument("--shapes", default="smollm2-135m,llama-8b" if cuda else "tiny",
                   help=f"embedded shapes with random weights: {', '.join(SHAPES)} (CPU: tiny)")
    p.add_argument("--spec-shapes", default="llama-8b" if cuda else "tiny",
                   help="shapes that also time the speculative step ('' for none)")
    p.add_argument("--batch-sizes", default="1,8,32,64" if cuda else "1,2")
    p.add_argument("--contexts", default="512,1024,2048,8192" if cuda else "16,40")
    p.add_argument("--no-layer-compare", action="store_true",
                   help="time only the layer the model picks (skip the forced fused / unfused columns)")
    p.add_argument("--no-attn-configs", action="store_true",
                   help="skip the table timing every CONFIG_CANDIDATES entry")
    p.add_argument("--decode-config", default=None,
                   help="run the model's decode attention with this launch setting (AttentionConfig.describe() form, "
                        "e.g. n64w4s2p32l) instead of DECODE_CONFIGS (head dims 64 and 128)")
    p.add_argument("--draft-len", type=int, default=7 if cuda else 3)
    p.add_argument("--page-size", type=int, default=32 if cuda else 8)


def _config(shape: str | None, model_dir: str | None, args, max_b: int, max_ctx: int):
    from tensorrt_llm_ext.configs.tiny_model import tiny_model
    from tensorrt_llm_ext.runtime.config import load_config

    run = {"max_batch_size": max_b, "max_seq_len": max_ctx + 2 * args.draft_len + 8,
           "speculative_config.max_draft_len": args.draft_len, "kv_cache_config.tokens_per_block": args.page_size}
    if model_dir is not None:
        return load_config(**{"model.path": model_dir, **run})
    if shape == "tiny":
        return load_config(**tiny_model(**{"model.drafter_init": "random", **run}))
    return load_config(**{**SHAPES[shape], **_DRAFTER, "model.dtype": "bfloat16", **run})


def device_random_weights(cfg, device) -> tuple[dict, dict]:
    """FULL target and drafter state dicts drawn on ``device`` (N(0, 1/fan_in) matrices, unit norms, small
    biases): an 8B shape in seconds, where the seeded host init would take minutes."""
    from tensorrt_llm_ext.models.dspark_drafter import full_weight_shapes as drafter_shapes
    from tensorrt_llm_ext.models.llama_target import full_weight_shapes as target_shapes
    from tensorrt_llm_ext.runtime.model_loader import model_configs, resolve_dtype

    tcfg, dcfg = model_configs(cfg)
    dtype = resolve_dtype(cfg.model.dtype, device)
    g = torch.Generator(device=device).manual_seed(cfg.model.seed)

    def draw(shapes):
        out = {}
        for name, shape in shapes.items():
            if len(shape) == 1:
                out[name] = (torch.ones(shape, dtype=dtype, device=device) if not name.endswith(".bias")
                             else torch.zeros(shape, dtype=dtype, device=device))
            else:
                w = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
                out[name] = (w / math.sqrt(shape[1]) if name != "embed_tokens.weight" else w).to(dtype)
        return out

    return draw(target_shapes(tcfg)), draw(drafter_shapes(dcfg))


def _launches(fn) -> int | None:
    """Kernels one eager call of ``fn`` launches (torch profiler); None where it cannot count."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    return len(kernels)


def _flashinfer():
    """``(module, None)`` or ``(None, why not)``."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # an optional extra: any import failure means the column is absent
        return None, f"flashinfer does not import here ({type(e).__name__}: {str(e)[:120]})"
    if not torch.cuda.is_available():
        return None, "flashinfer needs CUDA"
    return flashinfer, None


def _flashinfer_decode(fi, q, k_pool, v_pool, table, b, ctx, page):
    """A callable running FlashInfer's paged decode over the same pages (NHD layout = our pool's)."""
    n_pages = -(-ctx // page)
    indptr = torch.arange(0, (b + 1) * n_pages, n_pages, dtype=torch.int32, device=q.device)
    indices = table[:b, :n_pages].reshape(-1).contiguous()
    last = torch.full((b,), ctx - (n_pages - 1) * page, dtype=torch.int32, device=q.device)
    ws = torch.empty(128 * 2**20, dtype=torch.uint8, device=q.device)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
                                                    paged_kv_indices_buffer=indices,
                                                    paged_kv_last_page_len_buffer=last)
    wrapper.plan(indptr, indices, last, q.shape[1], k_pool.shape[2], q.shape[2], page, data_type=q.dtype,
                 q_data_type=q.dtype)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, (k_pool, v_pool), out=out)


@register_benchmark("target", "the target forward per decode step vs its floor: paged KV, fused attention "
                              "(CUDA graphs)", add_args=_add_args)
def run(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.interpreter import ensure_triton_interpreter

    ensure_triton_interpreter()
    from tensorrt_llm_ext.kernels.paged_attention import DECODE_CONFIGS, DECODE_CONFIGS_BY_BATCH, AttentionConfig

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",")]
        contexts = [int(x) for x in args.contexts.split(",")]
        if min(sizes) < 1 or min(contexts) < 1:
            raise ValueError
    except ValueError:
        print(f"error: bench target: --batch-sizes / --contexts must be positive ints, got {args.batch_sizes!r} / "
              f"{args.contexts!r}", file=sys.stderr)
        return 2
    shapes = [None] if args.model else [s for s in args.shapes.split(",") if s]
    spec = {s for s in args.spec_shapes.split(",") if s}
    bad = [s for s in shapes + sorted(spec) if s is not None and s not in SHAPES and s != "tiny"]
    if bad:
        print(f"error: bench target: unknown shapes {bad}; known: {', '.join(SHAPES)}, tiny", file=sys.stderr)
        return 2
    try:
        forced = AttentionConfig.parse(args.decode_config) if getattr(args, "decode_config", None) else None
    except ValueError as e:
        print(f"error: bench target: --decode-config: {e}", file=sys.stderr)
        return 2
    from tensorrt_llm_ext.runtime.config import ConfigError

    saved, saved_by_batch = dict(DECODE_CONFIGS), dict(DECODE_CONFIGS_BY_BATCH)
    try:
        if forced is not None:  # at every batch size
            DECODE_CONFIGS.update(dict.fromkeys(DECODE_CONFIGS, forced))
            DECODE_CONFIGS_BY_BATCH.clear()
        return _run(args, sizes, contexts, shapes, spec, cuda)
    except ConfigError as e:  # --batch-sizes / --contexts / --draft-len / --page-size outside the config's bounds
        print(f"error: bench target: {e}", file=sys.stderr)
        return 2
    finally:
        DECODE_CONFIGS.clear()
        DECODE_CONFIGS.update(saved)
        DECODE_CONFIGS_BY_BATCH.clear()
        DECODE_CONFIGS_BY_BATCH.update(saved_by_batch)


def _run(args, sizes, contexts, shapes, spec, cuda) -> int:
    from tensorrt_llm_ext.kernels.paged_attention import (CONFIG_CANDIDATES, DECODE_CONFIGS_BY_BATCH, SPLIT_TOKENS,
                                                          decode_config, paged_attention)
    from tensorrt_llm_ext.kernels.common import set_programmatic_launch
    from tensorrt_llm_ext.models.llama_target import FUSED_MAX_ROWS
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.speculative.reference_decoder import ReferenceDecoder

    timer = BenchTimer(reps=5, calls_per_rep=3)
    bw = measure_copy_bandwidth()
    fi, fi_why = _flashinfer()
    for shape in shapes:
        cfg = _config(shape, args.model, args, max(sizes), max(contexts))
        dev = torch.device("cuda" if cuda else "cpu")
        weights = device_random_weights(cfg, dev) if shape not in (None, "tiny") else None
        eng = Engine(cfg, weights=weights)
        del weights
        target, st, k = eng.target, eng.state, eng.draft_len
        worker = eng.worker("speculative", sampling=False)
        ref = ReferenceDecoder(worker, verify_shaped=False)  # the serving decode: [B, 1] rows
        kv = st.kv_cache
        elem = target.dtype.itemsize
        weight_bytes = sum(p.numel() for n, p in target.named_parameters() if not n.startswith("embed_tokens")) * elem
        kv_tok = target.kv_bytes_per_token()
        name = shape or args.model
        tcfg = target.config
        one = torch.zeros(1, 1, dtype=torch.int64, device=dev)
        launches = _launches(lambda: target(one, one, torch.zeros(1, dtype=torch.int32, device=dev), kv))
        rows, spec_rows, cfg_rows = [], [], []
        # The fused layer runs at TP 1 where Triton runs (the CPU smoke run: the interpreter would take minutes).
        fusable = cuda and eng.mapping.tp_size == 1
        max_b = max(sizes)
        for slot in range(max_b):
            eng.pages.allocate(slot, eng.pages.max_pages_per_slot)
        g = torch.Generator(device=dev).manual_seed(0)
        for b in sizes:
            slots = torch.arange(b, dtype=torch.int32, device=dev)
            worker.set_rows(list(range(b)), b)
            worker.decode_pages()
            for ctx in contexts:
                ctx0 = torch.full_like(st.ctx_lens, ctx)
                st.ctx_lens.copy_(ctx0)
                st.ref_lens.copy_(ctx0)
                st.slot_tokens.copy_(torch.randint(0, tcfg.vocab_size, st.slot_tokens.shape, generator=g, device=dev))
                tok1, tokk = st.slot_tokens[:b, :1].clone(), st.slot_tokens[:b].clone()
                pos1 = torch.full((b, 1), ctx, dtype=torch.int64, device=dev)
                posk = ctx + torch.arange(k + 1, device=dev)[None].expand(b, k + 1).contiguous()

                def target_only(b=b, ctx0=ctx0):
                    st.ref_lens.copy_(ctx0)
                    return ref.step(b)

                t = {"target_only": timer.time_graph([target_only], min_calls_per_graph=4)}
                if ctx == contexts[0]:  # launches do not depend on the context
                    counts = [_launches(lambda tok=tok, pos=pos: target(tok, pos, slots, kv))
                              for tok, pos in ((tok1, pos1), (tokk, posk))]
                    counts.append(_launches(lambda b=b: ref.step(b)))  # the target-only step (its lengths move)
                    st.ref_lens.copy_(ctx0)
                    step_launches = "/".join(str(n or "-") for n in counts)
                # Both layers at both shapes (fused five-launch layer / unfused cuBLAS layer): the comparison that
                # sets FUSED_MAX_ROWS; "decode fwd" / "verify fwd" are the ones the model picks at this shape.
                picks = {n: "fused" if target._fused_layers(r, tok1) else "unfused" for n, r in
                         (("decode", b), ("verify", b * (k + 1)))}
                compare = ("fused", "unfused") if fusable else ("unfused",)
                for kernels in compare if not args.no_layer_compare else sorted(set(picks.values())):
                    target.layer_kernels = kernels
                    try:
                        t["decode_" + kernels] = timer.time_graph([lambda: target(tok1, pos1, slots, kv)],
                                                                  min_calls_per_graph=4)
                        t["verify_" + kernels] = timer.time_graph([lambda: target(tokk, posk, slots, kv)],
                                                                  min_calls_per_graph=4)
                    finally:
                        target.layer_kernels = "auto"
                for step in ("decode", "verify"):
                    t[step] = t[step + "_" + picks[step]]
                # The same [B, 1] forward with programmatic dependent launch off (what PDL saves per step).
                prev = set_programmatic_launch(False)
                try:
                    t["decode_nopdl"] = timer.time_graph([lambda: target(tok1, pos1, slots, kv)], min_calls_per_graph=4)
                finally:
                    set_programmatic_launch(prev)
                q = torch.randn(b, 1, tcfg.num_heads // eng.mapping.tp_size, tcfg.head_dim, generator=g, device=dev
                                ).to(target.dtype)
                layers = range(min(tcfg.num_layers, 8))
                scale = tcfg.head_dim ** -0.5
                t["attn"] = timer.time_graph([lambda i=i: paged_attention(q, kv.k[i], kv.v[i], kv.page_table, slots,
                                                                          pos1, scale) for i in layers])
                cfg_t = [timer.time_graph([lambda i=i, c=c: paged_attention(q, kv.k[i], kv.v[i], kv.page_table, slots,
                                                                            pos1, scale, config=c) for i in layers])
                         if not args.no_attn_configs else float("nan") for c in CONFIG_CANDIDATES]
                fi_t = float("nan")
                if fi is not None:
                    try:
                        fi_t = timer.time_graph([_flashinfer_decode(fi, q[:, 0], kv.k[i], kv.v[i], kv.page_table, b,
                                                                    ctx + 1, kv.page_size) for i in layers])
                    except Exception as e:  # the peer failed at this shape: say so once, keep our columns
                        fi, fi_why = None, f"flashinfer failed at B={b} C={ctx}: {type(e).__name__}: {str(e)[:160]}"
                kv_bytes = b * (ctx + 1) * kv_tok
                floor = floor_us(weight_bytes + kv_bytes, bw)
                attn_floor = floor_us(kv_bytes // tcfg.num_layers, bw)
                rows.append([b, ctx, fmt(t["decode"]), fmt(t["decode_nopdl"]), fmt(t["verify"]), fmt(t["target_only"]),
                             fmt(floor),
                             fmt(t["decode"] / floor, 2), fmt(t.get("decode_fused", float("nan"))),
                             fmt(t.get("decode_unfused", float("nan"))), fmt(t.get("verify_fused", float("nan"))),
                             fmt(t.get("verify_unfused", float("nan"))), step_launches, fmt(t["attn"]), fmt(attn_floor),
                             fmt(t["attn"] / attn_floor, 2), fmt(fi_t)])
                best = min(range(len(cfg_t)), key=lambda j: cfg_t[j] if cfg_t[j] == cfg_t[j] else float("inf"))
                timed = cfg_t[best] == cfg_t[best]  # nan: a CPU smoke run
                cfg_rows.append([b, ctx, *[fmt(x) for x in cfg_t], fmt(attn_floor),
                                 CONFIG_CANDIDATES[best].describe() if timed else "-",
                                 fmt(cfg_t[best] / attn_floor, 2)])
                if shape in spec:
                    def spec_step(b=b, ctx0=ctx0):
                        st.ctx_lens.copy_(ctx0)
                        return worker.forward(b)

                    ts = timer.time_graph([spec_step], min_calls_per_graph=4)
                    spec_rows.append([b, ctx, fmt(ts), fmt(t["target_only"]), fmt(t["verify"]),
                                      fmt(ts - t["verify"]), fmt(ts / t["target_only"], 2)])
                print(f"bench target: {name} B={b} C={ctx}: decode {fmt(t['decode'])} verify {fmt(t['verify'])} "
                      f"target-only {fmt(t['target_only'])} floor {fmt(floor)} attn {fmt(t['attn'])} / "
                      f"{fmt(attn_floor)} us" + (f"; spec step {spec_rows[-1][2]}" if shape in spec else ""),
                      file=sys.stderr, flush=True)
        notes = [f"model: {name} ({tcfg.num_layers} layers, hidden {tcfg.hidden_size}, {tcfg.num_heads}/"
                 f"{tcfg.num_kv_heads} heads x {tcfg.head_dim}, vocab {tcfg.vocab_size}), {target.dtype}, K={k}, "
                 f"page {kv.page_size} tokens; weights read per step {weight_bytes / 1e6:.0f} MB, KV "
                 f"{kv_tok} B per token; copy bandwidth {bw / 1e12:.2f} TB/s; launches per eager [1, 1] decode "
                 f"forward: {launches if launches is not None else '-'}",
                 "times in us, median of CUDA-graph replays; floor = (weights but the embedding + B*(C+1) tokens of "
                 "K/V) at the copy bandwidth; attn = one layer's paged decode attention (T=1), attn floor = its "
                 "K/V bytes at the copy bandwidth",
                 f"decode / verify fwd: the layer the model picks (fused five-launch layer up to {FUSED_MAX_ROWS} "
                 "rows B*T at TP 1 for layers of <= 32 MiB of weights, else unfused); decode / verify fused / "
                 "unfused: the same forwards with each layer forced (fused: Triton small-M GEMMs with norm / RoPE / "
                 "SiLU / residual fused; unfused: cuBLAS GEMMs); launches dec/ver/step: kernels of one eager [B, 1] / "
                 "[B, K+1] forward and of one eager target-only step (torch profiler)",
                 "flashinfer: " + ("measured (BatchDecodeWithPagedKVCacheWrapper, NHD, same pages)" if fi is not None
                                   else f"not run: {fi_why}")]
        print_table(f"bench target: {name} decode step vs floor",
                    ["B", "C", "decode fwd", "decode no-PDL", "verify fwd", "target-only step", "floor", "decode/floor",
                     "decode fused", "decode unfused", "verify fused", "verify unfused", "launches dec/ver/step", "attn",
                     "attn floor", "attn/floor", "flashinfer attn"], rows, notes)
        if not args.no_attn_configs:
            print_table(
                f"bench target: {name} paged decode attention by launch config",
                ["B", "C", *[c.describe() for c in CONFIG_CANDIDATES], "attn floor", "best", "best/floor"], cfg_rows,
                [f"one layer's [B, 1] paged decode attention (us, CUDA-graph replay) with each of CONFIG_CANDIDATES "
                 f"(nN = keys per iteration, wW = warps, sS = pipeline stages, pP = a decode row's keys in P pieces "
                 f"sized from its length, f = fixed {SPLIT_TOKENS}-key pieces); the model runs "
                 f"DECODE_CONFIGS[{tcfg.head_dim}] = {decode_config(tcfg.head_dim).describe()}"
                 + "".join(f", from {n} requests {c.describe()}"
                           for n, c in DECODE_CONFIGS_BY_BATCH.get(tcfg.head_dim, ()))])
        if spec_rows:
            print_table(
                f"bench target: {name} speculative step vs target-only step",
                ["B", "C", "spec step", "target-only step", "verify fwd", "spec - verify fwd", "spec / target-only"],
                spec_rows, [f"K={k}; spec step = DSparkWorker.forward (verify forward, selection, strict acceptance, "
                            "drafter block decode, Markov chain), greedy rows; spec - verify fwd = what the drafter "
                            "and the step's tail add; times in us (CUDA-graph replay)"])
        del eng, worker, ref, kv, target, st
        if cuda:
            torch.cuda.empty_cache()
    return 0
