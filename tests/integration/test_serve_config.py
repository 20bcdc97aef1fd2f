"""The trtllm-serve configuration: a recipe-style YAML loads (no-effect fields logged), the user's file
layers over the embedded default, and types are strict."""

from __future__ import annotations

import logging

import pytest

from tensorrt_llm_ext.runtime.config import ConfigError, load_config, merge_layers

# Written the way TensorRT-LLM's deployment guides write `--config` / `extra_llm_api_options` files.
RECIPE = """
backend: pytorch
tensor_parallel_size: 2
moe_expert_parallel_size: 2
dtype: auto
max_batch_size: 8
max_num_tokens: 8192
max_seq_len: 256
max_input_len: 128
enable_attention_dp: false
enable_chunked_prefill: false
print_iter_log: true
disable_overlap_scheduler: false
attn_backend: TRTLLM
allreduce_strategy: AUTO
stream_interval: 10
trust_remote_code: true
enable_autotuner: false
moe_config:
  backend: TRTLLM
kv_cache_config:
  enable_block_reuse: false
  free_gpu_memory_fraction: 0.85
  dtype: fp8
  tokens_per_block: 32
cuda_graph_config:
  enable_padding: true
  max_batch_size: 8
speculative_config:
  decoding_type: DSpark
  max_draft_len: 3
  use_rejection_sampling: true
"""


def test_recipe_loads_and_logs_fields_without_effect(tmp_path, caplog):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        cfg = load_config(path)
    assert cfg.tensor_parallel_size == 2 and cfg.max_batch_size == 8 and cfg.max_seq_len == 256
    assert cfg.draft_len == 3 and cfg.kv_cache_config.tokens_per_block == 32
    assert cfg.graph_batch_sizes() == (1, 2, 4, 8)
    no_effect = {p for p, _, _ in cfg.no_effect_fields()}
    assert {"moe_expert_parallel_size", "max_input_len", "attn_backend", "allreduce_strategy",
            "kv_cache_config.dtype", "backend", "moe_config"} <= no_effect
    # honoured now (runtime/kv_cache.py, block reuse): the recipe's false is what runs
    assert not cfg.kv_cache_config.enable_block_reuse and "kv_cache_config.enable_block_reuse" not in no_effect
    # honoured now (docs/rejection_sampling.md): a real field, not a no-effect one
    assert cfg.speculative_config.use_rejection_sampling and "speculative_config.use_rejection_sampling" not in no_effect
    assert "tensor_parallel_size" not in no_effect and "kv_cache_config.tokens_per_block" not in no_effect
    assert "kv_cache_config.free_gpu_memory_fraction" not in no_effect  # sizes the page pool
    logged = [r.getMessage() for r in caplog.records]
    assert any("kv_cache_config.dtype='fp8' accepted, no effect here" in m for m in logged), logged


def test_user_file_layers_over_the_embedded_default(tmp_path):
    path = tmp_path / "spec_only.yaml"
    path.write_text("tensor_parallel_size: 2\nspeculative_config:\n  max_draft_len: 2\n")
    base = load_config()
    cfg = load_config(path)
    assert cfg.draft_len == 2
    # Before layering this file replaced the defaults: vocabulary 1031, unevenly sharded at TP 2.
    assert cfg.model.target == base.model.target and cfg.model.target.vocab_size % 2 == 0
    assert cfg.speculative_config.markov_rank == base.speculative_config.markov_rank
    assert merge_layers({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 3}, "d": None}) == {"a": {"b": 3, "c": 2},
                                                                                          "d": None}
    off = tmp_path / "no_graphs.yaml"
    off.write_text("cuda_graph_config: null\n")
    assert load_config(off).cuda_graph_config is None


