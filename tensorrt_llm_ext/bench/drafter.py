"""``trtllm-ext bench drafter``: what the drafter TP fusion saves.

1. Per-rank bytes of the context projection ``fc`` (Kimi-K3: ``[7168, 35840]`` bf16) at TP 1/2/4/8 for a
   declaring drafter (input-feature split: 1/tp) and a non-declaring one (whole fc) -- read from the
   real ``Linear`` modules built on the meta device, with the HBM read floor per step on CUDA.
2. On CUDA (single rank: the norm half of the fused all-reduce): fused residual add + RMSNorm (one
   Triton launch) vs the add and the norm launched separately, hidden 7168, rows 1..512, under CUDA
   graph replay with rotated inputs, against the HBM floor.
3. Launch counts per drafter layer before/after the fusion.

On CPU it runs a smoke pass (tiny sizes, timings meaningless).
"""

from __future__ import annotations

import argparse

import torch

from tensorrt_llm_ext.bench.harness import (BenchTimer, floor_us, fmt, measure_copy_bandwidth, print_table,
                                            register_benchmark, rotation_count)
from tensorrt_llm_ext.kernels.common import triton_runs_on
from tensorrt_llm_ext.kernels.rms_norm import rms_norm, rms_norm_reference
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafter, DSparkDrafterNoFusion, resolve_drafter_tp_plan
from tensorrt_llm_ext.modules.linear import Linear, TensorParallelMode

KIMI_K3_FC = (7168, 35840)  # [H, n_cap * H_t]


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--eps", type=float, default=1e-6)


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


@register_benchmark("drafter", "drafter TP fusion: fc bytes per rank, fused residual+RMSNorm, launch counts",
                    add_args=_add_args)
def run(args: argparse.Namespace) -> None:
    timer = BenchTimer()
    bandwidth = measure_copy_bandwidth(timer.device)
    _fc_table(bandwidth)
    _norm_table(args, timer, bandwidth)
    _launch_table()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_args(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
