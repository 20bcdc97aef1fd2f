"""Checkpoints from disk: export -> load round trip bit-exact, a real transformers LlamaForCausalLM loaded
here matches its logits (fp32, atol 2e-5 / rtol 1e-4), missing / corrupt / unsupported files give one
clear error, and the serving facts (EOS, BOS, length, dtype, tokenizer) are read from the directory."""

from __future__ import annotations

import json

import pytest
import torch

from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.models.checkpoint import CheckpointError, CheckpointFacts, read_checkpoint_facts
from tensorrt_llm_ext.testing.hf_checkpoints import load_target, target_logits
from tensorrt_llm_ext.runtime.config import ConfigError, load_config
from tensorrt_llm_ext.runtime.model_loader import full_state_dicts
from tensorrt_llm_ext.runtime.export import export_model

TINY = {
    "model.dtype": "float32", "model.target.vocab_size": 517, "model.target.hidden_size": 32,
    "model.target.head_dim": 8, "model.target.num_heads": 4, "model.target.num_kv_heads": 2,
    "model.target.num_layers": 2, "model.target.capture_layers": [0, 1], "model.target.intermediate_size": 48,
    "model.drafter.num_layers": 1, "model.drafter.latent_dim": 8, "model.drafter.head_dim": 8,
    "model.drafter.intermediate_size": 32, "speculative_config.markov_rank": 32, "max_batch_size": 2,
    "max_seq_len": 32,
}


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


def test_exported_files_are_readable_as_the_umask_allows(tmp_path):
    """safetensors creates owner-only files (0600): a checkpoint written by one user must load for another (a
    service account serving a shared directory), as every other file the process writes does."""
    import os

    from tensorrt_llm_ext.models.checkpoint import process_umask

    old = os.umask(0o022)
    try:
        assert process_umask() == 0o022
        export_model(load_config(**TINY), tmp_path / "m")
    finally:
        os.umask(old)
    weights = sorted((tmp_path / "m").rglob("*.safetensors"))
    assert len(weights) == 2  # the target's and the drafter's
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in weights)


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
        got = target_logits(load_target(tmp_path / "hf"), ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_exported_target_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = load_config(**TINY)
    export_model(cfg, tmp_path / "m")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval().float()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        torch.testing.assert_close(target_logits(load_target(tmp_path / "m"), ids), hf(torch.tensor([ids])).logits[0],
                                   atol=2e-5, rtol=1e-4)


def test_missing_corrupt_and_unsupported_files_are_clear_errors(tmp_path):
    cfg = load_config(**TINY)
    export_model(cfg, tmp_path / "m")
    d = tmp_path / "m"
    with pytest.raises(ConfigError, match="model directory .* not found"):
        load_config(model_dir=str(tmp_path / "nope"))
    config = json.loads((d / "config.json").read_text())
    for change, match in (({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "MixtralForCausalLM"),
                          ({"architectures": ["Qwen3ForCausalLM"], "model_type": "llama"}, "model_type='llama'"),
                          ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
                          ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
                          ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                             "high_freq_factor": 1.0}}, "low_freq_factor < high_freq_factor"),
                          ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
                          ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16},
                           "sliding_window=16"),
                          ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                            "sliding_window": 4096}, "sliding_window=4096"),
                          ({"num_local_experts": 8}, "mixture-of-experts"),
                          ({"hidden_act": "gelu"}, "hidden_act"),
                          ({"num_hidden_layers": 2.5}, "num_hidden_layers")):
        (d / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=match) as err:
            load_config(model_dir=str(d))
        assert "\n" not in str(err.value) and "config.json" in str(err.value)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(model_dir=str(d))


