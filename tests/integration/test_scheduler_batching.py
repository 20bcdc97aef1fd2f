"""The one batching loop (:class:`Scheduler`): a plan's admissions prefilled in batched prefills equal one prefill
per request token for token; with chunked prefill a long prompt's chunks run between the decode steps of the
running requests (their streams go on, a plan carries at most ``max_num_tokens`` prefill tokens) and the tokens
are unchanged; admission waits for pages and every page comes back after many mixed requests.

The engine runs the eager twins of the model's kernels (the same ops; the scheduling under test does not
depend on the op table, and the Triton interpreter is the slow part).
"""

from __future__ import annotations

import random

import pytest

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.speculative.step_ops import STOCK_OPS
from tensorrt_llm_ext.testing.requests import make_request
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 301, "model.target.capture_layers": [1], "max_batch_size": 4,
                       "max_seq_len": 64, "kv_cache_config.tokens_per_block": 4})
MODES = ["speculative", "target_only"]


def _eager_engine(mp, **overrides) -> Engine:
    """An engine on the stock torch op table (its workers are built while ``mp`` holds the patch)."""
    import tensorrt_llm_ext.kernels.rms_norm as rms
    import tensorrt_llm_ext.speculative.step_ops as step_ops

    mp.setattr(rms, "triton_runs_on", lambda t: False)
    mp.setattr(step_ops, "fused_ops_run_on", lambda device: False)
    eng = Engine(load_config(**SMALL, **overrides))
    eng.drafter.set_attention_backend("eager")
    assert eng.worker("speculative").ops is STOCK_OPS
    return eng


@pytest.fixture(scope="module")
def engine():
    with pytest.MonkeyPatch.context() as mp:
        yield _eager_engine(mp)


@pytest.fixture(scope="module")
def small_pool():
    """Cache pages for about two of the longest requests (64 tokens) on four slots."""
    with pytest.MonkeyPatch.context() as mp:
        yield _eager_engine(mp, **{"kv_cache_config.max_tokens": 2 * 80})


class _Recorder:
    """Wraps the engine's prefill entry points: per plan (between steps) the prefill tokens and calls."""

    def __init__(self, engine, mp):
        self.calls: list[tuple[str, int, int]] = []  # (kind, rows, tokens incl. padding)
        real_slots, real_chunk = engine.launch_prefill, engine.prefill_chunk

        def launch_prefill(slots, requests, mode="speculative", starts=None, **kw):
            starts = starts or [0] * len(slots)
            width = max(len(r.prompt_ids) - s for r, s in zip(requests, starts))
            self.calls.append(("prefill", len(slots), len(slots) * width))
            return real_slots(slots, requests, mode, starts, **kw)

        def prefill_chunk(slot, request, start, end, mode="speculative"):
            self.calls.append(("chunk", 1, end - start))
            return real_chunk(slot, request, start, end, mode)

        mp.setattr(engine, "launch_prefill", launch_prefill, raising=False)
        mp.setattr(engine, "prefill_chunk", prefill_chunk, raising=False)

    def take(self) -> list[tuple[str, int, int]]:
        out, self.calls = self.calls, []
        return out


def _prompt(i: int, n: int) -> list[int]:
    return [(11 * i + 5 * j + 2) % 301 for j in range(n)]


