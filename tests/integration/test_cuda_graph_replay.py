"""The CUDA-graph replay rule (runtime/cuda_graph.py, docs/end_to_end.md "CUDA graphs").

One rule, in the runner: a step replays the captured ``(batch size, variant)`` graph whose variant covers
every row's needs (a top-p row needs the top-p variant), else runs eagerly; ``generate`` and ``run_step``
(what ``serve`` calls) run the same step through it.

On CPU the decision is tested as the pure function :func:`plan_step`, and end to end through the engine with
*simulated* graphs: a :class:`SimulatedGraphRunner` whose "graph" re-runs the step with the variant frozen at
capture (what a real graph does: it replays the kernels of its capture whatever the rows hold), so a graph
replayed for rows it does not cover would emit the wrong distribution here too. On the GPU the same checks
run with real graphs (``test_gpu_*``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tensorrt_llm_ext.runtime import engine as engine_module
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.cuda_graph import CudaGraphRunner, plan_step
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.speculative.step_ops import STOCK_OPS
from tensorrt_llm_ext.speculative.step_variant import (DEFAULT_VARIANT, PROCESSED_TOP_P_VARIANT, PROCESSED_VARIANT,
                                                      TOP_P_VARIANT, StepVariant)
from tensorrt_llm_ext.testing.tiny_models import tiny_model

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BOTH = [(b, v) for b in (1, 2, 4) for v in (DEFAULT_VARIANT, TOP_P_VARIANT)]
PROMPTS = [[5, 17, 300, 42], [101], [7, 7, 7, 480, 2]]


# ---------------------------------------------------------------------------------------------------
# The rule as a pure function
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("need,rows,expected", [
    (DEFAULT_VARIANT, 3, (4, DEFAULT_VARIANT)),  # only greedy / top_p = 1 rows: the cheap graph, padded up
    (TOP_P_VARIANT, 3, (4, TOP_P_VARIANT)),  # a top-p row (alone or mixed with greedy rows): the top-p graph
    (TOP_P_VARIANT, 1, (1, TOP_P_VARIANT)),
    (DEFAULT_VARIANT, 2, (2, DEFAULT_VARIANT)),
])
def test_plan_step_picks_the_covering_graph(need, rows, expected):
    plan = plan_step(rows, need, BOTH)
    assert plan.replay and (plan.batch_size, plan.variant) == expected and plan.reason == ""


def test_plan_step_runs_eagerly_when_no_graph_covers_the_step():
    only_default = [(b, DEFAULT_VARIANT) for b in (1, 2, 4)]
    plan = plan_step(2, TOP_P_VARIANT, only_default)  # the bug of old: replaying a default graph here
    assert not plan.replay and plan.variant == TOP_P_VARIANT and plan.batch_size == 2
    assert "top-p" in plan.reason
    # the top-p graph covers a step without top-p rows (its rows keep their whole distribution)
    plan = plan_step(3, DEFAULT_VARIANT, [(b, TOP_P_VARIANT) for b in (1, 2, 4)])
    assert plan.replay and (plan.batch_size, plan.variant) == (4, TOP_P_VARIANT)
    # too many rows, padding off, nothing captured: eager, at the live rows, each with its reason
    for rows, captured, padding, words in [(5, BOTH, True, "largest graph"), (3, BOTH, False, "padding off"),
                                           (1, [], True, "no graph captured")]:
        plan = plan_step(rows, DEFAULT_VARIANT, captured, padding)
        assert not plan.replay and plan.batch_size == rows and words in plan.reason
    with pytest.raises(ValueError, match="at least one row"):
        plan_step(0, DEFAULT_VARIANT, BOTH)


SAMPLING_GRAPHS = [(b, v) for b in (1, 2, 4) for v in (DEFAULT_VARIANT, TOP_P_VARIANT, PROCESSED_TOP_P_VARIANT)]


@pytest.mark.parametrize("need", [PROCESSED_VARIANT, PROCESSED_TOP_P_VARIANT])
def test_plan_step_picks_the_processed_graph_for_a_processed_row(need):
    """A step with a processed row (with or without a top-p row) replays the processed graph, padded up; a step
    without one keeps its cheaper graph; a wide top-k row (above the captured exchange width) runs eagerly."""
    plan = plan_step(3, need, SAMPLING_GRAPHS)
    assert plan.replay and (plan.batch_size, plan.variant) == (4, PROCESSED_TOP_P_VARIANT)
    assert plan_step(3, DEFAULT_VARIANT, SAMPLING_GRAPHS).variant == DEFAULT_VARIANT
    assert plan_step(1, TOP_P_VARIANT, SAMPLING_GRAPHS).variant == TOP_P_VARIANT
    greedy_only = [(b, v) for b in (1, 2) for v in (DEFAULT_VARIANT, PROCESSED_VARIANT)]
    plan = plan_step(2, PROCESSED_VARIANT, greedy_only)
    assert plan.replay and (plan.batch_size, plan.variant) == (2, PROCESSED_VARIANT)
    wide = StepVariant(top_p=need.top_p, processed=True, wide_top_k=True)
    plan = plan_step(2, wide, SAMPLING_GRAPHS)
    assert not plan.replay and plan.variant == wide and "wide-top-k" in plan.reason
    for v in (DEFAULT_VARIANT, TOP_P_VARIANT, PROCESSED_TOP_P_VARIANT):
        assert not v.covers(wide)
    assert PROCESSED_TOP_P_VARIANT.covers(PROCESSED_VARIANT) and not PROCESSED_VARIANT.covers(PROCESSED_TOP_P_VARIANT)
    with pytest.raises(ValueError, match="wide_top_k"):
        StepVariant(wide_top_k=True)


def test_plan_step_never_replays_a_graph_that_does_not_cover_the_rows():
    keys = [(b, v) for b in (1, 2, 3, 8) for v in (DEFAULT_VARIANT, TOP_P_VARIANT)]
    for r in range(len(keys) + 1):
        for captured in itertools.combinations(keys, r):
            for need, rows, padding in itertools.product((DEFAULT_VARIANT, TOP_P_VARIANT), (1, 2, 5, 8, 9),
                                                         (True, False)):
                plan = plan_step(rows, need, captured, padding)
                assert plan.variant.covers(need)
                if plan.replay:
                    assert (plan.batch_size, plan.variant) in captured and plan.batch_size >= rows
                    assert padding or plan.batch_size == rows
                    # the cheapest covering variant at the smallest serving size
                    assert not any(v.covers(need) and (b, v) != (plan.batch_size, plan.variant)
                                   and rows <= b and (padding or b == rows)
                                   and (b, v.cost) < (plan.batch_size, plan.variant.cost) for b, v in captured)
                else:
                    assert plan.batch_size == rows
                    assert not any(v.covers(need) and (b == rows or (padding and b >= rows)) for b, v in captured)


# ---------------------------------------------------------------------------------------------------
# Through the engine, with simulated graphs on CPU
# ---------------------------------------------------------------------------------------------------
class _SimulatedGraph:
    """Replays the step with the variant frozen at capture, writing into the captured outputs."""

    def __init__(self, runner: CudaGraphRunner, batch_size: int, variant, outputs):
        self.runner, self.batch_size, self.variant, self.outputs = runner, batch_size, variant, outputs

    def replay(self) -> None:
        w = self.runner.worker
        if not hasattr(w, "_step_variant"):  # rows without step variants (the admission's first block)
            out = self.runner.forward(self.batch_size)
        else:
            prepared, slots = w._step_variant, w._step_slots
            # the captured code path and host facts (captured over dummy rows: no slots), whatever the rows hold
            w._step_variant, w._step_slots = self.variant, []
            try:
                out = self.runner.forward(self.batch_size)
            finally:
                w._step_variant, w._step_slots = prepared, slots
        if isinstance(out, dict):
            for k, v in out.items():
                self.outputs[k].copy_(v)
        else:
            self.outputs.copy_(out)


class SimulatedGraphRunner(CudaGraphRunner):
    """The engine's runner with CPU-replayable "graphs" (see the module docstring); the rule is the real one."""

    def _capture_variant(self, variant) -> None:
        w = self.worker
        snapshot = [t.clone() for t in w.state.mutable_tensors()]
        for b in sorted(self.batch_sizes, reverse=True):
            w.set_rows([], b, variant=variant)
            out = self.forward(b)
            out = {k: v.clone() for k, v in out.items()} if isinstance(out, dict) else out.clone()
            self.graphs[(b, variant)] = (_SimulatedGraph(self, b, variant, out), out)
        for t, s in zip(w.state.mutable_tensors(), snapshot):
            t.copy_(s)


