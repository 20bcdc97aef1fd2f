"""Serving's start-up warm-up: each kind of admission a request can take, run once before the server is ready.

Graph capture runs (and so builds) what the captured steps and prefill buckets launch. The rest runs eagerly on
first use -- a sampled request's first-token selection, a top-p or processed admission's first block, the
drafter's context projection over the prompt, a prefill past the largest captured bucket -- and Triton builds a
kernel per specialization on its first launch (its constexprs; each integer argument equal to 1 or a multiple of
16, each pointer 16-byte aligned or not). Measured on an H100 (2026-12-07, ``bench serve``, before this warm-up):
a fresh server's first sampled requests waited for those builds, TTFT p99 2.3-2.7 s on SmolLM2-135M and 2.7 / 4.3 s
(1 / 32 streams, speculative) on the embedded model.

:func:`warm_up` runs short requests of every sampling kind at the row counts and prompt lengths of
:func:`warmup_rounds` through schedulers of its own, without a speculation gate (the serving scheduler's gate and
counters never see them), then checks that every slot and page is free again. The tokens of later requests do
not depend on it: per-request state is written at admission (tested). On a CPU (the Triton interpreter builds
nothing) it is skipped unless forced; ``TLLM_EXT_SERVE_WARMUP=0`` skips it anywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.runtime.compile_watch import compile_watch
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.runtime.speculation_gate import speculation_gate, speculation_max_concurrency

__all__ = ["WARMUP_LENGTHS", "WARMUP_ROWS", "WARMUP_SAMPLING", "WarmupReport", "warm_up", "warmup_rounds"]

# The sampling kinds whose admissions and steps run different code (docs/token_decision.md): greedy, sampled
# without a top-p set, with one, and with every logits-processing field (one processed path runs them all).
WARMUP_SAMPLING: dict[str, SamplingParams] = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=1.0),
    "top-p": SamplingParams(temperature=1.0, top_p=0.95),
    "processed": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, presence_penalty=0.5,
                                frequency_penalty=0.5, repetition_penalty=1.1, logit_bias=((0, 1.0),)),
}
# Rows of one admission: one, two and three (row counts that are neither 1 nor a multiple of 16, of either
# parity: a per-row field's offset in a packed buffer may follow the count), and a multiple of 16.
WARMUP_ROWS = (1, 2, 3, 16)
# Prompt tokens of a one-row round: 1 (the products' one-row form), then per tile of 16 / 64 rows (the fused
# linear's, kernels/fused_linear.py) a count that is not a multiple of 16 and one that is.
WARMUP_LENGTHS = (1, 7, 16, 40, 48)


@dataclass
class WarmupReport:
    rounds: int = 0
    requests: int = 0
    seconds: float = 0.0
    builds: int = 0  # Triton kernel builds during the warm-up (compiled or loaded from the disk cache)
    build_seconds: float = 0.0
    skipped: str | None = None  # why it did not run
    skipped_requests: int = 0  # requests of a round whose requests fit no idle engine
    failed: int = 0  # requests a layer refused (logged as errors)


def warmup_rounds(engine) -> list[tuple[str, int, int, dict]]:
    """``(sampling kind, rows, prompt length, extra request fields)`` per round. Every kind: one row at each prompt
    length of :data:`WARMUP_LENGTHS` (the eager products over a prompt's tokens -- the drafter's context
    projection, a prefill past the captured buckets -- pick their tiles and specialize by the token count), and
    at each row count of :data:`WARMUP_ROWS` that fits ``max_batch_size`` with a short prompt; past the largest
    captured bucket at one and two rows with an odd length and at one row with a multiple of 16 (a batched prefill
    of long prompts runs at most ``max_num_tokens`` of them together: more rows add no kind); then one row with
    ``logprobs`` and ``prompt_logprobs``; then greedy prompts of every power of two up to the largest bucket (or
    ``max_num_tokens``) not run yet: the products over a prompt's tokens that go to cuBLAS pick a kernel per
    range of the token count, and a kernel's first launch loads its module (lazy loading). Lengths that do not fit
    ``max_seq_len`` are left out."""
    room = engine.config.max_seq_len - _new_tokens(engine) - engine.draft_len - 2  # the longest prompt it may carry
    if room < 1:
        return []
    top = max(engine.prefill_buckets, default=0)
    short = min(WARMUP_LENGTHS[1], room)
    shapes = [(1, n) for n in WARMUP_LENGTHS if n <= room]
    shapes += [(r, short) for r in WARMUP_ROWS if 1 < r <= engine.max_batch_size]
    if top and top + 7 <= room:
        shapes += [(r, top + 7) for r in (1, 2) if r <= engine.max_batch_size]
    if top and top + 16 <= room:
        shapes.append((1, top + 16))
    rounds = [(kind, r, n, {}) for kind in WARMUP_SAMPLING for r, n in dict.fromkeys(shapes)]
    rounds.append(("greedy", 1, short, {"logprobs": 2, "prompt_logprobs": 2}))
    bound = min(room, top or engine.max_num_tokens, engine.max_num_tokens)
    seen = {n for r, n in shapes if r == 1}
    rounds += [("greedy", 1, 1 << i, {}) for i in range(bound.bit_length()) if (1 << i) not in seen]
    return rounds


def _new_tokens(engine) -> int:
    """Each warm-up request's length: the first token and two steps."""
    return 2 * (engine.draft_len + 1) + 1


