"""Start ``trtllm-ext serve`` as a child process on a free loopback port (``bench serve`` and the tests), and
the request bodies and small config they send it.

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

__all__ = ["SMALL_SERVE_CONFIG", "ServerProcess", "free_port", "sample_bodies", "start_server"]


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
