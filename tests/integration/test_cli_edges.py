"""Edges of the command line that must end in one clear line, exit 2, no traceback, before any work: malformed
``config.json`` switches, a checkpoint refused at load (its line comes before any run banner), and
``--tp N`` on a host with fewer GPUs than N. In process: the exit code is ``main()``'s return value."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.export import export_model
from tensorrt_llm_ext.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    export_model(load_config(**tiny_model()), d)
    return d


def _edited(src, dst, **fields):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _errors(capsys) -> tuple[list[str], str]:
    cap = capsys.readouterr()
    return [ln for ln in cap.err.splitlines() if "[TRT-LLM-EXT]" not in ln], cap.out


@pytest.mark.parametrize("field,value,message", [
    ("torch_dtype", ["float32"], "torch_dtype=['float32'] is not a float dtype this loader reads"),
    ("attention_bias", "false", "attention_bias must be true or false, got 'false'"),
    ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false, got 'no'"),
], ids=["dtype_list", "bias_string", "tie_string"])
def test_malformed_config_fields_are_one_line(checkpoint, tmp_path, capsys, field, value, message):
    """A list dtype crashed with ``unhashable type: 'list'`` (exit 1, traceback); ``attention_bias: "false"``
    was taken as true and reported as a missing ``q_proj.bias``. Both are now refused by name."""
    d = _edited(checkpoint, tmp_path / "edited", **{field: value})
    assert main(["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "2", "1 17 305"]) == 2
    err, out = _errors(capsys)
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint: {d / 'config.json'}: ") and message in err[0], err
    assert "Traceback" not in out and "trtllm-ext generate:" not in out


def test_a_false_switch_loads_as_false(checkpoint, tmp_path, capsys):
    """The strict reading keeps real booleans working: ``attention_bias: false`` serves as before."""
    d = _edited(checkpoint, tmp_path / "plain", attention_bias=False, mlp_bias=None)
    assert main(["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "2", "1 17 305"]) == 0
    assert "-> 2 ids" in capsys.readouterr().out


def test_nan_checkpoint_prints_its_line_before_any_banner(checkpoint, tmp_path, capsys):
    """The run banner follows the load: a checkpoint refused there prints its one line and nothing else
    (was: the banner on stdout, then the error)."""
    import shutil

    d = tmp_path / "nan"
    shutil.copytree(checkpoint, d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"][3] = float("nan")
    save_file(sd, str(d / "model.safetensors"))
    assert main(["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "2", "1 17 305"]) == 2
    err, out = _errors(capsys)
    assert len(err) == 1 and "non-finite value(s)" in err[0] and out == "", (err, out)
    assert main(["generate", "--model", str(checkpoint), "--no-progress", "--max-new-tokens", "2", "1 17 305"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("trtllm-ext generate: DSpark one-model") and out[1].startswith("selection:")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_tp_above_the_gpu_count_is_one_line_before_any_rank(monkeypatch, capsys, command):
    """A host with one GPU, ``--tp 2``: one line naming 2 and the count, exit 2, and no rank started (was: a
    raw NCCL traceback, "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device")."""
    from tensorrt_llm_ext.runtime import launch, ranks

    monkeypatch.setattr(launch, "cuda_device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(ranks, "launch_ranks", no_ranks)
    monkeypatch.setattr(ranks, "launch_command", no_ranks)
    argv = ["generate", "--tp", "2", "--no-progress", "1 17 305"] if command == "generate" else \
        ["serve", "--tp", "2", "--port", "1"]
    assert main(argv) == 2
    err, out = _errors(capsys)
    assert err == ["error: --tp 2 needs 2 GPUs (one rank per GPU on this host), found 1 (CUDA_VISIBLE_DEVICES=0)"]
    assert out == ""
    monkeypatch.setattr(launch, "cuda_device_count", lambda: None)  # no CUDA: CPU ranks, no GPU bound
    assert launch.tp_gpu_error(2) is None
    monkeypatch.setattr(launch, "cuda_device_count", lambda: 2)
    assert launch.tp_gpu_error(2) is None and launch.tp_gpu_error(1) is None


@pytest.mark.parametrize("argv, message", [
    (("tail", "--batch-sizes", ","), "argument --batch-sizes: expected comma-separated integers, got ','"),
    (("tail", "--batch-sizes", "x"), "argument --batch-sizes: expected comma-separated integers, got 'x'"),
    (("step", "--batch-sizes", "0"), "argument --batch-sizes: expected integers in [1, 65536], got 0 in '0'"),
    (("markov", "--tables", "foo"), "argument --tables: expected a comma-separated subset of main,sweep,tp"),
    (("select", "--rows", "8,x"), "argument --rows: expected comma-separated integers, got '8,x'"),
    (("verify", "--batch-sizes", "1,,2"), "argument --batch-sizes: expected comma-separated integers"),
    (("exchange", "--worlds", "two"), "argument --worlds: expected comma-separated integers, got 'two'"),
    (("tp", "--tp", "0"), "argument --tp: expected an integer >= 1, got 0"),
], ids=["tail-empty", "tail-word", "step-zero", "markov-tables", "select-rows", "verify-hole", "exchange-worlds",
        "tp-zero"])
def test_bench_list_and_size_arguments_are_usage_errors(capsys, argv, message):
    """Comma lists, sizes and table names of `bench NAME` are checked by the parser: a usage line naming the flag,
    exit 2, before any work (was: a ValueError / ConfigError traceback, exit 1, or -- `exchange --worlds two`,
    `tp --sections foo` -- exit 0 having measured nothing)."""
    with pytest.raises(SystemExit) as stop:
        main(["bench", *argv])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"trtllm-ext bench {argv[0]}: error: {message}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,message", [
    (["generate", "--job-timeout", "nan"], "argument --job-timeout: expected seconds in (0, 1e+09], got nan"),
    (["generate", "--rank-timeout", "-1"], "argument --rank-timeout: expected seconds in (0, 1e+09], got -1"),
    (["generate", "--job-timeout", "inf"], "argument --job-timeout: expected seconds in (0, 1e+09], got inf"),
    (["test-list", "--jobs", "0"], "argument --jobs: expected an integer >= 1, got 0"),
])
def test_timeouts_and_worker_counts_are_usage_errors(capsys, argv, message):
    """A timeout that is not a finite positive number of seconds (``nan`` meant no bound at all, a negative one
    failed the job at once) and a worker count below one (run as one process, silently) are usage errors."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"trtllm-ext {argv[0]}: error: {message}" in err and "Traceback" not in err, err


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_more_layers_than_the_files_hold_is_one_line_before_any_listing(checkpoint, tmp_path, capsys, which):
    """A config.json whose layer count the weight files cannot hold is refused from the headers' layer indices
    before one name per layer is listed (was: `num_hidden_layers: 1000000000` built a set of 10^9 layer ids and
    10^10 expected tensor names -- a MemoryError under a 4 GB limit, the host's memory without one). 10^5 here keeps
    the old path cheap enough to show the difference: it listed 900 000 names, then 'tensors missing'."""
    import shutil
    import time

    d = tmp_path / which
    shutil.copytree(checkpoint, d)
    cfg_path = d / "config.json" if which == "target" else d / "dspark_drafter" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    held = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = 10**5
    cfg_path.write_text(json.dumps(cfg))
    start = time.monotonic()
    assert main(["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "2", "1 17 305"]) == 2
    assert time.monotonic() - start < 5
    err, _ = _errors(capsys)
    weights = cfg_path.parent / "model.safetensors"
    assert err == [f"error: checkpoint: {weights}: the config has 100000 {which} layers, the weight files hold {held}"]


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json",
                                  "dspark_drafter/config.json"])
def test_a_json_file_nested_too_deeply_is_one_line(checkpoint, tmp_path, capsys, name):
    """100 000 nested brackets in any JSON file the checkpoint reader opens were a RecursionError traceback, exit 1;
    now one line naming the file, exit 2."""
    import shutil

    d = tmp_path / "deep"
    shutil.copytree(checkpoint, d)
    (d / name).write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    assert main(["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "2", "1 17 305"]) == 2
    err, _ = _errors(capsys)
    assert err == [f"error: checkpoint: {d / name} is not valid JSON (nested too deeply)"], err
