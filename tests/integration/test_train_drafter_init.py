"""train-drafter's starts other than noise. ``--init embedding``: the Markov head starts as a linear map of the previous
token's target embedding (w1 = the embedding through a seeded projection, rows at unit RMS; w2 = 0, so the first drafts
are the backbone's alone). ``--init target``: each drafter layer starts as one of the target's top layers. Both train
from there."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafterConfig
from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
from tensorrt_llm_ext.training.trainer import TrainConfig, initial_weights, target_layer_weights


def test_embedding_init_maps_the_previous_tokens_embedding():
    cfg = DSparkDrafterConfig(hidden_size=16, target_hidden_size=16, num_capture_layers=1, num_layers=1, num_heads=2,
                              head_dim=8, latent_dim=8, intermediate_size=32, vocab_size=40, markov_rank=24,
                              mask_token_id=39)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(40, 16, generator=g)
    emb[5] = emb[3] * 7.0  # the same direction, another scale
    emb[6] = -emb[3]
    emb[7] = 0.0
    sd = initial_weights(cfg, {"embed_tokens.weight": emb}, seed=1, init="embedding")
    w1, w2 = sd["markov_w1"], sd["markov_w2"]
    assert w1.shape == (40, 24) and bool((w2 == 0).all())  # the Markov bias starts at zero
    rms = w1.pow(2).mean(-1).sqrt()
    assert torch.allclose(rms[torch.arange(40) != 7], torch.ones(39), atol=1e-5) and bool((w1[7] == 0).all())
    torch.testing.assert_close(w1[5], w1[3])  # a row depends on the embedding's direction only
    torch.testing.assert_close(w1[6], -w1[3])
    cos = torch.nn.functional.cosine_similarity(w1[None], w1[:, None], dim=-1)
    emb_cos = torch.nn.functional.cosine_similarity(emb[None], emb[:, None], dim=-1)
    keep = ~torch.eye(40, dtype=torch.bool) & (rms[None] > 0) & (rms[:, None] > 0)
    assert torch.corrcoef(torch.stack((cos[keep], emb_cos[keep])))[0, 1] > 0.8  # nearby embeddings, nearby rows
    scratch = initial_weights(cfg, {"embed_tokens.weight": emb}, seed=1, init="scratch")
    assert bool((scratch["markov_w1"] == 0).all())
    assert TrainConfig(init="embedding").init == "embedding"
    with pytest.raises(ValueError, match="'scratch', 'bigram', 'embedding' or 'target'"):
        TrainConfig(init="table")


def test_training_from_the_embedding_init_learns_the_markov_map(tmp_path):
    d = export_tiny_target(tmp_path / "tiny")
    assert main(["train-drafter", str(d), "--init", "embedding", "--num-prompts", "8", "--max-new-tokens", "12",
                 "--gen-batch", "8", "--eval-prompts", "2", "--num-layers", "1", "--num-heads", "2", "--head-dim", "8",
                 "--latent-dim", "8", "--intermediate-size", "32", "--draft-len", "3", "--batch-seqs", "2",
                 "--anchors", "4", "--lr", "3e-3", "--warmup", "2", "--markov-rank", "4", "--steps", "6",
                 "--save-every", "6", "--no-progress"]) == 0
    s = json.loads((d / "dspark_drafter" / "training.json").read_text())
    assert s["complete"] and s["knobs"]["init"] == "embedding"
    w2 = load_file(str(d / "dspark_drafter" / "model.safetensors"))["markov_w2"]
    assert float(w2.abs().max()) > 0  # learned from zero


def _target_like_sd(num_layers=3, hidden=16, heads=3, head_dim=8, inter=32, vocab=40):
    g = torch.Generator().manual_seed(2)
    sd = {"embed_tokens.weight": torch.randn(vocab, hidden, generator=g), "norm.weight": torch.rand(hidden, generator=g)}
    for i in range(num_layers):
        for n, shape in (("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,)),
                         ("self_attn.q_proj.weight", (heads * head_dim, hidden)),
                         ("self_attn.k_proj.weight", (head_dim, hidden)), ("self_attn.v_proj.weight", (head_dim, hidden)),
                         ("self_attn.o_proj.weight", (hidden, heads * head_dim)), ("mlp.gate_proj.weight", (inter, hidden)),
                         ("mlp.up_proj.weight", (inter, hidden)), ("mlp.down_proj.weight", (hidden, inter))):
            sd[f"layers.{i}.{n}"] = torch.randn(*shape, generator=g)
    return sd


def test_target_init_starts_each_layer_as_one_of_the_targets_top_layers(caplog):
    cfg = DSparkDrafterConfig(hidden_size=16, target_hidden_size=16, num_capture_layers=1, num_layers=2, num_heads=2,
                              head_dim=8, latent_dim=8, intermediate_size=32, vocab_size=40, markov_rank=24,
                              mask_token_id=39)
    tsd = _target_like_sd()
    layers = target_layer_weights(tsd, 2, target_head_dim=8, head_dim=8)
    sd = initial_weights(cfg, {"embed_tokens.weight": tsd["embed_tokens.weight"], **layers}, seed=1, init="target")
    scratch = initial_weights(cfg, {"embed_tokens.weight": tsd["embed_tokens.weight"]}, seed=1, init="scratch")
    for i, src in ((0, 1), (1, 2)):  # drafter layer i <- target layer src (the top two of three, in order)
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight", "mlp.down_proj.weight"):
            assert torch.equal(sd[f"layers.{i}.{n}"], tsd[f"layers.{src}.{n}"]), n
        # the first two of the target's three heads: q's first 16 rows, o's first 16 columns
        assert torch.equal(sd[f"layers.{i}.self_attn.q_proj.weight"], tsd[f"layers.{src}.self_attn.q_proj.weight"][:16])
        assert torch.equal(sd[f"layers.{i}.self_attn.o_proj.weight"], tsd[f"layers.{src}.self_attn.o_proj.weight"][:, :16])
        # keys and values come from the context latent: seeded as in scratch
        assert torch.equal(sd[f"layers.{i}.self_attn.k_up_proj.weight"], scratch[f"layers.{i}.self_attn.k_up_proj.weight"])
    assert torch.equal(sd["norm.weight"], tsd["norm.weight"]) and bool((sd["markov_w1"] == 0).all())
    assert torch.equal(sd["fc.weight"], scratch["fc.weight"])
    # another head dim: q / o stay seeded, the rest is copied
    other = target_layer_weights(tsd, 2, target_head_dim=4, head_dim=8)
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        sd2 = initial_weights(cfg, {"embed_tokens.weight": tsd["embed_tokens.weight"], **other}, seed=1, init="target")
    assert "q_proj / o_proj stay seeded" in caplog.text  # the fallback says so
    assert torch.equal(sd2["layers.0.self_attn.q_proj.weight"], scratch["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sd2["layers.1.mlp.down_proj.weight"], tsd["layers.2.mlp.down_proj.weight"])
    with pytest.raises(ValueError, match="at least 4 target layers"):
        target_layer_weights(tsd, 4, target_head_dim=8, head_dim=8)
    wide = dataclasses.replace(cfg, intermediate_size=48)
    with pytest.raises(ValueError, match="intermediate sizes must be the target's"):
        initial_weights(wide, {"embed_tokens.weight": tsd["embed_tokens.weight"], **layers}, seed=1, init="target")
    with pytest.raises(ValueError, match="'embedding' or 'target'"):
        TrainConfig(init="table")


def test_training_from_the_target_init(tmp_path):
    d = export_tiny_target(tmp_path / "tiny")
    cfg = json.loads((d / "config.json").read_text())
    assert main(["train-drafter", str(d), "--init", "target", "--num-prompts", "8", "--max-new-tokens", "12",
                 "--gen-batch", "8", "--eval-prompts", "2", "--num-layers", "1",
                 "--num-heads", str(cfg["num_attention_heads"]), "--head-dim",
                 str(cfg["hidden_size"] // cfg["num_attention_heads"]), "--latent-dim", "8",
                 "--intermediate-size", str(cfg["intermediate_size"]), "--draft-len", "3", "--batch-seqs", "2",
                 "--anchors", "4", "--lr", "3e-3", "--warmup", "2", "--markov-rank", "4", "--steps", "40",
                 "--save-every", "40", "--no-progress", "--save-dtype", "float32"]) == 0
    s = json.loads((d / "dspark_drafter" / "training.json").read_text())
    assert s["complete"] and s["knobs"]["init"] == "target"
    assert sum(s["last_tv"]) / len(s["last_tv"]) < sum(s["first_tv"]) / len(s["first_tv"])  # it trains from there
