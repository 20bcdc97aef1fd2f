"""Logits processing (logit_bias, penalties, min_p, top_k) in the engine, lossless under speculation:

* strict acceptance: the speculative decode equals the target's own decode with the same processing, bit for bit,
  for greedy and sampled rows in one batch (each field alone and combined), on the fused and the stock op table;
  the processing changes the output (the fields act);
* rejection sampling: greedy rows bit for bit; sampled rows in distribution -- the first three tokens' joint
  distribution with rejection sampling equals the target's own (strict, target-decode-equal) one under the same
  processing (chi-square, alpha = 1e-3);
* a step with no processed row is bit for bit the step without this feature (the rows beside processed rows too).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.testing.requests import make_request
from tensorrt_llm_ext.testing.stats import chi_square_homogeneity
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 67, "model.target.num_layers": 1, "model.target.capture_layers": [0]})
RS = {"speculative_config.use_rejection_sampling": True}
DIST = tiny_model(**{"model.target.vocab_size": 24, "model.target.num_layers": 1, "model.target.capture_layers": [0],
                     "speculative_config.max_draft_len": 2, "max_batch_size": 128, "max_seq_len": 16})
# One batch, a field per row (greedy and sampled rows, processed and not):
ROWS = [
    dict(prompt_ids=[3, 3, 3], repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=0.6),  # greedy
    dict(prompt_ids=[51], temperature=3.0, seed=1, top_k=2),
    dict(prompt_ids=[5, 17, 30, 42]),  # greedy, unprocessed beside the others
    dict(prompt_ids=[7, 7, 60, 2, 9], temperature=2.5, seed=3, top_p=0.9, min_p=0.3, logit_bias={9: 3.0}),
    dict(prompt_ids=[20, 21, 22], logit_bias={13: 100.0, 11: -100.0}),  # greedy: the +100 bias wins every step
    dict(prompt_ids=[5, 17, 30, 42], temperature=1.5, seed=5, top_k=1),  # top_k 1 is greedy decoding
]
MAX_NEW = 6


def _requests(processed: bool = True) -> list[Request]:
    keys = ("prompt_ids", "temperature", "seed", "top_p")
    return [make_request(max_new_tokens=MAX_NEW, **(r if processed else {k: v for k, v in r.items() if k in keys}))
            for r in ROWS]


@pytest.fixture(autouse=True)
def _eager_rms_norm(monkeypatch):
    import tensorrt_llm_ext.kernels.rms_norm as rms

    monkeypatch.setattr(rms, "triton_runs_on", lambda t: False)  # the same op; the interpreter is the slow part
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target_decode():
    """The target's own decode (no drafts) of the processed batch, and its engine."""
    import tensorrt_llm_ext.kernels.rms_norm as rms

    saved, rms.triton_runs_on = rms.triton_runs_on, lambda t: False
    try:
        eng = Engine(load_config(**SMALL))
        return eng, eng.generate(_requests(), "reference")[0]
    finally:
        rms.triton_runs_on = saved


def test_strict_speculative_equals_the_target_decode(target_decode):
    eng, ref = target_decode
    spec, _ = eng.generate(_requests(), "speculative")
    stock, _ = eng.generate(_requests(), "stock")
    plain, _ = eng.generate(_requests(processed=False), "stock")
    assert [r.error for r in spec] == [None] * len(ROWS)
    assert [r.output_ids for r in spec] == [r.output_ids for r in ref] == [r.output_ids for r in stock]
    assert spec[2].output_ids == plain[2].output_ids  # the unprocessed row beside processed ones: unchanged
    assert spec[0].output_ids != plain[0].output_ids  # the penalties moved a greedy row
    assert spec[4].output_ids == [13] * MAX_NEW and spec[5].output_ids == spec[2].output_ids
    assert spec[1].output_ids != plain[1].output_ids and spec[3].output_ids != plain[3].output_ids  # top_k, min_p


