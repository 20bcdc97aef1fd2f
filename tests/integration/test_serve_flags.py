"""vLLM's and trtllm-serve's flags that a user brings along: accepted with their meaning or with one *no effect
here* line, never refused as unknown (``--gpu-memory-utilization``, ``--trust-remote-code``,
``--enable-prefix-caching``, ``--pp_size``, ``--ep_size``, ``serve --model DIR``)."""

from __future__ import annotations

import argparse
import logging

import pytest

from tensorrt_llm_ext import logger as logger_mod
from tensorrt_llm_ext.runtime.config import ConfigError, log_no_effect_fields, no_effect_reason
from tensorrt_llm_ext.runtime.serve_cli import (_load, add_serve_args, check_serve_args, config_overrides,
                                                log_no_effect_flags, model_argument)


def _parse(*argv):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_vllm_and_trtllm_serve_flags_map_to_config_fields():
    args = _parse("--gpu-memory-utilization", "0.85", "--trust-remote-code", "--enable-prefix-caching",
                  "--pp_size", "1", "--ep_size", "4")
    assert config_overrides(args) == {"kv_cache_config.free_gpu_memory_fraction": 0.85, "trust_remote_code": True,
                                      "kv_cache_config.enable_block_reuse": True, "pipeline_parallel_size": 1,
                                      "moe_expert_parallel_size": 4}
    cfg = _load(args)
    assert cfg.kv_cache_config.free_gpu_memory_fraction == 0.85 and cfg.pipeline_parallel_size == 1
    # TensorRT-LLM's spellings reach the same fields.
    same = _parse("--kv_cache_free_gpu_memory_fraction", "0.85", "--trust_remote_code", "--enable_prefix_caching",
                  "--pipeline-parallel-size", "1", "--moe_expert_parallel_size", "4")
    assert config_overrides(same) == config_overrides(args)
    assert config_overrides(_parse("--no-enable-prefix-caching")) == {"kv_cache_config.enable_block_reuse": False}


def test_each_flag_without_effect_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(logger_mod, "_seen_once", set())
    args = _parse("--trust-remote-code", "--enable-prefix-caching", "--ep_size", "4", "--pp_size", "1")
    cfg = _load(args)
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        log_no_effect_fields(cfg)
        log_no_effect_flags(args)
    lines = [r.getMessage() for r in caplog.records]
    # Values that differ from the default: the config's line; the default asked for by a flag: the flag's line.
    assert [ln for ln in lines if "trust_remote_code" in ln] == [
        "config: trust_remote_code=True accepted, no effect here (no remote code is ever run)"]
    assert [ln for ln in lines if "moe_expert_parallel_size" in ln] == [
        "config: moe_expert_parallel_size=4 accepted, no effect here (dense target, no experts)"]
    assert cfg.kv_cache_config.enable_block_reuse  # honoured now: nothing to say
    assert not any("prefix" in ln or "block_reuse" in ln for ln in lines)
    assert no_effect_reason("kv_cache_config.enable_block_reuse") is None
    assert not any("pp" in ln or "pipeline" in ln for ln in lines)  # pp 1 is what runs: nothing to say
    assert no_effect_reason("kv_cache_config.free_gpu_memory_fraction") is None  # that one is used


def test_pipeline_parallelism_above_1_is_one_clear_error():
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        _load(_parse("--pp_size", "2"))


def test_serve_takes_the_model_as_a_flag_too(tmp_path):
    assert model_argument(_parse("--model", "/m")) == "/m" and model_argument(_parse("/m")) == "/m"
    assert model_argument(_parse("/m", "--model", "/m")) == "/m" and model_argument(_parse()) is None
    with pytest.raises(ConfigError, match="the model is given twice"):
        model_argument(_parse("/a", "--model", "/b"))


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "0", "-1"])
def test_a_drain_timeout_no_timer_holds_is_one_line_at_start(value):
    """``--drain-timeout inf`` / ``1e300`` started, then at SIGTERM the drain timer and the engine loop's join
    raised OverflowError: two tracebacks and exit 1 for a server with nothing in flight. Now refused at start."""
    cfg, err = check_serve_args(_parse("--drain-timeout", value))
    assert cfg is None and err.startswith("--drain-timeout ") and "expected seconds in (0, 1e+09]" in err, err


def test_the_longest_drain_timeout_is_accepted():
    _, err = check_serve_args(_parse("--drain-timeout", "1e9", "--port", "1"))
    assert err is None or "--drain-timeout" not in err, err


def test_a_named_tokenizer_directory_without_a_tokenizer_is_refused_at_start(tmp_path):
    """``serve --tokenizer DIR`` where DIR exists but holds no tokenizer started with token-id prompts only (the flag
    silently ignored, every text prompt a 400 saying the model has no tokenizer); a missing DIR was refused. Both
    are one line at start now; a directory with one of the tokenizer files passes this check."""
    cfg, err = check_serve_args(_parse("--tokenizer", str(tmp_path)))
    assert cfg is None and err.startswith(f"tokenizer directory {tmp_path} holds no tokenizer"), err
    _, err = check_serve_args(_parse("--tokenizer", str(tmp_path / "missing")))
    assert err == f"tokenizer directory {tmp_path / 'missing'} not found", err
    from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path, 517)
    _, err = check_serve_args(_parse("--tokenizer", str(tmp_path), "--port", "1"))
    assert err is None or "tokenizer" not in err, err
