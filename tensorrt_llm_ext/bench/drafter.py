"""``trtllm-ext bench drafter``: what the drafter TP fusion saves.

1. Per-rank bytes of the context projection ``fc`` (Kimi-K3: ``[7168, 35840]`` bf16) at TP 1/2/4/8 for a
   declaring drafter (input-feature split: 1/tp) and a non-declaring one (whole fc) -- read from the
   real ``Linear`` modules built on the meta device, with the HBM read floor per step on CUDA.
2. On CUDA (single rank: the norm half of the fused all-reduce): fused residual add + RMSNorm (one
   Triton launch) vs the add and the norm launched separately, hidden 7168, rows 1..512, under CUDA
   graph replay with rotated inputs, against the HBM floor.
3. Launch counts per drafter layer before/after the fusion.
4. The drafter block attention's schedule sweep per B (``latent_block_attention``: context tile ``block_n``,
   warps, stages, context split-K), against the eager twin and the HBM floor (the live context latents
   read once), so :data:`~tensorrt_llm_ext.kernels.latent_block_attention.ATTENTION_SCHEDULES` can be
   filled from one H200 run.
5. The served drafter step (``--tables serve``): per drafter shape and B, the context projection of the step's
   ``B x (K + 1)`` accepted rows plus the block decode (:meth:`DSparkDrafter.compute_context_latents` +
   :meth:`DSparkDrafter.forward_block`, the LM head excluded), under CUDA-graph replay, three ways: the unfused
   layers with the unsplit attention (the path before the fused layers and the swept table), the unfused
   layers with :data:`ATTENTION_SCHEDULES`, and the fused layers with it (the served default on CUDA).

On CPU it runs a smoke pass (tiny sizes, timings meaningless).
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from tensorrt_llm_ext.argtypes import int_list, name_list, positive_int
from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
import tensorrt_llm_ext.kernels.latent_block_attention as lba
from tensorrt_llm_ext.contract import DraftBlockPlacement, DrafterBlockInputs, PagedLatentCache
from tensorrt_llm_ext.kernels.common import triton_runs_on
from tensorrt_llm_ext.kernels.latent_block_attention import (AttentionSchedule, attention_schedule,
                                                             latent_block_attention, latent_block_attention_reference)
from tensorrt_llm_ext.kernels.rms_norm import rms_norm, rms_norm_reference
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.models.dspark_drafter import (DSparkDrafter, DSparkDrafterConfig, DSparkDrafterNoFusion,
                                                    generate_full_state_dict, resolve_drafter_tp_plan)
from tensorrt_llm_ext.modules.linear import Linear, TensorParallelMode

KIMI_K3_FC = (7168, 35840)  # [H, n_cap * H_t]
_TABLES = ("fc", "norm", "launches", "attention", "serve")


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=positive_int, default=7168)
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--eps", type=float, default=1e-6)
    p.add_argument("--attn-batch", type=int_list(), default="1,8,32", help="block attention sweep: batch sizes")
    p.add_argument("--attn-ctx", type=positive_int, default=1024, help="block attention sweep: context length per row")
    p.add_argument("--attn-shape", nargs="+", default=["8,64,256,7"],
                   help="heads,head_dim,latent_dim,K of the sweep (several: one table each, and the rows to paste "
                        "keyed by latent width)")
    p.add_argument("--attn-splits", type=int_list(), default="1,2,4,8,16", help="block attention sweep: context split-K values")
    p.add_argument("--attn-tiles", type=int_list(), default="16,32,64", help="block attention sweep: block_n values")
    p.add_argument("--attn-warps", type=int_list(), default="4,8", help="block attention sweep: num_warps values")
    p.add_argument("--serve-shape", nargs="+", default=["5,256", "5,512"],
                   help="served step: drafter layers,latent_dim (SmolLM2-135M's target: hidden 576, 8 heads x 64, "
                        "MLP 1536, 6 captured layers, vocabulary 49152)")
    p.add_argument("--serve-batch", type=int_list(), default="1,8,32", help="served step: batch sizes")
    p.add_argument("--serve-ctx", type=positive_int, default=512, help="served step: context positions per request")
    p.add_argument("--tables", type=name_list(_TABLES), default=",".join(_TABLES[:-1]),
                   help=f"comma-separated subset of {','.join(_TABLES)} (default: all but serve; attention alone: "
                        "the schedule sweep)")


def fc_bytes_per_rank(cls, tp: int, hidden: int = KIMI_K3_FC[0], in_features: int = KIMI_K3_FC[1],
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of ``fc.weight`` one rank stores under ``cls``'s resolved plan (built on meta: no memory)."""
    mapping = Mapping(world_size=tp, rank=0, tp_size=tp)
    plan = resolve_drafter_tp_plan(cls.tp_fusions, mapping, in_features, cls.__name__)
    mode = TensorParallelMode.ROW if plan.fc_input_split else None
    fc = Linear(in_features, hidden, dtype=dtype, device="meta", mapping=mapping, tensor_parallel_mode=mode,
                reduce_output=False)
    return fc.weight.numel() * fc.weight.element_size()


