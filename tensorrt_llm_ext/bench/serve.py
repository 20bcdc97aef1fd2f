"""``trtllm-ext bench serve``: TTFT, TPOT and throughput of ``trtllm-ext serve`` on loopback, speculative
against the target's own decode (``serve --no-speculation``), greedy and sampled, at several concurrencies --
all in one run.

For each decode (a server child process each, a free 127.0.0.1 port), each sampling setting (greedy, and
``temperature 1, top_p 0.95``) and each ``--concurrency`` value, ``--requests-per-client`` x concurrency
streamed completions of random token-id prompts are sent with that many in flight. Per request: TTFT = request
sent to the first chunk with a token, TPOT = (last token - first token) / (tokens - 1). Throughput = generated
tokens / wall time of the cell; acceptance = the server's acceptance histogram over the cell. Servers are
stopped with SIGTERM (their exit code is printed). Everything is bounded by ``--max-seconds`` per cell.

``--stub-engine``: the server's own host path per output token, on any machine -- the real server process over
a stub engine that costs no model time (:class:`~tensorrt_llm_ext.bench.server_process.StubScheduler`), one
server per ``--tokenizer``; it reports the server process's CPU time per output token.

On a CUDA device both servers capture every decode step in CUDA graphs (the serve default: the speculative
step and the ``--no-speculation`` target-only decode alike), so the speculative gain compares a captured step
with a captured step; ``--no-cuda-graph`` runs both eagerly. On a CPU the model is the small test config (Triton
interpreter) and the defaults are tiny: the numbers only show that the path works. This is a benchmark, not a
test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tensorrt_llm_ext.bench.harness import fmt, print_table, register_benchmark

SAMPLINGS = {"greedy": {"temperature": 0.0}, "T=1 top-p 0.95": {"temperature": 1.0, "top_p": 0.95}}


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="default: 1 2 on a CPU, 1 8 32 on a GPU; 32 with --stub-engine")
    p.add_argument("--requests-per-client", type=int, default=None, help="default: 2 on a CPU or the stub, else 8")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 4 on a CPU, else 128 (the stub too)")
    p.add_argument("--config", default=None, help="server YAML (default: the small CPU config / the embedded one)")
    p.add_argument("--model", default=None, help="checkpoint directory to serve")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--decodes", nargs="+", choices=["speculative", "target_only"],
                   default=["speculative", "target_only"])
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop sending in a cell after this long")
    p.add_argument("--prompt-set", choices=["random", "held_out", "mt_bench", "humaneval"], default="random",
                   help="random token ids, or a prompt set as bench acceptance reads it (a --model with a chat "
                        "tokenizer; docs/real_model.md): held_out = the generated instructions' held-out split, or "
                        "the --prompt-file's")
    p.add_argument("--prompt-file", default=None,
                   help="with --prompt-set held_out / mt_bench / humaneval: bench acceptance's --prompt-file (the "
                        ".jsonl[.gz] of scripts/build_prompt_file.py), so both benchmarks send the same prompts")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every request's prompt starts with the same N token ids (seeded), as a shared system "
                        "prompt does")
    p.add_argument("--prefix-caching", choices=["off", "on", "both"], default="off",
                   help="serve with kv_cache_config.enable_block_reuse off, on, or one server of each per decode "
                        "(the prefix-cache hit rate from the server's counters)")
    p.add_argument("--rounds", type=int, default=1,
                   help="serve every decode's cells this many times, a fresh server each round, in turns (decode A, B, "
                        "A, B, ...): the table's rows per round, then each cell's median and spread over the rounds "
                        "(a machine whose speed drifts between runs shows in the spread, not in one ratio)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="serve both decodes eagerly (default on a CUDA device: both captured, like for like)")
    p.add_argument("--disable-overlap-scheduler", action="store_true",
                   help="serve both decodes with the serial step loop (default: the overlap scheduler)")
    p.add_argument("--stub-engine", action="store_true",
                   help="the server's host path only: the real app (uvicorn, engine loop, output threads, SSE, "
                        "detokenizer) over a stub engine that costs no model time; reports the server process's CPU "
                        "time per output token (runs on a CPU; no model)")
    p.add_argument("--stub-step-ms", type=float, default=0.0,
                   help="--stub-engine: the stub step's period (0: as fast as the server takes tokens)")
    p.add_argument("--stub-host-ms", type=float, default=0.0,
                   help="--stub-engine: Python work per step that holds the interpreter lock (a step's launches), "
                        "inside the step's period")
    p.add_argument("--stub-stream-interval", type=int, default=1,
                   help="--stub-engine: the server's stream_interval (tokens a chunk gathers; 1: a chunk a step)")
    p.add_argument("--tokenizer", nargs="+", default=["embedded"],
                   help="--stub-engine: tokenizers to serve with, one server each: 'embedded' (the embedded "
                        "model's byte-level BPE) or a tokenizer directory (e.g. an imported checkpoint's)")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _one(client, body: dict) -> tuple[float, float, int] | str:
    """Streams one completion: (TTFT s, TPOT s, tokens), or what went wrong (a line for the user)."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return f"error in the stream: {json.dumps(chunk['error'])[:300]}"
            n = sum(len(c.get("token_ids", ())) for c in chunk["choices"])
            if n:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                tokens += n
    if first is None:
        return "the stream ended without a token"
    return first - t0, (last - first) / (tokens - 1) if tokens > 1 else float("nan"), tokens


