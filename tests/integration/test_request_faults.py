"""One request never takes the engine down: sampling fields are checked in fp32 (the engine's precision) where
they enter, and a request-level error raised inside a prefill or a step fails requests, not the scheduler.

Scheduler level (what every rank of a server applies), on a tiny model; the HTTP side is in
``test_serve_faults.py``.
"""

from __future__ import annotations

import dataclasses

import re

import pytest

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import FP32_MAX, MIN_TOP_P, Request, RequestError
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.testing.tiny_models import tiny_model
from tensorrt_llm_ext.testing.requests import make_request

SMALL = tiny_model(**{"model.target.vocab_size": 301, "model.target.capture_layers": [1], "max_batch_size": 3,
                       "max_seq_len": 40, "kv_cache_config.tokens_per_block": 4})


@pytest.fixture(scope="module")
def engine():
    return Engine(load_config(**SMALL))


def _run(sch: Scheduler, admit: list[tuple[int, dict]]) -> dict[int, list]:
    """Admit, then step until nothing is live: every handle's events."""
    out: dict[int, list] = {}
    events, _ = sch.apply(StepPlan(admit=[(h, make_request(**f)) for h, f in admit], run=False))
    while True:
        for e in events:
            out.setdefault(e.handle, []).append(e)
        if not sch.num_active:
            return out
        events, _ = sch.apply(StepPlan())


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def _alone(engine, fields: dict, mode: str = "reference") -> list[int]:
    """The request's tokens served alone; by default the target's own decode, which the speculative tokens
    equal (lossless under strict acceptance) at a fraction of the interpreter's time."""
    evs = _run(Scheduler(engine, mode=mode), [(0, fields)])[0]
    assert evs[-1].finish_reason == "length", evs[-1]
    return _tokens(evs)


def test_fp32_boundary_normalises_top_p_and_refuses_an_overflowing_temperature():
    # 1e-46 is a positive double and 0.0 in fp32: served as the smallest normal fp32 (same kept set).
    assert Request([1], 2, sampling=SamplingParams(top_p=1e-46)).sampling.effective_top_p == MIN_TOP_P
    assert Request([1], 2, sampling=SamplingParams(top_p=1e-300)).sampling.effective_top_p == MIN_TOP_P
    assert Request([1], 2, sampling=SamplingParams(top_p=0.25)).sampling.effective_top_p == 0.25
    Request([1], 2, sampling=SamplingParams(temperature=FP32_MAX, top_p=1e-46)).validate(10, 10)
    with pytest.raises(RequestError, match="temperature: 1e\\+39 overflows fp32"):
        Request([1], 2, sampling=SamplingParams(temperature=1e39)).validate(10, 10)
    # A divisor that is 0 or inf in fp32 (1e39 raised a RuntimeError in the prefill and killed the engine) and
    # a top_k past int64 (an OverflowError there): refused by name.
    for value, got in ((1e39, "inf"), (1e-46, "0")):
        with pytest.raises(RequestError, match=re.escape(f"repetition_penalty: {value!r} is {got} in fp32")):
            Request([1], 2, sampling=SamplingParams(repetition_penalty=value)).validate(10, 10)
    with pytest.raises(RequestError, match="top_k: expected .* below 2\\^63, got 1180591620717411303424"):
        Request([1], 2, sampling=SamplingParams(temperature=1.0, top_k=2**70)).validate(10, 10)
    Request([1], 2, sampling=SamplingParams(temperature=1.0, top_k=2**62, repetition_penalty=1e-30)).validate(10, 10)


def test_underflowing_top_p_is_served_as_the_top_token(engine):
    """top_p 1e-46 (0.0 in fp32: the kernels refuse it) keeps only the most probable token: sampled, its tokens
    equal the greedy ones; a greedy request with it next to a sampled top-p 0.9 request (the repro's
    ``greedy_mixed``, which killed the engine) gets the greedy tokens and the other its tokens alone."""
    greedy = _alone(engine, dict(prompt_ids=[1, 9, 17], max_new_tokens=4))
    assert _alone(engine, dict(prompt_ids=[1, 9, 17], max_new_tokens=4, temperature=1.0, top_p=1e-46, seed=3),
                  mode="speculative") == greedy
    tiny = dict(prompt_ids=[1, 9, 17], max_new_tokens=4, top_p=1e-46)
    other = dict(prompt_ids=[1, 5, 6], max_new_tokens=4, temperature=1.0, top_p=0.9, seed=1)
    both = _run(Scheduler(engine), [(0, tiny), (1, other)])
    assert _tokens(both[0]) == greedy and _tokens(both[1]) == _alone(engine, other)


class _Refusing:
    """An engine whose prefill / step raises ``ValueError`` (a layer below refusing a value) on chosen calls."""

    def __init__(self, engine, *, prefill_prompt=None, step_calls=()):
        self._engine, self._prompt, self._steps, self._n = engine, prefill_prompt, set(step_calls), 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def launch_prefill(self, slots, requests, mode="speculative", starts=None, **kw):
        launched = self._engine.launch_prefill(slots, requests, mode, starts, **kw)  # part way: the slots' state is written
        if any(list(r.prompt_ids) == self._prompt for r in requests):
            raise ValueError("top_p: expected values in (0, 1], got [0.0]")
        return launched

    def run_step(self, slots, mode="speculative"):
        self._n += 1
        out = self._engine.run_step(slots, mode)  # the step ran: the rows' state has advanced
        if self._n in self._steps:
            raise ValueError("top_p: expected values in (0, 1], got [0.0]")
        return out


A = dict(prompt_ids=[3, 4, 5], max_new_tokens=4)
B = dict(prompt_ids=[7] * 9, max_new_tokens=4, temperature=0.7, seed=5)
C = dict(prompt_ids=[250, 1, 2, 9], max_new_tokens=3)
_ALONE: dict[int, list[int]] = {}


