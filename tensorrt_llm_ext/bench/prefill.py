"""``trtllm-ext bench prefill``: what one admission's prefill costs, speculative against target-only, and where the
speculative one's time goes.

``Engine.prefill_slots`` of ``R`` requests of ``L`` prompt tokens, as ``serve`` admits them: with graphs on (a GPU),
the decode steps and the prefill's target forward captured first (``Engine.runner``), so the forward replays its
token buckets and everything after it runs as it does in ``serve``. Per (mode, R, L) the median over ``--reps``
admissions of the wall time from an idle device to the first tokens on the host (``Engine.prefill_slots``: the
launch and its read-back -- what an admission into an idle engine holds the loop and what its time to first token
pays beyond the queue; behind a running step the overlap scheduler reads it a plan later). ``spec, first
block eager``: the speculative one again with the first block run eagerly (no graph replay), in the same run.

The speculative prefill by stage (a second pass: every stage bracketed by device synchronisations, so each is timed
alone; their sum exceeds the undisturbed total by the synchronisations): ``forward`` (the target forward:
``DSparkWorker._prefill_forward``), ``select`` (the first tokens: ``_select``), ``latents`` (the drafter's context
latents of the prompt, stored: ``_store_prompt_latents``; where the forward replays token buckets they store the
latents themselves -- the prefill runner's latent fold -- so their cost is in ``forward`` and ``latents`` reads 0),
``draft`` (the first block: the bookkeeping of the first
token as an accepted one, drafter forward, Markov chain, confidences: ``draft_first_block``, one graph replay where
the engine captured it) and ``other`` (the pass's total less those four: host-to-device copies, the tokens read
back). The target-only prefill runs ``forward`` and
``select`` only.

On CPU: a smoke run of the tiny test model (timings meaningless, printed as "-").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from tensorrt_llm_ext.argtypes import int_list, positive_int
from tensorrt_llm_ext.bench.harness import first_line, fmt, print_table, register_benchmark

STAGES = ("forward", "select", "latents", "draft")
# The worker's method behind each stage (DSparkWorker)
STAGE_METHODS = {"forward": "_prefill_forward", "select": "_select", "latents": "_store_prompt_latents",
                 "draft": "draft_first_block"}


def _add_args(p: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a checkpoint directory (as import-gguf writes it; its drafter DIR/dspark_drafter when "
                        "present, else the seeded bigram drafter serve builds); default: the embedded model")
    p.add_argument("--rows", type=int_list(1, 1 << 16), default="1,4,16" if cuda else "1,2",
                   help="requests admitted together (one batched prefill)")
    p.add_argument("--prompt-lens", type=int_list(1, 1 << 20), default=None,
                   help="prompt tokens of each request (default: 128,512 on a GPU -- those of them that fit the "
                        "model's max_seq_len with the new tokens, at least the largest that does --, 8 on a CPU)")
    p.add_argument("--reps", type=positive_int, default=9 if cuda else 1, help="admissions timed per cell")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the requests' temperature (> 0: sampled rows, drafted by rejection sampling's chain)")


def default_prompt_lens(cuda: bool, max_seq_len: int, new_tokens: int) -> list[int]:
    """``--prompt-lens``' default: 128 and 512 on a GPU, 8 on a CPU -- those that fit ``max_seq_len`` with
    ``new_tokens``, else the longest prompt that does (at least 1: a model too short for any is refused after)."""
    lens = [128, 512] if cuda else [8]
    return [n for n in lens if n + new_tokens <= max_seq_len] or [max(1, max_seq_len - new_tokens)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def stage_timers(worker, device: torch.device, totals: dict[str, float]):
    """Bracket each :data:`STAGE_METHODS` method of ``worker`` with device synchronisations and add its seconds to
    ``totals[stage]``; the methods are the worker's own again on exit."""
    originals = {stage: getattr(worker, name) for stage, name in STAGE_METHODS.items()}

    def timed(stage, fn):
        def call(*args, **kwargs):
            _sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(device)
                totals[stage] = totals.get(stage, 0.0) + time.perf_counter() - t0
        return call

    for stage, fn in originals.items():
        setattr(worker, STAGE_METHODS[stage], timed(stage, fn))
    try:
        yield
    finally:
        for stage in originals:
            delattr(worker, STAGE_METHODS[stage])  # the instance attribute off: the class's method again


@register_benchmark("prefill", "one admission's prefill: speculative vs target-only, the speculative one by stage",
                    add_args=_add_args)
