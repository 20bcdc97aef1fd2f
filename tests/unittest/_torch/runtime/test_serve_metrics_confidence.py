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