def _fast_eager_kernels(monkeypatch):
    """The model's RMSNorm on its eager twin (numerically the same op; the interpreter is the slow part)."""
    import tensorrt_llm_ext.kernels.rms_norm as rms

    monkeypatch.setattr(rms, "triton_runs_on", lambda t: False)


def _engine(monkeypatch, graphs: bool, **overrides) -> Engine:
    eng = Engine(load_config(**tiny_model(**overrides)))
    eng.drafter.set_attention_backend("eager")
    # The target-only decode runs on the speculative worker: give it the eager twins (top-p's kernels are
    # the slow part in the interpreter; the rule under test does not depend on the op table).
    monkeypatch.setattr(eng.worker("speculative"), "ops", STOCK_OPS)
    if graphs:
        monkeypatch.setattr(engine_module, "CudaGraphRunner", SimulatedGraphRunner)
        eng.batch_sizes = (1, 2, 4)  # what use_cuda_graph=True sets on a GPU
    return eng


def _batch(kind: str, max_new: int = 6) -> list[Request]:
    """Three requests: ``greedy`` rows, ``top_p`` rows (T = 1, top-p 1e-3: the argmax is the whole top-p set
    of a 517-token vocabulary, so the answer is the greedy one), or ``mixed`` (greedy, top-p, plain sampled)."""
    rows = {"greedy": [{}] * 3, "top_p": [dict(temperature=1.0, top_p=1e-3)] * 3,
            "mixed": [{}, dict(temperature=1.0, top_p=1e-3), dict(temperature=0.8)]}[kind]
    return [Request(list(p), max_new_tokens=max_new, sampling=SamplingParams(**kw, seed=11 + i)) for i, (p, kw) in enumerate(zip(PROMPTS, rows))]


