"""``trtllm-ext bench tail``: the fused spec-tail kernels against their eager chains.

Per batch size B (generation requests, K draft tokens): strict acceptance, block-table decode, and
paged-latent bookkeeping + context-latent store, each fused op and its eager chain captured in CUDA
graphs and replayed (median of many, input sets rotated), with the number of device launches per call
(kernels + memsets + copies, counted by the profiler on one eager call). On CPU: a smoke run at tiny
sizes (timings and launch counts not meaningful).
"""

from __future__ import annotations

import argparse

import torch

from tensorrt_llm_ext.argtypes import int_list, positive_int
from tensorrt_llm_ext.bench.harness import BenchTimer, fmt, print_table, register_benchmark
from tensorrt_llm_ext.kernels.block_table import decode_block_table, decode_block_table_reference
from tensorrt_llm_ext.kernels.paged_latent import PagedLatentStep, paged_latent_step, paged_latent_step_reference, store_context_latents
from tensorrt_llm_ext.kernels.strict_accept import strict_accept, strict_accept_reference

_SETS = 4  # the tail's inputs are KiBs: rotation only keeps replays from reusing one set's lines


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-len", type=positive_int, default=7)
    p.add_argument("--batch-sizes", type=int_list(), default="1,4,16,64,128,256")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--max-pages", type=positive_int, default=64, help="block-table width per slot")
    p.add_argument("--layers", type=positive_int, default=2, help="drafter layers (L)")
    p.add_argument("--latent-dim", type=positive_int, default=512, help="latent width d_c")


def _store_eager_chain(latents, pages, offs, mask, pool):
    """Capturable stand-in for the stock store (which selects rows on the host): gather, where, scatter.

    Timing only: masked rows rewrite an old value at a clamped destination.
    """
    pc, oc = pages.clamp(min=0).long(), offs.long()
    cur = pool[:, pc, oc]
    pool[:, pc, oc] = torch.where(mask[None, :, None], latents.transpose(0, 1), cur)


def _count_launches(fn, device) -> str:
    if device.type != "cuda":
        return "-"
    from torch.profiler import ProfilerActivity, profile

    fn()  # compiled and warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return str(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))


def _accept_set(b, k, device, g):
    target = torch.randint(0, 4, (b, k + 1), generator=g).to(device)  # small alphabet: partial accepts
    draft = target[:, :k].clone()
    draft[torch.rand(b, k, generator=g).to(device) < 0.2] += 1
    return draft, target


def _paged_set(b, k, args, device, g):
    mp = args.max_pages
    num_slots = b + 1
    perm = torch.randperm(num_slots * mp, generator=g).to(torch.int32)
    table = perm.view(num_slots, mp).clone()
    ctx = torch.randint(0, 1024, (num_slots,), generator=g, dtype=torch.int32)  # ~600 more fit the pages
    accepted = torch.randint(0, 32000, (b, k + 1), generator=g, dtype=torch.int32)
    num_acc = torch.randint(1, k + 2, (b,), generator=g, dtype=torch.int32)
    slots = torch.randperm(b, generator=g).to(torch.int32)
    dummy = torch.zeros(b, dtype=torch.bool)
    t = [x.to(device) for x in (accepted, num_acc, slots, dummy, ctx, table)]
    latents = torch.randn((b * (k + 1), args.layers, args.latent_dim), generator=g).to(device, torch.bfloat16)
    return t, latents


@register_benchmark("tail", "fused spec-tail kernels vs their eager chains (strict accept, block table, paged latent)",
                    add_args=_add_args)
def run(args: argparse.Namespace) -> None:
    timer = BenchTimer()
    device = timer.device
    k = args.draft_len
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    if timer.smoke:
        sizes, args.max_pages, args.layers, args.latent_dim, args.page_size = [1, 4], 4, 2, 16, 8
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in sizes:
        # -- strict acceptance (a generation step) --
        sets = [_accept_set(b, k, device, g) for _ in range(_SETS)]
        outs = [(torch.empty((b, k + 1), dtype=torch.int32, device=device),
                 torch.empty((b,), dtype=torch.int32, device=device)) for _ in sets]
        fused = [lambda d=d, t=t, o=o: strict_accept(d, t, out=o) for (d, t), o in zip(sets, outs)]
        eager = [lambda d=d, t=t: strict_accept_reference(d, t) for d, t in sets]
        rows.append(_row("strict_accept", b, timer, fused, eager, device))

        # -- block-table decode --
        offs = [torch.randint(-64, 1 << 20, (b, args.max_pages), generator=g, dtype=torch.int32).to(device)
                for _ in range(_SETS)]
        tabs = [(torch.empty_like(o), torch.empty((b,), dtype=torch.int32, device=device)) for o in offs]
        fused = [lambda o=o, t=t: decode_block_table(o, 64, out=t[0], num_blocks_out=t[1]) for o, t in zip(offs, tabs)]
        eager = [lambda o=o, t=t: decode_block_table_reference(o, 64, out=t[0]) for o, t in zip(offs, tabs)]
        rows.append(_row("decode_block_table", b, timer, fused, eager, device))

        # -- paged-latent bookkeeping + store (all L layers) --
        num_pages = (b + 1) * args.max_pages
        pool = torch.zeros((args.layers, num_pages, args.page_size, args.latent_dim), dtype=torch.bfloat16,
                           device=device)
        kw = dict(num_contexts=0, page_size=args.page_size, draft_len=k, max_ctx_len=1 << 20, mask_token_id=1)

        def make(fused_op: bool):
            fns = []
            for _ in range(_SETS):
                t, lat = _paged_set(b, k, args, device, g)
                step = PagedLatentStep.allocate(b, k, device)

                def f(t=t, lat=lat, step=step):
                    s = paged_latent_step(*t, **kw, out=step)
                    store_context_latents(lat, s.latent_pages.view(-1), s.latent_offsets.view(-1),
                                          s.latent_write_mask.view(-1), pool)

                def e(t=t, lat=lat):
                    s = paged_latent_step_reference(*t, **kw)
                    _store_eager_chain(lat, s.latent_pages.view(-1), s.latent_offsets.view(-1),
                                       s.latent_write_mask.view(-1), pool)

                fns.append(f if fused_op else e)
            return fns

        rows.append(_row(f"paged_latent_step+store (L={args.layers}, d_c={args.latent_dim})", b, timer,
                         make(True), make(False), device))
        del pool

    print_table(
        f"Spec tail, K={k}, CUDA-graph replay (us per call)",
        ["op", "B", "fused us", "eager us", "eager/fused", "launches fused", "launches eager"],
        rows,
        notes=["Eager = the stock worker's chain of small torch ops (the *_reference twins; the store's eager "
               "chain is a capturable gather/where/scatter stand-in). Launches: device ops of one eager call "
               "(kernels, memsets, copies). Goal: strict accept and block-table decode one launch and >= 3x at "
               "B=64; bookkeeping + store >= 3x."],
    )


def _row(name, b, timer, fused, eager, device):
    t_f = timer.time_graph(fused)
    t_e = timer.time_graph(eager)
    ratio = t_e / t_f if t_f == t_f and t_f > 0 else float("nan")
    return [name, b, fmt(t_f, 2), fmt(t_e, 2), fmt(ratio, 2), _count_launches(fused[0], device),
            _count_launches(eager[0], device)]
