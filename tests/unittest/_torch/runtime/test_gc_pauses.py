"""The garbage collector's pauses counted per generation, /metrics' series of them, and the start-up heap's freeze
(runtime/gc_pauses.py)."""

import gc

import pytest

from tensorrt_llm_ext.runtime.gc_pauses import GcPauses, freeze_startup_heap


@pytest.fixture
def unfrozen():
    """Each test leaves the process's heap unfrozen, as it found it."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_pauses_counted_per_generation():
    pauses = GcPauses()
    pauses.install()
    try:
        before = pauses.snapshot()
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        counts, seconds = pauses.snapshot()
    finally:
        pauses.uninstall()
    assert counts[0] - before[0][0] >= 1 and counts[2] - before[0][2] == 2
    assert seconds[2] > 0 and all(s >= 0 for s in seconds)
    assert "gen 0/1/2 collections" in pauses.describe_since(before)
    gc.collect(2)  # uninstalled: no longer counted
    assert pauses.snapshot()[0] == counts


def test_freeze_moves_the_heap_out_of_every_collection(unfrozen, caplog):
    """Objects alive at the freeze are never walked again (a full collection's tracked count drops by them); a cycle
    made after it is still collected; switched off, nothing is frozen and a log line says so."""
    import logging

    caplog.set_level(logging.INFO, logger="tensorrt_llm_ext")
    assert freeze_startup_heap(enabled=False) == 0 and gc.get_freeze_count() == 0
    assert "not frozen (TLLM_EXT_SERVE_GC_FREEZE=0)" in caplog.text
    tracked = len(gc.get_objects())
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0.9 * tracked  # the garbage of the first collection is gone
    assert len(gc.get_objects()) < 0.1 * tracked  # what a full collection walks now
    assert f"{frozen} start-up objects frozen" in caplog.text

    class Node:
        pass

    a, b = Node(), Node()
    a.peer, b.peer = b, a  # a cycle: only the collector frees it
    del a, b
    assert gc.collect() >= 2


def test_metrics_series_per_generation(monkeypatch):
    import tensorrt_llm_ext.runtime.gc_pauses as gp
    from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics

    pauses = GcPauses()
    monkeypatch.setattr(gp, "gc_pauses", pauses)
    metrics = ServerMetrics(3, model_name="m")

    def series(name: str, generation: int) -> float:
        line = [ln for ln in metrics.render().decode().splitlines()
                if ln.startswith(f"trtllm_ext_{name}_total{{") and f'generation="{generation}"' in ln]
        assert len(line) == 1 and 'model_name="m"' in line[0]
        return float(line[0].rsplit(" ", 1)[1])

    assert [series("gc_pauses", g) for g in range(3)] == [0, 0, 0]
    pauses.install()
    try:
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert series("gc_pauses", 2) == 1 and series("gc_pause_seconds", 2) > 0


def test_a_long_pause_is_a_warning(caplog):
    """A collection at least ``long_pause_s`` long is a warning naming its generation and length; a shorter one is
    counted without a line."""
    import logging

    caplog.set_level(logging.INFO, logger="tensorrt_llm_ext")
    quiet, loud = GcPauses(long_pause_s=3600.0), GcPauses(long_pause_s=0.0)
    for pauses in (quiet, loud):
        pauses.install()
        try:
            gc.collect(2)
        finally:
            pauses.uninstall()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gc: a generation-2 collection")]
    assert len(lines) == 1 and "stopped every thread for" in lines[0] and "objects collected" in lines[0]
    assert quiet.snapshot()[0][2] == 1 and loud.snapshot()[0][2] == 1