def _fc_table(bandwidth: float) -> None:
    rows = []
    whole = fc_bytes_per_rank(DSparkDrafterNoFusion, 1)
    for tp in (1, 2, 4, 8):
        split = fc_bytes_per_rank(DSparkDrafter, tp)
        unsplit = fc_bytes_per_rank(DSparkDrafterNoFusion, tp)
        if split * tp != whole:
            raise AssertionError(f"fc bytes per rank at tp {tp}: {split}, expected {whole}/{tp}")
        rows.append([tp, f"{unsplit / 1e6:.1f}", f"{split / 1e6:.1f}", f"1/{whole // split}",
                     fmt(floor_us(unsplit, bandwidth)), fmt(floor_us(split, bandwidth))])
    print_table("Drafter fc weight per rank (Kimi-K3 fc [7168, 35840] bf16)",
                ["tp", "whole fc MB", "split fc MB", "ratio", "read floor whole us", "read floor split us"],
                rows, ["Split: DSparkDrafter (declares fc_input_split); whole: DSparkDrafterNoFusion. Read floor = "
                       "weight bytes / measured HBM copy bandwidth (one read per context projection)."])


def _norm_table(args: argparse.Namespace, timer: BenchTimer, bandwidth: float) -> None:
    dtype = getattr(torch, args.dtype)
    dev = timer.device
    hidden = args.hidden if not timer.smoke else 96
    row_list = args.rows if not timer.smoke else [1, 5]
    use_triton = triton_runs_on(torch.empty(0, device=dev))
    w = (1.0 + 0.1 * torch.randn(hidden)).to(dtype).to(dev)
    table = []
    for rows in row_list:
        elem = torch.empty((), dtype=dtype).element_size()
        set_bytes = 4 * rows * hidden * elem
        n = rotation_count(set_bytes) if not timer.smoke else 1
        sets = [tuple(torch.randn(rows, hidden, device=dev).to(dtype) for _ in range(4)) for _ in range(n)]

        def fused(s):
            x, r, o, ro = s
            if use_triton:
                return lambda: rms_norm(x, w, args.eps, residual=r, out=o, residual_out=ro)
            return lambda: rms_norm_reference(x, w, args.eps, residual=r)

        def separate(s):
            x, r, o, ro = s

            def call():
                torch.add(x, r, out=ro)
                if use_triton:
                    rms_norm(ro, w, args.eps, out=o)
                else:
                    rms_norm_reference(ro, w, args.eps)
            return call

        t_fused = timer.time_graph([fused(s) for s in sets])
        t_sep = timer.time_graph([separate(s) for s in sets])
        # Floor: fused reads x, r and writes out, residual_out; separate adds one write+read of the sum.
        f_fused = floor_us(4 * rows * hidden * elem, bandwidth)
        f_sep = floor_us(6 * rows * hidden * elem, bandwidth)
        table.append([rows, fmt(t_fused), fmt(t_sep), fmt(t_sep / t_fused, 2) if t_fused == t_fused else "-",
                      fmt(f_fused, 2), fmt(f_sep, 2), fmt(t_fused / f_fused, 1) if t_fused == t_fused else "-"])
    print_table(f"Residual add + RMSNorm, hidden {hidden}, {args.dtype} (single rank: the norm half)",
                ["rows", "fused us", "add + norm us", "speedup", "floor fused us", "floor separate us",
                 "fused / floor"], table,
                ["CUDA-graph replay, median of many, inputs rotated past the 60 MiB L2. Fused: one Triton "
                 "launch (the epilogue of AllReduceFusionOp.RESIDUAL_RMS_NORM); separate: torch.add + the "
                 "Triton RMSNorm." + (" CPU smoke run: timings meaningless." if timer.smoke else "")])