async def _cell(url: str, bodies: list[dict], concurrency: int, deadline: float):
    """Sends ``bodies`` with ``concurrency`` in flight until ``deadline``: (the results, one line per failed
    request)."""
    import httpx

    queue = list(reversed(bodies))
    out, errors = [], []

    async def client_loop(client):
        while queue and time.monotonic() < deadline:
            body = queue.pop()
            try:
                res = await _one(client, body)
            except httpx.HTTPError as e:
                res = f"{type(e).__name__}: {e}"
            if isinstance(res, str):
                errors.append(res)
            else:
                out.append(res)

    async with httpx.AsyncClient(base_url=url, timeout=max(1.0, deadline - time.monotonic())) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return out, errors


# The server's counters a cell reads before and after (sum / count pairs of its histograms).
SCRAPED = ("acceptance_length", "step_seconds", "step_host_seconds", "prefill_seconds")
# Counters read the same way: the prefix-cache hits and lookups (tokens), the Triton kernel builds while serving.
SCRAPED_COUNTERS = ("prefix_cache_hits", "prefix_cache_queries", "kernel_builds_while_serving")


def _scrape(url: str) -> dict[str, float]:
    """``{name_sum, name_count}`` of :data:`SCRAPED` and ``{name}`` of :data:`SCRAPED_COUNTERS` from the server's
    /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
               for s in fam.samples]
    m = {s.name: s.value for s in samples}
    out = {f"{n}_{part}": m.get(f"trtllm_ext_{n}_{part}", 0.0) for n in SCRAPED for part in ("sum", "count")}
    out.update({n: m.get(f"trtllm_ext_{n}_total", 0.0) for n in SCRAPED_COUNTERS})
    # the collector's pauses, every generation's series summed
    out["gc_pause_seconds"] = sum(s.value for s in samples if s.name == "trtllm_ext_gc_pause_seconds_total")
    return out


def _mean_delta(before: dict, after: dict, name: str, scale: float = 1.0) -> float:
    """The mean of histogram ``name`` over the observations between two scrapes (NaN without any)."""
    n = after[name + "_count"] - before[name + "_count"]
    return (after[name + "_sum"] - before[name + "_sum"]) / n * scale if n else float("nan")


def _per_step_delta(before: dict, after: dict, name: str, scale: float = 1.0) -> float:
    """Histogram ``name``'s total between two scrapes per engine step in that time (NaN without a step)."""
    steps = after["step_seconds_count"] - before["step_seconds_count"]
    return (after[name + "_sum"] - before[name + "_sum"]) / steps * scale if steps else float("nan")


def _median_ms(seconds: list[float], digits: int) -> str:
    """The median of ``seconds`` in ms, formatted (NaN when empty)."""
    return fmt(statistics.median(seconds) * 1e3 if seconds else float("nan"), digits)


