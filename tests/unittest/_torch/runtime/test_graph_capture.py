"""Every capture runs with Python's cyclic collector paused: a collection inside a capture that finalizes an
unreachable graph of an earlier capture invalidates the capture in progress (and, after it, every later capture
of the process)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tensorrt_llm_ext.runtime.cuda_graph import collector_paused, warm_up_and_capture

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_collector_is_paused_inside_and_left_as_it_was():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with collector_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()  # restored on an exception too
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller's own pause is kept
    finally:
        gc.enable()


class _Cycle:
    """Holds a graph in a reference cycle: only the cyclic collector frees it."""

    def __init__(self, graph):
        self.graph = graph
        self.me = self


@cuda_only
def test_gpu_no_collection_runs_inside_a_capture():
    """The collector one allocation from due (thresholds 1), an unreachable graph of an earlier capture waiting in
    a cycle, and a captured call that allocates hundreds of containers: collections run during the warm-up calls
    (watched through ``gc.callbacks``) and none while the stream captures. The capture replays the right values,
    and a collection after it frees the old graph."""
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    old, _, _ = warm_up_and_capture(lambda: x * 2, None, "test.old")
    holder = _Cycle(old)
    gone = weakref.ref(holder)
    del old, holder
    starts = {True: 0, False: 0}

    def watch(phase, info):
        if phase == "start":
            starts[torch.cuda.is_current_stream_capturing()] += 1

    def churn():
        for _ in range(500):
            [[], {}]  # noqa: B018 -- container allocations count towards the collector's threshold
        return x + 1

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(watch)
    try:
        graph, out, _ = warm_up_and_capture(churn, None, "test.new")
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*thresholds)
    assert starts[False] > 0 and starts[True] == 0, starts
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((8,), 4.0, device="cuda"))
    gc.collect()
    assert gone() is None
