"""Per-kernel time of one target decode forward on the GPU (issue 36): torch.profiler over an eager call and
over a CUDA-graph replay, kernels grouped by name with their total / mean microseconds, sorted.

``--steps BxT,...`` (e.g. ``1x8,4x8``): verify-shaped forwards instead of ``[B, 1]``. ``--variants`` (names of
``VARIANTS``): only the graph replay of each step under each setting of the small-step GEMMs (module constants of
``fused_linear``), one line each, with the largest difference of its output from the first variant's; a variant
name ending in ``+profile`` also prints its per-kernel table.

Usage on the GPU machine (repo root):  python3 scripts/profile_target_kernels.py --batch-sizes 1,32 --context 512
  python3 scripts/profile_target_kernels.py --steps 1x8,4x8,1x1 --context 1024 --variants default,gemv8
  python3 scripts/profile_target_kernels.py --steps 1x1,1x2,1x4,1x8 --context 1024 --variants default,gemv4,gemv8
  python3 scripts/profile_target_kernels.py --batch-sizes 32 --context 1024 --target-only
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from tensorrt_llm_ext.kernels.paged_attention import DECODE_CONFIGS, AttentionConfig


def _kernels(fn, reps: int):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower():
            out[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    return out


def _table(title, ker, reps):
    total = sum(sum(v) for v in ker.values()) / reps
    n = sum(len(v) for v in ker.values()) / reps
    print(f"== {title}: {n:.0f} kernels, {total:.1f} us of kernel time per forward")
    for name, v in sorted(ker.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(v) / reps:9.1f} us  {len(v) / reps:5.0f} x {sum(v) / len(v):7.2f} us  {name[:110]}")


_P4, _P2 = AttentionConfig(128, 4, 2, 4, prefetch=2), AttentionConfig(128, 4, 2, 2, prefetch=2)


def _every_step(cfg: AttentionConfig) -> dict:
    """Head dim 64's decode settings ``cfg`` at every batch (DECODE_CONFIGS_BY_BATCH emptied)."""
    return {"attn.DECODE_CONFIGS": {**DECODE_CONFIGS, 64: cfg}, "attn.DECODE_CONFIGS_BY_BATCH": {}}


