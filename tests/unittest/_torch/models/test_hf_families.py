"""Hugging Face families loaded into this project's target: greedy tokens equal transformers', token by token
(tiny random fp32 checkpoints written by transformers itself), and the config spellings real checkpoints use
are read as transformers reads them."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.models.checkpoint import CheckpointError, load_llama_state_dict, read_target_config
from tensorrt_llm_ext.models.hf_config import target_fields
from tensorrt_llm_ext.models.llama_target import LlamaTargetConfig
from tensorrt_llm_ext.modules.rope import RopeScaling

transformers = pytest.importorskip("transformers")

from tensorrt_llm_ext.testing.hf_checkpoints import (TINY_FAMILIES, greedy_decode, hf_greedy_decode,  # noqa: E402
                                                     load_target, save_tiny_hf_checkpoint, target_logits)

PROMPT = [5, 17, 300, 2, 99, 42, 7, 250, 1, 3]
NEW_TOKENS = 32  # positions up to 42, past the 32-position pre-training context of the scaled RoPE families


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_greedy_tokens_equal_transformers(tmp_path, family):
    hf = save_tiny_hf_checkpoint(tmp_path / family, family, seed=3)
    ours = load_target(tmp_path / family)
    with torch.no_grad():
        torch.testing.assert_close(target_logits(ours, PROMPT), hf(torch.tensor([PROMPT])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    want = hf_greedy_decode(hf, PROMPT, NEW_TOKENS)
    assert len(set(want)) > 4, f"degenerate reference decode {want}"
    assert greedy_decode(ours, PROMPT, NEW_TOKENS) == want


def test_family_switches_are_read_and_a_target_without_them_is_refused(tmp_path):
    save_tiny_hf_checkpoint(tmp_path / "q3", "qwen3")
    cfg, tie = read_target_config(tmp_path / "q3")
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.o_proj_bias, cfg.head_dim, tie) == (True, False, False, 24, False)
    plain = LlamaTargetConfig(**{k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                                                              "num_kv_heads", "head_dim", "intermediate_size")},
                              capture_layers=cfg.capture_layers)
    with pytest.raises(CheckpointError, match=r"q3/config.json: this checkpoint needs qk_norm=True"):
        load_llama_state_dict(tmp_path / "q3", plain)
    save_tiny_hf_checkpoint(tmp_path / "q2", "qwen2")
    cfg, tie = read_target_config(tmp_path / "q2")
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.qk_norm, tie) == (True, False, False, True)


def test_hub_config_spellings():
    """The pre-transformers-5 spellings of real checkpoints: `rope_scaling` + top-level `rope_theta`."""
    llama31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
               "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
               "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "mlp_bias": False, "attention_bias": False,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    f = target_fields(llama31)
    assert (f["rope_theta"], f["head_dim"], f["qkv_bias"]) == (500000.0, 128, False)
    assert f["rope_scaling"] == RopeScaling("llama3", 8.0, original_max_position_embeddings=8192)
    qwen25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
              "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
              "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
              "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
              "tie_word_embeddings": True,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    f = target_fields(qwen25)
    assert (f["qkv_bias"], f["o_proj_bias"], f["tie_word_embeddings"]) == (True, False, True)
    assert f["rope_scaling"] == RopeScaling("yarn", 4.0, original_max_position_embeddings=32768)
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
               "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768,
               "rope_theta": 1000000.0, "sliding_window": None}
    assert target_fields(mistral)["rope_scaling"] is None
    with pytest.raises(ValueError, match="sliding_window=4096"):
        target_fields({**mistral, "sliding_window": 4096})


def test_chat_checkpoint_writers_have_facts_and_a_working_template(tmp_path):
    """What a server test serves: the Llama-3-style and Qwen3-style writers with tokenizer, chat template and
    EOS; the same seed gives the same weights whatever the EOS (pick an EOS the greedy decode reaches)."""
    from tensorrt_llm_ext.models.checkpoint import read_checkpoint_facts
    from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_llama3_checkpoint, save_tiny_qwen3_checkpoint

    for name, write in (("l3", save_tiny_llama3_checkpoint), ("q3", save_tiny_qwen3_checkpoint)):
        hf = write(tmp_path / name, seed=1)
        facts = read_checkpoint_facts(tmp_path / name)
        assert (facts.eos_token_ids, facts.bos_token_id, facts.has_tokenizer, facts.has_chat_template) == (
            (2,), 1, True, True)
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        ids = tok.apply_chat_template([{"role": "user", "content": "w9 w300"}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert ids == [1, 3, 6, 9, 300, 4, 3, 7]  # <s> <|start|> user w9 w300 <|end|> <|start|> assistant
        assert tok.decode([9, 300]) == "w9 w300"
        other = write(tmp_path / f"{name}_eos9", seed=1, eos_token_id=9)
        assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), other.state_dict().values()))
        assert read_checkpoint_facts(tmp_path / f"{name}_eos9").eos_token_ids == (9, 2)


def test_tensors_the_model_does_not_use_are_logged(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    save_tiny_hf_checkpoint(tmp_path / "m", "llama3")
    path = tmp_path / "m" / "model.safetensors"
    sd = load_file(str(path))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, str(path))
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        load_target(tmp_path / "m")
    assert "1 rotary inv_freq buffer(s) not used" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # a weight the configuration leaves out (a q_proj bias while config.json has no attention_bias) is a WARNING
    # naming it: the served model would not be the checkpoint's
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.ones(sd["model.layers.0.self_attn.q_proj.weight"].shape[0])
    save_file(sd, str(path))
    caplog.clear()
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        load_target(tmp_path / "m")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "['model.layers.0.self_attn.q_proj.bias']" in warned[0] and "attention_bias" in warned[0]


@pytest.mark.parametrize("family", ["llama3", "llama_yarn", "llama_linear_biases", "qwen2", "qwen3"])
def test_export_of_a_loaded_checkpoint_writes_the_same_model(tmp_path, family):
    """`export --config` over a checkpoint of a family with switches writes them back (was: a plain Llama config,
    no RoPE scaling or biases: transformers and serve computed another model from the exported directory)."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.export import export_model

    hf = save_tiny_hf_checkpoint(tmp_path / "src", family, seed=2)
    export_model(load_config(model_dir=str(tmp_path / "src"), max_batch_size=2, max_seq_len=64), tmp_path / "out")
    src_cfg, _ = read_target_config(tmp_path / "src")
    out_cfg, _ = read_target_config(tmp_path / "out")
    assert out_cfg == src_cfg
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(torch.tensor([PROMPT])).logits, hf(torch.tensor([PROMPT])).logits)


