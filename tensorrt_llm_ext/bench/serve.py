"""``trtllm-ext bench serve``: a bounded load test of ``trtllm-ext serve`` on loopback.

Starts the server as a child process (a free 127.0.0.1 port), sends ``--requests`` completions with
``--concurrency`` in flight (greedy and seeded sampling alternating, random token-id prompts), stops the
server with SIGTERM and prints throughput and latency percentiles. Everything is bounded: the run stops
after ``--max-seconds`` whatever is left. Traffic goes to the loopback address only.

On a CPU the model is the small test config (Triton interpreter): the numbers only show that the path
works. This is a benchmark, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tensorrt_llm_ext.bench.harness import fmt, print_table, register_benchmark


def _add_args(p: argparse.ArgumentParser) -> None:
    cpu = not torch.cuda.is_available()
    p.add_argument("--requests", type=int, default=48 if cpu else 400)
    p.add_argument("--concurrency", type=int, default=8 if cpu else 32)
    p.add_argument("--max-tokens", type=int, default=4 if cpu else 64)
    p.add_argument("--config", default=None, help="server YAML (default: the small CPU config / the embedded one)")
    p.add_argument("--model", default=None, help="checkpoint directory to serve")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-seconds", type=float, default=600.0, help="stop sending after this long")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _load(url: str, bodies: list[dict], concurrency: int, deadline: float) -> tuple[list[float], int, int]:
    import httpx

    latencies, tokens, errors = [], 0, 0
    queue = list(reversed(bodies))

    async def worker(client):
        nonlocal tokens, errors
        while queue and time.monotonic() < deadline:
            body = queue.pop()
            t0 = time.perf_counter()
            try:
                r = await client.post("/v1/completions", json=body)
            except httpx.HTTPError:
                errors += 1
                continue
            if r.status_code != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=max(1.0, deadline - time.monotonic())) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return latencies, tokens, errors


@register_benchmark("serve", "bounded load test of trtllm-ext serve on loopback (throughput, p50/p99 latency)",
                    _add_args)
def run(args: argparse.Namespace) -> None:
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG, sample_bodies, start_server

    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    cfg_path = args.config
    if cfg_path is None and args.model is None and not torch.cuda.is_available():
        cfg_path = str(work / "small.yaml")
        Path(cfg_path).write_text(json.dumps(load_config(**SMALL_SERVE_CONFIG).model_dump(mode="json",
                                                                                         exclude_unset=True)))
    cfg = load_config(cfg_path, model_dir=args.model)
    srv_args = ([args.model] if args.model else []) + (["--config", cfg_path] if cfg_path else []) + \
        ["--tp", str(args.tp), "--max-queue", str(max(1024, args.requests))]
    bodies = sample_bodies(args.requests, cfg.model.target.vocab_size, max_tokens=(args.max_tokens, args.max_tokens))
    limit = cfg.max_seq_len - args.max_tokens
    for b in bodies:
        b["prompt"] = b["prompt"][:max(1, limit)]
    server = start_server(srv_args, str(work / "server.log"))
    try:
        t0 = time.perf_counter()
        lat, tokens, errors = asyncio.run(_load(server.url, bodies, args.concurrency,
                                                time.monotonic() + args.max_seconds))
        wall = time.perf_counter() - t0
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        metrics = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
                   for s in fam.samples}
    finally:
        rc = server.stop(60)
    acc_n = metrics.get("trtllm_ext_acceptance_length_count", 0)
    mean_acc = metrics.get("trtllm_ext_acceptance_length_sum", 0) / acc_n if acc_n else float("nan")
    rows = [[len(bodies), len(lat), errors, args.concurrency, args.max_tokens, fmt(wall, 1), fmt(len(lat) / wall, 2),
             fmt(tokens / wall, 1), fmt(statistics.median(lat) * 1e3 if lat else float("nan"), 0),
             fmt(_pct(lat, 0.99) * 1e3, 0), fmt(mean_acc, 2), rc]]
    notes = [f"tp={args.tp}, max_batch_size={cfg.max_batch_size}, K={cfg.draft_len}; latency = request sent to "
             f"full response; server exit code after SIGTERM in the last column."]
    if not torch.cuda.is_available():
        notes.append("CPU smoke (Triton interpreter, small config): the numbers only show the path works.")
    text = print_table("bench serve: bounded load on loopback",
                       ["requests", "ok", "errors", "concurrency", "max_tokens", "wall s", "req/s", "tok/s",
                        "p50 ms", "p99 ms", "mean acceptance", "exit"], rows, notes)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
