"""Engine exception safety and per-request validation: whatever escapes a prefill, a step or the
progress callback hands every slot and page back, and the next generate() equals a fresh engine's."""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import MIN_TEMPERATURE, Request
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 301, "model.target.capture_layers": [1], "max_batch_size": 2,
                       "max_seq_len": 40, "kv_cache_config.tokens_per_block": 4})


def _requests():
    # Three requests through two slots: the third is admitted when a slot frees up.
    return [Request([3, 4, 5], 5), Request([7] * 9, 5, sampling=SamplingParams(temperature=0.7, seed=5)), Request([250, 1, 2, 9], 4)]


class Injected(Exception):
    pass


_FRESH: dict[str, list[list[int]]] = {}


def _fresh_outputs(markov_mode: str) -> list[list[int]]:
    """A fresh engine's tokens for ``_requests()`` (computed once per Markov mode): its target's own decode, which
    the speculative tokens equal (lossless under strict acceptance), at a fraction of the interpreter's time."""
    if markov_mode not in _FRESH:
        results, _ = _engine(markov_mode).generate(_requests(), "reference")
        assert all(r.finish_reason == "length" for r in results)
        _FRESH[markov_mode] = [r.output_ids for r in results]
    return _FRESH[markov_mode]


def _engine(markov_mode):
    return Engine(load_config(**SMALL, **{"speculative_config.markov_chain_mode": markov_mode}))


def _assert_recovered(engine, markov_mode="exact"):
    assert engine.slots.num_free == engine.slots.num_slots
    assert engine.pages.num_free == engine.pages.num_pages
    assert int((engine.pages.encoded_offsets >= 0).sum()) == 0
    results, _ = engine.generate(_requests())  # would spin forever with leaked slots
    assert [r.output_ids for r in results] == _fresh_outputs(markov_mode)
    assert engine.slots.num_free == engine.slots.num_slots


def _raise_on_call(n, exc):
    calls = {"n": 0}

    def hook(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
    return hook


def test_exception_in_prefill_then_good_generate(monkeypatch):
    """The second admission's batched prefill (the third request, while the first two are active) fails."""
    engine = _engine("exact")
    worker = engine.worker()
    real = worker.launch_prefill_batch
    hook = _raise_on_call(2, Injected("prefill of the second admission fails"))

    def launch_prefill_batch(*args, **kwargs):
        hook()
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "launch_prefill_batch", launch_prefill_batch)
    with pytest.raises(Injected):
        engine.generate(_requests())
    monkeypatch.undo()
    _assert_recovered(engine)


def test_exception_mid_step_then_good_generate(monkeypatch):
    """The step raises after the target, the acceptance and the ctx_len advance ran (in the draft)."""
    engine = _engine("exact")
    worker = engine.worker()
    real = worker.draft
    hook = _raise_on_call(3, Injected("draft of the second step fails"))  # 1 batched prefill, step 1, step 2

    def draft(*args, **kwargs):
        hook()
        return real(*args, **kwargs)

    monkeypatch.setattr(worker, "draft", draft)
    with pytest.raises(Injected):
        engine.generate(_requests())
    monkeypatch.undo()
    _assert_recovered(engine)


@pytest.mark.parametrize("markov_mode", ["exact", "fused"])
def test_exception_inside_markov_chain_then_good_generate(markov_mode, monkeypatch):
    """The chain's exchange raises after its first launch (a collective timeout at TP > 1): the
    workspace must be left clean, or the fused mode's next chain resolves wrong tokens silently."""
    engine = _engine(markov_mode)
    chain = engine.worker().markov

    class TimedOut:
        def exchange_(self, keys):
            raise Injected("simulated collective timeout inside the chain")

    engine.generate([Request([3, 4, 5], 2)])  # one good request first
    monkeypatch.setattr(chain, "exchange", TimedOut())
    with pytest.raises(Injected):
        engine.generate(_requests())
    monkeypatch.undo()
    _assert_recovered(engine, markov_mode)


@pytest.mark.parametrize("exc", [Injected("callback failed"), KeyboardInterrupt("Ctrl-C")])
def test_exception_in_progress_callback_then_good_generate(exc):
    engine = _engine("exact")
    with pytest.raises(type(exc)):
        engine.generate(_requests(), progress=_raise_on_call(3, exc))  # after 2 prefilled requests, in the first step
    _assert_recovered(engine)


def test_generate_called_again_while_it_runs_is_refused():
    """generate() re-entered from its progress callback (the same holds for a second thread) refuses at once; the
    running call is untouched (was: the inner call found no free slot, raised "a broken invariant" and released the
    outer call's slots, which then died with "slot 0 released twice")."""
    engine = _engine("exact")
    inner = []

    def progress(_):
        if not inner:
            with pytest.raises(RuntimeError, match="already running a generate"):
                engine.generate([Request([9, 9], 3)])
            inner.append(True)

    results, _ = engine.generate(_requests(), progress=progress)
    assert inner and [r.output_ids for r in results] == _fresh_outputs("exact")
    _assert_recovered(engine)


