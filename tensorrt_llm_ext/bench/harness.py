"""Benchmark harness: CUDA-graph replay timing, the measured bandwidth floor, tables.

Benchmarks are CLIs that print tables, never timed tests. On CUDA every variant is captured into CUDA
graphs (one per rotated input set, so the 60 MiB L2 of an H200 does not serve the data) and replayed
round-robin; the time is the median over repetitions of the mean replay time. On CPU the harness runs
each variant once at a smoke size and says that timings are meaningless.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

L2_BYTES = 60 * 2**20  # H200


@dataclass(frozen=True)
class Benchmark:
    name: str
    help: str
    run: Callable[[argparse.Namespace], None]
    add_args: Callable[[argparse.ArgumentParser], None] | None = None


REGISTRY: dict[str, Benchmark] = {}

# Every table printed in this process, for `bench --json/--csv` (title, headers, rows, notes, environment).
TABLES: list[dict] = []


# The Markdown text of every table in TABLES (same order), for ``bench --out``.
_MARKDOWN: list[str] = []


def _file_size(path: str) -> int:
    import os

    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _appending_out(fn: Callable[[argparse.Namespace], object]) -> Callable[[argparse.Namespace], object]:
    """``fn`` whose tables also go to ``--out`` (every benchmark takes the flag): appended when the run returns,
    unless the benchmark appended them itself (the file grew) -- half of them did not, and ``--out`` was a file
    left empty."""
    import functools

    @functools.wraps(fn)
    def run(args: argparse.Namespace):
        out = getattr(args, "out", None)
        first, size = len(_MARKDOWN), _file_size(out) if out else -1
        rc = fn(args)
        if out and _MARKDOWN[first:] and _file_size(out) == size:
            with open(out, "a") as f:
                f.write("\n".join(_MARKDOWN[first:]) + "\n")
        return rc

    return run


def register_benchmark(name: str, help: str, add_args: Callable[[argparse.ArgumentParser], None] | None = None):
    """Decorator: register ``fn(args)`` as ``trtllm-ext bench <name>`` (its tables appended to ``--out``)."""

    def deco(fn):
        REGISTRY[name] = Benchmark(name=name, help=help, run=_appending_out(fn), add_args=add_args)
        return fn

    return deco


def load_benchmark(name: str) -> Benchmark:
    from importlib import import_module

    from tensorrt_llm_ext.bench import BENCHMARK_MODULES

    if name not in BENCHMARK_MODULES:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(sorted(BENCHMARK_MODULES))}")
    import_module(BENCHMARK_MODULES[name])
    if name not in REGISTRY:
        raise RuntimeError(f"module {BENCHMARK_MODULES[name]} did not register benchmark {name!r}")
    return REGISTRY[name]


def rotation_count(bytes_per_set: int, min_sets: int = 2, max_sets: int = 64) -> int:
    """How many input sets to rotate so their total is at least 3x the L2."""
    need = -(-3 * L2_BYTES // max(1, bytes_per_set))
    return int(max(min_sets, min(max_sets, need)))


class BenchTimer:
    """Times callables under CUDA-graph replay (CUDA) or marks a CPU smoke run.

    ``fns`` is one zero-argument callable per rotated input set; each must be graph-capturable (no
    allocation that escapes, no host sync). Returns microseconds per call (median over ``reps``).
    """

    def __init__(self, device: torch.device | str | None = None, reps: int = 15, calls_per_rep: int = 20):
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.reps = reps
        self.calls_per_rep = calls_per_rep

    @property
    def smoke(self) -> bool:
        return self.device.type != "cuda"

    def time_graph(self, fns: list[Callable[[], object]], min_calls_per_graph: int = 16) -> float:
        """Median microseconds per call of ``fns`` (round-robin) under CUDA-graph replay.

        One graph holds at least ``min_calls_per_graph`` calls (the rotated input sets back to back), so
        the few microseconds of ``cudaGraphLaunch`` are amortised and a tiny kernel is timed as it runs
        inside a captured decode step, not as a lone graph launch.
        """
        if self.smoke:
            for fn in fns[:1]:
                fn()
            return float("nan")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in fns:  # warm-up: compile kernels, pick cuBLAS algorithms
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        repeats = max(1, -(-min_calls_per_graph // len(fns)))
        calls = repeats * len(fns)
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            for _ in range(repeats):
                for fn in fns:
                    fn()
        return self._time(lambda i: graph.replay(), calls_per_item=calls)

    def time_eager(self, fns: list[Callable[[], object]]) -> float:
        if self.smoke:
            for fn in fns[:1]:
                fn()
            return float("nan")
        for fn in fns:
            fn()
        return self._time(lambda i: fns[i % len(fns)]())

    def _time(self, call: Callable[[int], object], calls_per_item: int = 1) -> float:
        for i in range(self.calls_per_rep):
            call(i)
        torch.cuda.synchronize()
        samples = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(self.calls_per_rep):
                call(i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / (self.calls_per_rep * calls_per_item))
        return statistics.median(samples)


_BANDWIDTH_CACHE: dict[str, float] = {}


def measure_copy_bandwidth(device: torch.device | str | None = None, nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (NaN on CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        return float("nan")
    if str(dev) in _BANDWIDTH_CACHE:
        return _BANDWIDTH_CACHE[str(dev)]
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    timer = BenchTimer(dev, reps=10, calls_per_rep=5)
    us = timer.time_eager([lambda: dst.copy_(src)])
    bw = nbytes / (us * 1e-6)
    _BANDWIDTH_CACHE[str(dev)] = bw
    return bw


def floor_us(bytes_moved: int, bandwidth: float) -> float:
    """Time to move ``bytes_moved`` at ``bandwidth`` bytes/s, in microseconds."""
    return bytes_moved / bandwidth * 1e6


def fmt(x: float, digits: int = 1) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def first_line(e: BaseException) -> str:
    """An exception as a benchmark's one-line error: its message's first line, else its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def environment_line() -> str:
    import datetime

    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke: timings meaningless)"
    return (f"{datetime.date.today().isoformat()} | {gpu} | torch {torch.__version__} | triton {triton.__version__} "
            f"| python {sys.version.split()[0]}")


def print_table(title: str, headers: list[str], rows: list[list[object]], notes: list[str] | None = None) -> str:
    """Print a Markdown table (readable in a terminal, pasteable into docs) and return its text."""
    lines = [f"### {title}", "", environment_line(), ""]
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    lines.append("| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        lines.append("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    for n in notes or []:
        lines.append(f"\n{n}")
    text = "\n".join(lines) + "\n"
    TABLES.append({"title": title, "environment": lines[2], "headers": [str(h) for h in headers],
                   "rows": [[c if isinstance(c, (int, float)) else str(c) for c in r] for r in rows],
                   "notes": list(notes or [])})
    _MARKDOWN.append(text)
    print(text, flush=True)
    return text


def write_tables(json_path: str | None, csv_path: str | None) -> None:
    """Write every table of this run as JSON (a list of tables) and/or CSV (one row per table row, the
    table's title in the first column)."""
    import csv
    import json

    if json_path:
        with open(json_path, "w") as f:
            json.dump(TABLES, f, indent=1)
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            for t in TABLES:
                w.writerow(["table", *t["headers"]])
                for r in t["rows"]:
                    w.writerow([t["title"], *r])
