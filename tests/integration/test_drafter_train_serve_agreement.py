"""Train/serve agreement of the DSpark drafter: what training measures is what serving gets.

A briefly trained drafter on the tiny target; the serving engine decodes a few prompts greedily with speculation
(K = 3) and records the tokens gained per step. On the SAME sequences (prompt + the engine's output, which is the
target's own greedy decode) the training code path must see exactly the same thing:

* the teacher-forced first draft (:func:`block_forward`: the block anchored at each step's anchor, context = the
  target's captured features of the positions before it) is accepted exactly at the steps where serving accepted
  its first draft -- same context, same anchor, same RoPE positions, same Markov ``prev_0``;
* the training-side greedy walk (:func:`walk_accepted_lens`, behind the held-out estimate in ``training.json``)
  gains the same number of tokens as serving at every step.

A mismatch in which position's hidden states the drafter reads, which token anchors the block, the block's
positions, the captured layers or the Markov chain's first token breaks these equalities.
"""

from __future__ import annotations


import pytest
import torch

from tensorrt_llm_ext.models.checkpoint import load_drafter_state_dict, read_drafter_config
from tensorrt_llm_ext.models.dspark_drafter import confidence_head_shapes
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
from tensorrt_llm_ext.training.data import load_target, teacher_pass
from tensorrt_llm_ext.training.drafter_forward import block_forward
from tensorrt_llm_ext.training import trainer
from tensorrt_llm_ext.training.trainer import TrainConfig, drafter_config, train_drafter, walk_accepted_lens

K = 3
KNOBS = dict(num_prompts=16, max_new_tokens=24, gen_batch=16, eval_prompts=0, num_layers=1, num_heads=2, head_dim=8,
             latent_dim=16, intermediate_size=64, draft_len=K, steps=30, batch_seqs=4, anchors=8, lr=3e-3, warmup=2,
             markov_rank=8, save_every=30)
PROMPTS = [[5, 17, 305, 42], [9, 8, 7, 100, 200, 3]]
NEW_TOKENS = 16


def _greedy_by_teacher_passes(model_dir, prompts, *, max_new_tokens, **_):
    """Stand-in for the engine's target-only decode of the training data (the Triton interpreter makes that
    minutes on CI): the target's greedy continuation by full teacher passes, the same tokens in fp32."""
    target = load_target(model_dir, [0], torch.device("cpu"), torch.float32)
    head = target.lm_head.weight.detach()
    seqs = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        for s in seqs:
            _, final = teacher_pass(target, torch.tensor([s]))
            s.append(int((final[0, -1] @ head.T).argmax()))
    width = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s, dtype=torch.int32)
    return {"tokens": tokens, "lens": torch.tensor(list(map(len, seqs))),
            "prompt_lens": torch.tensor([len(p) for p in prompts])}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = export_tiny_target(tmp_path_factory.mktemp("agree") / "tiny")
    tc = TrainConfig(**KNOBS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "regenerate", _greedy_by_teacher_passes)
        train_drafter(d, d / "dspark_drafter", tc, progress=False)
    engine = Engine(load_config(model_dir=str(d), **{"speculative_config.max_draft_len": K}))
    results, _ = engine.generate([Request(prompt_ids=p, max_new_tokens=NEW_TOKENS) for p in PROMPTS])
    assert all(r.error is None and len(r.output_ids) == NEW_TOKENS for r in results)
    dcfg, layers = drafter_config(d, tc)
    assert read_drafter_config(d / "dspark_drafter")["target_layer_ids"] == layers
    params = {n: t.float() for n, t in load_drafter_state_dict(d / "dspark_drafter", dcfg).items()}
    target = load_target(d, layers, torch.device("cpu"), torch.float32)
    return dcfg, params, target, results


def _sequences(results):
    seqs = [p + r.output_ids for p, r in zip(PROMPTS, results)]
    width = max(map(len, seqs))
    tokens = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = torch.tensor(s, dtype=torch.int32)
    return {"tokens": tokens, "lens": torch.tensor(list(map(len, seqs))),
            "prompt_lens": torch.tensor(list(map(len, PROMPTS)))}


