"""Faults of ``trtllm-ext bench`` as a user runs it on a CPU (thirteenth session's fault hunt): signals that
must not leave servers behind, files that are whole or absent, exit codes that say whether anything was
measured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_sigterm_mid_cell_stops_the_server_bench_serve_started():
    # A stand-in server and a cell that receives SIGTERM: the run must unwind and stop the server (Python's
    # default SIGTERM ended the process at once, leaving `trtllm-ext serve` children serving their ports).
    r = _python("""
        import argparse, os, signal, sys
        import tensorrt_llm_ext.bench.serve as bs
        import tensorrt_llm_ext.bench.server_process as sp

        class FakeServer:
            url = "http://127.0.0.1:9"
            class proc:
                pid = os.getpid()
            def stop(self, timeout=60):
                print("server stopped", flush=True)
                return 0

        sp.start_server = lambda *a, **k: FakeServer()
        def cell(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not interrupt the cell")
        bs._cell = cell
        bs.asyncio.run = lambda coro: coro
        args = argparse.Namespace(stub_engine=True, concurrency=[1], requests_per_client=1, max_tokens=2,
                                  shared_prefix=0, tp=1, stub_step_ms=0.0, stub_host_ms=0.0, max_seconds=5.0,
                                  tokenizer=["embedded"], out=None)
        bs.run(args)
    """)
    assert r.returncode == 128 + signal.SIGTERM, (r.returncode, r.stderr[-2000:])
    assert "server stopped" in r.stdout
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
