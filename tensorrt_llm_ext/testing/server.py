"""Start ``trtllm-ext serve`` as a child process on a free loopback port (tests and ``bench serve``).

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
