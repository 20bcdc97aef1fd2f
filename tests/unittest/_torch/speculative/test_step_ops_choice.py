"""Which op table an engine path runs: fused wherever Triton runs (CUDA, or TRITON_INTERPRET=1 -- the test
suite), the stock torch ops on a CPU without the interpreter; one log line says which."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from tensorrt_llm_ext import logger as logger_mod
from tensorrt_llm_ext.speculative import step_ops


@pytest.fixture
def fresh_once(monkeypatch):
    monkeypatch.setattr(logger_mod, "_seen_once", set())


@pytest.mark.parametrize("interpret, path, expected", [
    (False, "speculative", "stock"), (False, "gathered", "stock"), (False, "stock", "stock"),
    (True, "speculative", "fused"), (True, "gathered", "fused"), (True, "stock", "stock"),
])
def test_cpu_op_table_follows_the_interpreter_switch(monkeypatch, caplog, fresh_once, interpret, path, expected):
    monkeypatch.setattr(step_ops, "ENV", dataclasses.replace(step_ops.ENV, triton_interpret=interpret))
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        ops = step_ops.step_ops_for(path, "cpu")
    assert ops is step_ops.OP_TABLES[expected]
    assert step_ops.fused_ops_run_on("cpu") is interpret
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ops:")]
    if path == "stock":
        assert lines == []  # the stock path is asked for by name: nothing was chosen
    else:
        assert len(lines) == 1
        assert ("stock torch ops on cpu" if expected == "stock" else "interpreter") in lines[0]
        step_ops.step_ops_for(path, "cpu")  # logged once per process
        assert len([r for r in caplog.records if r.getMessage().startswith("step ops:")]) == 1
