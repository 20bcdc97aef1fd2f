"""Triton's first use of a kernel specialization in this process, counted and, once serving, logged.

Triton builds a kernel per specialization -- its constexprs, dtypes, and each integer argument equal to 1 or a
multiple of 16 -- on the first launch that needs it: compiled (about a second on the GPU machine) or loaded from
the disk cache (milliseconds). Graph capture and :mod:`~tensorrt_llm_ext.runtime.warmup` pay for the ones serving
uses before the server says it is ready; one that still happens while serving stalls that plan's requests, so
each is a warning naming the kernel and its specialization (the case the warm-up misses).

Through Triton's ``knobs.runtime.jit_cache_hook`` (before a build) and ``jit_post_compile_hook`` (after); a hook
installed before this one still runs. Under ``TRITON_INTERPRET=1`` nothing is built and nothing is counted.
"""

from __future__ import annotations

import threading
import time

from tensorrt_llm_ext.logger import logger

__all__ = ["CompileWatch", "compile_watch"]


class CompileWatch:
    """Counts Triton's kernel builds (:attr:`count`, :attr:`seconds`); after :meth:`serving`, warns at each and
    counts it apart (:attr:`serving_count`, :attr:`serving_seconds`: ``serve``'s ``/metrics``)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.serving_count = 0  # of those, after serving(): each stalled a plan (/metrics)
        self.serving_seconds = 0.0
        self.installed = False
        self._serving = False
        self._lock = threading.Lock()
        self._started = threading.local()
        self._previous = (None, None)

    def install(self) -> bool:
        """Hook Triton's builds (once per process); False where this Triton has no such hooks."""
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            logger.info("compile watch: this Triton has no build hooks; kernel builds while serving are not logged")
            return False
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self.before_build
        runtime.jit_post_compile_hook = self.after_build
        self.installed = True
        return True

    def serving(self, on: bool = True) -> None:
        """From now on each build is a warning (the server is ready: a build stalls requests)."""
        self._serving = on

    def before_build(self, **kwargs):
        """Triton's ``jit_cache_hook``: a truthy return skips the build, so only the previous hook's answer is
        returned."""
        self._started.t0 = time.perf_counter()
        previous = self._previous[0]
        return previous(**kwargs) if previous is not None else None

    def after_build(self, **kwargs):
        """Triton's ``jit_post_compile_hook``: count the build and its time; warn when serving."""
        t0 = getattr(self._started, "t0", None)
        dt = time.perf_counter() - t0 if t0 is not None else 0.0
        self._started.t0 = None
        with self._lock:
            self.count += 1
            self.seconds += dt
            if self._serving:
                self.serving_count += 1
                self.serving_seconds += dt
        if self._serving:
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or "a kernel"
            logger.warning(f"compile watch: Triton built {name} while serving ({dt * 1e3:.0f} ms; this plan's requests "
                           f"waited for it; the start-up warm-up does not reach this specialization): "
                           f"{specialization(kwargs)}")
        previous = self._previous[1]
        return previous(**kwargs) if previous is not None else None


def specialization(kwargs: dict) -> str:
    """What tells one build of a kernel from another: its launch options, constexpr values and the integer / pointer
    arguments Triton specialized (equal to 1, a multiple of 16, 16-byte aligned), as the hook receives them."""
    build = kwargs.get("compile") or {}
    parts = [str(kwargs.get("repr", ""))]
    for field in ("constants", "configs"):
        if build.get(field):
            parts.append(f"{field} {build[field]}")
    return "; ".join(parts)[:2000]


compile_watch = CompileWatch()  # one per process: Triton's hooks are process-wide