def _serve(eng: Engine, reqs: list[Request], mode: str, overlap: bool = False) -> list[list[int]]:
    """The requests through the scheduler (``serve``'s engine loop: :meth:`Engine.run_step` per step; with
    ``overlap`` step n + 1 is launched -- its graph replayed over the same output tensors -- before step n's
    tokens are collected)."""
    sched = Scheduler(eng, mode=mode, overlap=overlap)
    out = {i: [] for i in range(len(reqs))}
    events, _ = sched.apply(StepPlan(admit=list(enumerate(reqs))))
    while True:
        for e in events:
            assert e.error is None, e.error
            out[e.handle] += e.tokens
        if not sched.num_active:
            return [out[i] for i in range(len(reqs))]
        events, _ = sched.apply(StepPlan())


def _replayed(eng: Engine, mode: str) -> set:
    return {v for (_, v), n in eng.runner(mode).replays.items() if n}


@pytest.mark.parametrize("mode", ["stock", "target_only"])
def test_replay_rule_through_generate_and_run_step(monkeypatch, mode):
    """Greedy, top-p and mixed steps each replay the graph that covers them (never a default graph for a top-p
    row), emit the eager step's tokens, and ``generate`` == ``run_step`` (serve's loop)."""
    _fast_eager_kernels(monkeypatch)
    eager = _engine(monkeypatch, graphs=False)
    graphed = _engine(monkeypatch, graphs=True)
    greedy = [r.output_ids for r in eager.generate(_batch("greedy"), mode)[0]]
    # A mixed batch replays the top-p graph while its top-p row runs, the default one after it finished.
    for kind, used in [("greedy", {DEFAULT_VARIANT}), ("top_p", {TOP_P_VARIANT}),
                       ("mixed", {TOP_P_VARIANT, DEFAULT_VARIANT})]:
        graphed.runner(mode).replays.clear()
        want = [r.output_ids for r in eager.generate(_batch(kind), mode)[0]]
        got = [r.output_ids for r in graphed.generate(_batch(kind), mode)[0]]
        assert got == want, kind
        assert TOP_P_VARIANT in _replayed(graphed, mode) if kind != "greedy" else True
        assert _replayed(graphed, mode) <= used, kind
        assert graphed.runner(mode).eager_steps == 0
        graphed.runner(mode).replays.clear()
        assert _serve(graphed, _batch(kind), mode) == want, kind
        assert _replayed(graphed, mode) <= used and _replayed(graphed, mode), kind
        if kind == "mixed":  # the next replay rewrites the graph's outputs: the launched step's copy is kept
            assert _serve(graphed, _batch(kind), mode, overlap=True) == want
        if kind == "top_p":
            assert want == greedy  # top-p 1e-3 at T = 1 keeps only the argmax
    assert eager.runner(mode).graphs == {} and not eager.runner(mode).enabled


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_steps_over_dummy_rows_write_only_the_scratch_pages(monkeypatch, mode):
    """What capture's snapshot relies on (``CudaGraphRunner._capture_variant`` keeps only the last page of every
    page pool): the warm-up's steps over dummy rows, every variant and batch size, write no page of the target's
    K/V pools or of the drafter's latent pool but the scratch page, while real requests' pages hold data."""
    _fast_eager_kernels(monkeypatch)
    eng = _engine(monkeypatch, graphs=False)
    eng.generate(_batch("mixed"), mode)  # pages written by real requests (prefix reuse off: freed, not cleared)
    runner = eng.runner(mode)
    w = runner.worker
    pools = [*w.state.kv_cache.tensors(), w.state.latent_pool]
    assert all(bool(p[:, :-1].any()) for p in pools[:-1])
    assert bool(w.state.latent_pool[:, :-1].any()) == (mode == "speculative")  # the target-only decode drafts none
    kept = [p[:, :-1].clone() for p in pools]
    scratch = [p[:, -1].clone() for p in pools]
    for variant in w.step_variants:
        for b in (4, 1):
            w.set_rows([], b, variant=variant)
            runner.forward(b)
    for p, k in zip(pools, kept):
        assert torch.equal(p[:, :-1], k)
    assert any(not torch.equal(p[:, -1], s) for p, s in zip(pools, scratch))  # the dummies did write: there


