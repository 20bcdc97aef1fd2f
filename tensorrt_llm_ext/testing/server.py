"""Start ``trtllm-ext serve`` as a child process on a free loopback port (tests and ``bench serve``), or the
same server in this process (:func:`start_in_process`).

Every wait is bounded: the server must answer ``/health`` within ``start_timeout`` seconds, and
:meth:`ServerProcess.stop` sends SIGTERM, then SIGKILL after ``timeout``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tensorrt_llm_ext.testing.tiny_models import tiny_model


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        return self.proc.returncode


def start_server(args: list[str], log_path: str, start_timeout: float = 180.0, env: dict | None = None,
                 host: str = "127.0.0.1") -> ServerProcess:
    """``trtllm-ext serve ARGS --host HOST --port <free>``; returns once ``/health`` answers 200."""
    import httpx

    port = free_port(host)
    cmd = [sys.executable, "-m", "tensorrt_llm_ext.cli", "serve", *args, "--host", host, "--port", str(port)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    log.close()
    server = ServerProcess(proc, f"http://{host}:{port}", log_path)
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before answering:\n{server.log()[-4000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    server.stop(10)
    raise TimeoutError(f"serve did not answer /health within {start_timeout:.0f}s:\n{server.log()[-4000:]}")


# The Triton interpreter is not thread-safe: two engines stepping at once in one process (two in-process
# servers, or a server and a test's reference engine) corrupt each other's launches. Every in-process
# server's step holds this lock, and so must a test's own engine work while a server is alive.
KERNEL_LOCK = threading.RLock()


class _SerialScheduler:
    """A :class:`Scheduler` whose plans run under :data:`KERNEL_LOCK` (what the engine loop calls of it)."""

    def __init__(self, scheduler):
        self._scheduler = scheduler

    @property
    def num_free_slots(self) -> int:
        return self._scheduler.num_free_slots

    @property
    def num_active(self) -> int:
        return self._scheduler.num_active

    def apply(self, plan):
        with KERNEL_LOCK:
            return self._scheduler.apply(plan)


@dataclass
class InProcessServer:
    """A server in this process (uvicorn in a thread over an in-process engine): what tests use where the
    subprocess is not the point (no interpreter start, no model build per test module)."""

    url: str
    engine: object
    loop: object
    uvicorn_server: object
    thread: object

    def stop(self, timeout: float = 30.0) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(timeout)
        self.loop.stop(timeout)


def start_in_process(config_overrides: dict | None = None, *, model_dir: str | None = None, max_queue: int = 1024,
                     start_timeout: float = 60.0, host: str = "127.0.0.1") -> InProcessServer:
    """Engine + scheduler + engine loop + app of ``load_config(model_dir=..., **config_overrides)``, served by
    uvicorn on a free loopback port in a daemon thread; returns once it listens."""
    import uvicorn

    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.scheduler import Scheduler
    from tensorrt_llm_ext.runtime.server import (EngineLoop, PlanChannel, ServeContext, ServerMetrics, create_app,
                                                 load_tokenizer, served_model_name)

    cfg = load_config(model_dir=model_dir, **(config_overrides or {}))
    with KERNEL_LOCK:
        engine = Engine(cfg)
    metrics = ServerMetrics(cfg.draft_len)
    loop = EngineLoop(_SerialScheduler(Scheduler(engine)), PlanChannel(None), metrics, max_queue=max_queue)
    ctx = ServeContext(loop=loop, model_name=served_model_name(cfg, None), vocab_size=engine.vocab_size,
                       max_seq_len=cfg.max_seq_len, tokenizer=load_tokenizer(cfg.tokenizer or cfg.model.path))
    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(create_app(ctx, metrics), host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="on"))
    loop.start()
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            loop.stop(5)
            raise TimeoutError(f"the in-process server did not start within {start_timeout:.0f}s")
        time.sleep(0.02)
    return InProcessServer(f"http://{host}:{port}", engine, loop, server, thread)


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


def reference_outputs(config_overrides: dict, bodies: list[dict]) -> list[list[int]]:
    """What :meth:`Engine.generate` (TP 1, in this process) produces for single-prompt ``bodies``."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.requests import Request

    reqs = [Request(prompt_ids=b["prompt"], max_new_tokens=b["max_tokens"], temperature=b.get("temperature", 0.0),
                    seed=b.get("seed", 0), stop_token_ids=tuple(b.get("stop", ()))) for b in bodies]
    with KERNEL_LOCK:  # an in-process server may be stepping in this process
        results, _ = Engine(load_config(**config_overrides)).generate(reqs)
    return [r.output_ids for r in results]
