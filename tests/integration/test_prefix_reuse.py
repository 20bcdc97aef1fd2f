"""Block reuse (``kv_cache_config.enable_block_reuse``): a prompt's whole cache pages, once prefilled, serve later
prompts that start with the same tokens. The pages' bookkeeping (holders, idle cached pages, eviction, exact
keys) never leaks or hands out a page twice, and requests that reuse a prefix get the tokens of an engine that
prefills every prompt whole: the speculative decode equal to the target's own decode bit for bit, the target-only
decode and the sampled rows equal to the same engine without reuse, chunked prefill included."""

from __future__ import annotations

import random

import pytest

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.kv_cache import PageAllocator
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.testing.tiny_models import tiny_model

PAGE = 4
TINY = {"model.target.num_layers": 1, "model.target.capture_layers": [0], "max_batch_size": 2, "max_seq_len": 48,
        "kv_cache_config.tokens_per_block": PAGE}
SYSTEM = [11, 250, 3, 97, 97, 14, 400, 8, 61, 2, 330, 45, 19]  # 13 tokens: three whole pages and one more
PROMPTS = [SYSTEM + [5, 17], SYSTEM + [300, 42, 7, 9, 31], SYSTEM + [5, 17],  # the same prompt twice
           SYSTEM[:6] + [77, 78, 79, 80], [101, 102], SYSTEM + [5, 17, 6], list(SYSTEM)]


def _check(pages: PageAllocator) -> None:
    """Held pages are counted once per holder; held, idle cached and free pages partition the pool; every key
    names one page; both tables show each slot's pages in order."""
    held = [pg for row in pages._owned.values() for pg in row]
    counts = {pg: held.count(pg) for pg in set(held)}
    assert counts == pages._holders
    idle, free = set(pages._idle), set(pages._free)
    assert len(free) == len(pages._free) and not (idle & free) and not (set(counts) & (idle | free))
    assert len(counts) + len(idle) + len(free) == pages.num_pages
    assert idle <= set(pages._key_of) and not free & set(pages._key_of)
    assert {pg for _, pg in pages._cached.values()} == set(pages._key_of)
    children: dict = {}
    for key in pages._cached:
        children.setdefault(key[0], set()).add(key)
    assert children == pages._children  # partial reuse's index: the cached keys under each parent, no stale one
    assert all(pages._cached[key][1] == pg for pg, key in pages._key_of.items())
    for slot, row in pages._owned.items():
        assert pages.page_table[slot, :len(row)].tolist() == row
        assert pages.encoded_offsets[slot, :len(row)].tolist() == [pg * pages.divisor for pg in row]


def test_page_keys_read_lists_tuples_and_tensors_alike():
    """Page keys are slices of the ids (C speed: validated prompts and the engine's outputs are lists of Python ints);
    a tensor or an array of ids is converted once per call, so every form finds the same pages."""
    import numpy as np
    import torch

    pages = PageAllocator(num_pages=8, num_slots=4, max_pages_per_slot=6, divisor=2, device="cpu", page_size=PAGE,
                          enable_block_reuse=True, enable_partial_reuse=True)
    prompt = list(range(1, 15))
    pages.allocate(0, 5)
    assert pages.register(0, torch.tensor(prompt)) == 3
    first = pages._owned[0][:3]
    for form in (prompt, tuple(prompt), torch.tensor(prompt), np.array(prompt)):
        assert pages.match(form) == first
        assert pages.match_with_partial(form) == (first, None)
        assert pages.admission_cost(form, 4) == 1  # the three cached pages are held by slot 0: one fresh page
    assert pages.register(0, tuple(prompt)) == 0  # the same keys: nothing new


