#!/usr/bin/env python3
"""Where a served step's time goes at high concurrency: the serving loop (the engine's :class:`Scheduler` with the
overlap scheduler, as ``serve`` drives it, without HTTP) over a stream of requests, ``--concurrency`` in flight, under
the torch profiler for a window of plans.

``bench serve`` reports the engine's step (launch to tokens on the host) at 32 streams as ~2x the step's graph
replay (docs/serving.md, docs/real_model.md): this says whether the device idles (host work per plan above the
step), runs the admissions' prefills, or runs the steps longer than in the replay benchmark. From the profiler's
trace: the window's wall time, the device's busy time (the union of kernel intervals), the kernel time launched
inside each host phase (the step's launch, the admission's prefill, the rest), and per plan the host time of each
phase. Prints a Markdown table; ``--trace FILE`` keeps the Chrome trace.

    python3 scripts/profile_serve_loop.py --model out/real_model/SmolLM2-135M-Instruct --prompt-set mt_bench \\
        --prompt-file .gpu_data/prompts.jsonl.gz --concurrency 32 --mode speculative
"""
from __future__ import annotations

import argparse
import bisect
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import deque

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The host phases a kernel is attributed to: the profiler's annotation whose range holds the launching runtime call.
PHASES = ("launch_step", "prefill", "collect")


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals (us in, ms out)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def attribute(trace: dict) -> dict[str, float]:
    """Kernel ms per host phase of :data:`PHASES` (``other``: launched outside them), the device's busy ms (the union
    of every kernel's interval) and the window's wall ms (first to last annotation of a plan)."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    ranges = {p: [] for p in (*PHASES, "plan")}
    runtime_ts: dict[int, float] = {}
    kernels = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat == "user_annotation" and ev.get("name") in ranges:
            ranges[ev["name"]].append((ev["ts"], ev["ts"] + ev["dur"]))
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            corr = ev.get("args", {}).get("correlation")
            if corr is not None:
                runtime_ts[corr] = ev["ts"]
        elif cat == "kernel" or cat == "gpu_memcpy" or cat == "gpu_memset":
            kernels.append(ev)
    for v in ranges.values():
        v.sort()
    starts = {p: [s for s, _ in ranges[p]] for p in PHASES}  # one phase's ranges never overlap: bisect them

    def holds(p: str, ts: float) -> bool:
        i = bisect.bisect_right(starts[p], ts) - 1
        return i >= 0 and ts <= ranges[p][i][1]

    out = {p: 0.0 for p in (*PHASES, "other")}
    for k in kernels:
        ts = runtime_ts.get(k.get("args", {}).get("correlation"))
        phase = "other"
        if ts is not None:
            phase = next((p for p in PHASES if holds(p, ts)), "other")
        out[phase] += k["dur"] / 1e3
    out["busy"] = union_ms([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    plans = ranges["plan"]
    out["wall"] = (plans[-1][1] - plans[0][0]) / 1e3 if plans else 0.0
    return out


def stub_device(eng, runner) -> None:
    """``--host-only``: the runner's step returns its batch size's first outputs again (computed once), and an
    admission returns token 1 per row without a prefill -- the loop's own host work, whatever the model."""
    outputs: dict[int, object] = {}
    forward = runner.forward

    def cached(batch_size: int):
        if batch_size not in outputs:
            outputs[batch_size] = forward(batch_size)
        return outputs[batch_size]

    runner.forward = cached
    from tensorrt_llm_ext.runtime.engine import LaunchedPrefill

    def launch_prefill(slots, requests, mode="speculative", starts=None, **kw):
        return LaunchedPrefill(list(slots), mode, torch.ones(len(slots), dtype=torch.int64), None, None)

    eng.launch_prefill = launch_prefill


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--mode", choices=["speculative", "target_only"], default="speculative")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=384)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=None, help="K (default: the config's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompt-set", choices=["random", "mt_bench", "humaneval", "held_out"], default="random")
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--prompt-len", type=int, default=256, help="random prompts' length")
    p.add_argument("--warmup-plans", type=int, default=40)
    p.add_argument("--window-plans", type=int, default=200)
    p.add_argument("--no-overlap", action="store_true", help="the serial loop instead of the overlap scheduler")
    p.add_argument("--trace", default=None, help="keep the Chrome trace here")
    p.add_argument("--json", dest="json_out", default=None, help="also write the numbers as JSON here")
    p.add_argument("--host-only", action="store_true",
                   help="the loop's host cost alone: every step returns its batch size's first outputs again (no device "
                        "work after the first), every admission its first tokens without a prefill; graphs off, no "
                        "torch profiler window (runs on a CPU: what the loop costs the host per plan)")
    p.add_argument("--warm-up", action="store_true", help="run serve's start-up warm-up first (runtime/warmup.py; "
                   "forced on a CPU), as a served engine starts")
    p.add_argument("--gc-freeze", action="store_true", help="freeze the start-up heap before the loop, as serve does "
                   "(runtime/gc_pauses.py; its A/B)")
    p.add_argument("--cprofile", default=None, help="also profile the host (cProfile) over the window without the "
                   "torch profiler; the top functions go here")
    args = p.parse_args()

    from tensorrt_llm_ext.interpreter import ensure_triton_interpreter

    ensure_triton_interpreter()
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.gc_pauses import freeze_startup_heap, gc_pauses
    from tensorrt_llm_ext.runtime.requests import Request
    from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan

    cuda = torch.cuda.is_available()
    fields = {"max_batch_size": args.concurrency}
    if args.draft_len is not None:
        fields["speculative_config.max_draft_len"] = args.draft_len
    if args.model is None and not cuda:
        from tensorrt_llm_ext.configs.tiny_model import tiny_model

        fields = {**tiny_model(), **fields}
    cfg = load_config(model_dir=args.model, **fields)
    eng = Engine(cfg, use_cuda_graph=cuda and not args.host_only)
    runner = eng.runner(args.mode)  # the decode graphs (and the admission's, the prefill buckets) before the clock
    if args.warm_up:
        from tensorrt_llm_ext.runtime.warmup import warm_up

        warm_up(eng, args.mode, overlap=not args.no_overlap, force=True)
    if args.gc_freeze:
        freeze_startup_heap()  # as serve does after its warm-up (runtime/gc_pauses.py)
    gc_pauses.install()
    if args.host_only:
        stub_device(eng, runner)
    vocab = eng.vocab_size
    if args.prompt_set == "random":
        n = min(args.prompt_len, cfg.max_seq_len - args.max_tokens - cfg.draft_len - 2)
        prompts = [[(r * 7919 + i * 104729 + 13) % vocab for i in range(n)] for r in range(args.requests)]
    else:
        from tensorrt_llm_ext.bench.acceptance import prompt_set_ids

        prompts = prompt_set_ids(args.model, vocab, args.prompt_set, prompt_file=args.prompt_file,
                                 max_prompt_tokens=cfg.max_seq_len - args.max_tokens - cfg.draft_len - 2)
    queue = deque((i, Request(list(prompts[i % len(prompts)]), max_new_tokens=args.max_tokens, ignore_eos=True,
                              sampling=SamplingParams(args.temperature, seed=i)))
                  for i in range(args.requests))
    sched = Scheduler(eng, mode=args.mode, overlap=not args.no_overlap)
    rf = torch.profiler.record_function

    def annotate() -> None:
        """Each phase of a plan under its own annotation (the methods are the scheduler's and the engine's own,
        wrapped on the instances) -- for the profiled window only: the wrappers cost host time of their own."""
        def wrap(obj, method: str, name: str) -> None:
            orig = getattr(obj, method)

            def wrapped(*a, **k):
                with rf(name):
                    return orig(*a, **k)
            setattr(obj, method, wrapped)

        wrap(eng, "launch_step", "launch_step")
        wrap(sched, "_prefill", "prefill")
        wrap(sched, "_collect_step", "collect")
        wrap(sched, "_collect_firsts", "collect")

    plans: list[dict] = []
    tokens = 0
    prof = None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # warm-up, then a window without the profiler (its host times are the loop's own), then the profiled window
    bare_start = args.warmup_plans
    prof_start = bare_start + args.window_plans
    total_plans = prof_start + (1 if args.host_only else args.window_plans)  # host only: stops at the window's end
    bare_t0 = bare_tokens = bare_wall = None
    host_prof = cProfile.Profile() if args.cprofile else None
    while (queue or sched.num_active) and len(plans) < total_plans:
        if len(plans) == bare_start:
            sync()
            bare_t0, tokens, bare_gc = time.perf_counter(), 0, gc_pauses.snapshot()
            if host_prof is not None:
                host_prof.enable()
        if len(plans) == prof_start:
            sync()
            bare_wall, bare_tokens = time.perf_counter() - bare_t0, tokens
            bare_gc_text = gc_pauses.describe_since(bare_gc)
            if host_prof is not None:
                host_prof.disable()
                with open(args.cprofile, "w") as f:
                    stats = pstats.Stats(host_prof, stream=f)
                    stats.sort_stats("cumulative").print_stats(60)
                    stats.sort_stats("tottime").print_stats(40)
                    # this repository's own Python alone (where a plan's interpreter time goes, not torch's), and
                    # who calls the torch entry points that cost the most
                    stats.sort_stats("tottime").print_stats("tensorrt_llm_ext", 40)
                    stats.print_callers(r"copy_|to'|tensor'|pin_memory|index_select|replay|tolist|synchronize", 12)
            if args.host_only:
                break
            annotate()
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
            tokens = 0
        room = min(sched.admissible(r for _, r in queue), args.concurrency - sched.num_active)
        admit = [queue.popleft() for _ in range(max(0, room))]
        t0 = time.perf_counter()
        if prof is not None:
            with rf("plan"):
                events, st = sched.apply(StepPlan(admit=admit))
        else:
            events, st = sched.apply(StepPlan(admit=admit))
        plans.append({"wall": time.perf_counter() - t0, "admit": len(admit), "deferred": st.deferred_prefills,
                      "rows": st.num_rows,
                      "step_s": st.step_s, "prefill_s": st.prefill_s, "accepted": list(st.accepted_lens)})
        tokens += sum(len(e.tokens) for e in events)
    sync()
    if args.host_only:
        if bare_wall is None:
            print(f"error: the run ended after {len(plans)} plans, before the window; send more --requests",
                  file=sys.stderr)
            return 2
        bare = plans[bare_start:prof_start]
        print(f"host only ({args.mode}, concurrency {args.concurrency}, {torch.__version__}): {len(bare)} plans, "
              f"{sum(1 for w in bare if w['rows'])} steps, {bare_wall * 1e3 / len(bare):.3f} ms a plan; garbage collection "
              f"{bare_gc_text}")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"mode": args.mode, "concurrency": args.concurrency, "plans": len(bare),
                           "ms_per_plan": bare_wall * 1e3 / len(bare)}, f)
        return 0
    if prof is None:
        print(f"error: the run ended after {len(plans)} plans, before the window (--warmup-plans "
              f"{args.warmup_plans}); send more --requests", file=sys.stderr)
        return 2
    prof.__exit__(None, None, None)
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        at = attribute(json.load(f))
    bare = plans[bare_start:prof_start]
    win = plans[prof_start:]
    steps = [w for w in win if w["rows"]]
    acc = [a for w in win for a in w["accepted"]]
    n_admit = sum(w["admit"] for w in win)
    dev = torch.cuda.get_device_name() if cuda else "CPU (smoke: timings meaningless)"
    print(f"### Serving loop, {args.mode}, concurrency {args.concurrency} ({dev}; torch {torch.__version__}; "
          f"{'overlap' if not args.no_overlap else 'serial'} loop; {args.prompt_set} prompts, {args.max_tokens} "
          f"tokens, temperature {args.temperature:g})\n")
    print("| plans | steps | admissions | tokens | wall ms | device busy ms | idle % | kernel ms: step / prefill / "
          "collect / other | per step: wall ms / kernel ms | plan host ms p50 / p90 | mean rows | mean acceptance |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    n = max(1, len(steps))
    walls = sorted(w["wall"] * 1e3 for w in win)
    kern = at["launch_step"] + at["prefill"] + at["collect"] + at["other"]
    print(f"| {len(win)} | {len(steps)} | {n_admit} | {tokens} | {at['wall']:.1f} | {at['busy']:.1f} | "
          f"{100 * (1 - at['busy'] / at['wall']) if at['wall'] else float('nan'):.1f} | "
          f"{at['launch_step']:.1f} / {at['prefill']:.1f} / {at['collect']:.1f} / {at['other']:.1f} | "
          f"{at['wall'] / n:.3f} / {kern / n:.3f} | {statistics.median(walls):.3f} / "
          f"{walls[round(0.9 * (len(walls) - 1))]:.3f} | {statistics.mean(w['rows'] for w in steps) if steps else 0:.1f} | "
          f"{statistics.mean(acc) if acc else float('nan'):.2f} |")
    bare_steps = sum(1 for w in bare if w["rows"])
    bwalls = sorted(w["wall"] * 1e3 for w in bare)
    print(f"\nwithout the profiler, the {len(bare)} plans before the window: {bare_steps} steps, {bare_tokens} tokens in "
          f"{bare_wall * 1e3:.1f} ms ({bare_wall * 1e3 / max(1, bare_steps):.3f} ms a step, "
          f"{bare_tokens / bare_wall:.0f} tokens/s); plan host ms p50 / p90 {statistics.median(bwalls):.3f} / "
          f"{bwalls[round(0.9 * (len(bwalls) - 1))]:.3f}; admissions {sum(w['admit'] for w in bare)} "
          f"({sum(w['deferred'] for w in bare)} read a plan later); garbage collection {bare_gc_text}"
          f"{' (start-up heap frozen)' if args.gc_freeze else ''}")
    print(f"\nkernel ms by the host phase that launched it (launch_step: the step's replay or eager launches; prefill: "
          f"the admissions; collect: the step's token read-back and bookkeeping); idle: the window's wall less the "
          f"union of kernel intervals. Trace: {path}")
    if args.json_out:
        summary = {"device": dev, "mode": args.mode, "concurrency": args.concurrency,
                   "profiled": {**at, "plans": len(win), "steps": len(steps), "admissions": n_admit, "tokens": tokens,
                                "plan_host_ms": walls},
                   "bare": {"plans": len(bare), "steps": bare_steps, "tokens": bare_tokens, "wall_ms": bare_wall * 1e3,
                            "admissions": sum(w["admit"] for w in bare),
                            "read_a_plan_later": sum(w["deferred"] for w in bare), "plan_host_ms": bwalls}}
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    top = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25)
    print("\n```\n" + top + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
