"""What programmatic dependent launch (PDL) saves per launch on this GPU, under CUDA-graph replay (issue 36).

A chain of N small dependent kernels (each reads the previous one's output and writes its own: the shape of a
decode forward's ~157 launches), captured in one CUDA graph, replayed; three forms:

* ``plain``: ordinary launches;
* ``pdl``: ``launch_pdl=True``, each kernel calls ``gdc_launch_dependents()`` at its start and ``gdc_wait()``
  before its first load of the previous kernel's output (Triton 3.6: ``tl.extra.cuda``);
* ``pdl_nowait``: ``launch_pdl=True`` with neither call (the attribute alone: the next grid still waits for the
  whole previous grid, the launch is set up early).

Prints microseconds per launch (median of replays) and checks the chain's result (PDL must not let a kernel read
a stale input). The CPU interpreter does not run ``gdc_wait`` (inline PTX): the runtime's kernels would take it
behind a constexpr switch. Usage on the GPU machine:  python3 scripts/probe_pdl.py [--launches 150] [--programs 30]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.runtime.cuda_graph import graph_capture


@triton.jit
def _step_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr, WAIT: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its prologue now
    if WAIT:
        tl.extra.cuda.gdc_wait()  # the previous kernel's writes are visible after this
    x = tl.load(src_ptr + offs, mask=ok, other=0.0)
    tl.store(dst_ptr + offs, x + 1.0, mask=ok)


def _chain(bufs, launches, programs, block, pdl, wait):
    n = bufs[0].numel()
    for i in range(launches):
        _step_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=block, PDL=pdl, WAIT=wait,
                                  launch_pdl=pdl)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=150)
    p.add_argument("--programs", type=int, default=30)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--replays", type=int, default=50)
    args = p.parse_args()
    n = args.programs * args.block
    rows = []
    for name, pdl, wait in (("plain", False, False), ("pdl", True, True), ("pdl_nowait", True, False)):
        bufs = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
        try:
            _chain(bufs, 2, args.programs, args.block, pdl, wait)  # compile
            torch.cuda.synchronize()
            bufs[0].zero_()
            bufs[1].zero_()
            g = torch.cuda.CUDAGraph()
            with graph_capture(g):
                _chain(bufs, args.launches, args.programs, args.block, pdl, wait)
            bufs[0].zero_()
            bufs[1].zero_()
            g.replay()
            torch.cuda.synchronize()
            last = bufs[args.launches % 2]
            correct = bool((last == float(args.launches)).all())
            times = []
            for _ in range(args.replays):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            times.sort()
            med = times[len(times) // 2]
            rows.append((name, med, med / args.launches, correct))
        except Exception as e:  # a form the toolchain refuses: say so, keep the others
            rows.append((name, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:160]}"))
    print(f"probe_pdl: {args.launches} dependent launches of {args.programs} programs x {args.block} fp32, one graph, "
          f"median of {args.replays} replays; triton {triton.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")
    print("| form | graph us | us per launch | result correct |")
    print("|---|---|---|---|")
    for name, t, per, ok in rows:
        print(f"| {name} | {t:.1f} | {per:.2f} | {ok} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