@contextlib.contextmanager
def _exit_code_on_last_row(server, rows: list[list]):
    """Stops ``server`` (SIGTERM, 60 s) when the block ends; when it ends without an error, the exit code goes on
    the last row the server produced."""
    try:
        yield
    except BaseException:
        server.stop(60)  # an error or a signal: no exit code to show, but no server left serving either
        raise
    rows[-1].append(server.stop(60))


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is (a KeyboardInterrupt, so that no ``except Exception`` swallows it)."""

    signum = 15


@contextlib.contextmanager
def _sigterm_unwinds():
    """SIGTERM ends the run the way Ctrl-C does, through every ``finally``: Python's default SIGTERM ends the
    process at once and leaves the servers it started serving their ports."""
    import signal

    def _raise(signum, frame):
        raise _Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread (a test driving run()): the caller owns the signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _blank_exit_codes(rows: list[list], width: int) -> None:
    """The rows before each server's last carry no exit code: a blank cell keeps the table rectangular."""
    for r in rows:
        if len(r) == width:
            r.append("")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads; Linux ``/proc``)."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gc_seconds(url: str) -> float:
    """The server's garbage-collection pause seconds so far (/metrics); NaN where it cannot be read (the column is
    a diagnostic: a server that died mid-cell is reported by the cell's own check)."""
    import httpx

    try:
        return _scrape(url)["gc_pause_seconds"]
    except httpx.HTTPError:
        return float("nan")


def _stub_run(args: argparse.Namespace) -> None:
    """``--stub-engine``: per tokenizer, one stub server; per concurrency, streamed completions; the server
    process's CPU seconds over the cell / the tokens it streamed."""
    from tensorrt_llm_ext.bench.server_process import STUB_SERVE_COMMAND, sample_bodies, start_server

    work = Path(tempfile.mkdtemp(prefix="bench_serve_host_"))
    concurrency = args.concurrency or [32]
    max_tokens = args.max_tokens or 128
    per_client = args.requests_per_client or 2
    rows, empty = [], []
    for tok in args.tokenizer:
        srv_args = ["--slots", str(max(concurrency)), "--step-ms", str(args.stub_step_ms),
                    "--host-ms", str(args.stub_host_ms), "--stream-interval", str(args.stub_stream_interval)] + \
            ([] if tok == "embedded" else ["--tokenizer", tok])
        server = start_server(srv_args, str(work / f"server_{len(rows)}.log"), command=STUB_SERVE_COMMAND)
        with _exit_code_on_last_row(server, rows):
            for conc in concurrency:
                bodies = sample_bodies(conc * per_client, 259, max_tokens=(max_tokens,) * 2)
                gc0 = _gc_seconds(server.url)
                cpu0, t0 = _cpu_seconds(server.proc.pid), time.perf_counter()
                res, errors = asyncio.run(_cell(server.url, bodies, conc, time.monotonic() + args.max_seconds))
                if server.proc.poll() is not None:  # a dead server's failed requests are not a measurement
                    raise server.failure(f"during the cell {tok}, concurrency {conc}")
                wall, cpu = time.perf_counter() - t0, _cpu_seconds(server.proc.pid) - cpu0
                gc_ms = (_gc_seconds(server.url) - gc0) * 1e3
                tokens = sum(r[2] for r in res)
                tpot = [r[1] for r in res if r[1] == r[1]]
                us = cpu / tokens * 1e6 if tokens else float("nan")
                if not res:
                    empty.append(_empty_cell(f"{tok}, concurrency {conc}", errors))
                rows.append([tok, conc, len(bodies), len(res), len(errors),
                             _median_ms([r[0] for r in res], 1),
                             _median_ms(tpot, 2),
                             fmt(tokens / wall, 0), fmt(cpu, 2), fmt(us, 1),
                             fmt(1e6 / us if us else float("nan"), 0),  # the CPU clock ticks in 10 ms
                             fmt(gc_ms, 1)])
    _blank_exit_codes(rows, 12)
    import platform

    notes = [f"stub engine: one token per live request per step, step period {args.stub_step_ms:g} ms "
             f"(0: back to back), stream_interval {args.stub_stream_interval}; {per_client} requests per client of {max_tokens} tokens, random token-id "
             f"prompts, streamed completions (the stub's tokens spell English text); client (httpx) in the bench "
             f"process, server in its own.",
             "server CPU = user + system time of the server process over the cell (all threads); us/token = that "
             "/ output tokens; CPU-bound tok/s = 1e6 / us/token (the server's threads share one interpreter lock, "
             "so about one core is what it gets); GC ms = the server's garbage-collection pauses over the cell (its "
             "start-up heap frozen as serve's, unless TLLM_EXT_SERVE_GC_FREEZE=0).",
             f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()} "
             f"{os.cpu_count()} CPUs"]
    print_table("bench serve --stub-engine: the server's host path per output token",
                ["tokenizer", "concurrency", "requests", "ok", "errors", "TTFT p50 ms", "TPOT p50 ms",
                 "output tok/s", "server CPU s", "server CPU us/token", "CPU-bound tok/s", "GC ms", "exit"], rows,
                notes)
    return _nothing_measured(empty, work)