BAD_FIELDS = [
    (Request([1, 2], 4, stop_token_ids=5), "stop_token_ids"),
    (Request([1, 2], 4, stop_token_ids=None), "stop_token_ids"),
    (Request([1, 2], 4, stop_token_ids=("a",)), "stop_token_ids"),
    (Request([1, 2], 4, sampling=SamplingParams(temperature=None)), "temperature"),
    (Request([1, 2], 4, sampling=SamplingParams(temperature=float("inf"))), "temperature"),
    (Request([1, 2], 4, sampling=SamplingParams(temperature=True)), "temperature"),
    (Request(None, 4), "prompt_ids"),
    (Request("1 2 3", 4), "prompt_ids"),
    (Request([1, 2.0], 4), "prompt_ids"),
    (Request([1, 2], None), "max_new_tokens"),
    (Request([1, 2], 4.0), "max_new_tokens"),
    (Request([1, 2], 4, sampling=SamplingParams(seed="7")), "seed"),
    (Request([1, 2], 4, request_id="x"), "request_id"),
    ({"prompt_ids": [1, 2]}, "expected a Request"),
    # generate()'s results carry neither: refused (prompt_logprobs were computed and silently dropped)
    (Request([1, 2], 4, logprobs=2), "logprobs are reported by the step-level API"),
    (Request([1, 2], 4, prompt_logprobs=2), "prompt_logprobs are reported by the step-level API"),
]


def test_badly_typed_fields_are_their_requests_errors():
    """Each bad field (wrong types included) is its request's error; the good requests around them are
    served exactly as alone."""
    engine = _engine("exact")
    good = [Request([3, 4, 5], 4), Request([7] * 9, 4)]
    alone, _ = engine.generate(good, "reference")  # what the speculative tokens equal, served alone
    batch = [good[0]] + [bad for bad, _ in BAD_FIELDS] + [good[1]]
    results, _ = engine.generate(batch)
    assert [r.finish_reason for r in results] == ["length"] + ["error"] * len(BAD_FIELDS) + ["length"]
    for (_, match), r in zip(BAD_FIELDS, results[1:-1]):
        assert match in r.error and r.output_ids == [], r.error
    assert [results[0].output_ids, results[-1].output_ids] == [r.output_ids for r in alone]
    assert engine.slots.num_free == engine.slots.num_slots


@pytest.mark.parametrize("requests", [Request([3, 4, 5], 5), None, "3 4 5", 7], ids=["Request", "None", "str", "int"])
def test_generate_names_requests_that_are_not_a_list(requests):
    """A lone Request (was: ``KeyError: 0`` from its field lookup), None, a string (was: one error per character):
    one TypeError naming the argument; an iterable of requests is served as its list. A ``progress`` that is not
    callable is named before any work too."""
    engine = _engine("exact")
    with pytest.raises(TypeError, match="generate: requests must be a list of Request, got " + type(requests).__name__):
        engine.generate(requests)
    with pytest.raises(TypeError, match="generate: progress must be a callable or None, got int"):
        engine.generate(_requests(), progress=1)  # was: "'int' object is not callable" after the first step
    results, _ = engine.generate(r for r in _requests()[:1])
    assert [r.output_ids for r in results] == _fresh_outputs("exact")[:1]
    assert engine.slots.num_free == engine.slots.num_slots


@pytest.mark.parametrize("rejection", [False, True], ids=["strict", "rejection_sampling"])
def test_tiny_temperature_is_served_greedy_on_every_path(rejection):
    """``0 < T < MIN_TEMPERATURE`` is its T -> 0 limit on every path: the keyed Gumbel draw, the verification
    (strict or rejection sampling) and the target-only decode all give the greedy tokens, for every seed (was:
    ``x / T`` overflowed fp32 below ~2e-38 and every path agreed on ``[1, 0, 0, ...]``)."""
    assert Request([1], sampling=SamplingParams(temperature=MIN_TEMPERATURE)).sampling.effective_temperature == MIN_TEMPERATURE
    assert Request([1], sampling=SamplingParams(temperature=MIN_TEMPERATURE * 0.99)).sampling.effective_temperature == 0.0
    engine = Engine(load_config(**SMALL, **{"speculative_config.use_rejection_sampling": rejection}))
    prompts = [[3, 4, 5], [7] * 9]
    greedy = [r.output_ids for r in engine.generate([Request(p, 4) for p in prompts], "reference")[0]]
    for t, mode in ((1e-45, "speculative"), (2e-38, "gathered"), (2e-38, "reference")):
        reqs = [Request(p, 4, sampling=SamplingParams(temperature=t, seed=s, top_p=0.9)) for s, p in enumerate(prompts, start=11)]
        results, _ = engine.generate(reqs, mode=mode)
        assert [r.output_ids for r in results] == greedy, (t, mode)
