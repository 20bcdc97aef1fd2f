"""CUDA-graph capture and replay of a decode step, one graph per (batch size, step variant), and the one rule
that decides whether a step replays.

**The replay rule** (:func:`plan_step`, a pure function of the step's needs and what was captured): a step
over ``n`` rows that need variant ``need`` replays the captured graph ``(b, v)`` with the smallest ``b``
that serves ``n`` rows (``b == n``, or with padding the smallest ``b >= n``) and, at that ``b``, the
cheapest captured ``v`` that *covers* ``need`` (:meth:`StepVariant.covers`: computes every row's own
distribution). Without one the step runs eagerly, at ``n`` rows, in the variant it needs, and the runner
says so once per reason in the log. A graph computes the variant it was captured with, whatever its rows
hold at replay: a graph that does not cover the rows is never replayed. Callers never decide; they call
:meth:`CudaGraphRunner.step`.

**Capture.** Per variant of the worker (:attr:`DSparkWorker.step_variants`: default, top-p and
processed+top-p for a sampling worker, default and processed for a greedy-only one), per batch size,
largest first: its warm-up sizes every lazily cached scratch buffer (and the processing's count tables) for
the most rows, and all graphs share one memory pool (the engine's, across its runners). Warm-up and capture
run with every row a dummy (the dummy slot) in the variant forced by :meth:`DSparkWorker.set_rows`, and all
mutable state (KV cache, latent pool, ``ctx_len``, slot tokens) is snapshotted before and restored after, so
capturing never disturbs a request. Each variant's capture is agreed across the TP group: a variant that fails on any rank
is dropped on every rank (its steps run eagerly, logged), the others are kept. Inside a captured step there
is no launcher allocation and no host sync: the rows' slots are read from static buffers that
:meth:`DSparkWorker.set_rows` fills before each replay.

The same runner serves the speculative step (``worker.forward``) and the target-only decode
(``ReferenceDecoder.step``); with graphs off (a CPU, or ``cuda_graph_config: null``) it runs every step
eagerly through the same :meth:`CudaGraphRunner.step`.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from tensorrt_llm_ext.distributed import agree_all
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.speculative.step_variant import StepVariant
from tensorrt_llm_ext.speculative.worker_base import nvtx_range

__all__ = ["CudaGraphRunner", "ReplayPlan", "agree_on_capture", "collector_paused", "graph_capture", "pad_batch_size",
           "plan_step", "warm_up_and_capture"]

WARMUP_STEPS = 2


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was before, after it, on any exit). A collection
    inside a capture can finalize an unreachable ``CUDAGraph`` of an earlier capture; its ``cudaGraphExecDestroy``
    is not permitted while a stream captures, and it invalidates the capture in progress -- "operation failed due to
    a previous error during capture", and after it every later capture of the process is refused ("already
    recording to mempool_id"). torch stopped collecting before each capture (PyTorch 2.9); reference counting
    still frees what it can, and the next collection outside a capture takes the rest."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", pool=None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` with the collector paused (:func:`collector_paused`): every capture
    of the package, its benchmarks and its tests goes through here."""
    with collector_paused(), torch.cuda.graph(graph, pool=pool):
        yield


