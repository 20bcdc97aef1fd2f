"""Runtime config: the embedded default, trtllm-serve-style YAML, and errors that name the field."""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.runtime.config import (ConfigError, RuntimeConfig, _load_yaml, default_config_text,
                                             load_config, parse_config)

SERVE_YAML = """
backend: pytorch
tensor_parallel_size: 2
max_batch_size: 16
max_seq_len: 512
enable_chunked_prefill: false
print_iter_log: true
kv_cache_config:
  free_gpu_memory_fraction: 0.8
  tokens_per_block: 32
cuda_graph_config:
  enable_padding: true
  batch_sizes: [1, 2, 4, 8, 16]
speculative_config:
  decoding_type: DSpark
  max_draft_len: 7
  markov_rank: 48
  vocab_parallel_selection: on
  markov_chain_mode: fused
"""


def test_embedded_default_loads():
    cfg = load_config()
    assert isinstance(cfg, RuntimeConfig)
    assert cfg.speculative_config.decoding_type == "DSpark"
    assert cfg.model.target.vocab_size <= 4096  # small enough for a CPU
    assert _load_yaml(default_config_text())["speculative_config"]["decoding_type"] == "DSpark"


def test_serve_style_yaml(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE_YAML)
    cfg = load_config(path)
    assert cfg.tensor_parallel_size == 2 and cfg.max_batch_size == 16
    assert cfg.speculative_config.max_draft_len == 7
    assert cfg.speculative_config.vocab_parallel_selection == "on"
    assert cfg.speculative_config.markov_chain_mode == "fused"
    assert cfg.graph_batch_sizes() == (1, 2, 4, 8, 16)
    assert cfg.kv_cache_config.tokens_per_block == 32


def test_default_graph_batch_sizes_and_overrides():
    cfg = load_config(**{"max_batch_size": 6, "cuda_graph_config.enable_padding": True})
    assert cfg.graph_batch_sizes() == (1, 2, 4, 6)
    assert load_config(**{"speculative_config.max_draft_len": 3}).draft_len == 3


@pytest.mark.parametrize("data, field", [
    ({"speculative_config": {"max_draft_len": 0}}, "speculative_config.max_draft_len"),
    ({"speculative_config": {"decoding_type": "Eagle3"}}, "speculative_config.decoding_type"),
    ({"speculative_config": {"vocab_parallel_selection": "maybe"}}, "speculative_config.vocab_parallel_selection"),
    ({"speculative_config": {"markov_chain_mode": "slow"}}, "speculative_config.markov_chain_mode"),
    ({"speculative_config": {"max_draft_len": 4, "draft_len_typo": 3}}, "speculative_config.draft_len_typo"),
    ({"max_batch_sise": 4}, "max_batch_sise"),
    ({"cuda_graph_config": {"batch_sizes": [0, 2]}}, "cuda_graph_config.batch_sizes"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"model": {"dtype": "float8"}}, "model.dtype"),
    ({"model": {"target": {"head_dim": 7}}}, "head_dim"),
    ({"tensor_parallel_size": 3}, "num_heads"),
    ({"max_batch_size": 2, "cuda_graph_config": {"batch_sizes": [1, 4]}}, "cuda_graph_config.batch_sizes"),
    ({"speculative_config": {"markov_rank": 8}}, "speculative_config.markov_rank"),
])
def test_invalid_values_name_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert field in str(err.value), str(err.value)


