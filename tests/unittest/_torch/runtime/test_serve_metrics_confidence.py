"""/metrics: the drafter's mean confidence per draft position beside the acceptance per position."""

from __future__ import annotations

import json

import pytest

prom_parser = pytest.importorskip("prometheus_client.parser")


def test_confidence_per_position_sits_beside_acceptance_per_position():
    from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics

    m = ServerMetrics(3, model_name="m")
    m.speculative_step(4, confidences=[0.9, 0.8, 0.7])
    m.speculative_step(1, confidences=[0.5, 0.2, 1.5])  # clamped to [0, 1]
    m.speculative_step(2)  # a step without confidences (no head) counts for acceptance only
    samples = {s.name + json.dumps(s.labels, sort_keys=True): s.value
               for fam in prom_parser.text_string_to_metric_families(m.render().decode()) for s in fam.samples}

    def get(name, **labels):
        return samples[name + json.dumps({"model_name": "m", "engine": "0", **labels}, sort_keys=True)]

    n = get("trtllm_ext_spec_decode_num_confidence_drafts_total")
    assert n == 2 and get("trtllm_ext_spec_decode_num_drafts_total") == 3
    mean = [get("trtllm_ext_spec_decode_draft_confidence_sum_per_pos_total", position=str(p)) / n for p in range(3)]
    assert mean == pytest.approx([0.7, 0.5, 0.85])
    assert [get("trtllm_ext_spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)] \
        == [2, 1, 1]


def _samples(m) -> dict[str, float]:
    """Every sample but the creation times (which differ between two registries)."""
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in prom_parser.text_string_to_metric_families(m.render().decode()) for s in fam.samples
            if not s.name.endswith("_created")}


def _same(a: dict[str, float], b: dict[str, float]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), key  # NaN == NaN here


def test_a_plan_reported_at_once_equals_its_rows_one_by_one():
    """The engine loop reports a plan's rows in one update per metric (speculative_steps, delivered_many, and the
    histograms through observe_many): every sample of /metrics equals the rows reported one by one -- repeated
    handles in one plan (a request collected twice), a handle the metrics never admitted, first tokens and later
    ones, confidences or none, acceptance at every length, values on a bucket's bound, past the last, and NaN."""
    from types import SimpleNamespace

    from tensorrt_llm_ext.runtime.serve_metrics import ServerMetrics, observe_many

    one, many = ServerMetrics(3, model_name="m"), ServerMetrics(3, model_name="m")
    for m in (one, many):
        for h in range(4):
            m.admitted(h, arrived=1.0 + h, now=2.0 + h, request=SimpleNamespace(prompt_ids=[1, 2], max_new_tokens=9))
    plans = [
        (10.0, [(0, 1, 0.5), (1, 1, None), (2, 0, None), (9, 3, None)]),  # first tokens; nothing; not admitted
        (10.25, [(0, 4, None), (1, 2, None), (0, 1, None), (3, 1, 3.0)]),  # handle 0 twice in one plan
        (11.0, [(1, 1, None), (3, 2, None)]),
    ]
    for now, rows in plans:
        for r in rows:
            one.delivered(r[0], r[1], now, r[2])
        many.delivered_many(rows, now)
    steps = [(4, [0.9, 0.8, 0.7]), (1, [0.5, 0.2, 1.5]), (2, None), (3, [0.0, -1.0, 0.25]), (4, None), (1, None)]
    for row in steps:
        one.speculative_step(*row)
    many.speculative_steps(steps)
    many.speculative_steps([])  # a plan without speculative rows changes nothing
    _same(_samples(one), _samples(many))
    values = [0.0, 0.0005, 0.001, 0.00075, 3.0, 1e9, -1.0, float("nan"), 0.01]  # bounds, between, past, NaN
    for v in values:
        one.step_time.observe(v)
    observe_many(many.step_time, values)
    observe_many(many.step_time, [])
    _same(_samples(one), _samples(many))