# Settings of the small-step GEMMs the --variants mode times (module constants of fused_linear, also read by
# fused_qkv; "attn.X": paged_attention's X; "model.X": llama_target's X).
VARIANTS = {
    "default": {},  # the model's settings
    "gemv4": dict(GEMV_MAX_ROWS=4),  # the broadcast few-row form up to 4 rows (a K = 3 verify at B = 1)
    "gemv8": dict(GEMV_MAX_ROWS=8),  # the broadcast few-row form up to 8 rows
    "vs64": {"attn.SPLIT_TOKENS": 64},  # verify tiles in 64-key pieces
    "tiles32": dict(SMALL_STEP_ROWS=0),  # one 32-row dot tile for a 32-row step (before 16-row tiles, 2026-12-05)
    "fused64": {"model.FUSED_MAX_ROWS": 64},  # the fused layer up to 64 rows (B = 64 decode)
    "fused64bm16": {"model.FUSED_MAX_ROWS": 64, "SMALL_STEP_ROWS": 64},  # ... in 16-row tiles
    # the loads before the fifteenth session: the epilogue's inputs after the wait, the norm prologue in a loop
    "late": dict(EARLY_EPILOGUE=False, NORM_UNROLL_MAX=0),
    "stages2": dict(DOT_STAGES=2),  # the dot tiles' K loop with 2 / 4 software-pipeline stages (default 3)
    "stages4": dict(DOT_STAGES=4),
    "firstpiecefirst": {"attn.LAST_PIECE_FIRST": False},  # the split axis in piece order (before the fifteenth)
    "oneblocknopf": {"attn.ONE_BLOCK_PREFETCH": False},  # the one-block form without its L2 prefetch (fourteenth)
    # decode tiles (head dim 64) cut in at most 8 / 16 pieces instead of 32: at 1k keys the same 8 one-block pieces,
    # a grid of 8 / 16 programs per tile instead of 32 (no programs past a 1k-key row's keys with 8); 2 blocks a piece
    # from 1k / 2k keys
    "p8": _every_step(AttentionConfig(128, 4, 2, 8, prefetch=2)),
    # ... in at most 4 / 2 / 1 pieces (at B = 32 and 1k keys 384 / 192 / 96 programs, each streaming 2 / 4 / 8 blocks;
    # the seventeenth session's A/B: p4 at B = 17-32 and p2 above shipped, DECODE_CONFIGS_BY_BATCH)
    "p4": _every_step(_P4),
    "p2": _every_step(_P2),
    "p1": _every_step(AttentionConfig(128, 4, 3, 1, prefetch=2)),
    "p16": _every_step(AttentionConfig(128, 4, 2, 16, prefetch=2)),
    # around p4 (the seventeenth session's best at [32, 1]): 3 / 6 pieces, 3 stages, 64-key blocks
    "p3": _every_step(AttentionConfig(128, 4, 2, 3, prefetch=2)),
    "p6": _every_step(AttentionConfig(128, 4, 2, 6, prefetch=2)),
    "p4s3": _every_step(AttentionConfig(128, 4, 3, 4, prefetch=2)),
    "n64p4": _every_step(AttentionConfig(64, 4, 2, 4, prefetch=2)),
    # the pieces of steps of more than 32 requests: at most 1 / 4 / 8 a row (2 shipped since the seventeenth session)
    "wp1": {"attn.DECODE_CONFIGS_BY_BATCH": {64: ((17, _P4), (33, AttentionConfig(128, 4, 3, 1, prefetch=2)))}},
    "wp4": {"attn.DECODE_CONFIGS_BY_BATCH": {64: ((17, _P4), (33, _P4))}},
    "wp8": {"attn.DECODE_CONFIGS_BY_BATCH": {64: ((17, _P4), (33, AttentionConfig(128, 4, 2, 8, prefetch=2)))}},
    # ... of more than 64: 1 (p1 at B = 32, 96 programs, lost 40 %; at 128 requests 384)
    "xp1": {"attn.DECODE_CONFIGS_BY_BATCH": {64: ((17, _P4), (33, _P2),
                                                 (65, AttentionConfig(128, 4, 3, 1, prefetch=2)))}},
    "narrow": {"attn.DECODE_CONFIGS_BY_BATCH": {}},  # every decode step on DECODE_CONFIGS (before 2026-12-05)
    # the sixteenth session's rule: pieces of at least 3 blocks from 33 requests, the table's below
    "wide16": {"attn.DECODE_CONFIGS_BY_BATCH": {64: ((33, AttentionConfig(128, 4, 2, 32, 3, prefetch=2)),)}},
    # decode pieces of at least 2 / 3 blocks of 128 keys (256 / 384: at 1k keys 4 / 3 pieces instead of 8), of at least
    # 3 / 4 blocks of 64 keys (192 / 256)
    "m2": _every_step(AttentionConfig(128, 4, 2, 32, 2, prefetch=2)),
    "m3": _every_step(AttentionConfig(128, 4, 2, 32, 3, prefetch=2)),
    "n64m3": _every_step(AttentionConfig(64, 4, 2, 32, 3, prefetch=2)),
    "n64m4": _every_step(AttentionConfig(64, 4, 2, 32, 4, prefetch=2)),
    # the 16-row dot tiles' K blocks in 1 / 2 / 4 parts, one warp's batch each (DOT_K_SPLIT; 4 = the model's default
    # since 2026-12-08, 1 = off)
    "ks1": dict(DOT_K_SPLIT=1),
    "ks2": dict(DOT_K_SPLIT=2),
    "ks4": dict(DOT_K_SPLIT=4),
    "dot1ks4": dict(GEMV_MAX_ROWS=0, DOT_K_SPLIT=4),  # ... and a 1-row step in those tiles (not the few-row form)
    "peel": dict(DOT_PEEL_FIRST_BLOCK=True),  # the dot tiles' first weight block held in registers (before 2026-12-05)
    # the fourteenth session's launches: all of the above off
    "s14": {"attn.LAST_PIECE_FIRST": False, "attn.ONE_BLOCK_PREFETCH": False, "EARLY_EPILOGUE": False,
            "NORM_UNROLL_MAX": 0, "DOT_PEEL_FIRST_BLOCK": True},
}