def test_yaml_errors_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("speculative_config: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML|speculative_config"):
        load_config(bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(top)


def test_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    """A YAML saved as Latin-1 (or any binary file) is one error naming the file and the byte (was: a
    UnicodeDecodeError traceback, exit 1)."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"max_batch_size: 4\n# r\xe9glages\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml is not UTF-8 text \(byte 0xe9 at offset 21\)"):
        load_config(path)


@pytest.mark.parametrize("text, field", [
    ("speculative_config: 3\n", "speculative_config: Input should be a valid dictionary"),
    ("speculative_config: [1]\n", "speculative_config: Input should be a valid dictionary"),
    ("model: {path: 5}\n", "model.path: Input should be a valid string, got 5"),
    ("speculative_config: {speculative_model: [a]}\n", "speculative_config.speculative_model: Input should be"),
    ("speculative_config: {speculative_model_dir: 7}\n", "speculative_config.speculative_model_dir: Input should"),
], ids=["spec-int", "spec-list", "model-path-int", "drafter-list", "drafter-dir-int"])
def test_sections_and_directories_of_the_wrong_type_name_the_field(tmp_path, text, field):
    """A section that is not a mapping, or a model / drafter directory that is not a string, is the field's
    own error (was: a TypeError traceback while the checkpoint directories were resolved)."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert field in str(err.value), str(err.value)


def test_yaml_bombs_are_refused_before_they_expand(tmp_path):
    """Ten nested aliases of ten items (10^9 leaves under a free-form field), an alias inside itself and 50 000
    levels of nesting are each one ConfigError, at once (was: gigabytes then a MemoryError in the no-effect log
    line, a pydantic circular-reference traceback, a RecursionError)."""
    import time

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    cases = {"scheduler_config: &a {x: [1, *a]}\n": "refers to a node that contains it",
             "scheduler_config: " + "[" * 50000 + "]" * 50000 + "\n": "nested too deeply",
             "scheduler_config:\n" + "\n".join("  " + line for line in lines) + "\n": "aliases expand to more than"}
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"bomb{i}.yaml"
        path.write_text(text)
        start = time.monotonic()
        with pytest.raises(ConfigError, match=message):
            load_config(path)
        assert time.monotonic() - start < 5
    # Aliases that stay small are YAML as usual (a shared anchor, used twice).
    shared = tmp_path / "shared.yaml"
    shared.write_text("scheduler_config: {a: &p [1, 2], b: *p}\nmoe_config: {c: *p}\n")
    assert load_config(shared).scheduler_config == {"a": [1, 2], "b": [1, 2]}
    from tensorrt_llm_ext.runtime.config import MAX_YAML_NODES

    wide = tmp_path / "wide.yaml"
    wide.write_text("scheduler_config: {a: [" + ", ".join(["0"] * (MAX_YAML_NODES - 10)) + "]}\n")
    assert len(load_config(wide).scheduler_config["a"]) == MAX_YAML_NODES - 10


def test_attention_dp_flag_reaches_the_mapping():
    """``enable_attention_dp`` in the config was silently ignored (the rank's Mapping never carried it, so
    vocab-parallel selection and the drafter fusions stayed on); now it reaches the Mapping, and a config
    and a mapping that disagree are refused."""
    from tensorrt_llm_ext.mapping import Mapping
    from tensorrt_llm_ext.runtime.engine import Engine

    tiny = {"model.dtype": "float32", "model.target.vocab_size": 64, "model.target.hidden_size": 16,
            "model.target.head_dim": 4, "model.target.num_layers": 1, "model.target.capture_layers": [0],
            "model.target.intermediate_size": 16, "model.drafter.num_layers": 1, "model.drafter.latent_dim": 8,
            "model.drafter.head_dim": 4, "model.drafter.intermediate_size": 16,
            "speculative_config.markov_rank": 16, "max_batch_size": 1, "max_seq_len": 16}
    cfg = load_config(**tiny, enable_attention_dp=True)
    with pytest.raises(ValueError, match="enable_attention_dp"):
        Engine(cfg, Mapping())
    with pytest.raises(ValueError, match="enable_attention_dp"):
        Engine(load_config(**tiny), Mapping(enable_attention_dp=True))
    assert Engine(cfg).mapping.enable_attention_dp


def test_non_mapping_config_is_a_config_error():
    with pytest.raises(ConfigError, match="expected a mapping at the top level, got list"):
        parse_config([("max_batch_size", 4)])


def test_exchange_option_is_validated_and_reaches_the_pair_exchange():
    from tensorrt_llm_ext.distributed import PairExchange
    from tensorrt_llm_ext.mapping import Mapping
    from tensorrt_llm_ext.speculative.token_selector import VocabParallelSelector

    assert parse_config({}).speculative_config.exchange == "auto"
    for value in ("auto", "nccl", "low_latency"):
        assert parse_config({"speculative_config": {"exchange": value}}).speculative_config.exchange == value
    for bad in ("fast", "NCCL", True, 1, None):
        with pytest.raises(ConfigError) as err:
            parse_config({"speculative_config": {"exchange": bad}})
        msg = str(err.value)
        assert "speculative_config.exchange" in msg and "'auto', 'nccl' or 'low_latency'" in msg, msg
    with pytest.raises(ValueError, match=r"PairExchange: strategy must be one of \['auto', 'nccl', 'low_latency'\]"):
        PairExchange(Mapping(), "fast")
    # A single rank has nothing to exchange, whatever the strategy.
    ex = PairExchange(Mapping(), "low_latency", max_rows=8)
    assert ex.backend == "nccl" and ex.is_identity
    with pytest.raises(ValueError, match="'fast' is not a valid ExchangeStrategy"):
        VocabParallelSelector.bind(Mapping(), None, None, exchange="fast")
