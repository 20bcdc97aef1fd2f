"""scripts/profile_serve_loop.py: the kernel attribution of a profiler trace (hand-made trace: each kernel goes to
the host phase whose annotation holds its launching runtime call; the busy time is the union of kernel intervals),
and the script end to end on the CPU (the tiny model: the serving loop runs, the numbers add up)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_serve_loop.py"


def _load():
    spec = importlib.util.spec_from_file_location("profile_serve_loop", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(name, cat, ts, dur, corr=None):
    ev = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if corr is not None:
        ev["args"] = {"correlation": corr}
    return ev


def test_kernels_go_to_the_phase_that_launched_them():
    mod = _load()
    trace = {"traceEvents": [
        _x("plan", "user_annotation", 0, 100), _x("plan", "user_annotation", 100, 100),
        _x("launch_step", "user_annotation", 10, 20), _x("prefill", "user_annotation", 40, 30),
        _x("collect", "user_annotation", 120, 10),
        _x("cudaGraphLaunch", "cuda_runtime", 15, 2, corr=1), _x("cudaLaunchKernel", "cuda_runtime", 50, 2, corr=2),
        _x("cudaMemcpyAsync", "cuda_runtime", 125, 1, corr=3), _x("cudaLaunchKernel", "cuda_runtime", 90, 1, corr=4),
        # the graph's two kernels overlap each other (10 us of union), the prefill's kernel follows
        _x("k_step_a", "kernel", 20, 8, corr=1), _x("k_step_b", "kernel", 24, 6, corr=1),
        _x("k_prefill", "kernel", 60, 30, corr=2), _x("memcpy", "gpu_memcpy", 130, 4, corr=3),
        _x("k_outside", "kernel", 95, 5, corr=4), _x("k_unknown", "kernel", 300, 1, corr=99),
        {"ph": "i", "name": "marker", "ts": 5},
    ]}
    at = mod.attribute(trace)
    assert at["launch_step"] == pytest.approx(0.014)  # 8 + 6 us of kernel time, overlapping or not
    assert at["prefill"] == pytest.approx(0.030)
    assert at["collect"] == pytest.approx(0.004)
    assert at["other"] == pytest.approx(0.006)  # launched outside every phase, and a kernel with no runtime call
    assert at["busy"] == pytest.approx((10 + 30 + 5 + 4 + 1) / 1e3)  # the union: [20, 30), [60, 90), ...
    assert at["wall"] == pytest.approx(0.2)


def test_union_of_intervals():
    mod = _load()
    assert mod.union_ms([]) == 0.0
    assert mod.union_ms([(0, 10), (5, 20), (30, 40), (35, 36)]) == pytest.approx(0.030)


def test_the_loop_runs_on_the_cpu(tmp_path, monkeypatch):
    mod = _load()
    out = tmp_path / "loop.json"
    monkeypatch.setattr(sys, "argv", ["profile_serve_loop.py", "--concurrency", "2", "--requests", "8",
                                      "--max-tokens", "4", "--prompt-len", "6", "--draft-len", "2",
                                      "--warmup-plans", "1", "--window-plans", "2", "--json", str(out),
                                      "--trace", str(tmp_path / "trace.json")])
    assert mod.main() == 0
    res = json.loads(out.read_text())
    prof, bare = res["profiled"], res["bare"]
    assert prof["plans"] == 2 and bare["plans"] == 2
    assert 1 <= prof["steps"] <= prof["plans"] and prof["tokens"] > 0 and bare["tokens"] > 0
    assert prof["wall"] > 0 and len(prof["plan_host_ms"]) == 2 and bare["wall_ms"] > 0
    assert 0 <= bare["read_a_plan_later"] <= bare["admissions"]
    assert (tmp_path / "trace.json").stat().st_size > 0


def test_a_run_too_short_for_the_window_says_so(monkeypatch, capsys):
    mod = _load()
    monkeypatch.setattr(sys, "argv", ["profile_serve_loop.py", "--concurrency", "2", "--requests", "1",
                                      "--max-tokens", "2", "--prompt-len", "4", "--warmup-plans", "50"])
    assert mod.main() == 2
    assert "before the window" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["target_only", "speculative"])
def test_host_only_loop_reports_its_plans(tmp_path, monkeypatch, capsys, mode):
    """--host-only: the step returns its first outputs again and admissions skip the prefill, so the window is
    the loop's host work alone; it runs the window's plans, steps in them, and reports ms a plan."""
    mod = _load()
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", ["profile_serve_loop.py", "--host-only", "--mode", mode, "--concurrency", "4",
                                      "--requests", "40", "--max-tokens", "6", "--prompt-len", "6",
                                      "--warmup-plans", "3", "--window-plans", "8", "--json", str(out)])
    assert mod.main() == 0
    res = json.loads(out.read_text())
    assert res["plans"] == 8 and res["ms_per_plan"] > 0 and res["mode"] == mode
    assert f"host only ({mode}, concurrency 4" in capsys.readouterr().out
