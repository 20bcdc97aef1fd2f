"""Per-kernel time of one target decode forward on the GPU (issue 36): torch.profiler over an eager call and
over a CUDA-graph replay, kernels grouped by name with their total / mean microseconds, sorted.

Usage on the GPU machine (repo root):  python3 scripts/profile_target_kernels.py --batch-sizes 1,32 --context 512
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--kernels", default="fused,fused-dot,unfused",
                   help="layer_kernels values; fused-dot: the fused layer without the few-row GEMV form; "
                        "fused-noprefetch: without the weights' L2 prefetch before the programmatic wait")
    a = p.parse_args()
    from tensorrt_llm_ext.bench.target import _config, device_random_weights
    from tensorrt_llm_ext.bench.verify import capture_graph
    from tensorrt_llm_ext.kernels import fused_linear as fused_linear_mod
    from tensorrt_llm_ext.kernels import fused_qkv as fused_qkv_mod
    from tensorrt_llm_ext.runtime.engine import Engine

    gemv_rows = fused_linear_mod.GEMV_MAX_ROWS
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    args = argparse.Namespace(draft_len=7, page_size=32)
    cfg = _config(a.shape, None, args, max(sizes), a.context)
    dev = torch.device("cuda")
    eng = Engine(cfg, weights=device_random_weights(cfg, dev))
    target, st, kv = eng.target, eng.state, eng.state.kv_cache
    for slot in range(max(sizes)):
        eng.pages.allocate(slot, eng.pages.max_pages_per_slot)
    worker = eng.worker("speculative", sampling=False)
    for b in sizes:
        worker.set_rows(list(range(b)), b)
        worker.decode_pages()
        st.ctx_lens.fill_(a.context)
        slots = torch.arange(b, dtype=torch.int32, device=dev)
        tok = torch.randint(0, target.config.vocab_size, (b, 1), device=dev)
        pos = torch.full((b, 1), a.context, dtype=torch.int64, device=dev)
        for kern in a.kernels.split(","):
            fused_linear_mod.GEMV_MAX_ROWS = fused_qkv_mod.GEMV_MAX_ROWS = 0 if kern == "fused-dot" else gemv_rows
            fused_linear_mod.WEIGHT_PREFETCH = fused_qkv_mod.WEIGHT_PREFETCH = kern != "fused-noprefetch"
            target.layer_kernels = kern.split("-")[0]
            fwd = lambda: target(tok, pos, slots, kv)  # noqa: E731
            _table(f"B={b} C={a.context} {kern} eager", _kernels(fwd, 3), 3)
            g = capture_graph(fwd)
            _table(f"B={b} C={a.context} {kern} graph", _kernels(g.replay, 5), 5)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay()
            start.record()
            for _ in range(50):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            print(f"-- B={b} {kern}: graph replay {start.elapsed_time(end) * 1000 / 50:.1f} us per forward")
            target.layer_kernels = "auto"


if __name__ == "__main__":
    main()