def warm_up_and_capture(fn: Callable[[], object], pool, label: str):
    """``WARMUP_STEPS`` calls of ``fn`` on a side stream (lazily sized buffers, autotuning and first launches out of
    the graph), then one call captured into a new graph in ``pool`` (None: the graph's own, returned for the next
    capture to share): ``(graph, fn's outputs, pool)``. The caller keeps the state ``fn`` writes restorable."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), nvtx_range(f"{label}.warmup"):
        for _ in range(WARMUP_STEPS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with nvtx_range(f"{label}.capture"), graph_capture(graph, pool=pool):
        outputs = fn()
    return graph, outputs, pool if pool is not None else graph.pool()


def pad_batch_size(n: int, batch_sizes: tuple[int, ...], enable_padding: bool) -> int | None:
    """The captured batch size that serves ``n`` rows: ``n`` itself, else (with padding) the smallest larger
    one; None means run eagerly. ``batch_sizes`` sorted ascending."""
    if n in batch_sizes:
        return n
    if not enable_padding:
        return None
    i = bisect.bisect_left(batch_sizes, n)
    return batch_sizes[i] if i < len(batch_sizes) else None


@dataclass(frozen=True)
class ReplayPlan:
    """How one step runs: ``batch_size`` rows (``num_rows`` live, the rest dummies) in ``variant``, by
    replaying the captured graph ``(batch_size, variant)`` or eagerly (``reason`` says why)."""

    num_rows: int
    batch_size: int
    variant: StepVariant
    replay: bool
    reason: str = ""  # why the step runs eagerly; empty when it replays


def plan_step(num_rows: int, need: StepVariant, captured: Iterable[tuple[int, StepVariant]],
              enable_padding: bool = True) -> ReplayPlan:
    """The replay rule (module docstring): the graph a step over ``num_rows`` rows needing ``need`` replays,
    or the eager plan. ``captured``: the ``(batch size, variant)`` keys of the captured graphs.

    Example::

        >>> from tensorrt_llm_ext.speculative.step_variant import DEFAULT_VARIANT, TOP_P_VARIANT
        >>> plan = plan_step(3, TOP_P_VARIANT, [(4, DEFAULT_VARIANT), (4, TOP_P_VARIANT)])
        >>> plan.batch_size, str(plan.variant), plan.replay
        (4, 'top-p', True)
    """
    if num_rows < 1:
        raise ValueError(f"plan_step: expected at least one row, got {num_rows}")
    captured = set(captured)
    covering = sorted({b for b, v in captured if v.covers(need)})
    b = pad_batch_size(num_rows, tuple(covering), enable_padding)
    if b is not None:
        v = min((v for bb, v in captured if bb == b and v.covers(need)), key=lambda v: v.cost)
        return ReplayPlan(num_rows, b, v, True)
    if not captured:
        why = "no graph captured"
    elif not covering:
        why = f"no captured graph runs the {need} variant"
    elif enable_padding:
        why = f"more rows than the largest graph of a {need}-covering variant ({covering[-1]})"
    else:
        why = f"a batch size without a graph of a {need}-covering variant (padding off; captured {covering})"
    return ReplayPlan(num_rows, num_rows, need, False, why)


def agree_on_capture(mapping: Mapping, capture: Callable[[], None], what: str = "the speculative step") -> bool:
    """Run ``capture`` and agree across the TP group whether every rank succeeded.

    During capture the collectives are only recorded, so a rank whose capture raises does not leave its
    peers waiting; after the vote every rank takes the same path (graphs everywhere, or eager
    everywhere) and logs the same line.
    """
    error = None
    try:
        capture()
    except Exception as e:  # any capture failure becomes an agreed eager fallback, never a lone one
        error = e
    ok = agree_all(mapping, error is None)
    if not ok:
        mine = f"this rank: {type(error).__name__}: {error}" if error is not None else "this rank captured"
        logger.warning(f"CUDA-graph capture of {what} failed on at least one of {mapping.tp_size} ranks ({mine}); "
                       "every rank runs it eagerly")
    return ok


class CudaGraphRunner:
    """Runs every step of one kind (the speculative step, or the target-only decode) of one worker.

    Args:
        worker: the bound :class:`~tensorrt_llm_ext.speculative.dspark_worker.DSparkWorker` whose rows the
            step runs (``step_needs`` / ``set_rows`` / ``step_variants`` / ``state``).
        forward: ``forward(batch_size)`` -> the step's outputs (``worker.forward`` or ``ReferenceDecoder.step``),
            run over the rows prepared by ``set_rows``.
        name: what the step is, for the log (``"the speculative step"``).
        batch_sizes: the graph batch sizes; ``None``: graphs off (every step eager, nothing logged per step).
        enable_padding: pad a step up to the next captured size (else a size not captured runs eagerly).
        pool: a CUDA-graph memory pool handle to capture into (an engine shares one across its runners: their
            steps never run concurrently); None: this runner's first graph starts one.

    Usage: ``runner.capture(mapping)`` once (CUDA), then ``outputs = runner.step(slots)`` per step.
    """

    def __init__(self, worker, forward: Callable[[int], object], *, name: str = "the speculative step",
                 batch_sizes: Iterable[int] | None = None, enable_padding: bool = True, pool=None):
        self.worker = worker
        self.forward = forward
        self.name = name
        self.batch_sizes = None if batch_sizes is None else tuple(sorted(set(int(b) for b in batch_sizes)))
        if self.batch_sizes is not None and (not self.batch_sizes or self.batch_sizes[0] < 1
                                             or self.batch_sizes[-1] > worker.max_batch_size):
            raise ValueError(f"CudaGraphRunner: batch sizes {list(self.batch_sizes)} must be within "
                             f"[1, {worker.max_batch_size}]")
        self.enable_padding = enable_padding
        self.graphs: dict[tuple[int, StepVariant], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = pool
        self.replays: dict[tuple[int, StepVariant], int] = {}  # replays per graph (tests and logs read it)
        self.eager_steps = 0
        self._logged: set[str] = set()

    @property
    def enabled(self) -> bool:
        """Whether graphs are configured for this runner (captured or not)."""
        return self.batch_sizes is not None

    def captured(self, variant: StepVariant | None = None) -> list[int]:
        """The captured batch sizes (of ``variant``, or of any variant)."""
        return sorted({b for b, v in self.graphs if variant is None or v == variant})

    # -- the rule ------------------------------------------------------------------------------------
    def plan(self, slots: list[int]) -> ReplayPlan:
        """How a step over ``slots`` runs (:func:`plan_step` over what this runner captured)."""
        return plan_step(len(slots), self.worker.step_needs(slots), self.graphs, self.enable_padding)

    def step(self, slots: list[int]):
        """One step over ``slots``: prepare the rows in the planned variant, then replay or run eagerly."""
        plan = self.plan(slots)
        self.worker.set_rows(list(slots), plan.batch_size, variant=plan.variant)
        if plan.replay:
            key = (plan.batch_size, plan.variant)
            self.replays[key] = self.replays.get(key, 0) + 1
            return self._replay(key)
        self.eager_steps += 1
        if self.enabled and plan.reason not in self._logged:
            self._logged.add(plan.reason)
            logger.warning(f"{self.name} runs eagerly ({plan.reason}); logged once per reason")
        return self.forward(plan.batch_size)

    def _replay(self, key: tuple[int, StepVariant]):
        graph, outputs = self.graphs[key]
        with nvtx_range(f"cuda_graph.replay.{key[0]}.{key[1]}"):
            graph.replay()
        return outputs

    # -- capture -------------------------------------------------------------------------------------
    def capture(self, mapping: Mapping | None = None) -> bool:
        """Capture every variant at every batch size; each variant's outcome agreed across ``mapping``'s TP
        group (a failed variant is dropped on every rank and its steps run eagerly). True if all captured."""
        if not self.enabled:
            raise ValueError("CudaGraphRunner.capture: graphs are off for this runner (batch_sizes=None)")
        mapping = mapping or Mapping()
        ok = True
        for variant in self.worker.step_variants:
            if not agree_on_capture(mapping, lambda v=variant: self._capture_variant(v),
                                    f"{self.name} ({variant} variant)"):
                for key in [k for k in self.graphs if k[1] == variant]:
                    del self.graphs[key]
                ok = False
        logger.info(f"captured {self.name}: " + "; ".join(
            f"{v} variant at batch sizes {self.captured(v)}" for v in self.worker.step_variants))
        return ok

    def _capture_variant(self, variant: StepVariant) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphRunner: capturing needs CUDA")
        w = self.worker
        # Warm-up rows are all dummies: their K/V and their latents go to the scratch page only (the dummy slot's
        # page table and block offsets hold nothing else; test_steps_over_dummy_rows_write_only_the_scratch_pages),
        # so of the page pools -- the target's K/V and the drafter's latents -- only that page is kept: a pool sized
        # from free memory could not be cloned (the latent pool was, whole, until 2026-12-05).
        pools = [*w.state.kv_cache.tensors(), w.state.latent_pool]
        mutable = [t[:, -1] if any(t is p for p in pools) else t for t in w.state.mutable_tensors()]
        snapshot = [t.clone() for t in mutable]
        try:
            for b in sorted(self.batch_sizes, reverse=True):
                w.set_rows([], b, variant=variant)  # every row a dummy, the variant's code path
                graph, outputs, self.pool = warm_up_and_capture(lambda b=b: self.forward(b), self.pool,
                                                                f"cuda_graph.{b}.{variant}")
                self.graphs[(b, variant)] = (graph, outputs)
            torch.cuda.synchronize()
        finally:
            for t, s in zip(mutable, snapshot):
                t.copy_(s)
            torch.cuda.synchronize()