def test_teacher_forced_first_draft_is_accepted_where_serving_accepts_it(served):
    dcfg, params, target, results = served
    head = target.lm_head.weight.detach().float()
    data = _sequences(results)
    served_first, trained_first, margins = [], [], []
    for i, r in enumerate(results):
        n = int(data["lens"][i])
        tokens = data["tokens"][i:i + 1, :n].long()
        feats, _ = teacher_pass(target, tokens)
        # the anchors serving drafted from: the first generated token, then each step's bonus token
        anchors, a = [], len(PROMPTS[i])
        for gained in r.accepted_lens:
            if a + 1 < n:  # a draft whose target token is inside the sequence
                anchors.append(a)
            a += gained
        logits, _, _ = block_forward(params, dcfg, head, feats, tokens, torch.tensor([anchors]), K)
        first = logits[0, :, 0].argmax(-1)  # [M] the teacher-forced first draft of each block
        trained_first += (first == tokens[0, torch.tensor(anchors) + 1]).tolist()
        served_first += [gained >= 2 for gained in r.accepted_lens[:len(anchors)]]
        top2 = logits[0, :, 0].topk(2, dim=-1).values
        margins += (top2[:, 0] - top2[:, 1]).tolist()
    # Exactly equal; the one allowance is a near-tie of the first draft's two best logits, which a GPU's
    # other summation order (the H200 list runs this too) may break the other way.
    differ = [i for i, (s, t) in enumerate(zip(served_first, trained_first)) if s != t]
    assert all(margins[i] < 1e-3 for i in differ) and len(differ) <= 1, (served_first, trained_first)
    assert 0 < sum(served_first) < len(served_first)  # the drafter is neither always right nor always wrong


def test_training_walk_gains_what_serving_gains_at_every_step(served):
    """CPU (fp32, one summation order for both): bit-for-bit the same walk. Not in the GPU list, where a near-tie
    anywhere in a block may break differently and the walks then part."""
    dcfg, params, target, results = served
    walked = walk_accepted_lens(params, dcfg, target.lm_head.weight.detach().float(), _sequences(results), K,
                                torch.device("cpu"), target)
    for r, w in zip(results, walked):
        # serving's last step may draft past max_new_tokens (its overshoot is cut); the walk stops at the end
        assert w[:-1] == r.accepted_lens[:len(w) - 1] and len(w) == len(r.accepted_lens)
        assert w[-1] <= r.accepted_lens[-1]
    assert any(n > 1 for w in walked for n in w)


def test_batch_width_bucket_pads_past_every_sequence(served, monkeypatch):
    """A training batch's width is its longest sequence rounded up to ``SEQ_BUCKET`` (cuDNN reuses its plans for
    widths that repeat), capped at the data's width; the padding changes no real position's features or final
    hidden state, nor the distillation loss and its metrics on the same anchors."""
    assert [trainer.batch_width(n, s, b) for n, s, b in ((17, 100, 16), (32, 100, 16), (17, 20, 16), (5, 9, 1))] == \
        [32, 32, 20, 5]
    with pytest.raises(ValueError, match="bucket"):
        trainer.batch_width(5, 9, 0)
    dcfg, params, target, results = served
    data = _sequences(results)
    idx = torch.tensor([0])  # the shorter sequence: its batch has room to pad below the data's width
    n = int(data["lens"][0])
    assert n < data["tokens"].shape[1]
    batches = []
    for bucket in (1, 16):
        monkeypatch.setattr(trainer, "SEQ_BUCKET", bucket)
        batches.append(trainer._batch(data, idx, torch.device("cpu"), target))
    exact, padded = batches
    assert exact["tokens"].shape[1] == n and padded["tokens"].shape[1] == data["tokens"].shape[1]
    for key in ("features", "final"):
        torch.testing.assert_close(padded[key][:, :n], exact[key], atol=1e-6, rtol=1e-6)
    anchors = trainer.sample_anchors(exact, 6, torch.Generator().manual_seed(0))
    tc = TrainConfig(**KNOBS)
    head = target.lm_head.weight.detach().float()
    g = torch.Generator().manual_seed(1)
    params = {**params, **{n: torch.randn(shape, generator=g) for n, shape in confidence_head_shapes(dcfg).items()}}
    (loss_a, m_a), (loss_b, m_b) = (trainer.distillation_loss(params, dcfg, head, b, anchors, K, tc, fused=False)
                                    for b in (exact, padded))
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    for a, b in zip(trainer.metrics_vector(m_a), trainer.metrics_vector(m_b)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