def run(args: argparse.Namespace) -> int:
    from tensorrt_llm_ext.interpreter import ensure_triton_interpreter

    ensure_triton_interpreter()  # at run time, before the engine imports any kernel module (CPU smoke run)
    from tensorrt_llm_ext.contract import BuildRefusal, SamplingParams
    from tensorrt_llm_ext.runtime.config import ConfigError, describe_drafter, load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.requests import Request

    def refuse(msg: str) -> int:
        print(f"error: bench prefill: {msg}", file=sys.stderr)
        return 2

    if not (args.temperature == 0.0 or 0.0 < args.temperature < float("inf")):
        return refuse(f"--temperature: expected a finite number >= 0, got {args.temperature}")
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    rows = sorted({int(x) for x in args.rows.split(",")})
    lens = sorted({int(x) for x in args.prompt_lens.split(",")}) if args.prompt_lens else None
    fields = {"max_batch_size": max(rows)}
    if args.model is None and not cuda:
        from tensorrt_llm_ext.configs.tiny_model import tiny_model

        fields = {**tiny_model(), **fields}
    try:
        cfg = load_config(model_dir=args.model, **fields)
    except (ConfigError, OSError) as e:
        first = first_line(e)
        return refuse(f"--model {args.model}: {first}" if args.model is not None else first)
    new_tokens = cfg.draft_len + 2  # room for the first token and one step's block
    if lens is None:
        lens = default_prompt_lens(cuda, cfg.max_seq_len, new_tokens)
    if max(lens) + new_tokens > cfg.max_seq_len:
        return refuse(f"--prompt-lens {max(lens)}: a prompt and {new_tokens} new tokens do not fit max_seq_len "
                      f"{cfg.max_seq_len}")
    try:
        eng = Engine(cfg, use_cuda_graph=cuda)
    except BuildRefusal as e:
        return refuse(str(e).strip().splitlines()[0])
    device = eng.device
    modes = ("target_only", "speculative")
    for mode in modes:  # graphs as serve captures them: the decode steps, then the prefill's token buckets
        eng.runner(mode)
    worker = eng.worker("speculative")
    sampling = SamplingParams(args.temperature, seed=1)
    show = (lambda x: fmt(x, 2)) if cuda else (lambda x: "-")  # noqa: E731  (a CPU's timings mean nothing)
    out_rows = []
    for n_rows in rows:
        for n_tok in lens:
            requests = [Request([(r * 7919 + i * 104729) % eng.vocab_size for i in range(n_tok)],
                                max_new_tokens=new_tokens, sampling=sampling) for r in range(n_rows)]
            slots = [eng.slots.acquire() for _ in requests]
            try:
                for slot, req in zip(slots, requests):
                    eng.validate(req)
                    eng.reserve(slot, req)
                cell: dict[str, float] = {}
                admission = worker.admission_runner
                # the speculative prefill a second time with its first block eager (no runner): the graphs' gain
                for mode, key in (*((m, m) for m in modes), ("speculative", "eager first block")):
                    worker.admission_runner = None if key == "eager first block" else admission
                    eng.prefill_slots(slots, requests, mode)  # warm-up: first launches, lazily sized buffers
                    samples = []
                    for _ in range(args.reps):
                        _sync(device)
                        t0 = time.perf_counter()
                        eng.prefill_slots(slots, requests, mode)
                        _sync(device)
                        samples.append(time.perf_counter() - t0)
                    cell[key] = statistics.median(samples) * 1e3
                worker.admission_runner = admission
                totals: dict[str, float] = {}
                with stage_timers(worker, device, totals):
                    _sync(device)
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        eng.prefill_slots(slots, requests, "speculative")
                    _sync(device)
                    whole = (time.perf_counter() - t0) / args.reps * 1e3
                by_stage = {s: totals.get(s, 0.0) / args.reps * 1e3 for s in STAGES}
                by_stage["other"] = whole - sum(by_stage.values())
            finally:
                for slot in slots:
                    eng.release_slot(slot)
            out_rows.append([n_rows, n_tok, show(cell["target_only"]), show(cell["speculative"]),
                             show(cell["speculative"] - cell["target_only"]), show(cell["eager first block"]),
                             *(show(by_stage[s]) for s in (*STAGES, "other"))])
            print(f"bench prefill: R={n_rows} L={n_tok} done", file=sys.stderr, flush=True)
    graphs = ("prefill forward in captured token buckets " + str(list(eng.prefill_buckets))
              if eng.prefill_runner is not None else "prefill forward eager")
    admission = worker.admission_runner
    graphs += ("; first block replayed per row count " + str(admission.captured())
               if admission is not None and admission.captured() else "; first block eager")
    print_table("bench prefill: one admission, ms from an idle device to the first tokens on the host",
                ["R", "L", "target-only", "speculative", "spec - target", "spec, first block eager",
                 *(f"spec {s}" for s in STAGES),
                 "spec other"], out_rows,
                [f"model: {args.model or 'embedded'}; {describe_drafter(cfg)}; K={cfg.draft_len}; "
                 f"temperature {args.temperature}; {graphs}; median of {args.reps} admissions per cell",
                 "spec STAGE: the speculative prefill again with every stage between device synchronisations "
                 "(DSparkWorker: forward = _prefill_forward, select = _select, latents = _store_prompt_latents, "
                 "draft = draft_first_block; with the forward in captured buckets the latents are stored inside them: "
                 "their cost is in forward, latents reads 0); other = that pass's total less the four (copies, the "
                 "tokens read back)"])
    return 0