def test_rejection_sampling_greedy_rows_bitwise(target_decode):
    _, ref = target_decode
    eng = Engine(load_config(**{**SMALL, **RS}))
    eng.drafter.set_attention_backend("eager")  # the drafts decide acceptance only, never a greedy row's tokens
    spec, _ = eng.generate(_requests(), "stock")
    assert eng.worker("stock").verifier is not None
    for i in (0, 2, 4):  # greedy rows
        assert spec[i].output_ids == ref[i].output_ids


def _joint(results, positions=(0, 1, 2)):
    return Counter(tuple(r.output_ids[p] for p in positions) for r in results)


def test_rejection_sampling_keeps_the_processed_distribution():
    n, temp = 768, 2.0
    fields = dict(top_k=6, repetition_penalty=1.5, frequency_penalty=0.4, logit_bias={4: 1.5})
    prompt = [3, 11, 7]
    rs_reqs = [Request(list(prompt), max_new_tokens=3, sampling=SamplingParams(**fields, temperature=temp, seed=i)) for i in range(n)]
    ref_reqs = [Request(list(prompt), max_new_tokens=3, sampling=SamplingParams(**fields, temperature=temp, seed=n + i)) for i in range(n)]
    rs_eng, ref_eng = Engine(load_config(**{**DIST, **RS})), Engine(load_config(**DIST))
    for eng in (rs_eng, ref_eng):
        eng.drafter.set_attention_backend("eager")
    rs_res, _ = rs_eng.generate(rs_reqs, "stock")
    ref_res, _ = ref_eng.generate(ref_reqs, "stock")  # strict: bitwise the processed target decode (above)
    assert all(len(r.output_ids) == 3 for r in rs_res + ref_res)
    # top_k = 6 holds: at most 6 distinct first tokens
    assert len({r.output_ids[0] for r in rs_res}) <= 6 and len({r.output_ids[0] for r in ref_res}) <= 6
    stat, dof, p = chi_square_homogeneity(_joint(rs_res, (0, 1)), _joint(ref_res, (0, 1)))
    assert dof >= 8 and p > 1e-3, (stat, dof, p)
    stat, dof, p = chi_square_homogeneity(_joint(rs_res, (1, 2)), _joint(ref_res, (1, 2)))
    assert p > 1e-3, (stat, dof, p)
    # Power: the unprocessed distribution is a different one.
    plain = [Request(list(prompt), max_new_tokens=3, sampling=SamplingParams(temperature=temp, seed=2 * n + i)) for i in range(n)]
    plain_res, _ = ref_eng.generate(plain, "stock")
    _, _, p_wrong = chi_square_homogeneity(_joint(rs_res, (0, 1)), _joint(plain_res, (0, 1)))
    assert p_wrong < 1e-6, p_wrong


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rejection", [False, True])
def test_cuda_processed_rows_beside_captured_steps(rejection):
    """On the GPU in bf16 with CUDA graphs: processed steps replay the processed graph (none runs eagerly) beside
    replayed default steps, and the speculative decode is the target decode's (strict: every row; rejection
    sampling: the greedy rows)."""
    cfg = load_config(**{**SMALL, **(RS if rejection else {}), "model.dtype": "bfloat16",
                         "max_batch_size": 8, "cuda_graph_config.batch_sizes": [1, 2, 4, 8]})
    eng = Engine(cfg, use_cuda_graph=True)
    spec, _ = eng.generate(_requests(), "speculative")
    ref, _ = eng.generate(_requests(), "reference")
    assert eng._runners, "no graphs captured"
    assert eng.runner("speculative").eager_steps == 0 and eng.runner("reference").eager_steps == 0
    rows = (0, 2, 4) if rejection else range(len(ROWS))
    assert [spec[i].output_ids for i in rows] == [ref[i].output_ids for i in rows]
    assert spec[4].output_ids == [13] * MAX_NEW
    plain, _ = eng.generate(_requests(processed=False), "speculative")  # default steps: replayed graphs
    eager, _ = Engine(cfg).generate(_requests(processed=False), "speculative")
    assert [r.output_ids for r in plain] == [r.output_ids for r in eager]
