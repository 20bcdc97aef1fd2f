"""The interpreter's garbage-collector pauses while serving: counted, timed, and made short by freezing the start-up
heap.

CPython's cyclic collector stops the thread that triggers it (and, holding the interpreter lock, every other: the
engine loop and the HTTP threads alike) while it walks a generation's tracked objects. A full (generation-2)
collection walks every long-lived object -- after start-up ~200k of them (torch, Triton, the model's modules, the
captured graphs' bookkeeping): ~50-70 ms on this project's CPU machine for one ``gc.collect()`` -- and the serving
loop's own survivors (requests in flight, their token lists) trigger one now and then: a stall of every stream.

:func:`freeze_startup_heap` (``serve``, once the engine, its graphs and the warm-up are done, before ``/health``
answers) collects once and moves every object alive then into the permanent generation (``gc.freeze``), which no
collection walks again: later full collections walk what serving allocated only. vLLM's engine core freezes its heap
after start-up the same way. ``TLLM_EXT_SERVE_GC_FREEZE=0`` leaves the heap unfrozen (an A/B).

:class:`GcPauses` (``gc.callbacks``) counts the collections and their seconds per generation: ``/metrics``
(``trtllm_ext_gc_pauses_total`` / ``trtllm_ext_gc_pause_seconds_total``, by ``generation``), ``bench serve``'s
``GC ms`` column, ``scripts/profile_serve_loop.py``; a pause of :data:`LONG_PAUSE_S` or more is a warning line.
"""

from __future__ import annotations

import gc
import threading
import time

from tensorrt_llm_ext.logger import logger

__all__ = ["GcPauses", "freeze_startup_heap", "gc_pauses"]

GENERATIONS = 3
# A collection that stops the interpreter longer than this while serving is a warning line (SGLang logs its long
# collections the same way): a stall of every stream, which the log should name as the compile watch names a build.
LONG_PAUSE_S = 0.05


class GcPauses:
    """Per generation, the collections since :meth:`install` (:attr:`counts`) and the seconds they stopped the
    interpreter (:attr:`seconds`), from ``gc.callbacks``' start / stop events."""

    def __init__(self, long_pause_s: float = LONG_PAUSE_S):
        self.counts = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self.long_pause_s = long_pause_s  # a pause at least this long is logged (a warning)
        self.installed = False
        self._lock = threading.Lock()
        self._started: float | None = None

    def install(self) -> None:
        """Start counting (once per process)."""
        if not self.installed:
            gc.callbacks.append(self._callback)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            gc.callbacks.remove(self._callback)
            self.installed = False

    def _callback(self, phase: str, info: dict) -> None:
        # A collection runs on the thread that triggered it, with the interpreter lock held: start and stop pair up.
        if phase == "start":
            self._started = time.perf_counter()
            return
        started, self._started = self._started, None
        if started is None:
            return
        g = min(int(info.get("generation", GENERATIONS - 1)), GENERATIONS - 1)
        paused = time.perf_counter() - started
        with self._lock:
            self.counts[g] += 1
            self.seconds[g] += paused
        if paused >= self.long_pause_s:
            logger.warning(f"gc: a generation-{g} collection stopped every thread for {paused * 1e3:.0f} ms while "
                           f"serving ({info.get('collected', 0)} objects collected)")

    def snapshot(self) -> tuple[list[int], list[float]]:
        """``(counts, seconds)`` per generation, copies."""
        with self._lock:
            return list(self.counts), list(self.seconds)

    def describe_since(self, before: tuple[list[int], list[float]]) -> str:
        """The collections since ``before`` (a :meth:`snapshot`): their counts and milliseconds per generation."""
        counts, seconds = self.snapshot()
        n = [c - b for c, b in zip(counts, before[0])]
        s = [(c - b) * 1e3 for c, b in zip(seconds, before[1])]
        return (f"gen 0/1/2 collections {n[0]} / {n[1]} / {n[2]}, {s[0]:.1f} / {s[1]:.1f} / {s[2]:.1f} ms "
                f"({sum(s):.1f} ms in all)")


gc_pauses = GcPauses()


def freeze_startup_heap(enabled: bool = True) -> int:
    """Collect once, then freeze every object alive (``gc.freeze``): later collections never walk the start-up heap.
    Returns the number of objects frozen (0 when ``enabled`` is False: the heap is left as it is, and a log line says
    so)."""
    if not enabled:
        logger.info("gc: the start-up heap is not frozen (TLLM_EXT_SERVE_GC_FREEZE=0): full collections while "
                    "serving walk it")
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(f"gc: {frozen} start-up objects frozen after one collection ({(time.perf_counter() - t0) * 1e3:.0f} "
                f"ms); collections while serving walk only what serving allocates")
    return frozen