def test_match_register_evict_and_exact_keys():
    pages = PageAllocator(num_pages=8, num_slots=4, max_pages_per_slot=6, divisor=2, device="cpu", page_size=PAGE,
                          enable_block_reuse=True)
    prompt = list(range(1, 15))  # 14 tokens: 3 whole pages before its last token
    assert pages.match(prompt) == []
    pages.allocate(0, 5)
    assert pages.register(0, prompt) == 3 and pages.num_cached == 3
    first = pages._owned[0][:3]
    assert pages.match(prompt) == first and pages.match(prompt[:13]) == first  # 13 tokens: still 3 pages
    assert pages.match(prompt[:12]) == first[:2]  # the last token's page is always prefilled
    assert pages.match(prompt[:5] + [99] * 9) == first[:1]  # diverges inside page 2
    assert pages.match(prompt, root="other") == []  # another root: other contents
    pages.allocate(1, 4, prefix=first[:2])
    assert pages._holders[first[0]] == 2 and pages.num_free == 8 - 7
    assert pages.num_free_after([1]) == 1 + 2 and pages.num_free_after([0]) == 1 + 3
    assert pages.num_free_after([0, 1]) == 8
    pages.free(0)  # its registered pages stay cached: two still held by slot 1, one idle
    _check(pages)
    assert pages.num_free == 8 - 4 and list(pages._idle) == [first[2]]
    pages.free(1)
    _check(pages)
    assert pages.num_free == 8 and pages.num_used == 0 and pages.num_cached == 3
    # Idle cached pages are handed out last, the deepest of a chain first: its parents stay matchable.
    pages.allocate(2, 6)
    assert pages.match(prompt) == first[:2] and pages.num_cached == 2
    taken = pages.allocate(3, 2)  # the last two: the chain's pages are evicted
    assert pages.num_cached == 0 and pages.match(prompt) == [] and pages.num_free == 0
    # A page that held the chain's first page now holds other tokens: the old keys cannot reach it.
    other = [50 + t for t in prompt]
    assert pages.register(3, other) == 2  # slot 3 holds two pages
    pages.free(2)
    pages.free(3)
    assert pages.match(prompt) == [] and pages.match(other) == taken
    assert set(taken) & set(first)  # a page of the old chain, now under the new key
    uncached = next(pg for pg in range(8) if pg not in pages._key_of)
    with pytest.raises(RuntimeError, match="not cached pages"):
        pages.allocate(0, 2, prefix=[uncached])
    assert pages.num_free == 8 and pages.num_cached == 2  # the refused allocation took nothing
    assert pages.prefix_hits == PAGE * (3 + 3 + 2 + 1 + 2 + 2) and pages.prefix_queries > pages.prefix_hits
    _check(pages)