def _want(engine, h: int) -> list[int]:
    if h not in _ALONE:
        _ALONE[h] = _alone(engine, (A, B, C)[h])
    return _ALONE[h]


def test_request_refused_in_its_prefill_fails_alone(engine):
    """A prefill that raises ValueError for one request: that request ends with finish_reason error and the
    message, its slot freed; the others of the plan and later requests get their tokens alone."""
    want = {h: _want(engine, h) for h in (0, 2)}
    sch = Scheduler(_Refusing(engine, prefill_prompt=B["prompt_ids"]))
    got = _run(sch, [(0, A), (1, B), (2, C)])
    bad = got[1][-1]
    assert bad.finish_reason == "error" and bad.request_fault and bad.tokens == []
    assert "request 1: refused in its prefill: ValueError: top_p" in bad.error
    assert _tokens(got[0]) == want[0] and _tokens(got[2]) == want[2]
    assert engine.slots.num_free == engine.slots.num_slots and engine.pages.num_free == engine.pages.num_pages
    assert _tokens(_run(sch, [(3, A)])[3]) == want[0]


def test_request_level_error_inside_a_step_fails_its_requests_not_the_engine(engine):
    """A step that raises ValueError (after the rows advanced): every request of that step ends with an error
    (the scheduler survives), slots and pages come back, and later requests equal their runs alone."""
    want = {h: _want(engine, h) for h in (0, 1, 2)}
    sch = Scheduler(_Refusing(engine, step_calls={2}))
    got = _run(sch, [(0, A), (1, B)])
    for h in (0, 1):
        last = got[h][-1]
        assert last.finish_reason == "error" and not last.request_fault  # both valid: neither is blamed
        assert f"request {h}: ended with its step" in last.error and "ValueError: top_p" in last.error
    assert engine.slots.num_free == engine.slots.num_slots and engine.pages.num_free == engine.pages.num_pages
    later = _run(sch, [(5, A), (6, B), (7, C)])
    assert [_tokens(later[h]) for h in (5, 6, 7)] == [want[0], want[1], want[2]]


def test_step_error_names_the_request_that_fails_validation(engine):
    """When a request of the aborted step fails validation (a value that slipped past the boundary), it is
    named as the cause (request_fault) and the others end as bystanders."""
    sch = Scheduler(_Refusing(engine, step_calls={1}))
    events, _ = sch.apply(StepPlan(admit=[(0, make_request(**A)), (1, make_request(**C))], run=False))
    live = sch._live[1].request  # a value a layer below refuses; validation now refuses it too
    live.sampling = dataclasses.replace(live.sampling, top_p=0.0)
    events, _ = sch.apply(StepPlan())
    by = {e.handle: e for e in events}
    assert by[1].request_fault and "top_p: expected a number in (0, 1], got 0.0" in by[1].error
    assert not by[0].request_fault and "aborted by requests [1]" in by[0].error
    assert sch.num_active == 0 and engine.slots.num_free == engine.slots.num_slots


def test_an_engine_fault_still_propagates(engine):
    """Only request-level errors (ValueError) are caught: anything else is the engine's failure."""

    class Broken(_Refusing):
        def run_step(self, slots, mode="speculative"):
            raise RuntimeError("collective timed out")

    sch = Scheduler(Broken(engine))
    sch.apply(StepPlan(admit=[(0, make_request(**A))], run=False))
    with pytest.raises(RuntimeError, match="collective timed out"):
        sch.apply(StepPlan())
    engine._release_all()


class _Raising(_Refusing):
    """An engine whose prefill of prompt B raises ``exc`` (after the slot's state was written)."""

    def __init__(self, engine, exc: Exception):
        super().__init__(engine)
        self._exc = exc

    def launch_prefill(self, slots, requests, mode="speculative", starts=None, **kw):
        launched = self._engine.launch_prefill(slots, requests, mode, starts, **kw)
        if any(list(r.prompt_ids) == B["prompt_ids"] for r in requests):
            raise self._exc
        return launched


@pytest.mark.parametrize("exc", [OverflowError("int too large to convert to float"),
                                 ZeroDivisionError("float division by zero")], ids=["overflow", "zero_division"])
def test_an_arithmetic_error_from_a_request_value_fails_that_request_alone(engine, exc):
    """An ArithmeticError in a prefill comes from computing with the request's values (a top_k past int64 once
    raised OverflowError): the request fails with the message, the engine serves on (was: only ValueError was
    the request's, anything else killed the engine for every client)."""
    sch = Scheduler(_Raising(engine, exc))
    got = _run(sch, [(0, A), (1, B)])
    bad = got[1][-1]
    assert bad.finish_reason == "error" and bad.request_fault and f"{type(exc).__name__}: {exc}" in bad.error
    assert _tokens(got[0]) == _want(engine, 0)
    assert engine.slots.num_free == engine.slots.num_slots and engine.pages.num_free == engine.pages.num_pages


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: an illegal memory access"), MemoryError(),
                                 AssertionError("slot table out of step"), TypeError("bug"), IndexError("bug")],
                         ids=["runtime", "memory", "assertion", "type", "index"])
def test_any_other_exception_is_the_engines_failure(engine, exc):
    """Device faults, out of memory, broken invariants and bugs may leave the engine inconsistent: they
    propagate (the server then answers 503 and exits 3) instead of being pinned on one request."""
    sch = Scheduler(_Raising(engine, exc))
    try:
        with pytest.raises(type(exc)):
            sch.apply(StepPlan(admit=[(1, make_request(**B))], run=False))
    finally:
        engine._release_all()
