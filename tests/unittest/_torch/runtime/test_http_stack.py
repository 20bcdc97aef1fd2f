"""The server names the HTTP parser and event loop uvicorn picks, and warns when it falls back to h11 / asyncio's loop
(the serve extra installs httptools and uvloop: ~25 % less server CPU a streamed token)."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from tensorrt_llm_ext.runtime import server


@pytest.mark.parametrize("missing", [(), ("httptools",), ("uvloop",), ("httptools", "uvloop")])
def test_the_http_stack_is_named_and_a_fallback_warns(monkeypatch, caplog, missing):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    if not missing and (real("httptools") is None or real("uvloop") is None):
        pytest.fail("the serve extra's httptools / uvloop are not installed here (requirements-cpu.txt pins them)")
    parser, loop = server.http_stack()
    assert parser == ("h11" if "httptools" in missing else "httptools")
    assert loop == ("asyncio" if "uvloop" in missing else "uvloop")
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        server.log_http_stack()
    (line,) = [r for r in caplog.records if "HTTP parser" in r.getMessage()]
    assert (line.levelno == logging.WARNING) == bool(missing) and parser in line.getMessage()


def test_the_lifespan_loads_anyios_backend_before_the_first_request():
    """A streamed response's task group loads anyio's asyncio backend on first use; the app's lifespan loads it
    before the server listens, so the first request does not pay for the import (a fresh interpreter: the
    server's own imports leave it unloaded, the lifespan loads it)."""
    import subprocess
    import sys

    code = """
import asyncio, sys, types
from tensorrt_llm_ext.runtime.server import OpenAIServer, ServeContext
from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics
server = OpenAIServer(ServeContext(loop=types.SimpleNamespace(), model_name="m", vocab_size=8, max_seq_len=16),
                      ServerMetrics(3, model_name="m"))
before = "anyio._backends._asyncio" in sys.modules
async def start():
    async with server._lifespan(server.app):
        return "anyio._backends._asyncio" in sys.modules
print(before, asyncio.run(start()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]
