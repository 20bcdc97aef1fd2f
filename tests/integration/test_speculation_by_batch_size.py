"""Speculation by batch size (``speculative_config.max_concurrency``, TensorRT-LLM's rule): a plan with more requests
in flight than it says decodes target-only, one with at most that many speculatively. The running requests are
handed between the two decodes mid-stream: to the target-only decode as the speculation gate hands them, back by a
speculative prefill of what they decoded target-only (their drafter latents), whose token is their next one. A
greedy request's tokens are the target's own across every switch."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.runtime.config import ConfigError, load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.testing.requests import make_request
from tensorrt_llm_ext.testing.scheduling import SMALL, eager_engine, graphed_engines, prompt, serve_plans
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SWITCHED = {**SMALL, "speculative_config.max_concurrency": 2}


# Four in flight at plan 0 (target-only, above 2), two once 0 and 1 finish (speculative again), three when 4
# arrives (target-only), two once it or another finishes (speculative).
REQUESTS = {
    0: {"prompt_ids": prompt(0), "max_new_tokens": 3, "ignore_eos": True},
    1: {"prompt_ids": prompt(1), "max_new_tokens": 5, "ignore_eos": True},
    2: {"prompt_ids": prompt(2), "max_new_tokens": 24, "ignore_eos": True, "repetition_penalty": 1.8,
        "presence_penalty": 0.5, "frequency_penalty": 0.3},
    3: {"prompt_ids": prompt(3), "max_new_tokens": 20, "ignore_eos": True, "temperature": 0.8, "seed": 3},
    4: {"prompt_ids": prompt(4), "max_new_tokens": 6, "ignore_eos": True},
}
LATE = 9  # the plan request 4 arrives in


@pytest.fixture(scope="module")
def engines():
    import tensorrt_llm_ext.kernels.rms_norm as rms

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rms, "triton_runs_on", lambda t: False)
        yield eager_engine(SWITCHED), eager_engine(SMALL)


def _serve(engine: Engine, overlap: bool, mode: str = "speculative", modes: list[str] | None = None
           ) -> tuple[dict[int, list[int]], Scheduler]:
    """Requests 0-3 admitted together, 4 at plan ``LATE`` (:func:`serve_plans`)."""
    return serve_plans(engine, REQUESTS, {0: (0, 1, 2, 3), LATE: (4,)}, overlap, mode, modes)


def _switches(modes: list[str]) -> list[str]:
    """The decodes of ``modes`` with repeats removed (the order the steps went through them)."""
    return [m for i, m in enumerate(modes) if i == 0 or modes[i - 1] != m]


def test_the_config_takes_max_concurrency_as_a_rule():
    with pytest.raises(ConfigError, match="max_concurrency"):
        load_config(**tiny_model(**{"speculative_config.max_concurrency": 0}))
    cfg = load_config(**tiny_model(**{"speculative_config.max_concurrency": 3}))
    assert cfg.speculative_config.max_concurrency == 3
    assert not [f for f, _, _ in cfg.no_effect_fields() if "max_concurrency" in f]  # no longer "no effect here"


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_running_requests_switch_decodes_with_the_number_in_flight(engines, overlap):
    switched, plain = engines
    modes: list[str] = []
    got, sch = _serve(switched, overlap, modes=modes)
    # target-only while 3-4 run, speculative at 2: both ways, twice (the late request forces the second round)
    assert _switches(modes) == ["target_only", "speculative", "target_only", "speculative"], _switches(modes)
    assert sch.mode_switches == 4
    want, _ = _serve(plain, overlap, mode="target_only")  # the target's own decode, no speculation at all
    for h in (0, 1, 2, 4):  # greedy (2 with every count-based penalty): the target's tokens across every switch
        assert got[h] == want[h], h
    assert len(got[3]) == 20  # sampled: a valid draw of its own length
    again, _ = _serve(switched, overlap)
    assert again == got  # seeded: the same tokens


def test_the_resume_prefills_from_where_the_latents_end_and_counts_the_tokens_out(engines, monkeypatch):
    """Each resume prefills, speculatively, the request's prompt and tokens out from its last token stored with a
    latent, the tokens out counted as generated (the penalties read them), and its token is a step's (accepted 1),
    not a first token."""
    switched, _ = engines
    resumes = []
    real = switched.launch_prefill

    def spy(slots, requests, mode="speculative", starts=None, prompt_lens=None, **kw):
        if prompt_lens is not None:
            resumes.extend((len(r.prompt_ids), k, s) for r, k, s in zip(requests, prompt_lens, starts))
        return real(slots, requests, mode, starts, prompt_lens, **kw)

    monkeypatch.setattr(switched, "launch_prefill", spy)
    got, sch = _serve(switched, overlap=False)
    assert resumes, "no request resumed speculation"
    for seq, prompt, start in resumes:
        assert prompt < seq and prompt - 1 <= start < seq  # outputs appended; the prompt's last position at most
    # requests 2 and 3 resumed in both speculative rounds, request 4 (or the other survivor) in the second
    assert len(resumes) >= 4


def test_chunked_resume_equals_the_target_only_decode(engines):
    """With chunked prefill at 4 tokens a plan, a resume's prefill runs over several plans while the others step,
    and the switches still leave the target's own tokens."""
    switched, plain = engines
    with pytest.MonkeyPatch.context() as mp:
        for eng in (switched, plain):
            mp.setattr(eng, "chunked_prefill", True)
            mp.setattr(eng, "max_num_tokens", 4)
        chunks = []
        real = switched.prefill_chunk
        mp.setattr(switched, "prefill_chunk", lambda *a, **k: (chunks.append(a[2:4]), real(*a, **k))[1])
        modes: list[str] = []
        got, _ = _serve(switched, overlap=True, modes=modes)
        want, _ = _serve(plain, overlap=True, mode="target_only")
    assert "speculative" in modes and "target_only" in modes and chunks
    for h in (0, 1, 2, 4):
        assert got[h] == want[h], h


