"""The prefill's target forward in token buckets (runtime/prefill_graph.py, ``cuda_graph_config.prefill_max_tokens``).

On a CPU the runner is not captured: each bucket runs the forward eagerly on the runner's static buffers, so the
rule, the padding and the copy-out are the captured path's. Asserted: the greedy tokens of ``generate`` (every
prefill through the buckets) equal the eager prefill's, for prompts of 1, 15, 16, 17 tokens and one near
``max_seq_len``, batched ragged admissions and chunked prefill, speculative and target-only; the real positions'
K/V and the drafter latents the buckets store (the latent fold) equal (up to GEMM rounding of another row count, as
the batched prefill's tests allow), none stored by a target-only admission; a piece whose padding would pass the
page table runs eagerly; the knob's validation. The GPU test captures the buckets for real.
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.config import DEFAULT_PREFILL_MAX_TOKENS, ConfigError, load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.prefill_graph import PrefillGraphRunner, plan_prefill, prefill_buckets
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.testing.tiny_models import tiny_model

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MAX_SEQ = 64
TINY = {"model.target.num_layers": 1, "model.target.capture_layers": [0], "max_batch_size": 4, "max_seq_len": MAX_SEQ}
MAX_NEW = 5
# 1, 15, 16, 17 tokens (a bucket's edges) and one near max_seq_len (58 + 5 new of 64).
PROMPTS = [[101], list(range(30, 45)), list(range(60, 76)), list(range(90, 107)),
           [(7 * i) % 500 + 3 for i in range(58)]]
TOL = dict(atol=1e-5, rtol=1e-5)


def _engine(**over) -> Engine:
    return Engine(load_config(**tiny_model(**TINY, **over)))


def _bucketed(eng: Engine, buckets) -> PrefillGraphRunner:
    """The engine's runner (its buckets store the drafter's prompt latents: the latent fold), not captured."""
    runner = eng.prefill_graph_runner(buckets)
    assert runner.folds_latents
    eng.use_prefill_runner(runner)
    return runner


def _requests(prompts):
    return [Request(list(p), max_new_tokens=MAX_NEW) for p in prompts]


def test_plan_prefill_rule():
    assert prefill_buckets(100, 48) == (16, 32, 48) and prefill_buckets(8192, 3000)[-2:] == (2048, 3000)
    assert prefill_buckets(64, 9) == (9,) and prefill_buckets(64, 64) == (16, 32, 64)
    # one piece per row, the smallest bucket holding it; with chunks, one per row and chunk
    plan = plan_prefill([(0, 1), (3, 16), (0, 17)], 64, (16, 32, 64), 72)
    assert plan.replay and plan.buckets == (16, 16, 32)
    plan = plan_prefill([(10, 20)], 9, (4, 16), 72)
    assert [(p.first, p.tokens, p.column) for p in plan.pieces] == [(10, 9, 0), (19, 9, 9), (28, 2, 18)]
    assert plan.buckets == (16, 16, 4)
    # eager: more tokens than the largest bucket; padding that would reach past the table (41 + 32 > 72)
    assert not plan_prefill([(0, 65)], 128, (16, 32, 64), 200).replay
    over = plan_prefill([(0, 3), (41, 17)], 64, (16, 32, 64), 72)
    assert not over.replay and "page table" in over.reason
    assert plan_prefill([(40, 17)], 64, (16, 32, 64), 72).replay  # 40 + 32 = 72: the last position is 71


def test_knob_validation():
    assert load_config(**tiny_model()).cuda_graph_config.prefill_max_tokens == DEFAULT_PREFILL_MAX_TOKENS == 2048
    on = load_config(**tiny_model(**{"cuda_graph_config.prefill_max_tokens": 16}))
    assert on.cuda_graph_config.prefill_max_tokens == 16
    for bad in (8, -1, 1):
        with pytest.raises(ConfigError, match="prefill_max_tokens must be 0 .off. or at least 16"):
            load_config(**tiny_model(**{"cuda_graph_config.prefill_max_tokens": bad}))
    with pytest.raises(ConfigError, match="prefill_max_tokens"):
        load_config(**tiny_model(**{"cuda_graph_config.prefill_max_tokens": True}))
    # graphs off (a CPU engine): no buckets, every prefill eager
    eng = _engine(**{"cuda_graph_config.prefill_max_tokens": 64})
    assert eng.prefill_buckets == () and eng.prefill_runner is None and eng.worker().prefill_runner is None


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_bucketed_generate_equals_eager(mode):
    """Each prompt alone (1, 15, 16, 17, 58 tokens), then all in batched ragged admissions: the same tokens."""
    eager, bucketed = _engine(), _engine()
    runner = _bucketed(bucketed, prefill_buckets(64, MAX_SEQ))
    want = [r.output_ids for r in eager.generate(_requests(PROMPTS), mode)[0]]
    for p, w in zip(PROMPTS, want):
        assert [r.output_ids for r in bucketed.generate(_requests([p]), mode)[0]] == [w]
    assert runner.replays == {16: 3, 32: 1, 64: 1} and runner.eager_calls == 0
    # batched: the first four admitted together (4 slots), the 58-token one after a finish
    assert [r.output_ids for r in bucketed.generate(_requests(PROMPTS), mode)[0]] == want
    assert runner.eager_calls == 0 and sum(runner.replays.values()) == 10


def _serve(eng: Engine, mode: str, arrivals: dict[int, list[Request]]) -> list[list[int]]:
    """The serving loop's plans under the overlap scheduler: requests join at their plan and are admitted while
    others decode (their prefill runs behind a launched step). Tokens per request, in arrival order."""
    sch = Scheduler(eng, mode=mode, overlap=True)
    order = [r for i in sorted(arrivals) for r in arrivals[i]]
    queue, out, done = [], {}, set()
    for i in range(300):
        queue += [(order.index(r), r) for r in arrivals.get(i, [])]
        n = sch.admissible(r for _, r in queue)
        admit, queue = queue[:n], queue[n:]
        for e in sch.apply(StepPlan(admit=admit))[0]:
            out.setdefault(e.handle, []).extend(e.tokens)
            if e.finish_reason is not None:
                done.add(e.handle)
        if len(done) == len(order):
            return [out[h] for h in range(len(order))]
    raise AssertionError("not finished")


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_bucketed_overlap_serving_equals_eager(mode):
    """serve's loop (overlap scheduler, admissions between steps, greedy and seeded sampled rows): the tokens of
    the eager prefill, every admission bucketed."""
    def arrivals():
        reqs = [Request(list(p), max_new_tokens=6, ignore_eos=True,
                        sampling=SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i))
                for i, p in enumerate(PROMPTS)]
        return {0: reqs[:2], 2: reqs[2:3], 3: reqs[3:4], 5: reqs[4:]}
    eager, bucketed = _engine(), _engine()
    runner = _bucketed(bucketed, prefill_buckets(64, MAX_SEQ))
    assert _serve(bucketed, mode, arrivals()) == _serve(eager, mode, arrivals())
    assert sum(runner.replays.values()) == len(PROMPTS) and runner.eager_calls == 0


def test_bucketed_kv_equals_eager():
    """One batched prefill of ragged prompts: first tokens and ctx lengths bit for bit, the real positions' K/V
    up to GEMM rounding, and no page outside the prompts' slots touched but the scratch page."""
    out = {}
    for name in ("eager", "bucketed"):
        eng = _engine()
        if name == "bucketed":
            _bucketed(eng, (16, 32, 64))
        slots = [2, 0, 3, 1]
        for slot, p in zip(slots, PROMPTS[1:]):
            eng.pages.allocate(slot, eng.pages_for(Request(list(p), max_new_tokens=MAX_NEW)))
        toks = eng.worker().prefill_batch(slots, PROMPTS[1:], [SamplingParams()] * 4)
        out[name] = (eng, slots, toks)
    (e1, slots, t1), (e2, _, t2) = out["eager"], out["bucketed"]
    assert t1 == t2 and torch.equal(e1.state.ctx_lens, e2.state.ctx_lens)
    assert torch.equal(e1.state.slot_tokens, e2.state.slot_tokens)
    table = e1.pages.page_table
    assert torch.equal(table, e2.pages.page_table)
    owned = {int(pg) for pg in table.flatten() if pg < e1.state.kv_cache.num_pages}
    for a, b in zip(e1.state.kv_cache.tensors(), e2.state.kv_cache.tensors()):
        for slot, p in zip(slots, PROMPTS[1:]):
            rows = table[slot].long()
            torch.testing.assert_close(b[:, rows].flatten(1, 2)[:, :len(p)], a[:, rows].flatten(1, 2)[:, :len(p)],
                                       **TOL)
        free = [pg for pg in range(e1.state.kv_cache.num_pages) if pg not in owned]
        assert not b[:, free].any()  # padding wrote the slots' own pages or the scratch page only
    torch.testing.assert_close(e2.state.latent_pool, e1.state.latent_pool, **TOL)