# -- corrupt weight files (issue 22 items 3 and 9): one line naming the file and the problem -------------------
def _rewrite(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    edit(sd)
    save_file(sd, str(path))


def _lie_about_offsets(path) -> None:
    """The header claims data past the end of the file for one tensor (the file keeps its length)."""
    import struct

    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    start, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [start, end + 10**6]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


T, D = "model.safetensors", "dspark_drafter/model.safetensors"
HEADER_CASES = {  # checked before any work, from the headers alone
    "trunc_target": (T, lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "not a readable safetensors"),
    "trunc_header": (T, lambda p: p.write_bytes(p.read_bytes()[:20]), "not a readable safetensors file .20 bytes"),
    "trunc_drafter": (D, lambda p: p.write_bytes(p.read_bytes()[:-100]), "not a readable safetensors"),
    "empty_target": (T, lambda p: p.write_bytes(b""), "is empty .0 bytes"),
    "no_weights": (T, lambda p: p.unlink(), "has neither model.safetensors"),
    "wrong_shape": (T, lambda p: _rewrite(p, lambda sd: sd.update({
        "model.layers.0.self_attn.q_proj.weight": sd["model.layers.0.self_attn.q_proj.weight"][:, :-1].contiguous()})),
        r"model.layers.0.self_attn.q_proj.weight has shape \[32, 31\], the config implies \[32, 32\]"),
    "missing_tensor": (T, lambda p: _rewrite(p, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
                       r"target tensors missing: \['model.layers.1.mlp.up_proj.weight'\]"),
    "missing_drafter": (D, lambda p: _rewrite(p, lambda sd: sd.pop("markov_w1")), "drafter tensors missing"),
    "int_dtype": (T, lambda p: _rewrite(p, lambda sd: sd.update({"model.norm.weight": sd["model.norm.weight"].int()})),
                  "model.norm.weight is int32; weights must be float32, float16 or bfloat16"),
    "header_lies": (T, _lie_about_offsets, "not a readable safetensors"),
}


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "good"
    export_model(load_config(**TINY), d)
    return d


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_corrupt_weight_files_are_one_line_before_any_work(good_checkpoint, tmp_path, case):
    rel, corrupt, match = HEADER_CASES[case]
    d = _copy(good_checkpoint, tmp_path / case)
    corrupt(d / rel)
    with pytest.raises(ConfigError, match=match) as err:
        load_config(model_dir=str(d), max_batch_size=2, max_seq_len=32)
    msg = str(err.value)
    assert "\n" not in msg and str(d / rel if case != "no_weights" else d) in msg


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_non_finite_weights_are_refused_at_load_by_name(good_checkpoint, tmp_path, where):
    d = _copy(good_checkpoint, tmp_path / where)
    path, name, value = ((d / T, "model.norm.weight", float("nan")) if where == "target" else
                         (d / D, "markov_w2", float("inf")))

    def poison(sd):
        sd[name].view(-1)[1] = value

    _rewrite(path, poison)
    cfg = load_config(model_dir=str(d), max_batch_size=2, max_seq_len=32)  # the headers are fine
    with pytest.raises(CheckpointError, match=rf"{path}: {name} holds 1 non-finite value\(s\) \(NaN or inf\) of "):
        full_state_dicts(cfg)


def _shard(d, duplicate: str | None = None) -> list:
    """``d``'s target file as two shards plus ``model.safetensors.index.json`` (the index names the first shard
    for ``duplicate``, which the second shard holds too, zeroed)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / T))
    (d / T).unlink()
    names = sorted(sd)
    first = set(names[: len(names) // 2]) | ({duplicate} if duplicate else set())
    shards = {"model-00001-of-00002.safetensors": {n: sd[n] for n in names if n in first},
              "model-00002-of-00002.safetensors": {n: sd[n] for n in names if n not in first}}
    if duplicate:
        shards["model-00002-of-00002.safetensors"][duplicate] = torch.zeros_like(sd[duplicate])
    for file, part in shards.items():
        save_file(part, str(d / file))
    _write_json(d / "model.safetensors.index.json",
                {"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part
                                                if n != duplicate or file.startswith("model-00001")}})
    return sorted(d / file for file in shards)


def test_a_tensor_in_two_shards_is_refused_naming_both(good_checkpoint, tmp_path):
    """Was: the copy in the shard read last served, silently (here: a zeroed norm instead of the index's)."""
    from tensorrt_llm_ext.models.checkpoint import load_llama_state_dict
    from tensorrt_llm_ext.runtime.model_loader import model_configs

    cfg = load_config(model_dir=str(good_checkpoint), max_batch_size=2, max_seq_len=32)
    want = full_state_dicts(cfg)[0]
    d = _copy(good_checkpoint, tmp_path / "sharded")
    _shard(d)
    got = full_state_dicts(load_config(model_dir=str(d), max_batch_size=2, max_seq_len=32))[0]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    d = _copy(good_checkpoint, tmp_path / "twice")
    first, second = _shard(d, duplicate="model.norm.weight")
    with pytest.raises(ConfigError, match=f"checkpoint: model.norm.weight is in both {first} and {second}$"):
        load_config(model_dir=str(d), max_batch_size=2, max_seq_len=32)  # from the headers, before any work
    with pytest.raises(CheckpointError, match=f"checkpoint: model.norm.weight is in both {first} and {second}$"):
        load_llama_state_dict(d, model_configs(cfg)[0])  # the load reads the files again


@pytest.mark.parametrize("method", ["gptq", "fp8", "mlx"])
def test_a_quantized_checkpoint_is_named_as_such(good_checkpoint, tmp_path, method):
    """Was: `target tensors missing: [...q_proj.weight...]` (GPTQ / AWQ store qweight), `... is float8_e4m3fn` or
    `... has shape [32, 4]` (MLX packs 4-bit values) alone, which reads as a broken download; now the line names
    quantization_config (MLX: quantization) and its quant_method first."""
    from tensorrt_llm_ext.models.checkpoint import load_llama_state_dict
    from tensorrt_llm_ext.runtime.model_loader import model_configs

    cfg = model_configs(load_config(model_dir=str(good_checkpoint), max_batch_size=2, max_seq_len=32))[0]
    d = _copy(good_checkpoint, tmp_path / method)
    config = json.loads((d / "config.json").read_text())
    key, quant = (("quantization", {"group_size": 64, "bits": 4}) if method == "mlx" else
                  ("quantization_config", {"quant_method": method, "bits": 4}))
    _write_json(d / "config.json", {**config, key: quant})
    name = "model.layers.0.self_attn.q_proj.weight"

    def quantize(sd):
        w = sd.pop(name)
        if method == "gptq":
            sd[name.replace(".weight", ".qweight")] = torch.zeros(w.shape[1] // 8, w.shape[0], dtype=torch.int32)
        elif method == "mlx":  # 4-bit values packed 8 to a uint32 under the weight's own name
            sd[name] = torch.zeros(w.shape[0], w.shape[1] // 8, dtype=torch.uint32)
        else:
            sd[name] = w.to(torch.float8_e4m3fn)

    _rewrite(d / T, quantize)
    said = (rf"checkpoint: {d / 'config.json'}: quantized weights \({key}, "
            rf"quant_method={None if method == 'mlx' else repr(method)}\) "
            rf"are not supported; serve the float checkpoint \({d / T}: ")
    with pytest.raises(ConfigError, match=said):
        load_config(model_dir=str(d), max_batch_size=2, max_seq_len=32)
    with pytest.raises(CheckpointError, match=said):
        load_llama_state_dict(d, cfg)


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


def test_bf16_checkpoint_dtype_is_a_fact_and_its_cast_is_logged(tmp_path, caplog, monkeypatch):
    from tensorrt_llm_ext import logger as ext_logger
    from tensorrt_llm_ext.runtime.model_loader import build_models

    monkeypatch.setattr(ext_logger, "_seen_once", set())  # earlier tests may have logged the line already
    d = tmp_path / "bf16"
    export_model(load_config(**TINY), d, dtype="bfloat16")
    facts = read_checkpoint_facts(d)
    assert (facts.torch_dtype, facts.max_position_embeddings, facts.model_name) == (torch.bfloat16, 32, "bf16")
    cfg = load_config(model_dir=str(d), max_batch_size=2, max_seq_len=32)  # CPU: model.dtype auto -> float32
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        target, _ = build_models(cfg, Mapping(), torch.device("cpu"))
    assert target.dtype == torch.float32
    assert "LlamaTarget: weights stored as bfloat16 are cast to float32 (the model dtype)" in caplog.text


def test_a_build_reads_the_checkpoint_facts_once(tmp_path, monkeypatch):
    from tensorrt_llm_ext.models import checkpoint
    from tensorrt_llm_ext.runtime.engine import checkpoint_eos_ids
    from tensorrt_llm_ext.runtime.model_loader import build_models
    from tensorrt_llm_ext.runtime.server import served_model_name

    d = tmp_path / "tiny"
    export_model(load_config(**TINY), d)
    calls = []
    for name in ("read_checkpoint_facts", "read_target_family"):
        def counted(directory, _read=getattr(checkpoint, name), _name=name):
            calls.append(_name)
            return _read(directory)
        monkeypatch.setattr(checkpoint, name, counted)
    cfg = load_config(model_dir=str(d), max_batch_size=2, max_seq_len=32)
    build_models(cfg, Mapping(), torch.device("cpu"))
    assert checkpoint_eos_ids(cfg) == cfg.checkpoint_facts.eos_token_ids
    assert served_model_name(cfg, None) == "tiny" and cfg.max_seq_len == 32
    assert sorted(calls) == ["read_checkpoint_facts", "read_target_family"]  # config, engine and server share them
    assert load_config(**TINY).checkpoint_facts is None and load_config(**TINY).target_family == {}