def test_a_resume_in_its_chunks_stops_when_the_batch_grows_again(engines):
    """Chunked prefill at 4 tokens a plan: when request 4 arrives while a resume is still in its chunks (its last
    prefill not launched), that request decodes on target-only from where its chunks stopped -- no re-prefill
    wasted, the target's own tokens -- whichever plan it arrives in."""
    switched, plain = engines
    stopped = []
    hand_over = Scheduler._hand_over

    def spy(self):
        stopped.append(sum(p.resumed is not None for p in self._prefilling.values()))
        hand_over(self)
        assert not any(p.resumed is not None for p in self._prefilling.values())

    with pytest.MonkeyPatch.context() as mp:
        for eng in (switched, plain):
            mp.setattr(eng, "chunked_prefill", True)
            mp.setattr(eng, "max_num_tokens", 4)
        mp.setattr(Scheduler, "_hand_over", spy)
        for late in range(6, 14):
            arrivals = {0: (0, 1, 2, 3), late: (4,)}
            got, _ = serve_plans(switched, REQUESTS, arrivals, overlap=True)
            want, _ = serve_plans(plain, REQUESTS, arrivals, overlap=True, mode="target_only")
            for h in (0, 1, 2, 4):
                assert got[h] == want[h], (late, h)
    assert any(stopped), stopped  # some arrival met a resume in its chunks


def test_pages_registered_while_decoding_target_only_stop_where_the_latents_do():
    """Block reuse: a request that finishes while decoding target-only registers its pages under the speculative
    prefix root only up to its last position with a drafter latent -- a later speculative prompt never maps a page
    whose latents no step stored."""
    import tensorrt_llm_ext.kernels.rms_norm as rms

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rms, "triton_runs_on", lambda t: False)
        eng = eager_engine({**SWITCHED, "kv_cache_config.enable_block_reuse": True})
        plain = eager_engine({**SMALL, "kv_cache_config.enable_block_reuse": True})
        latents_end: dict[tuple, int | None] = {}  # prompt -> where its latents end (None: every position)
        checked = []
        hand_over, prefilled, register, launch = (eng.hand_over_to_target_only, eng.hand_over_prefilled_to_target_only,
                                                  eng.register_prefix, eng.launch_prefill)

        def on_hand_over(slots, requests, outputs):
            for r, o in zip(requests, outputs):
                latents_end[tuple(r.prompt_ids)] = len(r.prompt_ids) + len(o) - 1
            return hand_over(slots, requests, outputs)

        def own_prompt(ids) -> tuple:  # a resumed request's prompt_ids hold its tokens out too
            return next((p for p in latents_end if tuple(ids[:len(p)]) == p), tuple(ids))

        def on_prefilled(slots, requests):
            for r in requests:
                latents_end[own_prompt(r.prompt_ids)] = len(r.prompt_ids) - 1  # its last prompt position on
            return prefilled(slots, requests)

        def on_launch(slots, requests, mode="speculative", starts=None, prompt_lens=None, **kw):
            for r, k in zip(requests, prompt_lens or [None] * len(requests)):
                if k is not None:
                    latents_end[tuple(r.prompt_ids[:k])] = None  # resumed: latents written to its last token
            return launch(slots, requests, mode, starts, prompt_lens, **kw)

        def on_register(slot, request, mode="speculative", output_ids=()):
            end = latents_end.get(tuple(request.prompt_ids))
            if output_ids and end is not None and mode == "speculative":
                checked.append(len(request.prompt_ids) + len(output_ids) - 1)
                assert len(request.prompt_ids) + len(output_ids) - 1 <= end, (end, len(output_ids))
            return register(slot, request, mode, output_ids)

        mp.setattr(eng, "hand_over_to_target_only", on_hand_over)
        mp.setattr(eng, "hand_over_prefilled_to_target_only", on_prefilled)
        mp.setattr(eng, "launch_prefill", on_launch)
        mp.setattr(eng, "register_prefix", on_register)
        got, _ = _serve(eng, overlap=False)
        want, _ = _serve(plain, overlap=False, mode="target_only")
        assert checked, "no request finished while decoding target-only"
        for h in (0, 1, 2, 4):
            assert got[h] == want[h], h
        again, _ = _serve(eng, overlap=False)  # the same prompts now map the cached pages: the same tokens
        for h in (0, 1, 2, 4):
            assert again[h] == want[h], h


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_switches_decodes_under_graphs():
    """On the GPU with CUDA graphs: the scheduler captures the target-only decode when it is made, admissions above
    max_concurrency prefill speculatively and decode target-only, resumes replay the speculative prefill, and the
    greedy tokens across the switches are those of a target-only engine's graphs."""
    switched, plain = graphed_engines(SWITCHED)
    for overlap in (False, True):
        modes: list[str] = []
        got, _ = _serve(switched, overlap, modes=modes)
        assert _switches(modes) == ["target_only", "speculative", "target_only", "speculative"], _switches(modes)
        want, _ = _serve(plain, overlap, mode="target_only")
        for h in (0, 1, 2, 4):
            assert got[h] == want[h], (overlap, h)
        assert len(got[3]) == 20


