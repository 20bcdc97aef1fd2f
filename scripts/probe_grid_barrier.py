"""What a grid-wide barrier inside one persistent kernel costs against a kernel boundary under programmatic dependent
launch (issue 36: whether a persistent layer kernel pays before anyone builds one).

The `[32, 1]` decode layer is five dependent launches (~34 us a layer on the H200 against ~1.5 us of weight bytes and
~6 us of keys); a persistent kernel would run the same five phases in one launch, its resident programs meeting at a
grid barrier between phases. This probe times the hand-off alone, in two forms of the same work, under CUDA-graph
replay:

* ``pdl_chain``: N launches of G programs with programmatic dependent launch (``gdc_wait`` before the first
  dependent load, ``gdc_launch_dependents`` after it, as the model's kernels do);
* ``persistent``: one launch of G programs running N phases, a grid barrier between phases: each program's threads
  meet (``debug_barrier``), one release atomic arrives on a global counter, then acquire loads spin until the
  counter reaches the phase's count (the counter only grows inside a launch; the graph zeroes it before the launch).

Each phase, program p reads the block program ``(p + 1) % G`` wrote in the phase before and writes its own block
plus one, so a hand-off that lets a program read before its neighbour wrote shows as a final value below N (checked
for both forms). The spin is bounded: a barrier whose programs are not all resident (G above what fits at once)
ends with the error flag set instead of hanging. GPU only (the interpreter runs programs one at a time, so no
barrier could complete). Usage on the GPU machine:

    python3 scripts/probe_grid_barrier.py [--phases 150] [--programs 132 264] [--block 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorrt_llm_ext.bench.harness import BenchTimer  # noqa: E402

MAX_SPINS = tl.constexpr(1 << 16)  # ~0.1 s of polls: far past any barrier that can complete, short enough to end


@triton.jit
def _chain_step_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    tl.extra.cuda.gdc_wait()  # the previous launch's writes are visible after this
    tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(src_ptr + ((pid + 1) % g) * BLOCK + lanes)
    tl.store(dst_ptr + pid * BLOCK + lanes, x + 1.0)


@triton.jit
def _persistent_kernel(buf_ptr, counter_ptr, error_ptr, phases, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    n = g * BLOCK
    for i in range(phases):
        src = buf_ptr + (i % 2) * n
        dst = buf_ptr + ((i + 1) % 2) * n
        x = tl.load(src + ((pid + 1) % g) * BLOCK + lanes, cache_modifier=".cg")  # L2, never a stale L1 line
        tl.store(dst + pid * BLOCK + lanes, x + 1.0)
        # the grid barrier: every thread's store before the one release arrival, then spin on acquire loads
        tl.debug_barrier()
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        want = (i + 1) * g
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < want) & (spins < MAX_SPINS):
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if seen < want:
            tl.atomic_max(error_ptr, 1)
        tl.debug_barrier()


def _pdl_chain(phases: int, programs: int, block: int, timer: BenchTimer) -> tuple[float, bool]:
    bufs = [torch.zeros(programs * block, device="cuda") for _ in range(2)]

    def run():
        bufs[0].zero_()
        for i in range(phases):
            _chain_step_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], BLOCK=block, launch_pdl=True)

    us = timer.time_graph([run])
    torch.cuda.synchronize()
    return us, bool((bufs[phases % 2] == float(phases)).all())  # the last replay's chain


def _persistent(phases: int, programs: int, block: int, timer: BenchTimer) -> tuple[float, bool]:
    buf = torch.zeros(2 * programs * block, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    error = torch.zeros(1, dtype=torch.int32, device="cuda")  # set by any barrier that timed out, in any replay

    def run():
        buf[: programs * block].zero_()
        counter.zero_()
        _persistent_kernel[(programs,)](buf, counter, error, phases, BLOCK=block)

    us = timer.time_graph([run])
    torch.cuda.synchronize()
    out = buf[(phases % 2) * programs * block:][: programs * block]
    return us, bool((out == float(phases)).all()) and int(error.item()) == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", type=int, default=150)
    p.add_argument("--programs", type=int, nargs="+", default=None, help="default: the SM count, and twice it")
    p.add_argument("--block", type=int, default=256, help="fp32 values per program and phase")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions (median), each of 20 graph replays")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_grid_barrier: needs a CUDA GPU (the interpreter cannot run a grid barrier)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = args.programs or [sms, 2 * sms]
    timer = BenchTimer("cuda", reps=args.reps)
    print(f"probe_grid_barrier: {args.phases} dependent phases, programs x {args.block} fp32, one graph, median of "
          f"{args.reps} x 20 replays (BenchTimer); triton {triton.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()} ({sms} SMs)")
    print("| programs | form | us per chain | us per hand-off | result correct |")
    print("|---|---|---|---|---|")
    for g in programs:
        for name, fn in (("pdl_chain", _pdl_chain), ("persistent", _persistent)):
            try:
                t, ok = fn(args.phases, g, args.block, timer)
                print(f"| {g} | {name} | {t:.1f} | {t / args.phases:.2f} | {ok} |", flush=True)
            except Exception as e:  # a form the toolchain refuses: say so, keep the others
                print(f"| {g} | {name} | - | - | {type(e).__name__}: {str(e)[:160]} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
