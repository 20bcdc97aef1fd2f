"""``trtllm-ext bench step`` runs end to end (CPU: a smoke run of the tiny model; GPU: one small size)."""

from __future__ import annotations

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
