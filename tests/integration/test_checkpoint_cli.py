"""`generate --model DIR` and `serve DIR` on a checkpoint refused at load (non-finite weights): exit 2 with one
line naming the file and the tensor, no traceback -- the same as the checks that run before any work
(corrupt headers, wrong shapes, int weights; their cases are in unittest/_torch/models/test_checkpoint.py).
In process: the exit code is main()'s return value."""

from __future__ import annotations

import socket

import pytest
from safetensors.torch import load_file, save_file

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.export import export_model
from tensorrt_llm_ext.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "nan"
    export_model(load_config(**tiny_model()), d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"][3] = float("nan")
    save_file(sd, str(d / "model.safetensors"))
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", ["generate", "generate_tp2", "serve"])
def test_non_finite_checkpoint_exits_2_with_one_line(nan_checkpoint, capsys, command):
    argv = (["generate", "--model", str(nan_checkpoint), "--no-progress", "--max-new-tokens", "2", "1 17 305"]
            if command != "serve" else ["serve", str(nan_checkpoint), "--port", str(_free_port())])
    if command == "generate_tp2":  # every rank refuses the same file: one line, exit 2, not a rank fault
        argv += ["--tp", "2"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "[TRT-LLM-EXT]" not in line]
    assert err == [f"error: checkpoint: {nan_checkpoint / 'model.safetensors'}: model.norm.weight holds 1 "
                   f"non-finite value(s) (NaN or inf) of 32"]


def test_generate_model_serves_a_qwen3_checkpoint_with_its_family_switches(tmp_path, capsys):
    """The engine builds the target with the checkpoint's switches (q/k norms, explicit head_dim): the
    speculative output equals the target's own decode, and the first token is transformers' greedy one."""
    import torch
    from transformers import AutoModelForCausalLM

    from tensorrt_llm_ext.testing.hf_checkpoints import hf_greedy_decode, save_tiny_qwen3_checkpoint

    d = tmp_path / "qwen3"
    save_tiny_qwen3_checkpoint(d)
    prompt = [1, 17, 30]
    assert main(["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "4", "--check",
                 " ".join(map(str, prompt))]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out
    hf = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    expected = hf_greedy_decode(hf, prompt, 4)
    assert "-> 4 ids (length" in out and " ".join(map(str, expected)) in out, (expected, out)


@pytest.mark.parametrize("broken", ["truncated-json", "no-added-tokens"])
def test_a_broken_tokenizer_is_one_line_naming_its_directory(tmp_path, capsys, broken):
    """A tokenizer.json that transformers cannot load (cut short; valid JSON without its sections) is one line
    naming the directory, exit 2, for `generate` with a text prompt and for `serve` at start-up (was: a
    KeyError traceback, exit 1, or the JSON decoder's words naming no file)."""
    d = tmp_path / broken
    export_model(load_config(**tiny_model()), d)
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}' if broken == "truncated-json"
                                      else '{"version": "1.0", "model": {"type": "BPE"}}')
    for argv in (["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "2", "hello"],
                 ["serve", str(d), "--port", str(_free_port())]):
        assert main(argv) == 2, argv
        err = [line for line in capsys.readouterr().err.splitlines() if "[TRT-LLM-EXT]" not in line]
        assert len(err) == 1 and err[0].startswith(f"error: tokenizer: {d}: transformers cannot load it ("), err


def test_export_refuses_one_directory_for_target_and_drafter(tmp_path, capsys):
    """`export DIR --drafter-dir DIR` wrote the drafter's config.json and model.safetensors over the target's and
    exited 0 listing both (DIR then loaded as nothing: 'architectures=['DSparkDrafter'] ... is not supported'); now
    one line, exit 2, nothing written."""
    d = tmp_path / "model"
    assert main(["export", str(d), "--drafter-dir", str(tmp_path / "." / "model")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: export: the target and the drafter directory are both {d}; the drafter needs its own "
                   f"(default {d / 'dspark_drafter'})\n"), err
    assert not d.exists()