def _drive(engine, mode, overlap, arrivals: dict[int, list[tuple[int, dict]]], rec=None, cancel_at=None,
           max_plans: int = 300):
    """Apply plans as a serving loop does: at plan i the requests of ``arrivals[i]`` join the queue, and are
    admitted first come first served while slots and pages are free (:meth:`Scheduler.admissible`).
    ``cancel_at[h] = i``: cancel ``h`` in plan i. Returns (events per handle, per plan the recorder's calls and
    the handles that received tokens)."""
    sch = Scheduler(engine, mode=mode, overlap=overlap)
    queue, events, plans, done = [], {}, [], set()
    total = sum(len(v) for v in arrivals.values())
    for i in range(max_plans):
        queue += [(h, make_request(**f)) for h, f in arrivals.get(i, [])]
        cancel = sorted(h for h, at in (cancel_at or {}).items() if at == i and h not in done)
        n = sch.admissible((r for _, r in queue), cancel)
        admit, queue = queue[:n], queue[n:]
        evs, _ = sch.apply(StepPlan(cancel=cancel, admit=admit))
        got = set()
        for e in evs:
            assert e.handle not in done, e
            events.setdefault(e.handle, []).append(e)
            if e.tokens:
                got.add(e.handle)
            if e.finish_reason is not None:
                done.add(e.handle)
        plans.append((rec.take() if rec else [], got))
        if len(done) == total and not queue:
            assert not sch.num_active and not sch.in_flight
            return events, plans
    raise AssertionError(f"not finished after {max_plans} plans: {sorted(done)}")


def _tokens(evs) -> list[int]:
    return [t for e in evs for t in e.tokens]


REQS = [dict(prompt_ids=_prompt(0, 5), max_new_tokens=6, ignore_eos=True),
        dict(prompt_ids=_prompt(1, 1), max_new_tokens=4, temperature=0.9, seed=3, ignore_eos=True),
        dict(prompt_ids=_prompt(2, 13), max_new_tokens=5, ignore_eos=True),
        dict(prompt_ids=_prompt(3, 8), max_new_tokens=7, temperature=1.0, seed=8, ignore_eos=True),
        dict(prompt_ids=_prompt(4, 3), max_new_tokens=3, temperature=0.7, seed=1, ignore_eos=True)]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_batched_admission_equals_one_by_one(engine, mode, overlap):
    """Five requests (greedy and seeded sampled, ragged prompts) on four slots: one plan admits four, prefilled
    in ONE batched prefill, the fifth later; the tokens equal those of one prefill per request."""
    arrivals = {0: list(enumerate(REQS))}
    with pytest.MonkeyPatch.context() as mp:
        rec = _Recorder(engine, mp)
        batched, plans = _drive(engine, mode, overlap, arrivals, rec)
        assert plans[0][0] == [("prefill", 4, 4 * 13)]
        assert [c for p, _ in plans for c in p if c[1] > 1] == [("prefill", 4, 4 * 13)]
        mp.setattr(engine, "max_num_tokens", 1)  # every batched prefill is one request
        alone, plans = _drive(engine, mode, overlap, arrivals, rec)
        assert [c[:2] for c in plans[0][0]] == [("prefill", 1)] * 4
    for h in range(len(REQS)):
        assert _tokens(batched[h]) == _tokens(alone[h]) and len(_tokens(batched[h])) == REQS[h]["max_new_tokens"], h
        assert batched[h][-1].finish_reason == "length"
    assert engine.slots.num_free == SMALL["max_batch_size"] and engine.pages.num_free == engine.pages.num_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("mode", MODES)
