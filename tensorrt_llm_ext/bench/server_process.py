"""Start ``trtllm-ext serve`` as a child process on a free loopback port (``bench serve`` and the tests), and
the request bodies and small config they send it; and the same server over a stub engine
(:class:`StubScheduler`, ``python -m tensorrt_llm_ext.bench.server_process``: ``bench serve --stub-engine``),
whose steps cost no model time, so that what is measured is the server's own host path per token.

Every wait is bounded: the server must answer ``/health`` within ``start_timeout`` seconds, and
:meth:`ServerProcess.stop` sends SIGTERM, then SIGKILL after ``timeout``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from tensorrt_llm_ext.configs.tiny_model import tiny_model

__all__ = ["SERVE_COMMAND", "SMALL_SERVE_CONFIG", "STUB_SERVE_COMMAND", "ServerFailed", "ServerProcess", "ServerStartError",
           "StubScheduler", "free_port",
           "sample_bodies", "start_server", "stub_server_main"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    """The server exited (``returncode``) or stopped answering (``returncode`` None); ``headline`` is the one
    line for a user, the message adds the log's tail."""

    def __init__(self, headline: str, returncode: int | None, log_tail: str):
        super().__init__(f"{headline}:\n{log_tail}")
        self.headline, self.returncode = headline, returncode


class ServerStartError(ServerFailed):
    """The server exited or never answered /health while starting."""