def test_no_leak_after_1000_requests_sharing_prefixes():
    rng = random.Random(0)
    pages = PageAllocator(num_pages=30, num_slots=6, max_pages_per_slot=10, divisor=2, device="cpu", page_size=PAGE,
                          enable_block_reuse=True)
    stems = [[rng.randrange(50) for _ in range(20)] for _ in range(4)]
    live: dict[int, list[int]] = {}
    for i in range(1000):
        free_slots = [s for s in range(6) if s not in live]
        if free_slots and rng.random() < 0.6:
            stem = rng.choice(stems)
            prompt = stem[:rng.randint(1, 20)] + [rng.randrange(50) for _ in range(rng.randint(0, 8))]
            need = min(10, len(prompt) // PAGE + rng.randint(1, 3))
            prefix = pages.match(prompt)[:need]
            pinned_idle = sum(pg in pages._idle for pg in prefix)  # pinning takes them out of the free count
            if need - len(prefix) <= pages.num_free - pinned_idle:
                slot = rng.choice(free_slots)
                got = pages.allocate(slot, need, prefix=prefix)
                assert got[:len(prefix)] == prefix and len(got) == need
                if rng.random() < 0.8:
                    pages.register(slot, prompt)
                live[slot] = prompt
        elif live:
            pages.free(rng.choice(list(live)))
            live = {s: p for s, p in live.items() if s in pages._owned}
        if i % 25 == 0:
            _check(pages)
    for slot in list(live):
        pages.free(slot)
    _check(pages)
    assert pages.num_free == pages.num_pages and pages.num_used == 0 and pages.prefix_hits > 0
    pages.free_all()
    assert pages.num_cached == 0 and pages.match(stems[0]) == []


def _requests(sampled: bool) -> list[Request]:
    return [Request(list(p), max_new_tokens=6,
                    sampling=SamplingParams(temperature=0.8 if sampled and i % 2 else 0.0, seed=i))
            for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("chunked", [False, True])
def test_reused_prefixes_give_the_tokens_of_whole_prefills(chunked):
    """Two slots for seven requests: the later ones find earlier prompts' pages cached (the same prompt, a longer
    one, a shorter one, a partial page) and prefill the rest only."""
    extra = {"enable_chunked_prefill": True, "max_num_tokens": 7} if chunked else {}
    whole = Engine(load_config(**tiny_model(**TINY, **extra)))
    reuse = Engine(load_config(**tiny_model(**TINY, **extra, **{"kv_cache_config.enable_block_reuse": True})))
    assert not whole.pages.enable_block_reuse and reuse.pages.enable_block_reuse
    prefilled = []
    orig = reuse.launch_prefill

    def rows(slots, requests, mode="speculative", starts=None, **kw):
        prefilled.extend(len(r.prompt_ids) - s for r, s in zip(requests, starts))
        return orig(slots, requests, mode, starts, **kw)

    reuse.launch_prefill = rows
    for mode, sampled in (("speculative", False), ("target_only", False), ("speculative", True),
                          ("target_only", True)):
        reqs = _requests(sampled)
        hits = reuse.pages.prefix_hits
        prefilled.clear()
        # greedy speculative: the target's own decode without reuse, which it equals bit for bit
        want, _ = whole.generate(reqs, "reference" if mode == "speculative" and not sampled else mode)
        got, _ = reuse.generate(reqs, mode)
        assert [r.output_ids for r in got] == [r.output_ids for r in want], (mode, sampled)
        assert all(r.finish_reason == "length" for r in got)
        assert reuse.pages.prefix_hits - hits >= 3 * PAGE  # at least the repeated prompt's three pages
        if not chunked:
            assert sum(prefilled) == sum(len(p) for p in PROMPTS) - (reuse.pages.prefix_hits - hits)
        assert reuse.pages.num_used == 0 and reuse.slots.num_free == TINY["max_batch_size"]
        _check(reuse.pages)
    assert reuse.pages.num_cached > 0


def test_target_only_pages_do_not_serve_the_drafter():
    """A target-only prefill stores no drafter latents: a speculative request never reuses its pages."""
    eng = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.enable_block_reuse": True})))
    req = Request(PROMPTS[1], max_new_tokens=4)  # 18 + 4 tokens: 5 whole pages before the last token out
    eng.generate([req], "target_only")
    assert eng.pages.num_cached == 5
    hits = eng.pages.prefix_hits
    eng.generate([req], "speculative")
    assert eng.pages.prefix_hits == hits and eng.pages.num_cached == 10
    eng.generate([req], "target_only")
    assert eng.pages.prefix_hits == hits + 4 * PAGE + 1  # + partial reuse: the 5th page's first token (of 2 left)


def test_scheduler_reports_prefix_hits_and_frees_shared_pages_once():
    eng = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.enable_block_reuse": True})))
    sched = Scheduler(eng, mode="target_only")
    a, b = Request(PROMPTS[0], max_new_tokens=20), Request(PROMPTS[5], max_new_tokens=20)
    _, st = sched.apply(StepPlan(admit=[(0, a)], run=False))
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (len(a.prompt_ids), 0) and st.prefill_tokens == 15
    _, st = sched.apply(StepPlan(admit=[(1, b)], run=False))
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (len(b.prompt_ids), 3 * PAGE)
    assert st.prefill_tokens == len(b.prompt_ids) - 3 * PAGE
    # Cancelling b frees only its own pages; the shared ones stay held by a.
    assert sched.free_pages_after([1]) == eng.pages.num_free + eng.pages.num_held(1) - 3
    sched.apply(StepPlan(cancel=[0, 1], run=False))
    assert eng.pages.num_used == 0 and sched.kv_cache_usage == 0.0
    _check(eng.pages)


def test_serve_metrics_count_prefix_queries_and_hits():
    """The engine loop of ``serve`` over a reuse engine: ``/metrics`` has vLLM's prefix-cache counters (tokens)."""
    from tensorrt_llm_ext.runtime.engine_loop import EngineLoop, PlanChannel, Sink
    from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics

    eng = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.enable_block_reuse": True})))
    metrics = ServerMetrics(eng.draft_len)
    loop = EngineLoop(Scheduler(eng, mode="speculative"), PlanChannel(None), metrics, 16, speculative=True)
    done = []

    class Worker:
        def put(self, pairs):
            done.extend(e.handle for _, e in pairs if e.finish_reason is not None)

    sink = Sink(None, None, None, Worker())
    for prompt in (PROMPTS[0], PROMPTS[5]):  # one after the other: the second finds the first's pages
        loop.submit([Request(prompt, max_new_tokens=3)], sink)
        while loop.scheduler.num_active or loop.state().queued:
            plan = loop._next_plan()
            loop._record(plan, *loop.scheduler.apply(plan))

    def sample(name):
        return metrics.registry.get_sample_value(f"trtllm_ext_{name}_total",
                                                 {"model_name": "dspark-embedded", "engine": "0"})

    assert done == [0, 1]
    assert sample("prefix_cache_queries") == len(PROMPTS[0]) + len(PROMPTS[5])
    # three whole pages, and (partial reuse) the rest of the second prompt before its last token, which the first
    # request's fourth page (its prompt's end and its answer) holds
    hits = 3 * PAGE + len(PROMPTS[5]) - 1 - 3 * PAGE
    assert sample("prefix_cache_hits") == hits
    assert sample("prompt_tokens") == len(PROMPTS[0]) + len(PROMPTS[5]) - hits  # the tokens prefilled


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_reuse_under_graphs_gives_the_tokens_of_whole_prefills():
    """On CUDA, decode steps and prefill buckets captured: reused prefixes give the tokens of whole prefills
    (fp32: another prefill shape rounds far below any logit gap)."""
    cfg = {**TINY, "cuda_graph_config.prefill_max_tokens": 32}
    whole = Engine(load_config(**tiny_model(**cfg)), use_cuda_graph=True)
    reuse = Engine(load_config(**tiny_model(**cfg, **{"kv_cache_config.enable_block_reuse": True})),
                   use_cuda_graph=True)
    for mode in ("speculative", "target_only"):
        for sampled in (False, True):
            reqs = _requests(sampled)
            hits = reuse.pages.prefix_hits
            want = [r.output_ids for r in whole.generate(reqs, mode)[0]]
            assert [r.output_ids for r in reuse.generate(reqs, mode)[0]] == want, (mode, sampled)
            assert reuse.pages.prefix_hits - hits >= 3 * PAGE and reuse.pages.num_used == 0
    assert reuse.prefill_runner is not None and sum(reuse.prefill_runner.replays.values()) > 0


def _serve_one_by_one(eng: Engine, mode: str, overlap: bool, reqs: list[Request]) -> list[list[int]]:
    """``serve``'s scheduler, one request at a time (each admitted once the one before has finished)."""
    sched = Scheduler(eng, mode=mode, overlap=overlap)
    outs = []
    for handle, req in enumerate(reqs):
        out = []
        plan = StepPlan(admit=[(handle, req)])
        while True:
            events, _ = sched.apply(plan)
            for e in events:
                assert e.error is None, e.error
                out.extend(e.tokens)
            if not sched.num_active and not sched.in_flight:
                break
            plan = StepPlan()
        outs.append(out)
    return outs


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_a_next_turn_reuses_the_pages_of_the_answer(mode, overlap):
    """A finished request's answer pages are registered too: a next turn that repeats prompt and answer prefills
    only what follows (the overlap scheduler's step in flight never writes below the last token out)."""
    whole = Engine(load_config(**tiny_model(**TINY)))
    reuse = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.enable_block_reuse": True})))
    first = Request(PROMPTS[0], max_new_tokens=9, sampling=SamplingParams(temperature=0.7, seed=5))
    answer = _serve_one_by_one(reuse, mode, overlap, [first])[0]
    assert len(answer) == 9
    cached = (len(PROMPTS[0]) + len(answer) - 1) // PAGE  # whole pages before the last token out
    assert reuse.pages.num_cached == cached
    turn = Request(PROMPTS[0] + answer + [33, 34, 35], max_new_tokens=6,
                   sampling=SamplingParams(temperature=0.0 if mode == "speculative" else 0.9, seed=2))
    hits = reuse.pages.prefix_hits
    got = _serve_one_by_one(reuse, mode, overlap, [turn])[0]
    assert reuse.pages.prefix_hits - hits == cached * PAGE
    want = [r.output_ids for r in whole.generate([turn], "reference" if mode == "speculative" else mode)[0]][0]
    assert got == want
    assert reuse.pages.num_used == 0
    _check(reuse.pages)


def test_admission_counts_shared_pages_once():
    """A pool for two whole reservations: with reuse, requests that share a running request's prompt pages are
    admitted beside it (they take only their fresh pages); without, the next one waits."""
    stem = [rng for rng in range(300, 324)]  # 24 tokens: 5 whole pages before the last of a 25-token prompt
    reqs = [Request(stem + [i], max_new_tokens=6) for i in range(4)]
    need = Engine(load_config(**tiny_model(**TINY))).pages_for(reqs[0])
    shared = (len(reqs[0].prompt_ids) - 1) // PAGE  # 6 pages of each later prompt are the first one's
    for reuse, admitted in ((False, 1), (True, min(3, need // (need - shared)))):
        eng = Engine(load_config(**tiny_model(**{**TINY, "max_batch_size": 4, "kv_cache_config.max_tokens":
                                                 2 * need * PAGE, "kv_cache_config.enable_block_reuse": reuse})))
        sched = Scheduler(eng, mode="target_only")
        events, _ = sched.apply(StepPlan(admit=[(0, reqs[0])], run=False))  # prefilled: its pages registered
        assert events[0].error is None and eng.pages.num_free == need
        assert sched.admissible(reqs[1:]) == admitted and admitted >= (2 if reuse else 1)
        events, _ = sched.apply(StepPlan(admit=[(i, r) for i, r in enumerate(reqs[1:1 + admitted], 1)], run=False))
        assert all(e.error is None for e in events) and eng.pages.num_free >= 0
        # cancelling the first frees only the pages nobody else holds
        assert sched.free_pages_after([0]) == eng.pages.num_free_after([sched._live[0].slot])
        sched.apply(StepPlan(cancel=list(range(1 + admitted)), run=False))
        assert eng.pages.num_used == 0
        _check(eng.pages)


def test_tight_pool_with_reuse_never_over_admits():
    """Many requests sharing prefixes through a pool of two reservations: every admission's pages are there (an
    over-admission would raise in its allocation), and the tokens are those of an engine with pages for all."""
    rng = random.Random(3)
    stems = [[rng.randrange(500) for _ in range(18)] for _ in range(2)]
    prompts = [rng.choice(stems)[:rng.randint(5, 18)] + [rng.randrange(500) for _ in range(rng.randint(1, 4))]
               for _ in range(14)]
    reqs = [Request(p, max_new_tokens=5, sampling=SamplingParams(temperature=0.9 if i % 3 == 0 else 0.0, seed=i))
            for i, p in enumerate(prompts)]
    big = Engine(load_config(**tiny_model(**{**TINY, "max_batch_size": 4})))
    need = max(big.pages_for(r) for r in reqs)
    small = Engine(load_config(**tiny_model(**{**TINY, "max_batch_size": 4, "kv_cache_config.max_tokens":
                                               2 * need * PAGE, "kv_cache_config.enable_block_reuse": True})))
    for mode in ("target_only", "speculative"):
        want = [r.output_ids for r in big.generate(reqs, mode)[0]]
        got, _ = small.generate(reqs, mode)
        assert [r.output_ids for r in got] == want and all(r.error is None for r in got)
        assert small.pages.num_used == 0
        _check(small.pages)
    assert small.pages.prefix_hits > 0


@pytest.mark.parametrize("chunked", [False, True])
def test_one_prompt_admitted_together_prefills_its_shared_pages_once(chunked):
    """``n`` > 1 (and simultaneous requests with one prompt) are admitted in one plan, before any of them has
    registered a page: the first prefills the prompt, the others wait for its pages within the plan (the next
    group; with chunked prefill the next plan at most) and prefill only the rest, with the tokens of an engine
    without reuse and the pages they gave back free."""
    extra = {"enable_chunked_prefill": True, "max_num_tokens": 16} if chunked else {}
    cfg = {**TINY, "max_batch_size": 4, **extra}
    whole = Engine(load_config(**tiny_model(**cfg)))
    reuse = Engine(load_config(**tiny_model(**cfg, **{"kv_cache_config.enable_block_reuse": True})))
    prompt = SYSTEM + [5, 17, 6]  # 16 tokens: three whole pages before its last token
    shared = (len(prompt) - 1) // PAGE
    prefilled = []
    orig_rows, orig_chunk = reuse.launch_prefill, reuse.prefill_chunk

    def rows(slots, requests, mode="speculative", starts=None, **kw):
        prefilled.extend(len(r.prompt_ids) - s for r, s in zip(requests, starts))
        return orig_rows(slots, requests, mode, starts, **kw)

    def chunk(slot, request, start, end, mode="speculative"):
        prefilled.append(end - start)
        return orig_chunk(slot, request, start, end, mode)

    reuse.launch_prefill, reuse.prefill_chunk = rows, chunk
    for mode, temperature in (("speculative", 0.0), ("target_only", 0.0), ("speculative", 0.9),
                              ("target_only", 0.9)):
        reqs = [Request(list(prompt), max_new_tokens=5, sampling=SamplingParams(temperature=temperature, seed=i))
                for i in range(4)]
        reuse.pages.free_all()  # nothing cached from the round before
        prefilled.clear()
        hits = reuse.pages.prefix_hits
        sched = Scheduler(reuse, mode=mode)
        events, st = sched.apply(StepPlan(admit=list(enumerate(reqs)), run=False))
        if not chunked:  # one plan: the first prompt whole, the other three their last page
            assert all(e.error is None and len(e.tokens) == 1 for e in events) and len(events) == 4
            assert sorted(prefilled) == [len(prompt) - shared * PAGE] * 3 + [len(prompt)]
            assert st.prefix_cache_hits == 3 * shared * PAGE
        # the three others took the first one's pages: only the first holds fresh prompt pages
        assert reuse.pages.num_used == 4 * reuse.pages_for(reqs[0]) - 3 * shared
        _check(reuse.pages)
        sched.apply(StepPlan(cancel=list(range(4)), run=False))
        reuse.pages.free_all()
        prefilled.clear()
        got, _ = reuse.generate(reqs, mode)
        want = [r.output_ids for r in whole.generate(reqs, "reference" if mode == "speculative" and not temperature
                                                      else mode)[0]]
        assert [r.output_ids for r in got] == want, (mode, temperature)
        assert sum(prefilled) == len(prompt) + 3 * (len(prompt) - shared * PAGE)
        assert reuse.pages.prefix_hits - hits >= 2 * 3 * shared * PAGE
        assert reuse.pages.num_used == 0
        _check(reuse.pages)


def test_rematch_maps_cached_pages_in_place_of_fresh_ones():
    """The allocator's side: a slot admitted before the pages were registered swaps its fresh pages for them;
    the fresh ones are free again, a slot holding other tokens keeps its own, and the tables follow."""
    pages = PageAllocator(num_pages=12, num_slots=3, max_pages_per_slot=5, divisor=2, device="cpu", page_size=PAGE,
                          enable_block_reuse=True)
    prompt = list(range(1, 15))  # 3 whole pages before its last token
    pages.allocate(0, 4)
    pages.allocate(1, 4)
    pages.allocate(2, 4)
    assert pages.num_free == 0
    assert pages.rematch(1, prompt) == 0  # nothing registered yet: nothing moves
    pages.register(0, prompt)
    hits = pages.prefix_hits
    assert pages.rematch(1, prompt) == 3 and pages._owned[1][:3] == pages._owned[0][:3]
    assert pages.prefix_hits - hits == 3 * PAGE and pages.num_free == 3
    assert pages.rematch(1, prompt) == 3 and pages.num_free == 3  # idempotent
    other = prompt[:5] + [99] * 9  # shares page 0 only
    assert pages.rematch(2, other) == 1 and pages._owned[2][0] == pages._owned[0][0] and pages.num_free == 4
    _check(pages)
    pages.free(0)
    pages.free(1)
    pages.free(2)
    assert pages.num_used == 0
    _check(pages)


@pytest.mark.parametrize("chunked", [False, True])
def test_random_plans_with_cancels_keep_the_pages_and_the_tokens(chunked):
    """The scheduler under random plans: several admissions at once from a few shared stems (so requests wait
    for one another's pages), cancels of requests in prefill and in decode, the overlap scheduler. After every
    plan the pages partition the pool; at the end every page is back, and every request that ran to its length
    has the tokens of an engine without reuse."""
    rng = random.Random(11)
    extra = {"enable_chunked_prefill": True, "max_num_tokens": 12} if chunked else {}
    cfg = {**TINY, "max_batch_size": 4, **extra}
    whole = Engine(load_config(**tiny_model(**cfg)))
    reuse = Engine(load_config(**tiny_model(**cfg, **{"kv_cache_config.enable_block_reuse": True})))
    stems = [[rng.randrange(500) for _ in range(14)] for _ in range(2)]
    reqs = [Request(rng.choice(stems)[:rng.choice((9, 13, 14))] + [rng.randrange(500) for _ in range(rng.randint(1, 3))],
                    max_new_tokens=rng.randint(2, 6), sampling=SamplingParams(temperature=0.8 if i % 3 else 0.0, seed=i))
            for i in range(24)]
    sched = Scheduler(reuse, mode="target_only", overlap=True)
    queue, out, ended, cancelled = list(range(len(reqs))), {}, {}, set()
    while queue or sched.num_active or sched.in_flight:
        n = min(sched.admissible([reqs[h] for h in queue]), rng.randint(0, 3))
        admit, queue = queue[:n], queue[n:]
        live = [h for h in out if h not in ended]
        cancel = [h for h in live if rng.random() < 0.08]
        cancelled.update(cancel)
        events, _ = sched.apply(StepPlan(admit=[(h, reqs[h]) for h in admit], cancel=cancel))
        for h in admit:
            out.setdefault(h, [])
        for e in events:
            assert e.error is None, e.error
            out[e.handle].extend(e.tokens)
            if e.finish_reason is not None:
                ended[e.handle] = e.finish_reason
        _check(reuse.pages)
    assert reuse.pages.num_used == 0 and reuse.slots.num_free == 4 and reuse.pages.prefix_hits > 0
    _check(reuse.pages)
    ran = [h for h, why in ended.items() if why == "length"]
    assert len(ran) >= len(reqs) // 2
    want = whole.generate([reqs[h] for h in ran], "target_only")[0]
    assert [out[h] for h in ran] == [r.output_ids for r in want]


def test_partial_reuse_matches_the_longest_cached_page_start():
    """``match_partial``: where the whole pages stop, the cached page under the same chain whose first tokens match
    the most of the prompt's next ones (never its last token); none without a common first token, under another
    chain or root, with partial reuse off, or once the page is evicted (its index entry goes with it)."""
    pages = PageAllocator(num_pages=6, num_slots=3, max_pages_per_slot=5, divisor=2, device="cpu", page_size=PAGE,
                          enable_block_reuse=True, enable_partial_reuse=True)
    a = list(range(1, 14))  # 13 tokens: 3 whole pages registered
    pages.allocate(0, 4)
    pages.register(0, a)
    b = a[:4] + [50, 51, 52, 53, 60]  # page 1 differs: a[4:8] = 5..8
    pages.allocate(1, 3, prefix=pages.match(b))
    pages.register(1, b)  # page 1 of b under page 0's chain too
    hits = pages.prefix_hits
    assert pages.match_partial(a[:4] + [5, 6, 99, 99, 99]) == (pages._owned[0][1], 2)  # 5, 6 of page 1
    assert pages.match_partial(a[:4] + [50, 51, 52, 7, 9]) == (pages._owned[1][1], 3)
    assert pages.prefix_hits - hits == 5
    assert pages.match_partial(a[:4] + [5, 6]) == (pages._owned[0][1], 1)  # never the prompt's last token
    assert pages.match_partial(a[:4] + [77, 6, 7, 8, 9]) is None  # no common first token
    assert pages.match_partial([9] + a[1:]) is None and pages.match_partial(a[:6], root="other") is None
    assert pages.match_partial(a[:8] + [9, 10, 0, 0]) == (pages._owned[0][2], 2)  # after two whole pages
    for prompt in (a, a[:4] + [5, 6, 99, 99, 99], a[:8] + [9, 10, 0, 0], [9] + a[1:], a[:4] + [50, 51, 52, 7, 9]):
        q, h = pages.prefix_queries, pages.prefix_hits
        want = (pages.match(prompt), pages.match_partial(prompt))  # the engine's one walk equals the two calls
        counts = (pages.prefix_queries - q, pages.prefix_hits - h)
        assert pages.match_with_partial(prompt) == want, prompt
        assert (pages.prefix_queries - q - counts[0], pages.prefix_hits - h - counts[1]) == counts, prompt
    off = PageAllocator(num_pages=6, num_slots=3, max_pages_per_slot=5, divisor=2, device="cpu", page_size=PAGE,
                        enable_block_reuse=True, enable_partial_reuse=False)
    off.allocate(0, 4)
    off.register(0, a)
    assert off.match_partial(a[:4] + [5, 6, 99, 99]) is None
    assert off.match_with_partial(a[:4] + [5, 6, 99, 99]) == (off.match(a[:4] + [5, 6, 99, 99]), None) != ([], None)
    pages.free(0)
    pages.free(1)
    pages.allocate(2, 5)  # evicts 5 of the 5 idle cached pages (one was free)
    assert pages.match_partial(a[:4] + [5, 6, 99, 99, 99]) is None
    _check(pages)


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_partial_reuse_gives_the_tokens_of_whole_prefills_and_prefills_less(mode):
    """Prompts that share a page's first tokens only (a system prompt that ends inside a page): with partial reuse
    the later ones copy those positions and prefill the rest; the tokens equal the target's own decode without
    reuse, greedy and sampled, and more prompt tokens come from the cache."""
    prompts = [SYSTEM + [5, 17, 6, 2, 9], SYSTEM + [5, 17, 40, 41], SYSTEM + [5, 33, 34], SYSTEM[:14] + [9]]
    reqs = [Request(list(p), max_new_tokens=4, sampling=SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i))
            for i, p in enumerate(prompts)]
    whole = Engine(load_config(**tiny_model(**TINY)))
    want = [r.output_ids for r in whole.generate(reqs, "reference" if mode == "speculative" else mode)[0]]
    counts = {}
    for partial in (False, True):
        eng = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.enable_block_reuse": True,
                                                         "kv_cache_config.enable_partial_reuse": partial})))
        got = []
        for r in reqs:  # one at a time: each finds the pages of the ones before
            got.append(eng.generate([r], mode)[0][0].output_ids)
        assert got == want, partial  # strict acceptance: the sampled rows too are the target decode's
        counts[partial] = eng.pages.prefix_hits
        assert eng.pages.num_used == 0
        _check(eng.pages)
    # the 13-token system prompt ends inside the 4th page: each later prompt copies its first token or more
    assert counts[True] >= counts[False] + 3