def test_long_prompt_chunks_interleave_with_running_streams(engine, mode, overlap):
    """Chunked prefill, max_num_tokens 8: a 45-token prompt arriving while two requests stream is prefilled in
    chunks across plans; every plan carries at most 8 prefill tokens and the running streams get tokens in the
    plans while it prefills; every request's tokens equal those of the unchunked loop."""
    arrivals = {0: [(0, dict(prompt_ids=_prompt(0, 4), max_new_tokens=40, ignore_eos=True)),
                    (1, dict(prompt_ids=_prompt(1, 6), max_new_tokens=40, temperature=0.8, seed=4, ignore_eos=True))],
                2: [(2, dict(prompt_ids=_prompt(2, 45), max_new_tokens=5, ignore_eos=True)),
                    (3, dict(prompt_ids=_prompt(3, 3), max_new_tokens=4, temperature=1.0, seed=2, ignore_eos=True))]}
    want, _ = _drive(engine, mode, overlap, arrivals)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "chunked_prefill", True)
        mp.setattr(engine, "max_num_tokens", 8)
        rec = _Recorder(engine, mp)
        got, plans = _drive(engine, mode, overlap, arrivals, rec)
    for h in want:
        assert _tokens(got[h]) == _tokens(want[h]), h
    assert all(sum(c[2] for c in calls) <= 8 for calls, _ in plans)
    # The long prompt: chunks in the plans from its arrival until its first token, the streams served meanwhile.
    first = next(i for i, (_, got_h) in enumerate(plans) if 2 in got_h)
    chunks = [c for calls, _ in plans[2:first + 1] for c in calls if c[0] == "chunk"]
    assert len(chunks) >= 5 and all(c[2] <= 8 for c in chunks)
    # Overlapped, a plan that prefills while others decode launches their step first: a request prefilled in plan
    # 1 (stream 1: 4 + 6 prompt tokens do not fit one plan's 8) joins the step launched in plan 2, collected in 3.
    begin = 3 if overlap else 2
    streaming = [got_h for _, got_h in plans[begin:first]]
    assert len(streaming) >= 4 and all({0, 1} <= g for g in streaming), streaming
    assert all(0 in g for _, g in plans[2:first])
    assert engine.slots.num_free == SMALL["max_batch_size"] and engine.pages.num_free == engine.pages.num_pages


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_admission_waits_for_pages_and_nothing_leaks(engine, small_pool, chunked):
    """A pool of about two long requests' pages for four slots, 24 mixed requests arriving over time (some
    cancelled, possibly in their chunked prefill): admission waits for pages (never more held than the pool),
    every request gets the tokens of an engine with pages for every slot, and every slot and page comes back
    with clean tables."""
    rng = random.Random(7)
    reqs = {h: dict(prompt_ids=_prompt(h, rng.randint(1, 40)), max_new_tokens=rng.randint(1, 20), ignore_eos=True,
                    **({"temperature": 0.9, "seed": h} if h % 3 == 0 else {}))
            for h in range(24)}
    arrivals: dict[int, list] = {}
    for h in reqs:
        arrivals.setdefault(rng.randint(0, 30), []).append((h, reqs[h]))
    cancel_at = {5: 8, 11: 20, 17: 25}
    pages = small_pool.pages
    assert pages.num_pages < 4 * max(small_pool.pages_for(make_request(**r)) for r in reqs.values())
    want, _ = _drive(engine, "speculative", False, arrivals)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(small_pool, "chunked_prefill", chunked)
        mp.setattr(small_pool, "max_num_tokens", 16 if chunked else small_pool.max_num_tokens)
        peak = []
        real_allocate = pages.allocate

        def allocate(slot, n, **kw):
            out = real_allocate(slot, n, **kw)
            peak.append(pages.num_used)
            return out

        mp.setattr(pages, "allocate", allocate)
        got, _ = _drive(small_pool, "speculative", True, arrivals, cancel_at=cancel_at)
    assert max(peak) <= pages.num_pages and pages.num_free == pages.num_pages
    assert small_pool.slots.num_free == SMALL["max_batch_size"]
    assert (pages.page_table == pages.num_pages).all() and (pages.encoded_offsets == -1).all()
    for h, r in reqs.items():
        if got[h][-1].finish_reason == "cancelled":
            assert h in cancel_at and _tokens(got[h]) == _tokens(want[h])[:len(_tokens(got[h]))]
            continue
        assert got[h][-1].finish_reason == "length" and _tokens(got[h]) == _tokens(want[h]), h