def _last_line(text: str) -> str:
    """The log's last non-empty line (a refusal names its reason there)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:400] if lines else "(the log is empty)"


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def failure(self, when: str) -> ServerFailed:
        """What to raise when the server stopped answering ``when`` (its exit code, its log's last line)."""
        rc = self.proc.poll()
        log = self.log()
        state = f"exited with {rc}" if rc is not None else "stopped answering"
        return ServerFailed(f"serve {state} {when}: {_last_line(log)} (log: {self.log_path})", rc, log[-4000:])

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        return self.proc.returncode


SERVE_COMMAND = ("-m", "tensorrt_llm_ext.cli", "serve")
STUB_SERVE_COMMAND = ("-m", "tensorrt_llm_ext.bench.server_process")  # the serving stack over a stub engine


def start_server(args: list[str], log_path: str, start_timeout: float = 180.0, env: dict | None = None,
                 host: str = "127.0.0.1", command: tuple[str, ...] = SERVE_COMMAND) -> ServerProcess:
    """``trtllm-ext serve ARGS --host HOST --port <free>`` (``command``: the interpreter's arguments before
    ``ARGS``, :data:`STUB_SERVE_COMMAND` for the stub engine); returns once ``/health`` answers 200."""
    import httpx

    port = free_port(host)
    cmd = [sys.executable, *command, *args, "--host", host, "--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    log.close()
    server = ServerProcess(proc, f"http://{host}:{port}", log_path)
    deadline = time.monotonic() + start_timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = server.log()
                raise ServerStartError(f"serve exited with {proc.returncode} before answering /health: "
                                       f"{_last_line(log)} (log: {log_path})", proc.returncode, log[-4000:])
            try:
                if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    except BaseException:
        server.stop(10)  # Ctrl-C / SIGTERM while it loads: the caller never got the server to stop
        raise
    server.stop(10)
    raise ServerStartError(f"serve did not answer /health within {start_timeout:.0f}s (log: {log_path})", None,
                           server.log()[-4000:])


# A small config for CPU server tests (Triton interpreter): steps of 8 rows take about a second.
SMALL_SERVE_CONFIG = tiny_model(**{"model.target.vocab_size": 516, "max_batch_size": 8, "max_seq_len": 40})


def sample_bodies(n: int, vocab: int, seed: int = 5, max_tokens: tuple[int, int] = (2, 4)) -> list[dict]:
    """``n`` completion bodies: random prompts of 1..8 ids, every other one sampled with its own seed."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = {"prompt": [rng.randrange(vocab) for _ in range(rng.randint(1, 8))],
                "max_tokens": rng.randint(*max_tokens)}
        if i % 2:
            body.update(temperature=0.8, seed=1000 + i)
        out.append(body)
    return out


class StubScheduler:
    """What :class:`~tensorrt_llm_ext.runtime.engine_loop.EngineLoop` drives, without a model: each plan cancels,
    admits (the first token at once, as a prefill would) and runs one step that appends one token to every live
    request, ``step_s`` after the previous step began (a sleep, which releases the interpreter lock as a device
    wait does). Tokens are ``text_ids`` read cyclically from an offset per request, so the detokenizer decodes
    text; requests end at ``max_new_tokens`` (``length``)."""

    def __init__(self, slots: int, text_ids: list[int], step_s: float = 0.0, host_s: float = 0.0):
        self.slots, self.text_ids, self.step_s, self.host_s = slots, list(text_ids), step_s, host_s
        self._live: dict[int, list] = {}  # handle -> [request, tokens out]
        self._next_step = 0.0

    @property
    def num_free_slots(self) -> int:
        return self.slots - len(self._live)

    @property
    def num_active(self) -> int:
        return len(self._live)

    @property
    def kv_cache_usage(self) -> float:
        return len(self._live) / self.slots

    def admissible(self, queue, cancel=()) -> int:
        free = self.num_free_slots + sum(1 for h in cancel if h in self._live)
        return sum(1 for _, _ in zip(range(free), queue))

    def _token(self, handle: int, k: int) -> int:
        return self.text_ids[(handle * 7 + k) % len(self.text_ids)]

    def _emit(self, handle: int, live: list, accepted_len: int | None):
        from tensorrt_llm_ext.runtime.scheduler import Event

        request, n = live
        live[1] = n + 1
        done = n + 1 >= request.max_new_tokens
        if done:
            del self._live[handle]
        return Event(handle, [self._token(handle, n)], "length" if done else None, accepted_len=accepted_len,
                     speculative=accepted_len is not None)

    def apply(self, plan):
        from tensorrt_llm_ext.runtime.scheduler import Event, StepStats

        events, stats = [], StepStats()
        for handle in plan.cancel:
            if self._live.pop(handle, None) is not None:
                events.append(Event(handle, [], "cancelled"))
        for handle, request in plan.admit:
            self._live[handle] = [request, 0]
            stats.prefill_tokens += len(request.prompt_ids)
            events.append(self._emit(handle, self._live[handle], None))
        if plan.run and self._live:
            spin_until = time.perf_counter() + self.host_s
            while time.perf_counter() < spin_until:  # the step's launches: Python that holds the interpreter lock
                pass
            wait = self._next_step - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            t0 = time.perf_counter()
            self._next_step = t0 + self.step_s
            stats.num_rows = len(self._live)
            events.extend(self._emit(h, live, 1) for h, live in list(self._live.items()))
            stats.step_s = time.perf_counter() - t0
        return events, stats


# English text the stub engine's tokens spell (what the detokenizer decodes).
STUB_TEXT = ("The server is one Python process: the engine thread, the event loop and the output threads share the "
             "interpreter lock, and every token of every stream costs host time. A stream's text arrives in pieces, "
             "one or a few characters per token, punctuation, numbers like 3.14 or 2026, and words of any length. ")


def stub_server_main(argv: list[str] | None = None) -> int:
    """``python -m tensorrt_llm_ext.bench.server_process [--tokenizer DIR] [--vocab V] [--slots N] [--step-ms MS]
    --host H --port P``: the real app (:func:`~tensorrt_llm_ext.runtime.server.run_server`: uvicorn, the engine
    loop, output threads, SSE, the tokenizer) over a :class:`StubScheduler`."""
    import argparse

    from tensorrt_llm_ext.runtime.server import EngineLoop, PlanChannel, ServeContext, ServerMetrics, run_server
    from tensorrt_llm_ext.runtime.tokenizer import load_tokenizer

    p = argparse.ArgumentParser(prog="python -m tensorrt_llm_ext.bench.server_process")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded model's)")
    p.add_argument("--vocab", type=int, default=1536, help="the embedded tokenizer's vocabulary")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=0.0, help="the stub step's period (0: as fast as it goes)")
    p.add_argument("--host-ms", type=float, default=0.0,
                   help="interpreter-bound host work per step before its period's wait (the launches of a step)")
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--stream-interval", type=int, default=1, help="serve's stream_interval")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    if args.tokenizer is not None:
        tok = load_tokenizer(args.tokenizer)
        if tok is None:
            p.error(f"--tokenizer {args.tokenizer}: no tokenizer there")
    else:
        from tensorrt_llm_ext.configs.embedded_tokenizer import build_embedded_tokenizer

        tok = build_embedded_tokenizer(args.vocab)
    vocab = max(len(tok), args.vocab if args.tokenizer is None else 0)
    metrics = ServerMetrics(1, model_name="stub", max_model_len=4096)
    loop = EngineLoop(StubScheduler(args.slots, tok.encode(STUB_TEXT, add_special_tokens=False), args.step_ms / 1e3,
                                   args.host_ms / 1e3),
                      PlanChannel(None), metrics, max_queue=args.max_queue, speculative=False,
                      stream_interval=args.stream_interval)
    ctx = ServeContext(loop=loop, model_name="stub", vocab_size=vocab, max_seq_len=4096, tokenizer=tok,
                       speculative=False)
    from tensorrt_llm_ext._env import ENV
    from tensorrt_llm_ext.runtime.gc_pauses import freeze_startup_heap, gc_pauses

    freeze_startup_heap(ENV.serve_gc_freeze)  # as serve does before it is ready
    gc_pauses.install()
    return run_server(ctx, metrics, args.host, args.port, drain_timeout_s=5.0, ready_line="stub server ready")


if __name__ == "__main__":
    sys.exit(stub_server_main())