def test_a_missing_variant_runs_eagerly_and_logs_once(monkeypatch, caplog):
    """A variant whose capture failed is dropped; its steps run eagerly with the right distribution, logged once."""
    _fast_eager_kernels(monkeypatch)

    class NoTopP(SimulatedGraphRunner):
        def _capture_variant(self, variant):
            if variant.top_p:  # the top-p and the processed (+top-p) graphs: nothing covers a top-p step
                raise RuntimeError("operation not permitted when stream is capturing")
            super()._capture_variant(variant)

    eng = _engine(monkeypatch, graphs=True)
    monkeypatch.setattr(engine_module, "CudaGraphRunner", NoTopP)
    greedy = [r.output_ids for r in eng.generate(_batch("greedy", 4), "stock")[0]]
    with caplog.at_level("WARNING", logger="tensorrt_llm_ext"):
        got = [r.output_ids for r in eng.generate(_batch("top_p", 4), "stock")[0]]
    runner = eng.runner("stock")
    assert got == greedy and runner.captured(TOP_P_VARIANT) == [] and runner.captured(DEFAULT_VARIANT) == [1, 2, 4]
    assert runner.eager_steps > 1 and _replayed(eng, "stock") == {DEFAULT_VARIANT}
    eager_lines = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(eager_lines) == 1 and "top-p" in eager_lines[0].getMessage()


PROCESSED_PROMPTS = [[5, 17, 300, 42], [101, 9], [7, 7, 7, 480, 2], [33, 34]]
PROCESSED_ROWS = [  # each field in a replayed step, beside a greedy and a top-p row
    {},
    dict(temperature=1.0, top_p=0.9, top_k=5, repetition_penalty=1.3),
    dict(logit_bias={13: 100.0, 7: -100.0}),  # greedy: the +100 bias wins every step
    dict(temperature=0.8, min_p=0.2, frequency_penalty=0.5, presence_penalty=0.3),
]