@pytest.mark.parametrize("text, field", [
    ("speculative_config: {max_draft_len: true}", "speculative_config.max_draft_len"),
    ("speculative_config: {max_draft_len: 2.0}", "speculative_config.max_draft_len"),
    ("speculative_config: {max_draft_len: '3'}", "speculative_config.max_draft_len"),
    ("max_batch_size: true", "max_batch_size"),
    ("cuda_graph_config: {batch_sizes: [1, 2.5]}", "cuda_graph_config.batch_sizes.1"),
    ("cuda_graph_config: {enable_padding: 'yes'}", "cuda_graph_config.enable_padding"),
    ("kv_cache_config: {enable_block_reuse: 1}", "kv_cache_config.enable_block_reuse"),
    ("speculative_config: {mask_token_id: 99999}", "speculative_config.mask_token_id"),
    ("speculative_config: {target_layer_ids: [0, 2]}", "target_layer_ids"),
    ("speculative_config: {max_total_draft_tokens: 9}", "max_total_draft_tokens"),
    ("speculative_config: {speculative_model: /nonexistent/drafter}", "/nonexistent/drafter"),
    ("dtype: float16", "dtype"),
    ("pipeline_parallel_size: 2", "pipeline_parallel_size"),
    ("max_beam_width: 4", "max_beam_width"),
    ("dtype: bfloat16\nmodel: {dtype: float32}", "disagree"),
    ("tensor_parallel_size: 2\nmodel: {target: {vocab_size: 1031}}\n"
     "speculative_config: {vocab_parallel_selection: 'on'}", "vocab_parallel_selection"),
    ("model: /nonexistent/model", "/nonexistent/model"),
])
def test_strict_values_name_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert field in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_trtllm_names_and_aliases(tmp_path):
    path = tmp_path / "names.yaml"
    path.write_text("dtype: float32\nspeculative_config:\n  mask_token_id: 7\n  target_layer_ids: [0, 1, 2]\n")
    cfg = load_config(path)
    assert cfg.model.dtype == "float32" and cfg.mask_token_id == 7
    assert load_config().mask_token_id == cfg.model.target.vocab_size - 1
    assert load_config(**{"speculative_config.max_draft_len": 3}).no_effect_fields() == []
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(missing)


# trtllm-serve spelling -> (argv, the config value it must set)
_ALIASES = [
    (["--tp_size", "2"], lambda c: c.tensor_parallel_size == 2),
    (["--max_batch_size", "4"], lambda c: c.max_batch_size == 4),
    (["--max_seq_len", "64"], lambda c: c.max_seq_len == 64),
    (["--max_num_tokens", "512"], lambda c: c.max_num_tokens == 512),
    (["--log_level", "debug"], lambda c: c.log_level == "debug"),
    (["--backend", "pytorch"], lambda c: c.backend == "pytorch"),
    (["--kv_cache_free_gpu_memory_fraction", "0.9"], lambda c: c.kv_cache_config.free_gpu_memory_fraction == 0.9),
    (["--trust_remote_code"], lambda c: c.trust_remote_code is True),
    (["--extra_llm_api_options", "{yaml}"], lambda c: c.max_batch_size == 2 and c.draft_len == 2),
]


@pytest.mark.parametrize("argv,check", _ALIASES, ids=[a[0][0] for a in _ALIASES])
def test_trtllm_serve_flag_aliases(tmp_path, argv, check):
    """Every trtllm-serve spelling parses and lands on its config field; unset flags change nothing."""
    from tensorrt_llm_ext.cli import build_parser
    from tensorrt_llm_ext.runtime.serve_cli import _load

    yaml_path = tmp_path / "extra.yaml"
    yaml_path.write_text("max_batch_size: 2\nspeculative_config:\n  max_draft_len: 2\n")
    args = build_parser().parse_args(["serve", *[a.format(yaml=yaml_path) for a in argv]])
    level = logging.getLogger("tensorrt_llm_ext").level
    try:
        cfg = _load(args)  # --log_level also sets the logger's level
    finally:
        logging.getLogger("tensorrt_llm_ext").setLevel(level)
    assert check(cfg), cfg
    base = _load(build_parser().parse_args(["serve"]))
    changed = {k for k, v in cfg.model_dump().items() if v != base.model_dump()[k]}
    assert len(changed) <= 2, changed  # only the aliased field (and, for the YAML, its two keys)


def test_log_level_in_yaml_and_no_effect_lines_once_per_job(tmp_path, caplog):
    from tensorrt_llm_ext import logger as log_module
    from tensorrt_llm_ext.cli import build_parser
    from tensorrt_llm_ext.runtime.serve_cli import _load

    path = tmp_path / "cfg.yaml"
    path.write_text("log_level: warning\nmax_num_tokens: 4096\n")
    level = log_module.logger.level
    try:
        with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
            cfg = _load(build_parser().parse_args(["serve", "--config", str(path)]))
            assert cfg.log_level == "warning" and log_module.logger.level == logging.WARNING
        # the launcher and every rank load the config; none of them logs the no-effect lines there
        assert not [r for r in caplog.records if "no effect here" in r.getMessage()]
        with pytest.raises(ConfigError, match="log_level"):
            load_config(path, log_level="loud")
    finally:
        log_module.logger.setLevel(level)
