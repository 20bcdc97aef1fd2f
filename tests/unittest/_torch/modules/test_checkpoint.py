"""Checkpoints from disk: export -> load round trip bit-exact, a real transformers LlamaForCausalLM loaded
here matches its logits (fp32, atol 2e-5 / rtol 1e-4), missing / corrupt / unsupported files give one
clear error, and the serving facts (EOS, BOS, length, dtype, tokenizer) are read from the directory."""

from __future__ import annotations

import json

import pytest
import torch

from tensorrt_llm_ext.models.checkpoint import (CheckpointError, CheckpointFacts, load_llama_state_dict,
                                                read_checkpoint_facts, read_llama_config)
from tensorrt_llm_ext.models.llama_target import LlamaTarget, LlamaTargetConfig
from tensorrt_llm_ext.runtime.config import ConfigError, load_config
from tensorrt_llm_ext.runtime.engine import full_state_dicts
from tensorrt_llm_ext.runtime.export import export_model

TINY = {
    "model.dtype": "float32", "model.target.vocab_size": 517, "model.target.hidden_size": 32,
    "model.target.head_dim": 8, "model.target.num_heads": 4, "model.target.num_kv_heads": 2,
    "model.target.num_layers": 2, "model.target.capture_layers": [0, 1], "model.target.intermediate_size": 48,
    "model.drafter.num_layers": 1, "model.drafter.latent_dim": 8, "model.drafter.head_dim": 8,
    "model.drafter.intermediate_size": 32, "speculative_config.markov_rank": 32, "max_batch_size": 2,
    "max_seq_len": 32,
}


def _target_from_dir(directory) -> LlamaTarget:
    t = read_llama_config(directory)
    cfg = LlamaTargetConfig(**{k: v for k, v in t.items() if k not in ("tie_word_embeddings", "capture_layers")},
                            capture_layers=tuple(t["capture_layers"]))
    model = LlamaTarget(cfg, dtype=torch.float32)
    model.load_full_state_dict(load_llama_state_dict(directory, cfg))
    return model


def _our_logits(model: LlamaTarget, ids: list[int]) -> torch.Tensor:
    cache = model.make_kv_cache(1, len(ids) + 1)
    inp = torch.tensor([ids])
    out = model(inp, torch.arange(len(ids))[None], torch.zeros(1, dtype=torch.int32), cache)
    return model.logits(out.hidden_states)


def test_export_then_load_is_bit_exact(tmp_path):
    cfg = load_config(**TINY)
    export_model(cfg, tmp_path / "m")
    loaded = load_config(model_dir=str(tmp_path / "m"), **{"max_batch_size": 2, "max_seq_len": 32})
    assert loaded.model.target.model_dump(exclude={"residual_scale"}) == cfg.model.target.model_dump(
        exclude={"residual_scale"})
    assert loaded.model.drafter == cfg.model.drafter and loaded.mask_token_id == cfg.mask_token_id
    assert loaded.model.drafter_path == str(tmp_path / "m" / "dspark_drafter")
    for a, b in zip(full_state_dicts(cfg), full_state_dicts(loaded)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        export_model(cfg, tmp_path / "m")


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_llama_parity(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                                      rope_theta=50000.0, max_position_embeddings=64, tie_word_embeddings=tied)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval().float()
    with torch.no_grad():  # larger than the default 0.02 init, so the logits are far from zero
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    ids = [5, 17, 300, 2, 99, 42, 7, 250, 1]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        got = _our_logits(_target_from_dir(tmp_path / "hf"), ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_exported_target_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = load_config(**TINY)
    export_model(cfg, tmp_path / "m")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval().float()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        torch.testing.assert_close(_our_logits(_target_from_dir(tmp_path / "m"), ids), hf(torch.tensor([ids])).logits[0],
                                   atol=2e-5, rtol=1e-4)


def test_missing_corrupt_and_unsupported_files_are_clear_errors(tmp_path):
    cfg = load_config(**TINY)
    export_model(cfg, tmp_path / "m")
    d = tmp_path / "m"
    with pytest.raises(ConfigError, match="model directory .* not found"):
        load_config(model_dir=str(tmp_path / "nope"))
    # A corrupt weight file: named, one line.
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 3])
    tcfg = LlamaTargetConfig(vocab_size=517, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                             intermediate_size=48, capture_layers=(0, 1))
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        load_llama_state_dict(d, tcfg)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_llama_state_dict(d, tcfg)
    # A missing tensor is named.
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m2"
    export_model(cfg, d)
    drafter = d / "dspark_drafter" / "model.safetensors"
    sd = load_file(str(drafter))
    sd.pop("markov_w1")
    save_file(sd, str(drafter))
    from tensorrt_llm_ext.runtime.engine import Engine

    with pytest.raises(CheckpointError, match="markov_w1"):
        Engine(load_config(model_dir=str(d), **{"max_batch_size": 2, "max_seq_len": 32}))
    config = json.loads((d / "config.json").read_text())
    for change, match in (({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "only Llama"),
                          ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
                          ({"attention_bias": True}, "attention_bias"),
                          ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"num_hidden_layers": 2.5}, "num_hidden_layers")):
        (d / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=match) as err:
            load_config(model_dir=str(d))
        assert "\n" not in str(err.value)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(model_dir=str(d))