def _launch_table() -> None:
    rows = [
        ["unfused (before), tp > 1", "AR + add + norm = 3", "AR + add + norm = 3", 6,
         "GEMM(whole fc) + norm = 2"],
        ["fused here (NCCL AR + fused Triton epilogue)", "AR + add&norm = 2", "AR + add&norm = 2", 4,
         "GEMM(fc/tp) + AR + norm = 3"],
        ["fused, one-kernel all-reduce (TensorRT-LLM custom AR)", "1", "1", 2, "GEMM(fc/tp) + AR&norm = 2"],
        ["single rank: unfused", "add + norm = 2", "add + norm = 2", 4, "GEMM + norm = 2"],
    ]
    print_table("Launches per drafter layer around o_proj / down_proj (plus the context projection)",
                ["path", "after o_proj", "after down_proj", "per layer", "fc + hidden_norm"], rows,
                ["Counted from DSparkDrafter._add_norm / project_context. The fc split trades one all-reduce "
                 "for reading 1/tp of the fc weight."])


def attention_sweep_schedules(smoke: bool, tiles=(16, 32, 64), warps=(4, 8), splits=(1, 2, 4, 8, 16)
                              ) -> list[AttentionSchedule]:
    """The block attention schedules the sweep times (every B): tile x warps x split-K (stages: Triton's)."""
    if smoke:
        return [AttentionSchedule(None, block_n=16), AttentionSchedule(None, block_n=16, split_k=2)]
    return [AttentionSchedule(None, block_n=bn, num_warps=w, split_k=sk)
            for bn in tiles for w in warps for sk in splits]


