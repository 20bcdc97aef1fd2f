"""Rejection sampling wired into the engine (docs/rejection_sampling.md, "Engine and worker").

* Lossless in distribution: the joint distribution of the first two generated tokens with rejection
  sampling equals the target's own sampling distribution (chi-square, alpha = 1e-3), on a tiny model
  (V = 24, T = 2: the seeded tiny target is peaked at T = 1) over 1024 seeds per arm. Speed: this test runs the engine's ``stock`` path (the eager op table:
  verification by ``rejection_sample_reference`` on the gathered logits, which is bitwise the fused
  launcher) with the model's RMSNorm on its eager twin, because the Triton interpreter would take tens of
  minutes for this many requests; the fused table is held to the stock one bitwise below.
* Greedy rows in a mixed batch are bitwise today's strict-acceptance path; fused == stock tables.
* Config and request validation; top-p membership of every emitted token.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tensorrt_llm_ext.runtime.config import ConfigError, load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request, RequestError
from tensorrt_llm_ext.testing.requests import make_request
from tensorrt_llm_ext.testing.stats import chi_square_homogeneity
from tensorrt_llm_ext.testing.tiny_models import tiny_model

PROMPTS = [[5, 17, 30, 42], [51], list(range(20, 31)), [7, 7, 60, 2, 9]]
RS = {"speculative_config.use_rejection_sampling": True}
# V <= 64 for the distribution test: one target layer, K = 2, a batch of 128 requests per step.
DIST = tiny_model(**{"model.target.vocab_size": 24, "model.target.num_layers": 1, "model.target.capture_layers": [0],
                     "speculative_config.max_draft_len": 2, "max_batch_size": 128, "max_seq_len": 16})
ALPHA = 1e-3


def _eager_rms_norm(monkeypatch):
    """The model's RMSNorm on its eager twin (numerically the same op; the interpreter is the slow part)."""
    import tensorrt_llm_ext.kernels.rms_norm as rms

    monkeypatch.setattr(rms, "triton_runs_on", lambda t: False)


def test_chi_square_helper_accepts_equal_and_rejects_different():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    a = Counter(torch.multinomial(p, 2000, True, generator=g).tolist())
    b = Counter(torch.multinomial(p, 2000, True, generator=g).tolist())
    c = Counter(torch.multinomial(torch.tensor([0.3, 0.3, 0.2, 0.2]), 2000, True, generator=g).tolist())
    assert chi_square_homogeneity(a, b)[2] > ALPHA
    assert chi_square_homogeneity(a, c)[2] < 1e-6
    assert chi_square_homogeneity(a, b)[1] == 3


def _joint(results, idx=(0, 1)) -> Counter:
    return Counter(tuple(r.output_ids[i] for i in idx) for r in results)


def test_lossless_in_distribution_first_two_tokens(monkeypatch):
    _eager_rms_norm(monkeypatch)
    torch.set_num_threads(1)
    n, temp = 1024, 2.0
    prompt = [3, 11, 7]
    # Disjoint seeds: the first token comes from the same keyed draw in both arms, so shared seeds would
    # correlate the samples.
    rs_reqs = [Request(list(prompt), max_new_tokens=3, sampling=SamplingParams(temperature=temp, seed=i)) for i in range(n)]
    ref_reqs = [Request(list(prompt), max_new_tokens=3, sampling=SamplingParams(temperature=temp, seed=n + i)) for i in range(n)]
    rs_eng, ref_eng = Engine(load_config(**{**DIST, **RS})), Engine(load_config(**DIST))
    for eng in (rs_eng, ref_eng):  # the stock table's drafter attention: the eager twin (no interpreter)
        eng.drafter.set_attention_backend("eager")
    rs_res, rs_stats = rs_eng.generate(rs_reqs, "stock")
    # Strict acceptance with sampled target tokens is bitwise the target's own decode (the lossless tests),
    # so it is the target-only sampling distribution, at the stock table's speed.
    ref_res, ref_stats = ref_eng.generate(ref_reqs, "stock")
    assert all(len(r.output_ids) == 3 for r in rs_res + ref_res)
    stat, dof, p = chi_square_homogeneity(_joint(rs_res), _joint(ref_res))
    assert dof >= 8, dof
    assert p > ALPHA, (stat, dof, p)
    # The speculative step is what produced token 2 (K = 2: tokens 2 and 3 come from the first step), and
    # the same test also holds for tokens (2, 3) of that step.
    stat, dof, p = chi_square_homogeneity(_joint(rs_res, (1, 2)), _joint(ref_res, (1, 2)))
    assert p > ALPHA, (stat, dof, p)
    # The test has power at this size: another pair of positions is a different distribution.
    _, _, p_wrong = chi_square_homogeneity(_joint(rs_res), _joint(ref_res, (0, 2)))
    assert p_wrong < 1e-6, p_wrong
    # Rejection sampling accepts sampled drafts far more often than strict acceptance of greedy drafts.
    assert rs_stats.mean_acceptance_length > ref_stats.mean_acceptance_length + 0.2, (
        rs_stats.mean_acceptance_length, ref_stats.mean_acceptance_length)