def warm_up(engine, mode: str, overlap: bool, force: bool = False,
            rounds: list[tuple[str, int, int, dict]] | None = None) -> WarmupReport:
    """Run :func:`warmup_rounds` (or ``rounds``, a selection of them: the CPU tests run one round of each kind
    under the interpreter) through a scheduler of ``mode`` (``overlap`` as served) on ``engine``, whose runner for
    ``mode`` is built; every rank of a TP job runs it alike (its plans are the same on every rank).

    It never keeps a server from serving what it could serve without it: a round whose requests fit no idle
    engine (a small ``kv_cache_config.max_tokens``) is skipped and a request a layer refuses is logged as an error
    (that kind would fail for a client too); an engine error propagates (the engine has failed), and so does a
    slot or page still held after the rounds (a leak: a broken invariant)."""
    report = WarmupReport()
    if not ENV.serve_warmup and not force:
        report.skipped = "TLLM_EXT_SERVE_WARMUP=0"
        logger.info(f"warm-up: skipped ({report.skipped}; the first request of each kind waits for its kernel builds)")
        return report
    if engine.device.type != "cuda" and not force:
        report.skipped = "no kernel is built on a CPU (the Triton interpreter)"
        logger.info(f"warm-up: skipped ({report.skipped})")
        return report
    rounds = warmup_rounds(engine) if rounds is None else rounds
    if not rounds:
        report.skipped = f"no warm-up request fits max_seq_len={engine.config.max_seq_len}"
        logger.warning(f"warm-up: skipped ({report.skipped}); the first request of each kind waits for its builds")
        return report
    compile_watch.install()
    builds, build_s = compile_watch.count, compile_watch.seconds
    t0 = time.perf_counter()
    vocab = engine.vocab_size
    new = _new_tokens(engine)
    free_slots, free_pages = engine.slots.num_free, engine.pages.num_free
    # With a speculation gate or max_concurrency the served traffic may also decode target-only: that decode's
    # admissions are warmed too (with max_concurrency the speculative rounds wider than it switch between the two
    # decodes, as served). The warm-up's own schedulers run without a gate: its requests' acceptance (random
    # prompts) says nothing of the served traffic's, and its verdict would only be a misleading log line.
    switches = speculation_gate(engine, mode) is not None or speculation_max_concurrency(engine, mode) is not None
    modes = [mode] + (["target_only"] if switches else [])
    for (kind, rows, length, extra), run_mode in [(r, m) for m in modes for r in rounds]:
        scheduler = Scheduler(engine, mode=run_mode, overlap=overlap)
        scheduler.gate = None
        queue = [(i, Request([(report.requests + i) * 7919 % vocab] + [(j * 104729 + i * 31 + 13) % vocab
                                                                         for j in range(length - 1)],
                             max_new_tokens=new, ignore_eos=True, sampling=WARMUP_SAMPLING[kind], **extra))
                 for i in range(rows)]
        report.requests += rows
        report.rounds += 1
        while queue or scheduler.num_active:
            n = scheduler.admissible(r for _, r in queue)
            admit, queue = queue[:n], queue[n:]
            if not admit and not scheduler.num_active:
                logger.warning(f"warm-up: a {kind} request of {length} prompt tokens fits no idle engine (its pages "
                               f"exceed the cache): the rest of its round skipped")
                report.skipped_requests += len(queue)
                break
            events, _ = scheduler.apply(StepPlan(admit=admit))
            for e in events:
                if e.finish_reason == "error":
                    report.failed += 1
                    logger.error(f"warm-up: a {kind} request ({rows} rows, {length} prompt tokens) failed: {e.error} "
                                 f"(a client's request of this kind would fail alike)")
    if (engine.slots.num_free, engine.pages.num_free) != (free_slots, free_pages):
        raise RuntimeError(f"warm-up: slots / pages free {engine.slots.num_free} / {engine.pages.num_free} after, "
                           f"{free_slots} / {free_pages} before (a leak)")
    report.seconds = time.perf_counter() - t0
    report.builds, report.build_seconds = compile_watch.count - builds, compile_watch.seconds - build_s
    logger.info(f"warm-up: {report.requests} requests in {report.rounds} rounds ({'/'.join(modes)}; "
                f"{', '.join(WARMUP_SAMPLING)}; "
                f"{'/'.join(map(str, sorted({r for _, r, _, _ in rounds})))} rows) in "
                f"{report.seconds:.1f} s; Triton built {report.builds} kernel specializations "
                f"({report.build_seconds:.1f} s)" + ("" if compile_watch.installed else " (not counted: no hooks)")
                + (f"; {report.failed} failed" if report.failed else "")
                + (f"; {report.skipped_requests} skipped (no room)" if report.skipped_requests else ""))
    return report