def _processed_batch(rows=PROCESSED_ROWS, max_new: int = 5) -> list[Request]:
    return [Request(list(p), max_new_tokens=max_new, sampling=SamplingParams(**kw, seed=3 + i))
            for i, (p, kw) in enumerate(zip(PROCESSED_PROMPTS, rows))]


@pytest.mark.parametrize("mode", ["stock", "target_only"])
def test_processed_rows_replay_the_processed_graph(monkeypatch, mode):
    """Steps with processed rows replay the processed graph -- captured over dummy rows, so it runs with no host
    fact of its rows -- and emit the eager engine's tokens, through ``generate`` and ``run_step``; no step runs
    eagerly (before: every step with a processed row did, and so did its neighbours)."""
    _fast_eager_kernels(monkeypatch)
    eager = _engine(monkeypatch, graphs=False)
    graphed = _engine(monkeypatch, graphs=True)
    want = [r.output_ids for r in eager.generate(_processed_batch(), mode)[0]]
    assert want[2] == [13] * 5  # the fields act
    got = [r.output_ids for r in graphed.generate(_processed_batch(), mode)[0]]
    runner = graphed.runner(mode)
    assert got == want
    assert PROCESSED_TOP_P_VARIANT in _replayed(graphed, mode) and runner.eager_steps == 0
    assert runner.captured(PROCESSED_TOP_P_VARIANT) == [1, 2, 4]
    runner.replays.clear()
    assert _serve(graphed, _processed_batch(), mode) == want
    assert PROCESSED_TOP_P_VARIANT in _replayed(graphed, mode) and runner.eager_steps == 0


def test_a_wide_top_k_row_runs_its_steps_eagerly_and_logs_once(monkeypatch, caplog):
    """``top_k`` above the captured exchange width (128) is the one field kept eager: its steps run eagerly with
    the eager engine's tokens, logged once; the other processed steps still replay."""
    _fast_eager_kernels(monkeypatch)
    eager = _engine(monkeypatch, graphs=False)
    graphed = _engine(monkeypatch, graphs=True)
    rows = [dict(temperature=1.0, top_k=200), dict(temperature=1.0, top_k=7)]
    want = [r.output_ids for r in eager.generate(_processed_batch(rows, 3), "stock")[0]]
    with caplog.at_level("WARNING", logger="tensorrt_llm_ext"):
        got = [r.output_ids for r in graphed.generate(_processed_batch(rows, 3), "stock")[0]]
        graphed.generate(_processed_batch(rows, 3), "stock")
    assert got == want and graphed.runner("stock").eager_steps > 1
    lines = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(lines) == 1 and "wide-top-k" in lines[0], lines
    graphed.runner("stock").replays.clear()
    graphed.generate(_processed_batch(rows[1:], 3), "stock")
    assert _replayed(graphed, "stock") == {PROCESSED_TOP_P_VARIANT}


def test_the_old_rule_is_refused_not_replayed(monkeypatch):
    """Replaying a default graph whenever one exists (what ``run_step`` did) is refused by the worker for a step
    with a top-p row: a wrong distribution becomes an error, never tokens (each request of the refused step ends
    with the error, after its prefill's first token)."""
    _fast_eager_kernels(monkeypatch)

    class OldRule(SimulatedGraphRunner):
        def plan(self, slots):
            return plan_step(len(slots), DEFAULT_VARIANT, [k for k in self.graphs if k[1] == DEFAULT_VARIANT])

    eng = _engine(monkeypatch, graphs=True)
    monkeypatch.setattr(engine_module, "CudaGraphRunner", OldRule)
    results, _ = eng.generate(_batch("top_p", 2), "stock")
    assert all(r.finish_reason == "error" and "default step variant does not serve these rows" in r.error
               for r in results), [r.error for r in results]
    assert all(len(r.output_ids) == 1 for r in results)  # the prefill's token, nothing from the refused step
    assert eng.slots.num_free == eng.max_batch_size  # the failed step released its slots