def test_served_requests_switch_decodes_over_http():
    """``serve`` with max_concurrency 1 (the overlap scheduler, the engine loop): three greedy completions in flight
    decode target-only, the last one alone resumes speculation; every answer is the target's own decode, and the
    switches are counted by the scheduler."""
    import asyncio

    httpx = pytest.importorskip("httpx")
    from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG, reference_outputs, start_in_process

    bodies = [{"model": "dspark-embedded", "prompt": [5 + i, 17, 42, 9][: 2 + i], "max_tokens": n,
               "temperature": 0.0, "ignore_eos": True} for i, n in enumerate((12, 16, 30))]
    srv = start_in_process({**SMALL_SERVE_CONFIG, "speculative_config.max_concurrency": 1})
    try:
        async def post_all():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

        responses = asyncio.run(post_all())
        switches = srv.loop.scheduler.mode_switches
        text = httpx.get(srv.url + "/metrics", timeout=10).text
    finally:
        srv.stop(30)
    assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
    got = [r.json()["choices"][0]["token_ids"] for r in responses]
    assert got == reference_outputs(SMALL_SERVE_CONFIG, bodies)
    assert switches >= 2  # to the target-only decode while three ran, back for the last one
    metrics = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("trtllm_ext_speculation_")}
    assert metrics["trtllm_ext_speculation_switches_total"] == switches
    assert metrics["trtllm_ext_speculation_resumes_total"] >= 1  # the last request resumed at least once


def test_a_resume_refused_by_a_layer_below_fails_its_requests_and_the_engine_serves_on(engines, monkeypatch):
    """A request-level error in a resume's prefill (a layer below refusing a value) ends the requests of that prefill
    with an error after their tokens so far -- no token lost or repeated before it -- frees their slots and pages,
    and the engine serves the next request speculatively."""
    switched, plain = engines
    real = switched.launch_prefill
    refused = []

    culprit = REQUESTS[2]["prompt_ids"]

    def refusing(slots, requests, mode="speculative", starts=None, prompt_lens=None, **kw):
        if prompt_lens is not None and any(list(r.prompt_ids[:len(culprit)]) == culprit for r in requests):
            refused.append(len(requests))  # a batch with it fails; retried alone, it fails alone
            raise ValueError("top_p: expected values in (0, 1], got [0.0]")
        return real(slots, requests, mode, starts, prompt_lens, **kw)

    monkeypatch.setattr(switched, "launch_prefill", refusing)
    sch = Scheduler(switched, mode="speculative")
    out, ends = {h: [] for h in REQUESTS}, {}
    for i in range(300):
        admit = [(h, make_request(**REQUESTS[h])) for h in ((0, 1, 2, 3) if i == 0 else ())]
        events, _ = sch.apply(StepPlan(admit=admit))
        for e in events:
            out[e.handle].extend(e.tokens)
            if e.finish_reason:
                ends[e.handle] = (e.finish_reason, e.error)
        if len(ends) == 4:
            break
    assert refused and len(ends) == 4 and not sch.num_active
    assert ends[2][0] == "error" and "refused in its prefill" in ends[2][1], ends[2]
    assert 0 < len(out[2]) < REQUESTS[2]["max_new_tokens"]  # its tokens before the resume, then the error
    first4 = {h: REQUESTS[h] for h in (0, 1, 2, 3)}
    want, _ = serve_plans(plain, first4, {0: (0, 1, 2, 3)}, overlap=False, mode="target_only")
    assert out[2] == want[2][:len(out[2])] and out[0] == want[0] and out[1] == want[1]  # none lost or repeated
    for h in (0, 1, 3):  # the others, resumed in the same plan or not, run to their length
        assert ends[h][0] == "length" and len(out[h]) == REQUESTS[h]["max_new_tokens"], h
    assert switched.slots.num_free == SMALL["max_batch_size"] and switched.pages.num_free == switched.pages.num_pages
    got, _ = serve_plans(switched, {4: REQUESTS[4]}, {0: (4,)}, overlap=False)  # serves on
    assert len(got[4]) == REQUESTS[4]["max_new_tokens"]
