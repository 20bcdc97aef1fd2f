"""The speculation gate (``speculative_config.acceptance_window`` / ``acceptance_length_threshold``): the rolling
mean of accepted drafts per step over the last finished requests; once it falls below the threshold the scheduler
decodes target-only for good, the running requests handed over mid-stream with the target's own tokens."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.runtime.config import ConfigError, load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.scheduler import Scheduler
from tensorrt_llm_ext.runtime.speculation_gate import SpeculationGate
from tensorrt_llm_ext.speculative.logits_processing import SlotLogitsProcessors
from tensorrt_llm_ext.testing.scheduling import SMALL, eager_engine, graphed_engines, prompt, serve_plans
from tensorrt_llm_ext.testing.tiny_models import tiny_model

# closes at the first finished request that took a speculative step (no drafter accepts 100 drafts per step)
GATED = {**SMALL, "speculative_config.acceptance_window": 1, "speculative_config.acceptance_length_threshold": 100.0}


def test_gate_closes_for_good_when_the_rolling_mean_falls_below_the_threshold():
    gate = SpeculationGate(window=3, threshold=1.0)
    assert not gate.record(9, 3) and not gate.record(2, 2)  # 2.0 and 0.0 accepted drafts per step; 2 of 3 so far
    assert gate.rolling_mean is None and not gate.closed
    assert not gate.record(5, 0)  # no speculative step: not a record
    assert not gate.record(6, 3) and gate.rolling_mean == pytest.approx(1.0)  # (2 + 0 + 1) / 3: not below
    assert gate.record(1, 1, handle=7) and gate.closed  # (0 + 1 + 0) / 3 < 1: closed by this record
    assert gate.closed_mean == pytest.approx(1 / 3) and gate.finished == 4
    assert not gate.record(50, 2) and gate.closed and gate.finished == 4  # closed for good: nothing recorded
    with pytest.raises(ValueError, match="window"):
        SpeculationGate(0, 1.0)


def test_the_config_takes_the_gate_whole_or_not_at_all():
    with pytest.raises(ConfigError, match="takes both"):
        load_config(**tiny_model(**{"speculative_config.acceptance_window": 4}))
    with pytest.raises(ConfigError, match="takes both"):
        load_config(**tiny_model(**{"speculative_config.acceptance_length_threshold": 0.5}))
    with pytest.raises(ConfigError, match="acceptance_length_threshold"):
        load_config(**tiny_model(**{"speculative_config.acceptance_window": 4,
                                    "speculative_config.acceptance_length_threshold": float("nan")}))
    with pytest.raises(ConfigError):
        load_config(**tiny_model(**{"speculative_config.acceptance_window": -1,
                                    "speculative_config.acceptance_length_threshold": 0.5}))
    cfg = load_config(**tiny_model(**{"speculative_config.acceptance_window": 0}))  # TensorRT-LLM's "off"
    assert cfg.speculative_config.acceptance_window == 0
    # no longer in the "accepted, no effect here" list
    cfg = load_config(**tiny_model(**{"speculative_config.acceptance_window": 4,
                                      "speculative_config.acceptance_length_threshold": 0.5}))
    assert not [f for f, _, _ in cfg.no_effect_fields() if f.startswith("speculative_config.acceptance")]


@pytest.fixture(scope="module")
def engines():
    import tensorrt_llm_ext.kernels.rms_norm as rms

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rms, "triton_runs_on", lambda t: False)
        yield eager_engine(GATED), eager_engine(SMALL)


REQUESTS = {
    0: {"prompt_ids": prompt(0), "max_new_tokens": 2, "ignore_eos": True},  # finishes first: closes the gate
    1: {"prompt_ids": prompt(1), "max_new_tokens": 14, "ignore_eos": True},
    2: {"prompt_ids": prompt(2), "max_new_tokens": 12, "ignore_eos": True, "repetition_penalty": 1.8,
        "presence_penalty": 0.5},
    3: {"prompt_ids": prompt(3), "max_new_tokens": 10, "ignore_eos": True, "temperature": 0.8, "seed": 3},
    4: {"prompt_ids": prompt(4), "max_new_tokens": 6, "ignore_eos": True},  # arrives once the gate is closed
}


def _serve(engine: Engine, overlap: bool, modes: list[str] | None = None,
           mode: str = "speculative", late: int = 4, deferred: list[int] | None = None
           ) -> tuple[dict[int, list[int]], Scheduler]:
    """Requests 0-3 admitted together, 4 ``late`` plans later (:func:`serve_plans`)."""
    return serve_plans(engine, REQUESTS, {0: (0, 1, 2, 3), late: (4,)}, overlap, mode, modes, deferred)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_closed_gate_hands_the_running_requests_to_the_target_only_decode(engines, overlap):
    gated, plain = engines
    modes: list[str] = []
    got, sch = _serve(gated, overlap, modes)
    assert sch.gate is not None and sch.gate.closed and sch.step_mode == "target_only"
    # speculative steps until request 0 finished, then target-only steps only (never back)
    first = modes.index("target_only")
    assert first > 0 and set(modes[:first]) == {"speculative"} and set(modes[first:]) == {"target_only"}
    want, _ = _serve(plain, overlap, mode="target_only")  # the target's own decode, no speculation at all
    for h in (0, 1, 2, 4):  # greedy (2 with penalties): the target's tokens across the hand-over
        assert got[h] == want[h], h
    assert len(got[3]) == 10  # sampled: a valid draw of its own length, speculative then target-only
    again, _ = _serve(gated, overlap)
    assert again == got  # seeded: the same tokens


def test_a_first_token_not_read_back_when_the_gate_closes_is_handed_over_with_its_request():
    """Overlap: request 4 arrives (a fifth slot free) in the plan whose step ends request 0 and closes the gate; its
    speculative prefill is launched behind that step and read a plan later. The hand-over reads it first (the
    request's history holds its first token) and the request goes on target-only: the target's own tokens, like
    the requests running."""
    import tensorrt_llm_ext.kernels.rms_norm as rms

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rms, "triton_runs_on", lambda t: False)
        gated, plain = eager_engine({**GATED, "max_batch_size": 5}), eager_engine({**SMALL, "max_batch_size": 5})
        _serve_across_the_close(gated, plain)


def _serve_across_the_close(gated: Engine, plain: Engine) -> None:
    modes: list[str] = []
    deferred: list[int] = []
    handed = []
    real = gated.hand_over_to_target_only

    def hand_over(slots, requests, outputs):
        handed.extend((list(r.prompt_ids), list(o)) for r, o in zip(requests, outputs))
        return real(slots, requests, outputs)

    gated.hand_over_to_target_only = hand_over
    got, sch = _serve(gated, True, modes, late=1, deferred=deferred)
    assert deferred[1] == 1 and sch.gate.closed  # request 4's prefill was read a plan later
    # handed over with its first token in its history (read before the hand-over)
    assert [out for prompt, out in handed if prompt == REQUESTS[4]["prompt_ids"]] == [got[4][:1]]
    first = modes.index("target_only")
    assert set(modes[:first]) == {"speculative"} and set(modes[first:]) == {"target_only"}
    want, _ = _serve(plain, True, mode="target_only", late=1)
    for h in (0, 1, 2, 4):
        assert got[h] == want[h], h
    assert gated.slots.num_free == 5 and gated.pages.num_free == gated.pages.num_pages


def test_hand_over_sets_a_separate_processing_state_from_the_history(engines, monkeypatch):
    """A sharded worker's target-only decode keeps its own full-vocabulary logits processing: the hand-over
    fills it from the requests' prompts and tokens out so far -- the counts the speculative steps kept."""
    gated, plain = engines
    worker = gated.worker("speculative")
    ref = gated.reference("speculative", verify_shaped=False)
    separate = SlotLogitsProcessors(worker.processors.num_slots, 0, gated.vocab_size, gated.vocab_size,
                                    gated.device)
    monkeypatch.setattr(ref, "processors", separate)
    seen = []
    hand_over = gated.hand_over_to_target_only

    def check(slots, requests, outputs):
        hand_over(slots, requests, outputs)
        seen.append(len(slots))
        rows = torch.tensor(slots)
        assert torch.equal(separate.repetition[rows], worker.processors.repetition[rows])
        assert torch.equal(separate.presence[rows], worker.processors.presence[rows])
        assert torch.equal(gated.state.ref_lens[rows], gated.state.ctx_lens[rows])
        # the count tables of the rows that read them (a slot without penalties never does)
        rows = torch.tensor([s for s, r in zip(slots, requests) if r.sampling.uses_counts])
        assert len(rows) == 1 and int(worker.processors.counts[rows].sum()) > 0
        assert torch.equal(separate.counts[rows], worker.processors.counts[rows])
        assert torch.equal(separate.in_prompt[rows], worker.processors.in_prompt[rows])

    monkeypatch.setattr(gated, "hand_over_to_target_only", check)
    got, _ = _serve(gated, overlap=True)
    assert seen == [3]  # requests 1-3 were running when the gate closed
    want, _ = _serve(plain, overlap=True, mode="target_only")
    assert got[2] == want[2]  # the penalised greedy request read the replayed counts


def test_serve_reports_the_closed_gate_and_counts_only_speculative_steps():
    """Over HTTP: ``speculative_decoding_enabled`` is 1 until the gate closes, then 0; the target-only steps after
    it add nothing to the drafts counters (they draft nothing)."""
    httpx = pytest.importorskip("httpx")
    prom_parser = pytest.importorskip("prometheus_client.parser")
    from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG, start_in_process

    def metrics() -> dict[str, float]:
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        return {s.name: s.value for fam in prom_parser.text_string_to_metric_families(text) for s in fam.samples}

    def complete(max_tokens: int) -> dict:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "dspark-embedded", "prompt": [5, 17, 42], "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    srv = start_in_process({**SMALL_SERVE_CONFIG, "speculative_config.acceptance_window": 2,
                            "speculative_config.acceptance_length_threshold": 100.0})
    try:
        assert metrics()["trtllm_ext_speculative_decoding_enabled"] == 1
        complete(6)
        m = metrics()
        assert m["trtllm_ext_speculative_decoding_enabled"] == 1  # one finished request of a window of 2
        drafts = m["trtllm_ext_spec_decode_num_drafts_total"]
        assert drafts > 0
        complete(6)  # the window is full and its mean below 100: closed
        m = metrics()
        assert m["trtllm_ext_speculative_decoding_enabled"] == 0
        drafts = m["trtllm_ext_spec_decode_num_drafts_total"]
        out = complete(8)
        assert out["usage"]["completion_tokens"] == 8
        m = metrics()
        assert m["trtllm_ext_spec_decode_num_drafts_total"] == drafts and m["trtllm_ext_engine_steps_total"] > 0
    finally:
        srv.stop(30)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gate_hands_over_under_graphs():
    """On the GPU with CUDA graphs: the gated engine captures its target-only decode when the scheduler is made (not
    when the gate closes), and the greedy tokens across the hand-over are those of a target-only engine's graphs."""
    gated, plain = graphed_engines(GATED)
    for overlap in (False, True):
        modes: list[str] = []
        got, sch = _serve(gated, overlap, modes)
        assert sch.gate.closed and modes[0] == "speculative" and modes[-1] == "target_only"
        want, _ = _serve(plain, overlap, mode="target_only")
        for h in (0, 1, 2, 4):
            assert got[h] == want[h], (overlap, h)
        assert len(got[3]) == 10
    assert gated.slots.num_free == SMALL["max_batch_size"] and gated.pages.num_free == gated.pages.num_pages