def test_bucketed_chunked_prefill_equals_eager():
    """Chunked prefill (9 tokens a forward): chunks and batched rests replay 4- and 16-token buckets (padding
    past a chunk into the next chunk's positions, rewritten before they are attended); the same tokens."""
    over = {"enable_chunked_prefill": True, "max_num_tokens": 9}
    eager, bucketed = _engine(**over), _engine(**over)
    runner = _bucketed(bucketed, (4, 16))
    reqs = _requests(PROMPTS)
    for mode in ("speculative", "target_only"):
        assert ([r.output_ids for r in bucketed.generate(reqs, mode)[0]]
                == [r.output_ids for r in eager.generate(reqs, mode)[0]])
    assert runner.replays.get(16, 0) > 0 and runner.replays.get(4, 0) > 0 and runner.eager_calls == 0
    # the chunks' and the rests' latents, stored by the buckets, are the eager prefill's
    assert bucketed.state.latent_pool.abs().sum() > 0
    torch.testing.assert_close(bucketed.state.latent_pool, eager.state.latent_pool, **TOL)


def test_target_only_admission_through_the_latent_fold_stores_no_latent():
    """The buckets compute the drafter's latents for every admission, but a target-only one stores none of them
    (its pieces' prompt length is 0); a speculative admission after it stores its prompt's."""
    eng = _engine()
    _bucketed(eng, (16, 32, 64))
    w = eng.worker()
    for slot, prompt in ((0, PROMPTS[3]), (1, PROMPTS[2])):
        eng.pages.allocate(slot, eng.pages_for(Request(prompt, max_new_tokens=MAX_NEW)))
    before = eng.state.latent_pool.clone()
    w.prefill_batch([0], [PROMPTS[3]], [SamplingParams()])  # speculative: its prompt's latents stored
    assert not torch.equal(eng.state.latent_pool, before)
    before = eng.state.latent_pool.clone()
    w.prefill_batch([1], [PROMPTS[2]], [SamplingParams()], speculative=False)  # after it, target-only: none
    assert torch.equal(eng.state.latent_pool, before)