def _slot_cache(eng: Engine, slot: int, n: int):
    """The K, V and drafter latents of ``slot``'s positions ``0 .. n-1``, read through its page table."""
    pos = __import__("torch").arange(n)
    pages = eng.pages.page_table[slot, pos // PAGE].long()
    kv = eng.state.kv_cache
    return kv.k[:, pages, pos % PAGE], kv.v[:, pages, pos % PAGE], eng.state.latent_pool[:, pages, pos % PAGE]


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_partial_reuse_copies_the_page_start(mode):
    """After a prefill that reused whole pages and a page's start, the slot's cache holds what a prefill of the
    whole prompt writes: K and V at every prompt position (and the drafter's latents below the last one,
    speculative) equal an engine without reuse's (fp32, up to another GEMM shape's rounding)."""
    import torch

    first, later = SYSTEM + [5, 17, 6, 2, 9], SYSTEM + [5, 17, 40, 41]
    whole = Engine(load_config(**tiny_model(**TINY)))
    reuse = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.enable_block_reuse": True})))
    reuse.generate([Request(list(first), max_new_tokens=2)], mode)  # its pages are cached now
    hits = reuse.pages.prefix_hits
    caches = []
    for eng in (whole, reuse):
        sched = Scheduler(eng, mode=mode)
        events, _ = sched.apply(StepPlan(admit=[(0, Request(list(later), max_new_tokens=4))], run=False))
        assert events[0].error is None
        caches.append(_slot_cache(eng, sched._live[0].slot, len(later)))
        sched.apply(StepPlan(cancel=[0], run=False))
    assert reuse.pages.prefix_hits - hits == len(SYSTEM) + 2  # 3 whole pages and 3 positions of the 4th
    (k0, v0, l0), (k1, v1, l1) = caches
    # equal up to the rounding of a GEMM of another row count (the cached positions came from the first prompt's
    # prefill, the rest from a 2-row one; the engine without reuse ran one of 17 rows)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k1, k0, **tol)
    torch.testing.assert_close(v1, v0, **tol)
    if mode == "speculative":
        torch.testing.assert_close(l1[:, :len(later) - 1], l0[:, :len(later) - 1], **tol)


class _SlicedPrompt(list):
    """A prompt that counts the slices taken of it (the cache reads a prompt's pages as slices)."""

    slices = 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            type(self).slices += 1
        return super().__getitem__(i)


def test_admitted_requests_are_not_walked_again_before_their_prefill():
    """Requests that matched a long cached prefix at admission are not matched again, page by page, before their
    prefill when nothing was registered since (was: every plan that admitted walked each admission's cached chain
    twice -- a few ms of host time per request behind a long shared prefix, the running streams waiting). Their
    first tokens are those of an engine without reuse."""
    cfg = tiny_model(**{**TINY, "max_batch_size": 4})
    reuse = Engine(load_config(**cfg, **{"kv_cache_config.enable_block_reuse": True}))
    shared = [(7 * j + 3) % 500 for j in range(40)]  # ten whole pages
    sched = Scheduler(reuse, mode="target_only")
    sched.apply(StepPlan(admit=[(0, Request(shared + [1], 1))]))  # registers the shared pages
    reqs = [(h, Request(_SlicedPrompt(shared + [h, 2]), 2)) for h in range(1, 5)]
    _SlicedPrompt.slices = 0
    events, st = sched.apply(StepPlan(admit=reqs, run=False))
    assert st.prefix_cache_hits == 4 * 40 and st.prefill_tokens == 4 * 2
    pages = len(shared) // PAGE
    assert _SlicedPrompt.slices <= 4 * (pages + 1), _SlicedPrompt.slices  # the admission's match (and partial match)
    whole = Engine(load_config(**cfg))
    want, _ = whole.generate([Request(shared + [h, 2], 1) for h in range(1, 5)], "target_only")
    assert [e.tokens for e in events] == [r.output_ids for r in want]
    sched.apply(StepPlan(cancel=[1, 2, 3, 4], run=False))
    assert reuse.pages.num_used == 0
    _check(reuse.pages)