def _graph_us(fn, reps: int = 40) -> float:
    from tensorrt_llm_ext.bench.verify import capture_graph
    g = capture_graph(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        g.replay()
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", default=None, help="BxT,... forwards (default: [B, 1] for --batch-sizes)")
    p.add_argument("--variants", default=None,
                   help=f"time the graph replay under these settings: {', '.join(VARIANTS)}")
    p.add_argument("--target-only", action="store_true",
                   help="profile the whole target-only decode step ([B, 1] forward, head, greedy selection: what "
                        "`bench target`'s target-only column replays) instead of the forward")
    p.add_argument("--kernels", default="fused,fused-dot,unfused",
                   help="layer_kernels values; fused-dot: the fused layer in dot tiles only (no few-row forms); "
                        "fused-noprefetch: without the weights' L2 prefetch before the programmatic wait")
    a = p.parse_args()
    from tensorrt_llm_ext.bench.target import _config, device_random_weights
    from tensorrt_llm_ext.bench.verify import capture_graph
    from tensorrt_llm_ext.kernels import fused_linear as fused_linear_mod
    from tensorrt_llm_ext.kernels import fused_qkv as fused_qkv_mod
    from tensorrt_llm_ext.runtime.engine import Engine

    steps = ([tuple(int(v) for v in st.split("x")) for st in a.steps.split(",")] if a.steps
             else [(int(x), 1) for x in a.batch_sizes.split(",")])
    sizes = [b for b, _ in steps]
    args = argparse.Namespace(draft_len=7, page_size=32)
    cfg = _config(a.shape, None, args, max(sizes), a.context)
    dev = torch.device("cuda")
    eng = Engine(cfg, weights=device_random_weights(cfg, dev))
    target, st, kv = eng.target, eng.state, eng.state.kv_cache
    for slot in range(max(sizes)):
        eng.pages.allocate(slot, eng.pages.max_pages_per_slot)
    worker = eng.worker("speculative", sampling=False)
    from tensorrt_llm_ext.kernels import paged_attention as attn_mod

    from tensorrt_llm_ext.models import llama_target as model_mod

    def module_of(key):
        if key.startswith("model."):
            return model_mod, key[6:]
        return (attn_mod, key[5:]) if key.startswith("attn.") else (fused_linear_mod, key)

    def apply(settings):
        for key, val in settings.items():
            mod, attr = module_of(key)
            for m in ((mod,) if mod in (attn_mod, model_mod) else (fused_linear_mod, fused_qkv_mod)):
                setattr(m, attr, val)

    defaults = {key: getattr(*module_of(key)) for key in {n for v in VARIANTS.values() for n in v}}
    first = None
    for b, t in steps:
        worker.set_rows(list(range(b)), b)
        worker.decode_pages()
        st.ctx_lens.fill_(a.context)
        slots = torch.arange(b, dtype=torch.int32, device=dev)
        tok = torch.randint(0, target.config.vocab_size, (b, t), device=dev)
        pos = (a.context + torch.arange(t, device=dev))[None].expand(b, t).contiguous()
        if a.target_only:
            from tensorrt_llm_ext.speculative.reference_decoder import ReferenceDecoder
            ref = ReferenceDecoder(worker, verify_shaped=False)
            ctx0 = torch.full_like(st.ref_lens, a.context)

            def step(b=b, ctx0=ctx0):
                st.ref_lens.copy_(ctx0)
                return ref.step(b)
            g = capture_graph(step)
            _table(f"[{b}, 1] C={a.context} target-only step, graph", _kernels(g.replay, 5), 5)
            print(f"-- [{b}, 1] C={a.context} target-only step: graph replay {_graph_us(step):.1f} us", flush=True)
            continue
        if a.variants:
            for var in a.variants.split(","):
                name = var.removesuffix("+profile")
                apply({**defaults, **VARIANTS[name]})
                fwd = lambda: target(tok, pos, slots, kv)  # noqa: E731
                if var.endswith("+profile"):
                    _table(f"[{b}, {t}] C={a.context} {name} eager", _kernels(fwd, 3), 3)
                print(f"-- [{b}, {t}] C={a.context} {name}: graph replay {_graph_us(fwd):.1f} us per forward",
                      flush=True)
                out = fwd().hidden_states.float()  # the final hidden rows: every variant against the first one
                first = out if var == a.variants.split(",")[0] else first
                print(f"   max |hidden - first variant's| {(out - first).abs().max().item():.3g} "
                      f"(|hidden| max {out.abs().max().item():.3g})", flush=True)
            apply(defaults)
            continue
        for kern in a.kernels.split(","):
            apply({**defaults, **({"GEMV_MAX_ROWS": 0} if kern == "fused-dot" else {})})
            fused_linear_mod.WEIGHT_PREFETCH = fused_qkv_mod.WEIGHT_PREFETCH = kern != "fused-noprefetch"
            target.layer_kernels = kern.split("-")[0]
            fwd = lambda: target(tok, pos, slots, kv)  # noqa: E731
            _table(f"[{b}, {t}] C={a.context} {kern} eager", _kernels(fwd, 3), 3)
            g = capture_graph(fwd)
            _table(f"[{b}, {t}] C={a.context} {kern} graph", _kernels(g.replay, 5), 5)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            start.record()
            for _ in range(50):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            print(f"-- [{b}, {t}] {kern}: graph replay {start.elapsed_time(end) * 1000 / 50:.1f} us per forward")
            target.layer_kernels = "auto"


if __name__ == "__main__":
    main()