def _empty_cell(cell: str, errors: list[str]) -> str:
    """One cell that served no request, with the first reason the server gave."""
    return f"{cell}: " + (f"{len(errors)} failed, the first with {errors[0]}" if errors else
                          "no request finished within --max-seconds")


def _nothing_measured(empty: list[str], work: Path) -> int:
    """Exit 1, with a line per cell, when a cell served no request: its row measured nothing (exit 0 said the
    table held numbers); else 0."""
    for cell in empty:
        print(f"error: bench serve: no request served ({cell}); server logs in {work}", file=sys.stderr)
    return 1 if empty else 0


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the sizes and times asked for (None: nothing), before any server starts."""
    import math

    for name, lo, hi in (("concurrency", 1, 4096), ("requests_per_client", 1, 1 << 20), ("max_tokens", 1, 1 << 20),
                         ("shared_prefix", 0, 1 << 20), ("tp", 1, 1024), ("stub_stream_interval", 1, 1 << 20),
                         ("rounds", 1, 100)):
        values = getattr(args, name)
        for v in values if isinstance(values, list) else [values]:
            if v is not None and not lo <= v <= hi:
                return f"--{name.replace('_', '-')} {v}: expected an integer in [{lo}, {hi}]"
    for name in ("stub_step_ms", "stub_host_ms", "max_seconds"):
        v = getattr(args, name)
        if not (math.isfinite(v) and 0 <= v <= 1e6):
            return f"--{name.replace('_', '-')} {v}: expected a finite number in [0, 1e6]"
    if args.prompt_file is not None and args.prompt_set == "random":
        return "--prompt-file: needs --prompt-set held_out, mt_bench or humaneval (random prompts read no file)"
    return None


@register_benchmark("serve", "TTFT / TPOT / throughput of trtllm-ext serve on loopback, speculative vs target-only",
                    _add_args)
def run(args: argparse.Namespace) -> int | None:
    bad = _check_args(args)
    if bad:
        print(f"error: bench serve: {bad}", file=sys.stderr)
        return 2
    from tensorrt_llm_ext.bench.server_process import ServerFailed
    from tensorrt_llm_ext.runtime.config import ConfigError

    try:
        with _sigterm_unwinds():
            return _stub_run(args) if args.stub_engine else _model_run(args)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: the servers are stopped by now; a line, not a traceback
        signum = getattr(e, "signum", 2)
        print(f"error: bench serve: interrupted (signal {signum}); every server it started is stopped",
              file=sys.stderr)
        return 128 + signum
    except ConfigError as e:  # --config / --model: the user's file, named in one line as `serve` names it
        print(f"error: bench serve: {e}", file=sys.stderr)
        return 2
    except ServerFailed as e:  # a server refused its arguments (2), failed to load or died: its reason, its log
        print(f"error: bench serve: {e.headline}", file=sys.stderr)
        return 2 if e.returncode == 2 else 1


def _model_run(args: argparse.Namespace) -> int | None:
    import httpx

    cpu = not torch.cuda.is_available()
    args.concurrency = args.concurrency or ([1, 2] if cpu else [1, 8, 32])
    args.requests_per_client = args.requests_per_client or (2 if cpu else 8)
    args.max_tokens = args.max_tokens or (4 if cpu else 128)
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.bench.server_process import SMALL_SERVE_CONFIG, sample_bodies, start_server

    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    cfg_path = args.config
    if cfg_path is None and args.model is None and not torch.cuda.is_available():
        cfg_path = str(work / "small.yaml")
        Path(cfg_path).write_text(json.dumps(load_config(**SMALL_SERVE_CONFIG).model_dump(mode="json",
                                                                                         exclude_unset=True)))
    cfg = load_config(cfg_path, model_dir=args.model)
    limit = cfg.max_seq_len - args.max_tokens
    if limit < 1:  # every request would be refused (prompt + max_tokens past the model): say so before any server
        print(f"error: bench serve: --max-tokens {args.max_tokens}: expected at most max_seq_len - 1 = "
              f"{cfg.max_seq_len - 1} (a prompt needs a token)", file=sys.stderr)
        return 2
    most = max(args.concurrency) * args.requests_per_client
    srv_args = ([args.model] if args.model else []) + (["--config", cfg_path] if cfg_path else []) + \
        ["--tp", str(args.tp), "--max-queue", str(max(1024, most))] + \
        (["--no-cuda-graph"] if args.no_cuda_graph else []) + \
        (["--disable-overlap-scheduler"] if args.disable_overlap_scheduler else [])
    graphs = torch.cuda.is_available() and not args.no_cuda_graph and cfg.cuda_graph_config is not None
    set_ids = None  # the prompt set's token ids, cycled over the requests
    if args.prompt_set == "held_out" and args.prompt_file is None:
        from tensorrt_llm_ext.training.prompts import prompt_token_ids

        set_ids = prompt_token_ids(args.model, "held_out", min(most, 320), cfg.model.target.vocab_size)
    elif args.prompt_set != "random":
        from tensorrt_llm_ext.bench.acceptance import prompt_set_ids

        try:
            set_ids = prompt_set_ids(args.model, cfg.model.target.vocab_size, args.prompt_set,
                                      prompt_file=args.prompt_file, num_prompts=min(most, 320),
                                      max_prompt_tokens=max(1, limit), limit_flag="max_seq_len - --max-tokens")
        except (OSError, ValueError) as e:
            print(f"error: bench serve: --prompt-set {args.prompt_set}: {str(e).strip().splitlines()[0]}",
                  file=sys.stderr)
            return 2
    rows = []
    caching = {"off": [False], "on": [True], "both": [False, True]}[args.prefix_caching]
    import random

    shared = [random.Random(11).randrange(cfg.model.target.vocab_size) for _ in range(args.shared_prefix)]
    empty = []
    rounds: dict[tuple, list[tuple[float, float]]] = {}  # a cell's (TPOT p50 ms, output tok/s) per round
    for rnd, decode, reuse in ((k, d, r) for k in range(args.rounds) for d in args.decodes for r in caching):
        label = decode if args.rounds == 1 else f"{decode} r{rnd + 1}"
        server = start_server(srv_args + (["--no-speculation"] if decode == "target_only" else []) +
                              (["--enable-prefix-caching"] if reuse else []),
                              str(work / f"server_{decode}_{'reuse' if reuse else 'whole'}_{rnd}.log"))
        with _exit_code_on_last_row(server, rows):
            for name, sampling in SAMPLINGS.items():
                for conc in args.concurrency:
                    n = conc * args.requests_per_client
                    bodies = sample_bodies(n, cfg.model.target.vocab_size, max_tokens=(args.max_tokens,) * 2)
                    if set_ids is not None:
                        for b, p in zip(bodies, set_ids * (n // len(set_ids) + 1)):
                            b["prompt"] = p
                    for i, b in enumerate(bodies):
                        b.update(prompt=(shared + b["prompt"])[:max(1, limit)], seed=i, **sampling)
                    try:
                        m0 = _scrape(server.url)
                        t0 = time.perf_counter()
                        res, errors = asyncio.run(_cell(server.url, bodies, conc,
                                                        time.monotonic() + args.max_seconds))
                        wall = time.perf_counter() - t0
                        m1 = _scrape(server.url)
                    except httpx.HTTPError:  # the server died (OOM killer, a crash): its exit and its log's reason
                        raise server.failure(f"during the cell {decode}, {name}, concurrency {conc}") from None
                    tokens = sum(r[2] for r in res)
                    ttft = [r[0] for r in res]
                    tpot = [r[1] for r in res if r[1] == r[1]]
                    looked_up = m1["prefix_cache_queries"] - m0["prefix_cache_queries"]
                    hit = (m1["prefix_cache_hits"] - m0["prefix_cache_hits"]) / looked_up if looked_up else 0.0
                    if not res:
                        empty.append(_empty_cell(f"{label}, {name}, concurrency {conc}", errors))
                    cache = f"on ({hit:.0%} hit)" if reuse else "off"
                    rounds.setdefault((decode, name, "on" if reuse else "off", conc), []).append(
                        (statistics.median(tpot) * 1e3 if tpot else float("nan"), tokens / wall))
                    rows.append([label, name, cache, conc, n, len(res),
                                 len(errors),
                                 _median_ms(ttft, 1),
                                 fmt(_pct(ttft, 0.99) * 1e3, 1),
                                 _median_ms(tpot, 2),
                                 fmt(tokens / wall, 1), fmt(len(res) / wall, 2),
                                 fmt(_mean_delta(m0, m1, "acceptance_length"), 2),
                                 fmt(_mean_delta(m0, m1, "step_seconds", 1e3), 3),
                                 fmt(_mean_delta(m0, m1, "step_host_seconds", 1e3), 3),
                                 fmt(_per_step_delta(m0, m1, "prefill_seconds", 1e3), 3),
                                 int(m1["kernel_builds_while_serving"] - m0["kernel_builds_while_serving"]),
                                 fmt((m1["gc_pause_seconds"] - m0["gc_pause_seconds"]) * 1e3, 1)])
    _blank_exit_codes(rows, 18)
    notes = [f"tp={args.tp}, max_batch_size={cfg.max_batch_size}, K={cfg.draft_len}, max_tokens={args.max_tokens}, "
             f"{args.requests_per_client} requests per client, {args.prompt_set} prompts"
             + (f" of {args.prompt_file}" if args.prompt_file else "")
             + (f" after one shared prefix of {args.shared_prefix} token ids" if args.shared_prefix else "") +
             "; streamed completions; prefix cache = kv_cache_config.enable_block_reuse (hit = cached prompt tokens "
             "over prompt tokens looked up, from the server's counters); "
             "TTFT = request sent to its "
             "first token, TPOT = time per output token after the first; target_only = serve --no-speculation; "
             "a server's exit code after SIGTERM on its last row; step ms = the engine's mean step (launch to tokens "
             "on the host), host ms/step = the mean host time between back-to-back steps, prefill ms/step = the "
             "admissions' prefill time (launch to first tokens) over the steps of the cell (server metrics); kernel "
             "builds = Triton kernel builds in the server while the cell ran (each stalled a plan: 0 once the start-up "
             "warm-up covers the traffic); GC ms = the server's Python garbage-collection pauses while the cell ran "
             "(every thread stopped; the start-up heap is frozen unless TLLM_EXT_SERVE_GC_FREEZE=0).",
             "CUDA graphs: " + (f"on for both decodes (batch sizes {list(cfg.graph_batch_sizes())})" if graphs
                                else "off (every step eager)"),
             "overlap scheduler: " + ("off (serial loop: host ms/step runs while the device idles)"
                                      if args.disable_overlap_scheduler else
                                      "on (host ms/step runs while the device runs the next step; step ms = the "
                                      "engine thread's wait on the device per step)")]
    if not torch.cuda.is_available():
        from tensorrt_llm_ext._env import ENV

        notes.append("On a CPU: " + ("the Triton interpreter" if ENV.triton_interpret else
                                     "the stock torch ops") + (f", {args.model}" if args.model else ", the small "
                                     "config") + ": the numbers compare rows of this run, not a GPU's speed.")
    print_table("bench serve: TTFT / TPOT / throughput on loopback",
                ["decode", "sampling", "prefix cache", "concurrency", "requests", "ok", "errors", "TTFT p50 ms",
                 "TTFT p99 ms", "TPOT p50 ms", "output tok/s", "req/s", "mean acceptance", "step ms",
                 "host ms/step", "prefill ms/step", "kernel builds", "GC ms", "exit"], rows, notes)
    if args.rounds > 1:
        print_table(f"bench serve: each cell over {args.rounds} rounds",
                    ["decode", "sampling", "prefix cache", "concurrency", "TPOT p50 ms: median", "min", "max",
                     "max / min", "output tok/s: median", "min", "max"], _round_rows(rounds),
                    ["every round a fresh server per decode, the decodes in turns; the TPOT p50 and output tok/s of "
                     "the table above, per cell"])
    return _nothing_measured(empty, work)


def _round_rows(rounds: dict[tuple, list[tuple[float, float]]]) -> list[list]:
    """Per cell, the median / min / max over its rounds of its TPOT p50 and output tokens/s (the spread of TPOT as
    max / min: how far one round's ratio between decodes can be from another's)."""
    rows = []
    for (decode, name, cache, conc), vals in rounds.items():
        tpot = [t for t, _ in vals if t == t]
        rate = [r for _, r in vals]
        row = [decode, name, cache, conc]
        row += ([fmt(statistics.median(tpot), 2), fmt(min(tpot), 2), fmt(max(tpot), 2),
                 fmt(max(tpot) / min(tpot), 2) if min(tpot) > 0 else "-"] if tpot else ["-"] * 4)
        row += [fmt(statistics.median(rate), 1), fmt(min(rate), 1), fmt(max(rate), 1)]
        rows.append(row)
    return rows
