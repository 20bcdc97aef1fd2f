"""Serving's start-up warm-up (``runtime/warmup.py``): every kind of admission once, through a scheduler of its own.

On a CPU (forced): every round runs to completion, every slot and page is free again, and the requests served after
it get exactly the tokens a cold engine gives them. On the GPU, as ``serve`` runs it (graphs captured): traffic of
every sampling kind at row counts and prompt lengths the warm-up never ran builds no Triton kernel (a build there
stalled the first T = 1 requests of a fresh server by 2.3-2.7 s)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.compile_watch import CompileWatch, compile_watch
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.runtime.warmup import WARMUP_SAMPLING, warm_up, warmup_rounds
from tensorrt_llm_ext.testing.tiny_models import tiny_model

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _traffic(vocab: int, lengths: list[int], seed: int = 0) -> list[Request]:
    """Requests of every warm-up sampling kind (and a greedy one with penalties only), prompts of ``lengths``."""
    kinds = [*WARMUP_SAMPLING.values(), SamplingParams(repetition_penalty=1.3, presence_penalty=0.4)]
    out = []
    for i, n in enumerate(lengths):
        s = kinds[i % len(kinds)]
        s = replace(s, seed=seed + i) if s.temperature else s
        out.append(Request([(i * 131 + j * 17 + 3) % vocab for j in range(n)], max_new_tokens=6 + i % 4,
                           ignore_eos=True, sampling=s))
    return out


def _one_of_each(rounds: list[tuple[str, int, int, dict]]) -> list[tuple[str, int, int, dict]]:
    """Of ``rounds``, each sampling kind's widest admission (most rows, then the longest prompt), the longest greedy
    prompt and the ``logprobs`` round: every kind of admission and step the warm-up runs, in ~1/5 of the whole set's
    interpreter time (the whole set, ~30 rounds, took ~80 CPU s of a 2-core CI machine in the speculative mode)."""
    picked: dict[tuple[str, bool], tuple[str, int, int, dict]] = {}
    for r in rounds:
        key = (r[0], bool(r[3]))
        if key not in picked or r[1:3] > picked[key][1:3]:
            picked[key] = r
    longest = max((r for r in rounds if r[0] == "greedy" and not r[3]), key=lambda r: r[2])
    out = list(picked.values())
    return out + [longest] * (longest not in out)


def test_rounds_cover_every_kind_row_count_and_length():
    """The whole set (not run here: the tests below run :func:`_one_of_each` of it): every sampling kind at every
    row count and prompt length that fits, the logprobs round, and the greedy powers of two."""
    eng = Engine(load_config(**tiny_model(**{"max_batch_size": 4, "max_seq_len": 64})))
    rounds = warmup_rounds(eng)
    room = 64 - 2 * (eng.draft_len + 1) - 1 - eng.draft_len - 2
    for kind in WARMUP_SAMPLING:
        assert {(r, n) for k, r, n, x in rounds if k == kind and not x} >= {(1, n) for n in (1, 7, 16, 40, 48)
                                                                             if n <= room} | {(2, 7), (3, 7)}
    assert [x for *_, x in rounds if x] == [{"logprobs": 2, "prompt_logprobs": 2}]
    assert {n for k, r, n, x in rounds if k == "greedy" and r == 1} >= {1, 2, 4, 8, 16, 32} & set(range(room + 1))
    assert len(_one_of_each(rounds)) == 6 and {k for k, *_ in _one_of_each(rounds)} == set(WARMUP_SAMPLING)


@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_warm_up_leaves_no_state_and_the_same_tokens(mode):
    cfg = {"model.target.vocab_size": 301, "max_batch_size": 4, "max_seq_len": 64,
           "speculative_config.use_rejection_sampling": True}
    warm, cold = (Engine(load_config(**tiny_model(**cfg))) for _ in range(2))
    warm.runner(mode)
    slots, pages = warm.slots.num_free, warm.pages.num_free
    rounds = _one_of_each(warmup_rounds(warm))
    report = warm_up(warm, mode, overlap=True, force=True, rounds=rounds)
    assert report.skipped is None and report.rounds == len(rounds)
    assert report.requests == sum(r for _, r, _, _ in rounds)
    assert {k for k, _, _, _ in rounds} == set(WARMUP_SAMPLING)
    assert (warm.slots.num_free, warm.pages.num_free) == (slots, pages)
    reqs = _traffic(301, [3, 9, 1, 17, 8, 30])
    got, _ = warm.generate(reqs, mode)
    want, _ = cold.generate(_traffic(301, [3, 9, 1, 17, 8, 30]), mode)
    assert [r.finish_reason for r in got] == ["length"] * len(reqs)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_warm_up_skips_on_a_cpu_or_when_switched_off_unless_forced(monkeypatch):
    import dataclasses

    import tensorrt_llm_ext.runtime.warmup as warmup

    eng = Engine(load_config(**tiny_model()), device="cpu")
    eng.runner("target_only")
    report = warm_up(eng, "target_only", overlap=False)
    assert report.rounds == 0 and "CPU" in report.skipped
    monkeypatch.setattr(warmup, "ENV", dataclasses.replace(warmup.ENV, serve_warmup=False))
    report = warm_up(eng, "target_only", overlap=False)
    assert report.rounds == 0 and report.skipped == "TLLM_EXT_SERVE_WARMUP=0"
    assert warm_up(eng, "target_only", overlap=False, force=True, rounds=warmup_rounds(eng)[:1]).rounds == 1


def test_compile_watch_counts_and_warns_only_when_serving(caplog):
    """The hooks as Triton calls them (keyword arguments): counted always, a warning only once serving; a hook
    that was installed before still runs and its answer to the pre-build hook is kept."""
    seen = []
    w = CompileWatch()
    w._previous = (lambda **k: seen.append(("before", k["repr"])) or None,
                   lambda **k: seen.append(("after", k["repr"])))
    kw = {"key": 1, "repr": "_k[num_warps=4](x: *fp32)", "fn": type("F", (), {"name": "_k"})(), "compile": {},
          "is_manual_warmup": False, "already_compiled": False}
    assert w.before_build(**kw) is None
    w.after_build(**kw)
    assert w.count == 1 and w.seconds >= 0
    assert not [r for r in caplog.records if "compile watch" in r.getMessage()]
    w.serving()
    w.before_build(**kw)
    w.after_build(**kw)
    assert w.count == 2
    msgs = [r.getMessage() for r in caplog.records if "compile watch" in r.getMessage()]
    assert len(msgs) == 1 and "_k" in msgs[0] and "x: *fp32" in msgs[0]
    assert seen == [("before", kw["repr"]), ("after", kw["repr"])] * 2


@cuda_only
@pytest.mark.parametrize("mode", ["speculative", "target_only"])
def test_gpu_no_kernel_build_after_warm_up(mode):
    """As ``serve`` starts (graphs, the runner, the warm-up), then traffic at row counts (3, 5, 11, 16) and prompt
    lengths (1 .. past the largest prefill bucket) the warm-up never ran: no Triton build."""
    cfg = {"model.target.vocab_size": 301, "max_batch_size": 16, "max_seq_len": 160,
           "speculative_config.use_rejection_sampling": True, "cuda_graph_config.prefill_max_tokens": 64}
    eng = Engine(load_config(**tiny_model(**cfg)), use_cuda_graph=True)
    eng.runner(mode)
    assert compile_watch.install()
    report = warm_up(eng, mode, overlap=False)
    assert report.rounds == len(warmup_rounds(eng)) and max(n for _, _, n, _ in warmup_rounds(eng)) > 64
    before = compile_watch.count
    compile_watch.serving()  # each build below is a warning naming its specialization (what the warm-up missed)
    try:
        for lengths in ([5, 40, 1], [2, 3, 70, 11, 90], list(range(1, 12)), [13 + 5 * i for i in range(16)],
                        [24], [33], [64, 32], [100]):
            results, _ = eng.generate(_traffic(301, lengths, seed=len(lengths)), mode)
            assert all(r.finish_reason == "length" for r in results)
    finally:
        compile_watch.serving(False)
    assert compile_watch.count == before, f"{compile_watch.count - before} Triton builds after the warm-up"


def test_warm_up_on_a_small_engine():
    """A cache that holds one request at max_seq_len (the smallest the engine sizes) runs every round, rows admitted
    as pages free, nothing left held; a max_seq_len no warm-up request fits skips the warm-up (a warning)."""
    small = Engine(load_config(**tiny_model(**{"max_seq_len": 64, "kv_cache_config.max_tokens": 48})))
    small.runner("target_only")
    slots, pages = small.slots.num_free, small.pages.num_free
    # the rounds the tight cache makes wait: the longest prompt and the admissions of several rows
    rounds = [r for r in warmup_rounds(small) if r[0] == "greedy" and not r[3] and (r[1] > 1 or r[2] == 48)]
    report = warm_up(small, "target_only", overlap=False, force=True, rounds=rounds)
    assert report.skipped is None and report.skipped_requests == 0 and report.failed == 0
    assert report.rounds == len(rounds) == 3 and max(n for _, _, n, _ in warmup_rounds(small)) == 48
    assert (small.slots.num_free, small.pages.num_free) == (slots, pages)
    tight = Engine(load_config(**tiny_model(**{"max_seq_len": 12})))
    tight.runner("target_only")
    assert warmup_rounds(tight) == []
    report = warm_up(tight, "target_only", overlap=False, force=True)
    assert report.rounds == 0 and "max_seq_len=12" in report.skipped


def test_builds_while_serving_in_metrics(monkeypatch):
    """/metrics counts the builds after the server was ready and their seconds (0 until one happens); the builds
    before it (capture, the warm-up) are not counted there."""
    import tensorrt_llm_ext.runtime.compile_watch as cw
    from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics

    watch = CompileWatch()
    monkeypatch.setattr(cw, "compile_watch", watch)
    metrics = ServerMetrics(3, model_name="m")
    kw = {"repr": "_k[num_warps=4](x: *fp32)", "fn": type("F", (), {"name": "_k"})()}

    def series(name: str) -> float:
        line = [ln for ln in metrics.render().decode().splitlines() if ln.startswith(f"trtllm_ext_{name}_total{{")]
        assert len(line) == 1 and 'model_name="m"' in line[0]
        return float(line[0].rsplit(" ", 1)[1])

    watch.before_build(**kw)
    watch.after_build(**kw)  # before serving: not counted here
    assert series("kernel_builds_while_serving") == 0 and series("kernel_build_seconds_while_serving") == 0
    watch.serving()
    for _ in range(2):
        watch.before_build(**kw)
        watch.after_build(**kw)
    assert series("kernel_builds_while_serving") == 2 and watch.count == 3
    assert series("kernel_build_seconds_while_serving") == watch.serving_seconds >= 0


def test_warm_up_with_a_speculation_gate(caplog):
    """With a speculation gate configured the warm-up also runs the target-only decode's admissions (the traffic
    decodes there once the gate closes), and its own schedulers run without a gate: its random prompts' acceptance
    closes no gate and logs no verdict; the serving scheduler built after it starts with an open gate."""
    from tensorrt_llm_ext.runtime.scheduler import Scheduler

    cfg = {"max_batch_size": 4, "max_seq_len": 40, "speculative_config.acceptance_window": 2,
           "speculative_config.acceptance_length_threshold": 3.5}
    eng = Engine(load_config(**tiny_model(**cfg)))
    eng.runner("speculative")
    slots, pages = eng.slots.num_free, eng.pages.num_free
    rounds = _one_of_each(warmup_rounds(eng))[:2]  # greedy and sampled: what the gate test needs is both modes
    report = warm_up(eng, "speculative", overlap=True, force=True, rounds=rounds)
    assert report.rounds == 2 * len(rounds) and report.failed == 0
    assert (eng.slots.num_free, eng.pages.num_free) == (slots, pages)
    assert not [r for r in caplog.records if "speculation gate" in r.getMessage()]
    assert any("speculative/target_only" in r.getMessage() for r in caplog.records if "warm-up:" in r.getMessage())
    serving = Scheduler(eng, mode="speculative", overlap=True)
    assert serving.gate is not None and not serving.gate.closed and serving.step_mode == "speculative"
