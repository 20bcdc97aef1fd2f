"""The CLI's front door: one-line errors before any work, --version, test-list argument order, bench on a
CPU without TRITON_INTERPRET (with --json/--csv), richer generate --json, generate on a CPU without
TRITON_INTERPRET (the stock torch ops, the same tokens as the fused kernels)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from tensorrt_llm_ext import __version__
from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG


def _cli(*args, env_drop=(), env=None, timeout=300):
    e = {k: v for k, v in os.environ.items() if k not in env_drop}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tensorrt_llm_ext.cli", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


def test_version_and_env_errors_are_one_line():
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"trtllm-ext {__version__}"
    r = _cli("info", "--ranks", "1", env={"TLLM_EXT_COLLECTIVE_TIMEOUT_S": "soon"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("error: environment: TLLM_EXT_COLLECTIVE_TIMEOUT_S='soon': expected a number of "
                                "seconds > 0")


def test_info_reports_the_step_ops_generate_would_use():
    r = _cli("info", "--ranks", "1", env_drop=("TRITON_INTERPRET",))
    assert r.returncode == 0 and "triton interpreter: off" in r.stdout
    assert "step ops: stock torch ops (CPU;" in r.stdout


def test_test_list_dry_run_in_either_order(capsys):
    for argv in (["test-list", "l0_h200", "--dry-run"], ["test-list", "--dry-run", "l0_h200"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith("# TIMEOUT") and "-m pytest" in out and "--dry-run" not in out


def test_bench_switches_the_interpreter_on_and_writes_json_csv(tmp_path):
    j, c = tmp_path / "t.json", tmp_path / "t.csv"
    r = _cli("bench", "tail", "--json", str(j), "--csv", str(c), env_drop=("TRITON_INTERPRET",))
    assert r.returncode == 0, r.stderr[-2000:]
    tables = json.loads(j.read_text())
    assert tables and tables[0]["headers"][0] == "op" and tables[0]["rows"]
    rows = list(csv.reader(c.open()))
    assert rows[0][0] == "table" and rows[1][0] == tables[0]["title"] and len(rows) > len(tables[0]["rows"])
    r = _cli("bench", "tail", "--json", str(tmp_path / "no" / "such" / "t.json"))
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr


def test_a_kernel_benchmark_runs_its_kernels_without_the_interpreter_set():
    """``bench markov`` on a CPU without TRITON_INTERPRET: the CLI switches the interpreter on before anything of the
    package reads the environment (it imported ``runtime.launch`` for the switch, whose imports read ``_env`` first:
    a ValueError traceback, exit 1; ``bench select`` silently timed the eager twins)."""
    r = _cli("bench", "markov", "--tables", "main", "--batch", "1", "--variants", "0", env_drop=("TRITON_INTERPRET",))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.fixture(scope="module")
def small_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "small.yaml"
    path.write_text(json.dumps(load_config(**SMALL_SERVE_CONFIG).model_dump(mode="json", exclude_unset=True)))
    return str(path)


@pytest.mark.parametrize("argv_tail, content, message", [
    (["--prompts-file"], "[[1, 2, null]]", "token ids must be integers, got null"),
    (["--prompts-file"], "[[1, 2.7]]", "token ids must be integers, got 2.7"),
    (["--prompts-file"], "[[1, true]]", "token ids must be integers, got true"),
    (["--json", "/nonexistent/dir/out.json"], None, "--json /nonexistent/dir/out.json: cannot write"),
    (["--tp", "2", "--vocab-parallel", "on", "--config"], "model: {target: {vocab_size: 515}}\n",
     "vocab_parallel_selection='on' needs a vocabulary that shards evenly"),
    # forced on where the target cannot run vocab-parallel (TP 1): refused while built (was: a traceback, exit 1)
    (["--vocab-parallel", "on"], None, "forced on (mode='on'"),
])
def test_generate_errors_are_one_line_before_any_work(tmp_path, capsys, small_yaml, argv_tail, content, message):
    argv = ["generate", "--no-progress"]
    if content is not None:
        f = tmp_path / "input"
        f.write_text(content)
        argv += [*argv_tail, str(f)]
    else:
        argv += [*argv_tail, "--config", small_yaml]
    if "--prompts-file" in argv_tail:
        argv += ["--config", small_yaml]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_generate_json_has_requests_config_versions_and_verdict(tmp_path, small_yaml):
    out = tmp_path / "out.json"
    assert main(["generate", "--config", small_yaml, "--no-progress", "--max-new-tokens", "3", "--check",
                 "--json", str(out), "5 6 7", "9"]) == 0
    data = json.loads(out.read_text())
    assert data["versions"]["tensorrt_llm_ext"] == __version__ and "torch" in data["versions"]
    assert data["config"]["max_batch_size"] == SMALL_SERVE_CONFIG["max_batch_size"]
    assert [r["prompt_ids"] for r in data["requests"]] == [[5, 6, 7], [9]]
    assert all(len(r["output_ids"]) == 3 and r["steps"] == len(r["accepted_lens"]) for r in data["requests"])
    assert data["check"]["passed"] is True


def test_generate_on_a_cpu_without_the_interpreter_runs_torch_ops_with_the_same_tokens(tmp_path, small_yaml):
    # The suite runs with TRITON_INTERPRET=1: in process, the fused kernels (interpreted); in a child without
    # it, the stock torch ops, said in one log line. Both pass --check and produce the same tokens.
    argv = ["generate", "--config", small_yaml, "--no-progress", "--max-new-tokens", "5", "--check",
            "5 6 7", "9", "1 2 3 4 5 6 7 8 9 10"]
    fused, stock = tmp_path / "fused.json", tmp_path / "stock.json"
    assert main([*argv, "--json", str(fused)]) == 0
    r = _cli(*argv, "--json", str(stock), env_drop=("TRITON_INTERPRET",))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "check passed" in r.stdout and "cpu (torch ops)" in r.stdout
    ops_lines = [ln for ln in r.stderr.splitlines() if "step ops:" in ln]
    assert len(ops_lines) == 1 and "stock torch ops on cpu" in ops_lines[0], r.stderr[-2000:]
    out = {name: json.loads(p.read_text())["ranks"][0]["results"] for name, p in (("fused", fused), ("stock", stock))}
    assert out["stock"]["speculative"]["outputs"] == out["fused"]["speculative"]["outputs"]
    assert out["stock"]["speculative"]["accepted_lens"] == out["fused"]["speculative"]["accepted_lens"]
    assert out["stock"]["reference"]["outputs"] == out["fused"]["reference"]["outputs"]


def test_test_list_help_shows_the_pytest_pass_through(capsys):
    with pytest.raises(SystemExit) as e:
        main(["test-list", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "[-- PYTEST ARGS ...]" in out and "trtllm-ext test-list l0_cpu -- -x -k markov" in out.replace("\n", " ")


def test_models_written_by_the_readme_are_git_ignored():
    # The README's import-gguf / train-drafter write under models/: a checkpoint must never be committed.
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", "models/SmolLM2-135M-Instruct/model.safetensors"],
                       capture_output=True, timeout=30)
    assert r.returncode == 0, "models/ is not git-ignored"


HUGE = "99999999999999999999"


@pytest.mark.parametrize("argv, message", [
    (("serve", "--max_batch_size", HUGE), "max_batch_size: Input should be less than or equal to 65536"),
    (("serve", "--max_seq_len", HUGE), "max_seq_len: Input should be less than or equal to 2147483648"),
    (("bench", "target", "--batch-sizes", HUGE), "max_batch_size: Input should be less than or equal to 65536"),
    (("bench", "target", "--page-size", HUGE), "tokens_per_block: Input should be less than or equal to 4096"),
    (("bench", "target", "--draft-len", "0"), "max_draft_len: Input should be greater than or equal to 1"),
    (("bench", "serve", "--concurrency", HUGE), f"--concurrency {HUGE}: expected an integer in [1, 4096]"),
    (("bench", "serve", "--stub-engine", "--stub-host-ms", "inf"), "--stub-host-ms inf: expected a finite number"),
    (("bench", "serve", "--max-seconds", "nan"), "--max-seconds nan: expected a finite number"),
], ids=["serve-batch", "serve-seq-len", "bench-target-batch", "bench-target-page", "bench-target-draft-len",
        "bench-serve-concurrency", "bench-serve-host-ms", "bench-serve-max-seconds"])
def test_sizes_past_their_bounds_are_one_line_and_exit_2(argv, message):
    """A size no tensor can hold, or a time that never ends, is refused by name before any work (was: an
    OverflowError traceback from the engine's allocation, a config traceback, or a run that never ended)."""
    r = _cli(*argv, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert message in r.stderr.strip().splitlines()[-1]



def test_a_failed_benchmark_leaves_no_empty_output_file(tmp_path, monkeypatch):
    """``--json`` / ``--csv`` / ``--out`` are checked for writing before the run; a file the check created is removed
    again, so a run that fails leaves none behind (it left a 0-byte file, neither complete nor absent)."""
    from types import SimpleNamespace

    from tensorrt_llm_ext.bench import harness
    from tensorrt_llm_ext.cli import main

    def fails(args):
        raise RuntimeError("the benchmark failed")

    monkeypatch.setattr(harness, "load_benchmark", lambda name: SimpleNamespace(name=name, help="", add_args=None,
                                                                                   run=fails))
    outs = [tmp_path / "t.json", tmp_path / "t.csv", tmp_path / "t.md"]
    outs[2].write_text("kept\n")  # a file that was there stays as it was
    with pytest.raises(RuntimeError, match="the benchmark failed"):
        main(["bench", "tail", "--json", str(outs[0]), "--csv", str(outs[1]), "--out", str(outs[2])])
    assert not outs[0].exists() and not outs[1].exists() and outs[2].read_text() == "kept\n"
