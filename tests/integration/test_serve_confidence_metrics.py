"""The drafter's confidence head reaches ``/metrics`` from the live serving loop: each step's event carries the
confidences of the drafts that step verified (those its slot's prefill or previous step drafted), and the engine
loop feeds them to the per-position counters beside the acceptance per position."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tensorrt_llm_ext.models.dspark_drafter import CONFIDENCE_CALIBRATION, confidence_head_shapes
from tensorrt_llm_ext.runtime.scheduler import Scheduler, StepPlan
from tensorrt_llm_ext.testing.requests import make_request


def _head(cfg, k: int, seed: int | None = None, shifts=None) -> dict[str, torch.Tensor]:
    """A confidence head: random weights (``seed``), or zero weights with a per-position calibration shift (every
    confidence at position p is then exactly ``sigmoid(bias + shifts[p])``, whatever the drafts)."""
    shapes = confidence_head_shapes(cfg)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        return {n: torch.randn(s, generator=g) * 0.3 for n, s in shapes.items()}
    return {"confidence.weight": torch.zeros(shapes["confidence.weight"]),
            "confidence.bias": torch.tensor([-0.5]),
            CONFIDENCE_CALIBRATION: torch.tensor([[1.0] * k, list(shifts)])}


def test_step_events_carry_the_confidences_of_the_drafts_they_verified():
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.testing.tiny_models import tiny_model

    eng = Engine(load_config(**tiny_model(**{"model.target.vocab_size": 301, "max_batch_size": 3,
                                            "max_seq_len": 40})), torch_ops=True)
    k = eng.draft_len
    eng.drafter.load_confidence_head(_head(eng.drafter.config, k, seed=3))
    drafted: dict[int, list[list[float]]] = {}  # slot -> the confidences of each block it drafted, in order
    real_prefill, real_collect = eng.collect_prefill, eng._collect_confidences

    def collect_prefill(launched):
        out = real_prefill(launched)
        for s in launched.slots:
            drafted[s] = [eng._pending_confidences[s]]
        return out

    def collect(launched):
        real_collect(launched)
        for s in launched.slots:
            drafted[s].append(eng._pending_confidences[s])

    eng.collect_prefill, eng._collect_confidences = collect_prefill, collect
    sch = Scheduler(eng, overlap=True)
    reqs = [make_request(prompt_ids=[5 + i, 17, 42 + i], max_new_tokens=12, ignore_eos=True,
                         temperature=0.9 * (i % 2), seed=i) for i in range(3)]
    evs, _ = sch.apply(StepPlan(admit=[(h, r) for h, r in enumerate(reqs)], run=False))
    steps: dict[int, list] = {h: [] for h in range(3)}
    slot_of = {h: sch._live[h].slot for h in range(3)}
    for _ in range(40):
        evs, _ = sch.apply(StepPlan())
        for e in evs:
            if e.accepted_len is not None:
                steps[e.handle].append(e.confidences)
        if not sch.num_active:
            break
    assert not sch.num_active
    for h, confs in steps.items():
        assert confs and all(c is not None and len(c) == k for c in confs)
        assert all(0.0 < x < 1.0 for c in confs for x in c)
        # step n verifies what the prefill (n = 0) or step n - 1 drafted on the request's slot
        assert confs == drafted[slot_of[h]][:len(confs)], h
    assert len({tuple(c) for cs in steps.values() for c in cs}) > 1  # real, varying confidences


def _metrics(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_served_requests_report_mean_confidence_per_position_in_metrics():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG, sample_bodies, start_in_process

    srv = start_in_process(SMALL_SERVE_CONFIG)
    try:
        k = srv.engine.draft_len
        shifts = [0.25 * p for p in range(k)]
        srv.engine.drafter.load_confidence_head(_head(srv.engine.drafter.config, k, shifts=shifts))
        for body in sample_bodies(4, SMALL_SERVE_CONFIG["model.target.vocab_size"], max_tokens=(6, 9)):
            r = httpx.post(srv.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text
        m = _metrics(srv.url)
    finally:
        srv.stop(30)

    def get(name, **labels):
        return m[name + json.dumps({"model_name": "dspark-embedded", "engine": "0", **labels}, sort_keys=True)]

    drafts = get("trtllm_ext_spec_decode_num_drafts_total")
    n = get("trtllm_ext_spec_decode_num_confidence_drafts_total")
    assert drafts > 0 and n == drafts  # every speculative step carried its drafts' confidences
    means = [get("trtllm_ext_spec_decode_draft_confidence_sum_per_pos_total", position=str(p)) / n for p in range(k)]
    want = [1.0 / (1.0 + math.exp(0.5 - s)) for s in shifts]
    assert means == pytest.approx(want, abs=1e-5)


def test_a_request_cancelled_before_its_first_token_leaves_no_confidences_on_its_slot():
    """Overlap: a request admitted behind a step (its first token read a plan later) and cancelled before that read
    frees its slot at once; a request admitted into that slot in the same plan -- prefilled at once here, as one
    asking for logprobs is -- verifies its own first block's confidences on its first step, not the cancelled
    one's (whose prefill is read back after it)."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.testing.tiny_models import tiny_model

    eng = Engine(load_config(**tiny_model(**{"model.target.vocab_size": 301, "max_batch_size": 2,
                                            "max_seq_len": 40})), torch_ops=True)
    eng.drafter.load_confidence_head(_head(eng.drafter.config, eng.draft_len, seed=5))
    drafted = {}
    real = eng.collect_prefill

    def collect_prefill(launched, live=None):
        out = real(launched, live)
        for row, s in enumerate(launched.slots):
            drafted.setdefault(s, []).append(launched.confidences[row].tolist())
        return out

    eng.collect_prefill = collect_prefill
    sch = Scheduler(eng, overlap=True)
    long = make_request(prompt_ids=[5, 17, 42], max_new_tokens=20, ignore_eos=True)
    sch.apply(StepPlan(admit=[(0, long)], run=False))
    sch.apply(StepPlan())
    evs, _ = sch.apply(StepPlan(admit=[(1, make_request(prompt_ids=[9, 8, 7, 6], max_new_tokens=20))]))
    assert not [e for e in evs if e.handle == 1]  # its first token waits for the next plan
    slot = sch._live[1].slot
    newcomer = make_request(prompt_ids=[3, 1, 4, 1, 5], max_new_tokens=6, ignore_eos=True, logprobs=1)
    evs, _ = sch.apply(StepPlan(cancel=[1], admit=[(2, newcomer)]))
    assert sch._live[2].slot == slot and [e.finish_reason for e in evs if e.handle == 1] == ["cancelled"]
    own = drafted[slot][-2]  # the newcomer's prefill was read first, the cancelled one's after it
    firsts = []
    while sch.num_active:
        evs, _ = sch.apply(StepPlan())
        firsts += [e.confidences for e in evs if e.handle == 2 and e.accepted_len is not None][:1]
    assert firsts and firsts[0] == own and own != drafted[slot][-1]
