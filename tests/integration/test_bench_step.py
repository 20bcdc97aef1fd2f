"""``trtllm-ext bench step`` runs end to end (CPU: a smoke run of the tiny model; GPU: one small size)."""

from __future__ import annotations

import subprocess
import sys

import torch

from tensorrt_llm_ext.cli import main


def test_bench_step_smoke(tmp_path, capsys):
    out = tmp_path / "step.md"
    args = ["bench", "step", "--batch-sizes", "1,2", "--out", str(out)]
    if torch.cuda.is_available():
        args += ["--vocab", "32000"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "bench step" in text and "| 2 " in text
    assert "outside target" in out.read_text()


def test_bench_step_sampled_mode_smoke(capsys):
    """The sampled mode: sampled drafts + rejection verification, ours and stock timed in one run, both as the
    graph of the top-p variant (what the engine replays for top-p rows); ``--profile`` lists the kernels of
    the captured sampled step on a GPU."""
    args = ["bench", "step", "--batch-sizes", "1", "--temperature", "1", "--top-p", "0.95", "--rejection-sampling",
            "--profile"]
    if torch.cuda.is_available():
        args += ["--vocab", "32000"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "sampled traffic" in text and "rejection sampling (sampled drafts)" in text and "| 1 " in text
    assert "| top-p / top-p " in text
    assert "sampled / greedy" in text  # the goal's ratio, greedy measured in the same run
    assert "the fused step by stage, sampled and greedy rows" in text  # --profile: which stage holds it
    assert "| 1 | sampled " in text and "| 1 | greedy " in text
    if torch.cuda.is_available():
        assert "profile of one captured sampled step (ours) at B=1:" in text
        assert "profile of one captured sampled step (stock) at B=1:" in text


def test_bench_step_bad_sampling_arguments_exit_2(capsys):
    assert main(["bench", "step", "--rejection-sampling"]) == 2  # the sampled mode needs a temperature
    assert main(["bench", "step", "--temperature", "1", "--top-p", "1.5"]) == 2
    assert "--top-p: expected a number in (0, 1], got 1.5" in capsys.readouterr().err


def test_bench_step_import_leaves_the_environment_alone():
    """Importing the benchmark module changes no environment variable (the interpreter is switched on when
    it runs, issue 24 item 9)."""
    code = ("import os; os.environ.pop('TRITON_INTERPRET', None); before = dict(os.environ); "
            "import tensorrt_llm_ext.bench.step; assert dict(os.environ) == before, 'changed'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