def _write_json(path, data) -> None:
    path.write_text(json.dumps(data))


def test_checkpoint_facts_from_config_generation_config_and_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_tokenizer

    d = tmp_path / "Tiny-Llama-3"
    d.mkdir()
    _write_json(d / "config.json", {"eos_token_id": 7, "bos_token_id": 1, "max_position_embeddings": 256,
                                    "torch_dtype": "bfloat16"})
    assert read_checkpoint_facts(d) == CheckpointFacts(
        model_name="Tiny-Llama-3", eos_token_ids=(7,), bos_token_id=1, max_position_embeddings=256,
        torch_dtype=torch.bfloat16, has_tokenizer=False, has_chat_template=False)
    # A list in generation_config.json adds to config.json's int (order kept, no repeats); transformers >= 5
    # spells the dtype `dtype`.
    _write_json(d / "config.json", {"eos_token_id": [9, 7], "dtype": "float32"})
    _write_json(d / "generation_config.json", {"eos_token_id": [7, 11], "bos_token_id": 3})
    facts = read_checkpoint_facts(d)
    assert (facts.eos_token_ids, facts.bos_token_id, facts.torch_dtype) == ((9, 7, 11), 3, torch.float32)
    assert facts.max_position_embeddings is None
    # The tokenizer's eos (`<|end|>` is id 4 of the tiny tokenizer) comes last; its bos fills a missing one.
    save_tiny_tokenizer(d, 40, eos_token="<|end|>")
    (d / "generation_config.json").unlink()
    facts = read_checkpoint_facts(str(d) + "/")
    assert (facts.model_name, facts.eos_token_ids, facts.bos_token_id) == ("Tiny-Llama-3", (9, 7, 4), 1)
    assert facts.has_tokenizer and facts.has_chat_template
    _write_json(d / "config.json", {})
    (d / "chat_template.jinja").unlink()
    facts = read_checkpoint_facts(d)
    assert (facts.eos_token_ids, facts.has_tokenizer, facts.has_chat_template) == ((4,), True, False)


def test_checkpoint_facts_missing_and_malformed_files(tmp_path, caplog):
    with pytest.raises(CheckpointError, match="model directory .*nope not found"):
        read_checkpoint_facts(tmp_path / "nope")
    d = tmp_path / "m"
    d.mkdir()
    with pytest.raises(CheckpointError, match="config.json not found"):
        read_checkpoint_facts(d)
    _write_json(d / "config.json", {"vocab_size": 10})
    assert read_checkpoint_facts(d) == CheckpointFacts("m", (), None, None, None, False, False)
    for change, match in (({"eos_token_id": "2"}, "config.json: eos_token_id must be a token id"),
                          ({"eos_token_id": [2, -1]}, "eos_token_id must be"),
                          ({"bos_token_id": True}, "bos_token_id must be"),
                          ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1"),
                          ({"torch_dtype": "int8"}, "torch_dtype='int8' is not a float dtype")):
        _write_json(d / "config.json", change)
        with pytest.raises(CheckpointError, match=match) as err:
            read_checkpoint_facts(d)
        assert "\n" not in str(err.value)
    _write_json(d / "config.json", {})
    (d / "generation_config.json").write_text("{")
    with pytest.raises(CheckpointError, match="generation_config.json is not valid JSON"):
        read_checkpoint_facts(d)
    (d / "generation_config.json").unlink()
    # A tokenizer eos that no tokenizer file can resolve is left out, with a warning naming it.
    _write_json(d / "tokenizer_config.json", {"eos_token": {"content": "<eot>"}})
    with caplog.at_level("WARNING", logger="tensorrt_llm_ext"):
        assert read_checkpoint_facts(d).eos_token_ids == ()
    assert "eos_token='<eot>' has no id" in caplog.text
    _write_json(d / "tokenizer_config.json", {"eos_token": {"content": "<eot>"},
                                              "added_tokens_decoder": {"12": {"content": "<eot>"}}})
    assert read_checkpoint_facts(d).eos_token_ids == (12,)