def test_export_refuses_switches_no_family_expresses():
    from tensorrt_llm_ext.models.checkpoint import hf_llama_config

    cfg = LlamaTargetConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=48, capture_layers=(0,), o_proj_bias=True)  # o_proj bias, no q/k/v
    with pytest.raises(ValueError, match="no Hugging Face family served here has these switches together: "
                                         "qkv_bias=False, o_proj_bias=True"):
        hf_llama_config(cfg, torch.float32, 64)


_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 509, "max_position_embeddings": 128}
_L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {**_L3, "original_max_position_embeddings": "8192"}},
     "original_max_position_embeddings must be an integer, got '8192'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": [32]}},
     r"original_max_position_embeddings must be an integer, got \[32\]"),
    ({"rope_theta": 1.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "rope_theta=1.0 is not supported with rope_type='yarn'"),
    ({"rope_theta": 0}, "rope_theta must be > 0, got 0.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, "rope_theta must be > 0, got -5.0"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be >= 0"),
], ids=["llama3-original-str", "yarn-original-list", "yarn-theta-1", "theta-0", "theta-negative", "eps-negative"])
def test_rope_and_norm_numbers_out_of_their_domain_are_named(change, match):
    """Was: a TypeError / ZeroDivisionError traceback when the model was built (exit 1), or a model computing NaN
    logits; now a ValueError naming the field while config.json is read."""
    with pytest.raises(ValueError, match=match):
        target_fields({**_LLAMA, **change})
    # the number transformers computes with, written as a float, is read as the integer
    f = target_fields({**_LLAMA, "rope_scaling": {**_L3, "original_max_position_embeddings": 8192.0}})
    assert f["rope_scaling"] == RopeScaling("llama3", 8.0, original_max_position_embeddings=8192)
