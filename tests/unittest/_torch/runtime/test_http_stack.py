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