def test_set_rows_refuses_a_variant_that_does_not_cover_the_rows(monkeypatch):
    _fast_eager_kernels(monkeypatch)
    eng = _engine(monkeypatch, graphs=False)
    w = eng.worker("stock")
    eng.pages.allocate(0, eng.pages.max_pages_per_slot)
    w.prefill(0, [5, 6, 7], SamplingParams(1.0, top_p=0.5, seed=3))
    assert w.step_needs([0]) == TOP_P_VARIANT
    with pytest.raises(ValueError, match="does not serve these rows"):
        w.set_rows([0], 1, variant=DEFAULT_VARIANT)
    w.set_rows([0], 2)
    assert w.step_variant == TOP_P_VARIANT
    greedy_only = eng.worker("stock", sampling=False)
    assert greedy_only.step_variants == (DEFAULT_VARIANT, PROCESSED_VARIANT)
    with pytest.raises(ValueError, match="does not serve these rows"):
        greedy_only.set_rows([], 1, variant=TOP_P_VARIANT)
    eng.pages.free(0)


# ---------------------------------------------------------------------------------------------------
# GPU: real graphs end to end
# ---------------------------------------------------------------------------------------------------
SEEDS = 12


def _gpu_engine(**overrides) -> Engine:
    cfg = load_config(**tiny_model(**{"max_batch_size": 16, "max_seq_len": 64, **overrides}))
    return Engine(cfg, use_cuda_graph=True)


@cuda_only
@pytest.mark.parametrize("mode,rejection", [("speculative", False), ("speculative", True), ("target_only", False)])
def test_gpu_top_p_tiny_equals_greedy_under_graphs(mode, rejection):
    """With graphs (captured per batch size and variant), T = 1 and top-p 1e-3 answer the greedy answer for
    every one of 12 seeds, through ``run_step`` (serve's loop) and ``generate`` alike, replaying the top-p graph
    -- before the rule lived in the runner, ``serve --cuda-graph`` replayed the default graph here (0 of 12)."""
    eng = _gpu_engine(**{"speculative_config.use_rejection_sampling": rejection})
    prompt = [5, 17, 300, 42, 7, 7]
    greedy = [Request(list(prompt), max_new_tokens=24) for _ in range(SEEDS)]
    sampled = [Request(list(prompt), max_new_tokens=24, sampling=SamplingParams(temperature=1.0, top_p=1e-3, seed=s)) for s in range(SEEDS)]
    want = [r.output_ids for r in eng.generate(greedy, mode)[0]]  # row by row: the same step shapes
    eng.runner(mode).replays.clear()
    served = _serve(eng, sampled, mode)
    assert served == want, f"{sum(s == w for s, w in zip(served, want))} of {SEEDS} seeds equal greedy"
    assert _replayed(eng, mode) == {TOP_P_VARIANT} and eng.runner(mode).eager_steps == 0
    assert [r.output_ids for r in eng.generate(sampled, mode)[0]] == want


@cuda_only
@pytest.mark.parametrize("rejection", [False, True])
def test_gpu_mixed_steps_replay_and_equal_eager(rejection):
    """Greedy, top-p (0.9) and plain sampled rows in one batch: graph replay emits the eager engine's tokens,
    through ``generate``, ``run_step`` and the overlap scheduler; every step replayed (top-p variant)."""
    over = {"speculative_config.use_rejection_sampling": rejection}
    eng = _gpu_engine(**over)
    eager = Engine(eng.config, use_cuda_graph=False)
    reqs = [Request([3 + i, 40 * i + 1, 7], max_new_tokens=12 + 3 * i,
                    sampling=SamplingParams(**[{}, dict(temperature=1.0, top_p=0.9), dict(temperature=0.7)][i % 3],
                                            seed=i)) for i in range(7)]
    want = [r.output_ids for r in eager.generate(reqs, "speculative")[0]]
    got = [r.output_ids for r in eng.generate(reqs, "speculative")[0]]
    assert got == want
    assert _serve(eng, reqs, "speculative") == want
    assert _serve(eng, reqs, "speculative", overlap=True) == want  # asynchronous launch, pinned copies, events
    assert TOP_P_VARIANT in _replayed(eng, "speculative") and eng.runner("speculative").eager_steps == 0
    runner = eng.runner("speculative")
    assert runner.captured(DEFAULT_VARIANT) == runner.captured(TOP_P_VARIANT) == [1, 2, 4, 8, 16]