def test_admissible_is_first_come_first_served_over_slots_and_pages(engine):
    sch = Scheduler(engine, mode="target_only")
    small, big = make_request(prompt_ids=[1, 2], max_new_tokens=2), make_request(prompt_ids=[3] * 40, max_new_tokens=20)
    bad = make_request(prompt_ids=[], max_new_tokens=2)  # takes no pages: its admission reports the error
    assert sch.admissible([small] * 9) == SMALL["max_batch_size"]  # slots bound it
    free = engine.pages.num_free
    n_big = free // engine.pages_for(big)
    assert sch.admissible([big] * 9) == min(n_big, 4)
    assert sch.admissible([bad, small]) == 2
    evs, _ = sch.apply(StepPlan(admit=[(0, big), (1, small)], run=False))
    assert [e.finish_reason for e in evs] == [None, None]
    assert sch.admissible([small] * 9) == 2
    assert sch.admissible([small] * 9, cancel=[0]) == 3  # a cancellation of the same plan frees its slot
    assert sch.free_pages_after([0, 1]) == free
    sch.apply(StepPlan(cancel=[0, 1], run=False))
    assert engine.pages.num_free == free and engine.slots.num_free == SMALL["max_batch_size"]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_request_cancelled_in_its_chunked_prefill_frees_everything(engine, overlap):
    """Cancelled between two chunks of its prompt: no token reaches it, its slot and pages come back, a stream
    running beside it is unaffected, and the slot then serves a new request with the tokens it gets alone."""
    short = dict(prompt_ids=_prompt(5, 4), max_new_tokens=12, ignore_eos=True)
    again = dict(prompt_ids=_prompt(6, 7), max_new_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    want, _ = _drive(engine, "speculative", overlap, {0: [(0, short), (2, again)]})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "chunked_prefill", True)
        mp.setattr(engine, "max_num_tokens", 8)
        rec = _Recorder(engine, mp)
        got, plans = _drive(engine, "speculative", overlap,
                            {0: [(0, short)], 1: [(1, dict(prompt_ids=_prompt(7, 45), max_new_tokens=4))]},
                            rec, cancel_at={1: 3})
        assert [e.finish_reason for e in got[1]] == ["cancelled"] and not _tokens(got[1])
        assert [c[0] for c in plans[1][0] + plans[2][0]] == ["chunk", "chunk"]
        assert engine.slots.num_free == SMALL["max_batch_size"] and engine.pages.num_free == engine.pages.num_pages
        after, _ = _drive(engine, "speculative", overlap, {0: [(2, again)]})
    assert _tokens(got[0]) == _tokens(want[0]) and _tokens(after[2]) == _tokens(want[2])


class _CountedIds(tuple):
    """A stop-id list that counts how often it is read."""

    reads = 0

    def __iter__(self):
        type(self).reads += 1
        return super().__iter__()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_long_stop_list_is_read_once_per_request_not_per_step(engine, overlap):
    """serve takes up to 1024 stop ids per request: the scheduler builds a request's stop set once (was: rebuilt from
    its list for every row of every step, ~57 us per row at 1024 ids on one CPU core -- more host time between
    steps than the step itself at a few hundred rows). The list still ends the request where it should."""
    from tensorrt_llm_ext.runtime.requests import Request

    greedy, _ = _drive(engine, "target_only", overlap, {0: [(0, dict(prompt_ids=_prompt(5, 4), max_new_tokens=20,
                                                                       ignore_eos=True))]})
    want = _tokens(greedy[0])
    stop = want[12]
    ids = _CountedIds(sorted({stop} | set(range(0, 301, 3)) - set(want[:12])))
    _CountedIds.reads = 0
    sch = Scheduler(engine, mode="target_only", overlap=overlap)
    evs, _ = sch.apply(StepPlan(admit=[(0, Request(_prompt(5, 4), 20, stop_token_ids=ids, ignore_eos=True))]))
    got = _tokens(evs)
    while sch.num_active or sch.in_flight:
        evs, _ = sch.apply(StepPlan())
        got += _tokens(evs)
    assert got == want[:want.index(stop) + 1] and evs[-1].finish_reason == "stop"
    assert _CountedIds.reads <= 3, _CountedIds.reads  # admission's validation and the stop set: not per step
    assert engine.slots.num_free == engine.slots.num_slots