def test_padding_past_the_table_runs_eagerly(caplog):
    """A rest of 35 tokens from position 10 would pad to 64 past the table (72 positions): that call runs eagerly
    (logged once), the tokens are the eager prefill's."""
    prompt = PROMPTS[-1][:45]
    firsts = {}
    for name in ("eager", "bucketed"):
        eng = _engine()
        runner = _bucketed(eng, (16, 32, 64)) if name == "bucketed" else None
        eng.pages.allocate(0, eng.pages_for(Request(prompt, max_new_tokens=MAX_NEW)))
        w = eng.worker()
        w.prefill_chunk(0, prompt, 0, 10)
        firsts[name] = w.prefill_batch([0], [prompt], [SamplingParams()], starts=[10])
    assert eng.state.kv_cache.max_positions == 72
    assert firsts["eager"] == firsts["bucketed"]
    assert runner.replays == {16: 1} and runner.eager_calls == 1
    assert "runs eagerly (a bucket's padding would reach past the page table" in caplog.text


@cuda_only
def test_gpu_captured_prefill_buckets_equal_eager():
    """On CUDA: the buckets captured at engine start (after the decode graphs, one pool), every prefill of
    ``generate`` replayed, the tokens those of the eager prefill; a capture leaves a live request's K/V alone."""
    cfg = {**TINY, "max_batch_size": 8}
    graphed = Engine(load_config(**tiny_model(**cfg, **{"cuda_graph_config.prefill_max_tokens": 64})),
                     use_cuda_graph=True)
    eager = Engine(load_config(**tiny_model(**cfg, **{"cuda_graph_config.prefill_max_tokens": 0})),
                   use_cuda_graph=True)
    reqs = _requests(PROMPTS)
    runners = []
    for mode in ("speculative", "target_only"):
        want = [r.output_ids for r in eager.generate(reqs, mode)[0]]
        assert [r.output_ids for r in graphed.generate(reqs, mode)[0]] == want  # the same admissions and steps
        runner = graphed.prefill_runner  # captured again after the new mode's decode graphs
        assert runner is not None and sorted(runner.graphs) == [16, 32, 64] and runner.eager_calls == 0
        assert sum(runner.replays.values()) == len(PROMPTS)  # one piece per prompt
        runners.append(runner)
    assert runners[0] is not runners[1] and graphed.worker().prefill_runner is runners[1]
    # the prompts' drafter latents stored by the captured buckets (the latent fold) are the eager admissions'
    assert runners[1].folds_latents and graphed.state.latent_pool.abs().sum() > 0
    torch.testing.assert_close(graphed.state.latent_pool, eager.state.latent_pool, atol=1e-4, rtol=1e-4)
    # a capture with a request's K/V in the cache: only the scratch page is written, and it is restored
    eng = graphed
    eng.pages.allocate(0, eng.pages_for(reqs[4]))
    eng.worker().prefill(0, PROMPTS[4])
    before = [t.clone() for t in eng.state.kv_cache.tensors()]
    again = eng.prefill_graph_runner((16, 64), pool=eng._graph_pool)
    assert again.capture()
    assert all(torch.equal(a, b) for a, b in zip(before, eng.state.kv_cache.tensors()))
    eng.pages.free(0)