def _staggered(eng: Engine, reqs: list[Request], mode: str) -> tuple[list[list[int]], int]:
    """``reqs`` arriving one a plan while the earlier ones decode (the overlap scheduler): every request's tokens, and
    how many admissions got no first token in their own plan (read a plan later)."""
    sched = Scheduler(eng, mode=mode, overlap=True)
    out = {i: [] for i in range(len(reqs))}
    deferred, i = 0, 0
    while i < len(reqs) or sched.num_active:
        admit = [(i, reqs[i])] if i < len(reqs) and sched.num_free_slots else []
        events, _ = sched.apply(StepPlan(admit=admit))
        if admit and sched.in_flight and not any(e.handle == i for e in events):
            deferred += 1
        i += len(admit)
        for e in events:
            assert e.error is None, e.error
            out[e.handle] += e.tokens
    return [out[i] for i in range(len(reqs))], deferred


@cuda_only
@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_gpu_admissions_while_decoding_equal_eager(mode):
    """Requests arriving one a plan while others decode (the overlap scheduler, graphs): each prefill is launched
    behind the step in flight and its first token read back a plan later, the request already in the next launch
    (its first token and drafts read on the device, the first block's confidences copied before that step rewrites
    them); every request gets the tokens of the eager engine under the same arrivals (the same prefill shapes), and
    at least half of the admissions' first tokens came a plan after them."""
    eng = _gpu_engine()
    eager = Engine(eng.config, use_cuda_graph=False)
    reqs = [Request([3 + i, 40 * i + 1, 7, 11 * i], max_new_tokens=6 + 2 * (i % 5),
                    sampling=SamplingParams(**[{}, dict(temperature=1.0, top_p=0.9), dict(temperature=0.7)][i % 3],
                                            seed=i)) for i in range(12)]
    want, _ = _staggered(eager, reqs, mode)
    got, deferred = _staggered(eng, reqs, mode)
    assert got == want and all(len(t) == r.max_new_tokens for t, r in zip(got, reqs))
    assert deferred >= len(reqs) // 2, deferred


GPU_PROCESSED_ROWS = [  # every field, greedy and sampled, beside unprocessed greedy / top-p rows
    {}, dict(temperature=1.0, top_p=0.9),
    dict(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4),
    dict(temperature=1.2, top_k=20, min_p=0.05, logit_bias={9: 2.0, 40: -5.0}),
    dict(logit_bias={13: 100.0}),
    dict(temperature=0.9, top_p=0.8, top_k=3, repetition_penalty=1.2),
    dict(temperature=1.0, min_p=0.3, frequency_penalty=-0.5),
]


@cuda_only
@pytest.mark.parametrize("mode,rejection", [("speculative", False), ("speculative", True), ("target_only", False)])
def test_gpu_processed_rows_replay_and_equal_eager(mode, rejection):
    """Real graphs: steps with processed rows (every field, greedy and sampled, beside greedy and top-p rows)
    replay the processed graph -- no step runs eagerly -- and emit the eager engine's tokens, through
    ``generate`` and ``run_step`` (serve's loop)."""
    eng = _gpu_engine(**{"speculative_config.use_rejection_sampling": rejection})
    eager = Engine(eng.config, use_cuda_graph=False)
    reqs = [Request([3 + i, 40 * i + 1, 7], max_new_tokens=12 + 3 * i, sampling=SamplingParams(**row, seed=i))
            for i, row in enumerate(GPU_PROCESSED_ROWS)]
    want = [r.output_ids for r in eager.generate(reqs, mode)[0]]
    assert want[4] == [13] * len(want[4])  # the fields act
    runner = eng.runner(mode)
    runner.replays.clear()
    got = [r.output_ids for r in eng.generate(reqs, mode)[0]]
    assert got == want
    assert PROCESSED_TOP_P_VARIANT in _replayed(eng, mode) and runner.eager_steps == 0
    assert runner.captured(PROCESSED_TOP_P_VARIANT) == [1, 2, 4, 8, 16]
    assert _serve(eng, reqs, mode) == want and runner.eager_steps == 0