class _CountedPrompt(list):
    """A prompt that counts how often it is scanned whole."""

    scans = 0

    def __iter__(self):
        type(self).scans += 1
        return super().__iter__()


def test_a_request_waiting_for_pages_is_not_revalidated_every_plan(small_pool):
    """A request at the head of the queue waits for pages while a slot is free: every plan asks how many requests it
    may admit. Its prompt is validated once while it waits, not once per plan (was: every plan scanned the whole
    prompt twice -- 2.4 ms per plan for a 30k-token prompt on one CPU core, more than a decode step). Admitted once the
    pages are free, it gets the tokens it gets alone."""
    from tensorrt_llm_ext.runtime.requests import Request

    alone, _ = _drive(small_pool, "target_only", False, {0: [(0, dict(prompt_ids=_prompt(6, 20), max_new_tokens=5))]})
    sch = Scheduler(small_pool, mode="target_only")
    holders = [(h, Request(_prompt(h, 4), 56)) for h in (0, 1)]
    sch.apply(StepPlan(admit=holders, run=False))
    waiting = Request(_CountedPrompt(_prompt(6, 20)), 5)
    _CountedPrompt.scans = 0
    for _ in range(10):
        assert sch.num_free_slots and sch.admissible([waiting]) == 0
    assert _CountedPrompt.scans <= 3, _CountedPrompt.scans  # one validation (its types, min and max: C-level passes)
    sch.apply(StepPlan(cancel=[0, 1], run=False))
    assert sch.admissible([waiting]) == 1
    evs, _ = sch.apply(StepPlan(admit=[(2, waiting)]))
    got = _tokens(evs)
    while sch.num_active:
        evs, _ = sch.apply(StepPlan())
        got += _tokens(evs)
    assert got == _tokens(alone[0])
    assert small_pool.slots.num_free == small_pool.slots.num_slots
    assert small_pool.pages.num_free == small_pool.pages.num_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_a_plan_that_reuses_a_handle_in_flight_is_refused_and_changes_nothing(engine, overlap):
    """Events are keyed by handle: a plan admitting a handle still in flight, or one handle twice, is refused before
    anything changes (was: an "error" event for the live handle blaming "no free slot" while a slot was free, then
    the first request's tokens under the same handle). Cancelling a handle and admitting it again in one plan is
    fine; the running request finishes with the tokens it gets alone."""
    from tensorrt_llm_ext.runtime.requests import Request

    alone, _ = _drive(engine, "target_only", overlap, {0: [(0, dict(prompt_ids=_prompt(7, 3), max_new_tokens=6))]})
    sch = Scheduler(engine, mode="target_only", overlap=overlap)
    evs, _ = sch.apply(StepPlan(admit=[(0, Request(_prompt(7, 3), 6))]))
    got = _tokens(evs)
    free = engine.slots.num_free
    for admit in ([(0, Request([9, 9], 4))], [(5, Request([9, 9], 4)), (5, Request([8], 4))]):
        with pytest.raises(ValueError, match=r"handle\(s\) \[\d\] admitted twice or still in flight"):
            sch.apply(StepPlan(admit=admit))
        assert engine.slots.num_free == free and sch.num_active == 1
    while sch.num_active or sch.in_flight:
        evs, _ = sch.apply(StepPlan())
        assert all(e.finish_reason != "error" for e in evs)
        got += _tokens(evs)
    assert got == _tokens(alone[0])
    evs, _ = sch.apply(StepPlan(admit=[(1, Request([9, 9], 4))]))
    evs, _ = sch.apply(StepPlan(cancel=[1], admit=[(1, Request([8], 1))]))  # cancel, then the handle again
    assert [(e.handle, e.finish_reason) for e in evs][:2] == [(1, "cancelled"), (1, "length")]
    assert engine.slots.num_free == engine.slots.num_slots and engine.pages.num_free == engine.pages.num_pages