def _attention_case(b: int, ctx: int, heads: int, d: int, d_c: int, k: int, dtype, device, seed: int):
    """Inputs of one block-attention call: ``b`` rows of ``ctx`` context positions in pages of 64 (rows' pages
    interleaved, as a busy pool would place them), the block right after the context."""
    g = torch.Generator().manual_seed(seed)
    page = 64
    pages_per_row = -(-(ctx + k) // page)
    num_pages = b * pages_per_row + 1
    table = torch.randperm(num_pages - 1, generator=g)[: b * pages_per_row].view(b, pages_per_row).to(torch.int32)
    pos = (torch.full((b, 1), ctx) + torch.arange(k)).to(torch.int32)
    pages = torch.gather(table.long(), 1, (pos.long() // page)).to(torch.int32)
    mv = lambda t: t.to(device)  # noqa: E731
    placement = DraftBlockPlacement(mv(pos), mv(pages), mv((pos % page).to(torch.int32)),
                                    mv(torch.full((b,), ctx, dtype=torch.int32)),
                                    mv(torch.full((b,), ctx + k, dtype=torch.int32)))
    return dict(q=mv(torch.randn(b, k, heads, d, generator=g).to(dtype)),
                block_latents=mv(torch.randn(b, k, d_c, generator=g).to(dtype)),
                pool_layer=mv(torch.randn(num_pages, page, d_c, generator=g).to(dtype)), block_table=mv(table),
                slot_ids=mv(torch.arange(b, dtype=torch.int32)),
                placement=placement,
                k_up_weight=mv((torch.randn(heads * d, d_c, generator=g) / d_c ** 0.5).to(dtype)),
                v_up_weight=mv((torch.randn(heads * d, d_c, generator=g) / d_c ** 0.5).to(dtype)),
                rope_theta=10000.0, scale=d ** -0.5)


def _table_rows(best: dict[int, AttentionSchedule], max_latent: int | None) -> list[str]:
    rows: list[list] = []
    for b in sorted(best):
        s = best[b]
        key = (s.block_n, s.num_warps, s.num_stages, s.split_k)
        if rows and rows[-1][1] == key:
            rows[-1][0] = b
        else:
            rows.append([b, key])
    parts = []
    lat = "" if max_latent is None else f", max_latent={max_latent}"
    for i, (b, (n, w, st, k)) in enumerate(rows):
        bound = "None" if i == len(rows) - 1 else str(b)
        parts.append(f"AttentionSchedule({bound}, block_n={n}, num_warps={w}, num_stages={st}, split_k={k}{lat})")
    return parts


def attention_table_source(best: dict) -> str:
    """``ATTENTION_SCHEDULES`` source from the fastest schedule per measured B (``{B: schedule}``), or per latent
    width and B (``{d_c: {B: schedule}}``): consecutive B with the same winner share a row whose ``max_batch`` is
    the largest of them; per latent width the last row covers every larger B (``max_latent`` = that width; the
    widest width's rows have none, so they cover every wider latent too)."""
    groups = best if best and isinstance(next(iter(best.values())), dict) else {None: best}
    widths = sorted(groups, key=lambda w: -1 if w is None else w)
    parts: list[str] = []
    for i, w in enumerate(widths):
        last = i == len(widths) - 1
        parts += _table_rows(groups[w], None if last else w)
    return f"ATTENTION_SCHEDULES = ({', '.join(parts)}{',' if len(parts) == 1 else ''})"


def _attention_table(args: argparse.Namespace, timer: BenchTimer, bandwidth: float) -> None:
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    sweep = attention_sweep_schedules(timer.smoke, ints(args.attn_tiles), ints(args.attn_warps), ints(args.attn_splits))
    best_by_latent: dict[int, dict[int, AttentionSchedule]] = {}
    for shape in args.attn_shape:
        heads, d, d_c, k = ints(shape)
        batches = [int(x) for x in args.attn_batch.split(",")]
        ctx = args.attn_ctx
        if timer.smoke:
            heads, d, d_c, k, batches, ctx = 2, 16, 32, 3, [1], 40
        dtype = torch.bfloat16
        rows, best = [], {}
        for b in batches:
            case = _attention_case(b, ctx, heads, d, d_c, k, dtype, timer.device, seed=b)
            out = torch.empty_like(case["q"])
            # Floor: the live context latents and both up-projections read once, the output written once.
            nbytes = (b * ctx * d_c + 2 * heads * d * d_c + b * k * heads * d) * 2
            fl = floor_us(nbytes, bandwidth)
            t_eager = timer.time_graph([lambda: latent_block_attention_reference(**case, out=out)])
            table_sched = attention_schedule(b, latent_dim=d_c)
            same = lambda x, y: (x.block_n, x.num_warps, x.num_stages, x.split_k) == (  # noqa: E731
                y.block_n, y.num_warps, y.num_stages, y.split_k)
            for sched in [table_sched] + [x for x in sweep if not same(x, table_sched)]:
                latent_block_attention(**case, out=out, schedule=sched)  # compile + partials outside capture
                t = timer.time_graph([lambda s=sched: latent_block_attention(**case, out=out, schedule=s)])
                if b not in best or t < best[b][1]:
                    best[b] = (sched, t)
                rows.append([b, ctx, sched.describe(), "*" if same(sched, table_sched) else "", fmt(t, 2),
                             fmt(t_eager, 1), fmt(t_eager / t, 2) if t == t else "-", fmt(fl, 2),
                             fmt(t / fl, 1) if t == t else "-"])
        best_by_latent.setdefault(d_c, {}).update({b: v[0] for b, v in best.items()})
        print_table(f"Drafter block attention schedules, heads {heads} x {d}, latent {d_c}, K {k}, bf16 (us per "
                    "layer)", ["B", "ctx", "schedule", "table", "fused us", "eager us", "eager/fused", "floor us",
                               "fused/floor"],
                    rows, ["schedule: n<block_n>/w<warps>/s<stages>/k<context splits> (split-K adds one combine "
                           "launch). * = the row of ATTENTION_SCHEDULES for (B, latent); fill it from the fastest per "
                           "B. Goal: <= 10 us at B <= 8. Split-K changes the softmax sum order (within the twin's "
                           "tolerance, not bitwise)."])
        # After every shape (the widths so far): a run cut short still leaves the rows it measured.
        print("to paste (kernels/latent_block_attention.py): " + attention_table_source(best_by_latent), flush=True)


@contextlib.contextmanager
def _attention_schedules(table):
    """Swap :data:`ATTENTION_SCHEDULES` (read at each call) for one column of the served-step table."""
    saved = lba.ATTENTION_SCHEDULES
    lba.ATTENTION_SCHEDULES = table
    try:
        yield
    finally:
        lba.ATTENTION_SCHEDULES = saved


def served_step_inputs(drafter: DSparkDrafter, b: int, ctx: int, k: int, page: int, generator: torch.Generator
                       ) -> tuple[DrafterBlockInputs, torch.Tensor]:
    """One served step's drafter inputs at batch ``b``: ``ctx`` context positions per row in pages of ``page``
    (random latents, each row its own pages), the block of ``k`` mask tokens right after them, and random
    captured features for the ``b * (k + 1)`` accepted positions the step projects."""
    cfg, dev, dtype = drafter.config, drafter.kv_a_proj.weight.device, drafter.dtype
    pages_per_row = -(-(ctx + k) // page)
    table = torch.arange(b * pages_per_row, dtype=torch.int32, device=dev).view(b, pages_per_row)
    pool = torch.randn(*drafter.latent_pool_shape(b * pages_per_row + 1, page), generator=generator,
                       device=dev).to(dtype)
    pos = (ctx + torch.arange(k, device=dev)).expand(b, k).to(torch.int32)
    placement = DraftBlockPlacement(pos, table.gather(1, (pos // page).long()), pos % page,
                                    torch.full((b,), ctx, dtype=torch.int32, device=dev),
                                    torch.full((b,), ctx + k, dtype=torch.int32, device=dev))
    ids = torch.full((b, k), cfg.mask_token_id, dtype=torch.long, device=dev)
    inputs = DrafterBlockInputs(ids, torch.arange(b, dtype=torch.int32, device=dev), placement,
                                PagedLatentCache(pool, table))
    feats = torch.randn(b * (k + 1), cfg.fc_in_features, generator=generator, device=dev).to(dtype)
    return inputs, feats


def _serve_table(args: argparse.Namespace, timer: BenchTimer) -> None:
    dev, k, page = timer.device, 7, 64
    dtype = torch.float32 if timer.smoke else torch.bfloat16
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.serve_shape]
    batches, ctx = [int(x) for x in args.serve_batch.split(",")], args.serve_ctx
    if timer.smoke:
        shapes, batches, ctx = shapes[:1], batches[:1], 8
    fast = BenchTimer(dev, reps=7, calls_per_rep=8)  # 36 graphs of up to ~1 ms calls: keep the run short
    columns = [("eager layers, unsplit attention", "eager", (AttentionSchedule(None),)),
               ("eager layers, table", "eager", None), ("fused layers, table", "fused", None)]
    if not triton_runs_on(torch.empty(0, device=dev)):
        columns = columns[:2]
    if timer.smoke:  # one column (the served path) keeps the CPU smoke run cheap
        columns = columns[-1:]
    rows = []
    for layers, d_c in shapes:
        cfg = (DSparkDrafterConfig(num_layers=1) if timer.smoke else DSparkDrafterConfig(
            hidden_size=576, target_hidden_size=576, num_capture_layers=6, num_layers=layers, num_heads=8,
            head_dim=64, latent_dim=d_c, intermediate_size=1536, vocab_size=49152, markov_rank=256,
            mask_token_id=49151, rms_norm_eps=1e-5))
        drafter = DSparkDrafter(cfg, dtype=dtype, device=dev, layer_backend="eager")
        drafter.load_full_state_dict(generate_full_state_dict(cfg, 0, dtype, device=dev))
        g = torch.Generator(device=dev).manual_seed(0)
        for b in batches:
            inputs, feats = served_step_inputs(drafter, b, ctx, k, page, g)
            times = []
            for _, backend, sched in columns:
                drafter.set_layer_backend(backend)
                with _attention_schedules(sched or lba.ATTENTION_SCHEDULES), torch.no_grad():
                    t_block = float("nan") if timer.smoke else fast.time_graph([lambda: drafter.forward_block(inputs)])
                    t_step = fast.time_graph([lambda: (drafter.compute_context_latents(feats),
                                                       drafter.forward_block(inputs))])
                times.append((t_step, t_block))
            row = [cfg.num_layers, cfg.latent_dim, b, ctx]
            for t_step, t_block in times:
                row += [fmt(t_step, 1), fmt(t_block / cfg.num_layers, 1)]
            rows.append(row + [fmt(times[0][0] / times[-1][0], 2) if times[-1][0] == times[-1][0] else "-"])
        del drafter, inputs, feats
    heads = []
    for name, _, _ in columns:
        heads += [f"{name}: step us", "block us/layer"]
    print_table("Served drafter step (context projection of B x (K + 1) rows + block decode, K 7, LM head excluded; "
                "SmolLM2-135M target shape, random weights)", ["layers", "latent", "B", "ctx"] + heads + ["speed-up"],
                rows, ["block us/layer: forward_block over the layer count (its embedding and final norm included). "
                       "speed-up: the first column's step over the last's."])


@register_benchmark("drafter", "drafter TP fusion (fc bytes, fused residual+RMSNorm, launches), block attention sweep",
                    add_args=_add_args)
def run(args: argparse.Namespace) -> None:
    timer = BenchTimer()
    tables = set(getattr(args, "tables", ",".join(_TABLES[:-1])).split(","))
    if not tables <= set(_TABLES):
        raise ValueError(f"--tables: expected a subset of {','.join(_TABLES)}, got {','.join(sorted(tables))}")
    bandwidth = measure_copy_bandwidth(timer.device)
    if "fc" in tables:
        _fc_table(bandwidth)
    if "norm" in tables:
        _norm_table(args, timer, bandwidth)
    if "launches" in tables:
        _launch_table()
    if "attention" in tables:
        _attention_table(args, timer, bandwidth)
    if "serve" in tables:
        _serve_table(args, timer)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