# ---------------------------------------------------------------------------------------------------
# Graphs by default on a CUDA device (serve, generate, bench serve), off by config or flag, none on a CPU
# ---------------------------------------------------------------------------------------------------
def test_graphs_are_on_by_default_on_cuda_and_off_by_null_or_flag(monkeypatch, tmp_path, caplog):
    from tensorrt_llm_ext.cli import build_parser
    from tensorrt_llm_ext.logger import _seen_once
    from tensorrt_llm_ext.runtime.serve_cli import use_cuda_graph

    cfg = load_config(**{"max_batch_size": 12})
    assert cfg.cuda_graph_config is not None and cfg.graph_batch_sizes() == (1, 2, 4, 8, 12)
    off = tmp_path / "off.yaml"
    off.write_text("cuda_graph_config: null\n")
    no_cfg = load_config(off)
    assert no_cfg.cuda_graph_config is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_cuda_graph(cfg) and not use_cuda_graph(no_cfg)
    assert not use_cuda_graph(cfg, False) and use_cuda_graph(no_cfg, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _seen_once.discard("CUDA graphs: no CUDA device, every step runs eagerly")
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        assert not use_cuda_graph(cfg) and not use_cuda_graph(cfg, True) and not use_cuda_graph(no_cfg)
    assert sum("no CUDA device" in r.getMessage() for r in caplog.records) == 1
    parser = build_parser()
    for command in ("serve", "generate"):
        assert parser.parse_args([command]).cuda_graph is None  # the config decides
        assert parser.parse_args([command, "--no-cuda-graph"]).cuda_graph is False
        assert parser.parse_args([command, "--cuda-graph"]).cuda_graph is True


def test_graphs_off_runs_every_step_eagerly_without_a_log_line(monkeypatch, caplog):
    """A CPU engine (graphs off) runs each mode's steps through the same runner, eagerly, logging nothing per step."""
    _fast_eager_kernels(monkeypatch)
    eng = _engine(monkeypatch, graphs=False)
    with caplog.at_level("WARNING", logger="tensorrt_llm_ext"):
        for mode in ("stock", "target_only"):
            eng.generate(_batch("mixed", 3), mode)
            assert not eng.runner(mode).enabled and eng.runner(mode).eager_steps > 0
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]


@cuda_only
def test_gpu_the_old_rule_drops_top_p():
    """What ``serve --cuda-graph`` did before the rule lived in the runner: the rows prepared for their top-p
    step, then the default graph (captured without the top-p restriction) replayed. The same 12 seeds then
    stop answering the greedy answer -- the failure the rule above prevents, shown on real graphs."""

    class OldRule(CudaGraphRunner):
        def step(self, slots):
            b = plan_step(len(slots), DEFAULT_VARIANT, [k for k in self.graphs if k[1] == DEFAULT_VARIANT]).batch_size
            self.worker.set_rows(list(slots), b)  # the rows' own variant (top-p) ...
            return self._replay((b, DEFAULT_VARIANT))  # ... but a graph captured without it

    eng = _gpu_engine()
    prompt = [5, 17, 300, 42, 7, 7]
    want = [r.output_ids for r in eng.generate([Request(list(prompt), max_new_tokens=24) for _ in range(SEEDS)])[0]]
    runner = eng.runner("speculative")
    old = OldRule(runner.worker, runner.forward, batch_sizes=runner.batch_sizes)
    old.graphs = runner.graphs  # the engine's own captured graphs
    eng._runners["speculative"] = old
    sampled = [Request(list(prompt), max_new_tokens=24, sampling=SamplingParams(temperature=1.0, top_p=1e-3, seed=s)) for s in range(SEEDS)]
    served = _serve(eng, sampled, "speculative")
    assert sum(s == w for s, w in zip(served, want)) < SEEDS