def test_sharpened_drafts_stay_lossless_in_distribution(monkeypatch):
    """``draft_temperature_scale`` s < 1 draws the drafts at s T and stores their logits divided by s: the
    verifier's q is the distribution the drafts came from, so the output is still the target's (chi-square, as
    above); and the knob acts (sharper drafts: another acceptance than at s = 1 on the same seeds)."""
    _eager_rms_norm(monkeypatch)
    torch.set_num_threads(1)
    n, temp, prompt = 1024, 2.0, [3, 11, 7]
    reqs = lambda first: [Request(list(prompt), max_new_tokens=3,  # noqa: E731
                                  sampling=SamplingParams(temperature=temp, seed=first + i)) for i in range(n)]
    sharp = Engine(load_config(**{**DIST, **RS, "speculative_config.draft_temperature_scale": 0.25}))
    plain, ref = Engine(load_config(**{**DIST, **RS})), Engine(load_config(**DIST))
    for eng in (sharp, plain, ref):
        eng.drafter.set_attention_backend("eager")
    assert sharp.worker("stock").draft_temperature_scale == 0.25
    sharp_res, sharp_stats = sharp.generate(reqs(0), "stock")
    plain_res, plain_stats = plain.generate(reqs(0), "stock")
    ref_res, _ = ref.generate(reqs(n), "stock")
    for idx in ((0, 1), (1, 2)):
        stat, dof, p = chi_square_homogeneity(_joint(sharp_res, idx), _joint(ref_res, idx))
        assert dof >= 8 and p > ALPHA, (idx, stat, dof, p)
    # Same seeds, same first tokens (the target's own draw), other drafts from the second token on.
    assert [r.output_ids[0] for r in sharp_res] == [r.output_ids[0] for r in plain_res]
    assert sharp_stats.mean_acceptance_length != plain_stats.mean_acceptance_length


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_draft_temperature_scale_outside_0_1_is_refused(bad):
    with pytest.raises(ConfigError, match="draft_temperature_scale"):
        load_config(**{**DIST, **RS, "speculative_config.draft_temperature_scale": bad})


# The fused-table tests: a small odd vocabulary and one target layer keep the interpreter quick.
SMALL = tiny_model(**{"model.target.vocab_size": 67, "model.target.num_layers": 1, "model.target.capture_layers": [0]})


def _mixed_requests(max_new=5):
    drawn = [SamplingParams(seed=0), SamplingParams(1.0, seed=1), SamplingParams(seed=2),
             SamplingParams(0.7, top_p=0.8, seed=3)]
    return [Request(list(p), max_new_tokens=max_new, sampling=drawn[i] if i < len(drawn) else SamplingParams(seed=i))
            for i, p in enumerate(PROMPTS)]


def test_greedy_rows_bitwise_and_fused_equals_stock(monkeypatch):
    _eager_rms_norm(monkeypatch)
    base = SMALL
    reqs = _mixed_requests()
    rs = Engine(load_config(**{**base, **RS}))
    strict = Engine(load_config(**base))
    fused, _ = rs.generate(reqs, "speculative")
    stock, _ = rs.generate(reqs, "stock")
    today, _ = strict.generate(reqs, "speculative")
    ref, _ = rs.generate(reqs, "reference")
    assert rs.worker().verifier is not None and strict.worker().verifier is None
    for i in (0, 2):  # greedy rows: today's strict acceptance, bit for bit (tokens and acceptance)
        assert fused[i].output_ids == today[i].output_ids == ref[i].output_ids
        assert fused[i].accepted_lens == today[i].accepted_lens
    # One worker, two op tables: the eager twin verifies to the same bits as the fused launchers.
    assert [r.output_ids for r in fused] == [r.output_ids for r in stock]
    assert [r.accepted_lens for r in fused] == [r.accepted_lens for r in stock]
    # Every emitted token lies in its target's top-p kept set (greedy: it is the argmax).
    for req, res in zip(reqs, fused):
        assert all(rs.top_p_membership(req, res.output_ids))
    # The membership check can fail: a tiny top-p keeps only the argmax, and the greedy tokens shifted by one
    # id are reported outside (the first token stays the argmax, so the sequence is teacher-forced as given).
    shifted = fused[0].output_ids[:1] + [(t + 1) % rs.vocab_size for t in fused[0].output_ids[1:]]
    inside = rs.top_p_membership(make_request(prompt_ids=reqs[0].prompt_ids, max_new_tokens=len(shifted),
                                              temperature=1.0, top_p=1e-6), shifted)
    assert inside[0] and not any(inside[1:]), inside


