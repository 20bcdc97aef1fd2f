"""Capacity check: N concurrent requests of about 2k tokens (prompt + output) through the one batching loop
(:meth:`Engine.generate` drives the :class:`Scheduler` that ``serve`` drives) on SmolLM2-135M's shape with random
weights (bf16, CUDA graphs, chunked prefill). Reports the page pool (pages, tokens, bytes), the peak pages in
use and requests holding a slot, device memory, and whether every request finished with all its tokens.

Usage (the GPU machine, repo root): ``python3 scripts/gpu_capacity.py --out DIR``; ``--shape tiny --requests 8
--prompt-len 24 --output-len 8`` runs on a CPU in seconds (a smoke test of the script). Exit 0 when every request
finished with all its tokens and the peak number of requests holding a slot reached ``--requests``, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensorrt_llm_ext.bench.target import _DRAFTER, SHAPES, device_random_weights  # noqa: E402
from tensorrt_llm_ext.configs.tiny_model import tiny_model  # noqa: E402
from tensorrt_llm_ext.contract import SamplingParams  # noqa: E402
from tensorrt_llm_ext.runtime.config import load_config  # noqa: E402
from tensorrt_llm_ext.runtime.engine import Engine  # noqa: E402
from tensorrt_llm_ext.runtime.requests import Request  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", choices=[*SHAPES, "tiny"])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--modes", default="target_only", help="comma-separated: target_only (--no-speculation), speculative")
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--fraction", type=float, default=0.85, help="kv_cache_config.free_gpu_memory_fraction")
    p.add_argument("--draft-len", type=int, default=7)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    n, plen, olen = args.requests, args.prompt_len, args.output_len
    run = {"max_batch_size": n, "max_seq_len": plen + olen, "speculative_config.max_draft_len": args.draft_len,
           "kv_cache_config.tokens_per_block": args.page_size, "enable_chunked_prefill": True,
           "max_num_tokens": args.max_num_tokens,
           # A few graph batch sizes (padding covers the rest): capture stays a few seconds at max_batch_size 256.
           "cuda_graph_config.batch_sizes": sorted({b for b in (1, 8, 32, 64, 128, n) if b <= n})}
    if cuda:
        run["kv_cache_config.free_gpu_memory_fraction"] = args.fraction
    if args.shape == "tiny":
        cfg = load_config(**tiny_model(**{"model.drafter_init": "random", **run}))
    else:
        cfg = load_config(**{**SHAPES[args.shape], **_DRAFTER, "model.dtype": "bfloat16", **run})
    t0 = time.perf_counter()
    weights = device_random_weights(cfg, dev) if args.shape != "tiny" else None
    eng = Engine(cfg, device=dev, use_cuda_graph=cuda and not args.no_cuda_graph, weights=weights)
    del weights
    build_s = time.perf_counter() - t0
    pages = eng.pages
    kv = eng.state.kv_cache
    pool_bytes = sum(t.numel() * t.element_size() for t in kv.tensors()) + \
        eng.state.latent_pool.numel() * eng.state.latent_pool.element_size()
    bytes_per_page = pool_bytes / (pages.num_pages + 1)
    need = eng.pages_for(Request([0] * plen, olen))
    vocab = eng.vocab_size
    g = torch.Generator().manual_seed(0)
    report = {"shape": args.shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "requests": n, "prompt_len": plen, "output_len": olen,
              "page_size": eng.state.page_size, "pool_pages": pages.num_pages,
              "pool_tokens": pages.num_pages * eng.state.page_size, "pool_gib": pool_bytes / 2**30,
              "bytes_per_page": bytes_per_page, "pages_per_request": need,
              "requests_the_pool_holds": pages.num_pages // need, "build_s": build_s, "cuda_graph": eng.use_cuda_graph,
              "modes": {}}
    print(f"pool: {pages.num_pages} pages x {eng.state.page_size} tokens = {report['pool_tokens']} tokens, "
          f"{report['pool_gib']:.2f} GiB (target K/V + drafter latents); a request takes {need} pages: the pool "
          f"holds {pages.num_pages // need} at once; engine built in {build_s:.1f} s", flush=True)
    ok = True
    for mode in [m for m in args.modes.split(",") if m]:
        reqs = [Request(torch.randint(0, vocab, (plen,), generator=g).tolist(), olen, ignore_eos=True,
                        sampling=SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i)) for i in range(n)]
        peak = {"pages": 0, "held": 0}
        real_allocate = pages.allocate

        def allocate(slot, k, _real=real_allocate, _peak=peak):
            out = _real(slot, k)
            _peak["pages"] = max(_peak["pages"], pages.num_used)
            _peak["held"] = max(_peak["held"], eng.slots.num_slots - eng.slots.num_free)
            return out

        pages.allocate = allocate
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            results, stats = eng.generate(reqs, mode=mode)
        finally:
            del pages.allocate
        wall = time.perf_counter() - t0
        finished = sum(r.finish_reason == "length" and len(r.output_ids) == olen for r in results)
        errors = sorted({r.error for r in results if r.error})[:3]
        row = {"wall_s": wall, "steps": stats.num_steps, "output_tokens": stats.num_tokens,
               "output_tok_per_s": stats.num_tokens / wall, "finished": finished, "errors": errors,
               "peak_pages_in_use": peak["pages"], "peak_requests_holding_a_slot": peak["held"],
               "pages_in_use_after": pages.num_used, "mean_acceptance_length": stats.mean_acceptance_length}
        if cuda:
            free, total = torch.cuda.mem_get_info()
            row.update(max_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                       reserved_gib=torch.cuda.memory_reserved() / 2**30, device_free_gib=free / 2**30,
                       device_total_gib=total / 2**30)
        report["modes"][mode] = row
        good = finished == n and peak["held"] >= n and pages.num_used == 0
        ok &= good
        print(f"{mode}: {finished}/{n} finished with {olen} tokens in {wall:.1f} s ({stats.num_steps} steps, "
              f"{row['output_tok_per_s']:.0f} output tok/s); peak {peak['held']} requests holding a slot, peak "
              f"{peak['pages']} / {pages.num_pages} pages in use ({100 * peak['pages'] / pages.num_pages:.0f}%), "
              f"{pages.num_used} after"
              + (f"; memory: max allocated {row['max_allocated_gib']:.1f} GiB, reserved {row['reserved_gib']:.1f} "
                 f"GiB, device free {row['device_free_gib']:.1f} / {row['device_total_gib']:.1f} GiB" if cuda else "")
              + ("" if good else f"  FAILED {errors}"), flush=True)
    report["ok"] = ok
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "capacity.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("capacity check " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
