"""CUDA-graph capture of the whole speculative step, one graph per batch size.

Capture order is the largest batch size first: its warm-up sizes every lazily cached scratch buffer
(the selection kernel's split scratch) for the most rows, and the graphs share one memory pool. Warm-up
and capture run with every row a dummy (the dummy slot), and all mutable state (KV cache, latent pool,
``ctx_len`` and sampling/slot state) is snapshotted before and restored after, so capturing never
disturbs a request. Inside the captured step there is no launcher allocation and no host sync: the rows'
slots are read from static buffers that :meth:`DSparkWorker.set_rows` fills before each replay.
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch

from tensorrt_llm_ext.distributed import agree_all
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.speculative.worker_base import nvtx_range

WARMUP_STEPS = 2


def pad_batch_size(n: int, batch_sizes: tuple[int, ...], enable_padding: bool) -> int | None:
    """The captured batch size that serves ``n`` rows: ``n`` itself, else (with padding) the smallest larger
    one; None means run eagerly. ``batch_sizes`` sorted ascending."""
    if n in batch_sizes:
        return n
    if not enable_padding:
        return None
    i = bisect.bisect_left(batch_sizes, n)
    return batch_sizes[i] if i < len(batch_sizes) else None


def agree_on_capture(mapping: Mapping, capture: Callable[[], None]) -> bool:
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
        logger.warning(f"CUDA-graph capture failed on at least one of {mapping.tp_size} ranks ({mine}); "
                       "every rank runs the speculative step eagerly")
    return ok


class CudaGraphRunner:
    """Captures ``worker.forward(B)`` for each ``B`` in ``batch_sizes`` and replays it."""

    def __init__(self, worker, batch_sizes, enable_padding: bool = True):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphRunner needs CUDA")
        self.worker = worker
        self.batch_sizes = tuple(sorted(set(int(b) for b in batch_sizes)))
        if not self.batch_sizes or self.batch_sizes[-1] > worker.max_batch_size:
            raise ValueError(f"CudaGraphRunner: batch sizes {self.batch_sizes} must be within "
                             f"[1, {worker.max_batch_size}]")
        self.enable_padding = enable_padding
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict]] = {}
        self.pool = None

    def padded_size(self, n: int) -> int | None:
        """The graph batch size that serves ``n`` rows (padding up), or None to run eagerly."""
        return pad_batch_size(n, self.batch_sizes, self.enable_padding)

    def capture(self) -> None:
        w = self.worker
        mutable = w.state.mutable_tensors()
        snapshot = [t.clone() for t in mutable]
        try:
            for b in sorted(self.batch_sizes, reverse=True):
                w.set_rows([], b)  # every row a dummy
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream), nvtx_range(f"cuda_graph.warmup.{b}"):
                    for _ in range(WARMUP_STEPS):
                        w.forward(b)
                torch.cuda.current_stream().wait_stream(stream)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with nvtx_range(f"cuda_graph.capture.{b}"), torch.cuda.graph(graph, pool=self.pool):
                    outputs = w.forward(b)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[b] = (graph, outputs)
            torch.cuda.synchronize()
        finally:
            for t, s in zip(mutable, snapshot):
                t.copy_(s)
            torch.cuda.synchronize()
        logger.info(f"captured the speculative step for batch sizes {sorted(self.graphs)}")

    def capture_agreed(self, mapping: Mapping) -> bool:
        """:meth:`capture` with an agreed outcome; on failure the graphs are dropped (run eagerly)."""
        ok = agree_on_capture(mapping, self.capture)
        if not ok:
            self.graphs.clear()
        return ok

    def run(self, batch_size: int) -> dict:
        graph, outputs = self.graphs[batch_size]
        with nvtx_range(f"cuda_graph.replay.{batch_size}"):
            graph.replay()
        return outputs