def test_top_p_strict_speculative_equals_target_decode(monkeypatch):
    """Without rejection sampling, top-p rows stay lossless bitwise: the target draws from the same exact
    top-p set in the step and in its own decode."""
    _eager_rms_norm(monkeypatch)
    eng = Engine(load_config(**SMALL))
    reqs = _mixed_requests()
    reqs[1].sampling = SamplingParams(3.0, top_p=0.3, seed=reqs[1].sampling.seed)
    spec, _ = eng.generate(reqs, "stock")
    ref, _ = eng.generate(reqs, "reference")
    assert [r.output_ids for r in spec] == [r.output_ids for r in ref]
    wide = [Request(list(r.prompt_ids), max_new_tokens=5,
                    sampling=SamplingParams(seed=r.sampling.seed, temperature=r.sampling.temperature)) for r in reqs]
    unrestricted, _ = eng.generate(wide, "reference")
    assert unrestricted[1].output_ids != ref[1].output_ids  # top-p changed the draw


def test_config_and_request_validation():
    cfg = load_config(**RS)
    assert cfg.speculative_config.use_rejection_sampling and cfg.speculative_config.vocab_sharded_verification == "auto"
    assert not load_config().speculative_config.use_rejection_sampling  # TensorRT-LLM's default: off
    # YAML 1.1 reads a bare on/off as a boolean
    assert load_config(**RS, **{"speculative_config.vocab_sharded_verification": False}
                       ).speculative_config.vocab_sharded_verification == "off"
    with pytest.raises(ConfigError, match="speculative_config.vocab_sharded_verification"):
        load_config(**{**RS, "speculative_config.vocab_sharded_verification": "sometimes"})
    with pytest.raises(ConfigError, match="needs use_rejection_sampling"):
        load_config(**{"speculative_config.vocab_sharded_verification": "on"})
    with pytest.raises(ConfigError, match="use_rejection_sampling"):
        load_config(**{"speculative_config.use_rejection_sampling": "maybe"})
    # 'on' where it cannot shard (tp 1): an error at load, naming why
    eng = Engine(load_config(**tiny_model(**RS, **{"speculative_config.vocab_sharded_verification": "on",
                                                  "model.target.num_layers": 1, "model.target.capture_layers": [0]})))
    with pytest.raises(ValueError, match="vocab_sharded_verification='on' but not possible: .*tp_size == 1"):
        eng.worker()
    for bad in (0.0, -0.1, 1.5, float("nan"), True, "0.9"):
        with pytest.raises(RequestError, match="top_p"):
            Request([1, 2], sampling=SamplingParams(top_p=bad)).validate(100, 64)
    Request([1, 2], sampling=SamplingParams(top_p=1.0)).validate(100, 64)
    Request([1, 2], sampling=SamplingParams(top_p=1e-3, temperature=1.0)).validate(100, 64)


def test_decision_is_logged_and_stored_once(monkeypatch):
    _eager_rms_norm(monkeypatch)
    eng = Engine(load_config(**tiny_model(**RS, **{"model.target.num_layers": 1, "model.target.capture_layers": [0]})))
    w = eng.worker()
    d = w.verifier.decision
    assert d.enabled and not d.sharded and "tp_size == 1" in d.reason
    assert w.metadata.draft_logits.shape == (eng.state.dummy_slot + 1, eng.draft_len, eng.vocab_size)
    # the greedy-only worker keeps strict acceptance
    g = eng.worker(sampling=False)
    assert g.verifier is None
    assert d.tp_size == 1 and "rejection sampling, gathered" in d.describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replay_equals_eager(dtype):
    """The whole rejection-sampling verification is captured in the step: graph replay (with padding) emits
    the eager step's bits, for steps without a top-p row (the default graphs) and with one (the top-p graphs;
    the batch keeps its top-p request)."""
    cfg = load_config(**{**SMALL, **RS, "model.dtype": dtype, "max_batch_size": 4,
                         "cuda_graph_config.batch_sizes": [1, 2, 4]})
    graphed_engine = Engine(cfg, use_cuda_graph=True)
    for reqs in (_mixed_requests(max_new=8)[:3], _mixed_requests(max_new=8)):  # without / with the top-p row
        eager, _ = Engine(cfg).generate(reqs, "speculative")
        graphed, _ = graphed_engine.generate(reqs, "speculative")
        assert [r.output_ids for r in graphed] == [r.output_ids for r in eager]
        assert [r.accepted_lens for r in graphed] == [r.accepted_lens for r in eager]
    runner = graphed_engine.runner("speculative")
    assert runner.eager_steps == 0
    assert {v.top_p for (_, v), n in runner.replays.items() if n} == {False, True}
