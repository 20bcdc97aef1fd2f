"""The page pool shared by the target's paged KV cache and the drafter's latents: sizing from
``kv_cache_config``, admission that waits for pages (never a failure mid-request), no leak, any free order."""

from __future__ import annotations

import random

import pytest
import torch

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.kv_cache import PageAllocator, num_cache_pages
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.testing.tiny_models import tiny_model

TINY = {"model.target.num_layers": 1, "model.target.capture_layers": [0], "max_batch_size": 4, "max_seq_len": 40}


def _check_tables(pages: PageAllocator) -> None:
    """Every held page appears once, in its owner's row of both tables; free rows are all unallocated."""
    held = [pg for row in pages._owned.values() for pg in row]
    assert len(held) == len(set(held)) and not set(held) & set(pages._free)
    assert len(held) + pages.num_free == pages.num_pages
    for slot in range(pages.page_table.shape[0]):
        row = pages._owned.get(slot, [])
        n = len(row)
        assert pages.page_table[slot, :n].tolist() == row
        assert (pages.page_table[slot, n:] == pages.num_pages).all()
        assert pages.encoded_offsets[slot, :n].tolist() == [pg * pages.divisor for pg in row]
        assert (pages.encoded_offsets[slot, n:] == -1).all()


def test_no_leak_after_1000_mixed_requests_and_out_of_order_frees():
    rng = random.Random(0)
    pages = PageAllocator(num_pages=40, num_slots=9, max_pages_per_slot=12, divisor=2, device="cpu")
    live: list[int] = []
    for i in range(1000):
        free_slots = [s for s in range(8) if s not in live]
        need = rng.randint(1, 12)
        if free_slots and pages.can_allocate(need) and rng.random() < 0.6:
            slot = rng.choice(free_slots)
            got = pages.allocate(slot, need)
            assert len(got) == need
            live.append(slot)
        elif live:
            pages.free(live.pop(rng.randrange(len(live))))  # any order
        if i % 50 == 0:
            _check_tables(pages)
    for slot in live:
        pages.free(slot)
    assert pages.num_free == pages.num_pages and pages.num_used == 0
    _check_tables(pages)
    pages.allocate(0, 12)
    pages.allocate(1, 12)
    pages.allocate(2, 12)
    assert not pages.can_allocate(5)
    with pytest.raises(RuntimeError, match="5 pages requested, 4 free"):
        pages.allocate(3, 5)


def test_pool_size_from_kv_cache_config():
    kw = dict(max_batch_size=8, max_pages_per_slot=10, page_size=16, bytes_per_page=1000)
    assert num_cache_pages(**kw)[0] == 80  # neither: every slot at max_seq_len
    assert num_cache_pages(**kw, max_tokens=16 * 30 + 1)[0] == 31  # ceil(max_tokens / page_size)
    assert num_cache_pages(**kw, max_tokens=16)[0] == 10  # raised to one longest request
    assert num_cache_pages(**kw, max_tokens=10 ** 6)[0] == 80  # capped: more pages than slots can hold
    n, why = num_cache_pages(**kw, free_gpu_memory_fraction=0.5, device="cpu")
    assert n == 80 and "every slot" in why  # no device memory on a CPU (logged)


def test_a_pool_past_the_free_memory_is_refused_before_it_is_allocated(monkeypatch, tmp_path, capsys):
    """Sized as every slot at ``max_seq_len`` (no ``kv_cache_config`` bound), a long ``max_seq_len`` asks for more
    than the device holds: a :class:`BuildRefusal` naming the pool, the free memory and the fields that bound it,
    before anything is allocated (was: the allocator's traceback, exit 1); ``generate`` and ``serve`` print it as
    one line, exit 2. A ``max_tokens`` bound that fits is built."""
    from tensorrt_llm_ext.cli import main
    from tensorrt_llm_ext.contract import BuildRefusal
    from tensorrt_llm_ext.runtime import kv_cache

    free = 64 * 2**20
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda device: free)
    cfg = tiny_model(max_batch_size=4, max_seq_len=100_000)
    with pytest.raises(BuildRefusal, match=r"kv cache: the page pool needs .* GiB .* but 0\.1 GiB of cpu memory is "
                                           r"free: lower max_seq_len \(100000\) or max_batch_size \(4\)"):
        Engine(load_config(**cfg))
    Engine(load_config(**cfg, **{"kv_cache_config.max_tokens": 4096}))  # bounded: fits
    monkeypatch.undo()
    (tmp_path / "c.yaml").write_text("max_seq_len: 2147483648\nmax_batch_size: 1\n")  # terabytes on any machine
    import socket

    with socket.socket() as sock:  # a port free now (serve checks it before the build)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for cmd in (["generate", "--config", str(tmp_path / "c.yaml"), "--max-new-tokens", "2", "1 2"],
                ["serve", "--config", str(tmp_path / "c.yaml"), "--port", str(port)]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: kv cache: the page pool needs"), err


def test_engine_waits_for_pages_instead_of_failing_and_frees_them():
    """A pool of 2 requests' pages for 4 slots: generate() admits as pages free up, every request completes
    with the tokens of an engine that has pages for every slot, and all pages come back."""
    prompts = [[5, 17, 300, 42], [101], list(range(200, 215)), [7, 7, 480, 2], [9, 8, 7]]
    reqs = [Request(list(p), max_new_tokens=10, sampling=SamplingParams(temperature=0.0, seed=i))
            for i, p in enumerate(prompts)]
    big = Engine(load_config(**tiny_model(**TINY)))
    page = big.state.page_size
    need = max(big.pages_for(r) for r in reqs)
    small = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.max_tokens": 2 * need * page})))
    assert small.pages.num_pages == 2 * need < big.pages.num_pages
    peak = []
    orig = small.pages.allocate

    def allocate(slot, n, _orig=orig, **kw):
        out = _orig(slot, n, **kw)
        peak.append(small.pages.num_used)
        return out

    small.pages.allocate = allocate
    for mode in ("speculative", "target_only"):
        # speculative: the big engine's target decode, which its speculative tokens equal bit for bit
        want, _ = big.generate(reqs, "reference" if mode == "speculative" else mode)
        got, _ = small.generate(reqs, mode)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert all(r.finish_reason == "length" for r in got)
        assert small.pages.num_free == small.pages.num_pages and big.pages.num_free == big.pages.num_pages
    assert max(peak) <= small.pages.num_pages
    _check_tables(small.pages)


def test_scheduler_admission_budget_counts_pages():
    eng = Engine(load_config(**tiny_model(**TINY, **{"kv_cache_config.max_tokens": 1})))  # one longest request
    sched = Scheduler(eng, mode="target_only")
    request = Request([1, 2, 3], max_new_tokens=30)
    need = sched.pages_for(request)
    assert need == eng.pages_for(request) and need <= eng.pages.num_pages
    assert sched.pages_for(Request([], max_new_tokens=3)) == 0  # invalid: its admission errors out
    events, _ = sched.apply(StepPlan(admit=[(0, request)], run=False))
    assert events[0].finish_reason is None
    assert sched.free_pages_after([]) == eng.pages.num_free < need  # a second one must wait
    assert sched.free_pages_after([0]) == eng.pages.num_pages  # unless the first is cancelled in the same plan
    assert sched.kv_cache_usage == pytest.approx(need / eng.pages.num_pages)
    sched.apply(StepPlan(cancel=[0], run=False))
    assert eng.pages.num_free == eng.pages.num_pages
    assert torch.all(eng.pages.page_table == eng.pages.num_pages)
