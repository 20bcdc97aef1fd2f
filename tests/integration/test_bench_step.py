"""``trtllm-ext bench step`` runs end to end (CPU: a smoke run of the tiny model; GPU: one small size)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.testing.tiny_models import tiny_model

CKPT_VOCAB = 611  # not the synthetic model's 517: the model line tells which one was timed


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    """A tiny checkpoint directory as ``train-drafter`` leaves one (the target and ``DIR/dspark_drafter``) and the
    same target without a drafter (as ``import-gguf`` writes it)."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.export import export_model

    root = tmp_path_factory.mktemp("bench_step_ckpt")
    trained = root / "with_drafter"
    export_model(load_config(**tiny_model(**{"model.target.vocab_size": CKPT_VOCAB})), trained)
    bare = root / "target_only"
    shutil.copytree(trained, bare)
    shutil.rmtree(bare / "dspark_drafter")
    return trained, bare


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


@pytest.fixture
def workers_built(monkeypatch):
    """The paths of the workers the run asks its engine for (``stock``: the stock table was timed)."""
    from tensorrt_llm_ext.runtime.engine import Engine

    built, worker = [], Engine.worker

    def spy(self, path="speculative", **kw):
        built.append(path)
        return worker(self, path, **kw)

    monkeypatch.setattr(Engine, "worker", spy)
    return built


def test_bench_step_model_dir_times_the_checkpoint_with_its_drafter(checkpoint_dirs, capsys, workers_built):
    """``--model DIR``: the stages of the checkpoint's step (its vocabulary, its drafter), loaded as ``serve DIR``
    loads it; ``--draft-len`` set over it; ``--no-stock`` times ours only (the stock column "-")."""
    trained, _ = checkpoint_dirs
    assert main(["bench", "step", "--model", str(trained), "--batch-sizes", "1", "--draft-len", "2",
                 "--no-stock"]) == 0
    assert "speculative" in workers_built and "stock" not in workers_built  # the stock table never ran
    text = capsys.readouterr().out
    assert "| 1 " in text and "| 2 " not in text
    assert f"model: checkpoint {trained}, vocab {CKPT_VOCAB}, hidden 32, 2 target layers" in text
    assert f"drafter: {trained / 'dspark_drafter'} (a trained DSpark checkpoint" in text
    assert "K=2," in text  # the flag over the checkpoint's config
    assert "not timed: --no-stock" in text
    row = next(line for line in text.splitlines() if line.startswith("| 1 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(c.endswith("/ -") for c in cells[2:7] + cells[8:9]), row  # every stock half "-"
    assert cells[7] == "-" and cells[9] == "-", row  # no gain without stock


def test_bench_step_model_dir_without_a_drafter_says_so(checkpoint_dirs, capsys, caplog, workers_built):
    """No ``DIR/dspark_drafter``: the loader's seeded bigram drafter (what ``serve DIR`` builds), said in a log line
    and in the table's model line; both tables by default."""
    _, bare = checkpoint_dirs
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        assert main(["bench", "step", "--model", str(bare), "--batch-sizes", "1"]) == 0
    text = capsys.readouterr().out
    assert any(f"bench step: no trained drafter in {bare}" in r.getMessage() for r in caplog.records)
    assert "stock" in workers_built  # without --no-stock both tables run
    assert f"checkpoint {bare}, vocab {CKPT_VOCAB}" in text and "drafter: seeded, not trained" in text
    assert "| 1 " in text and "not timed: --no-stock" not in text


def test_bench_step_model_dir_bad_input_exits_2(checkpoint_dirs, tmp_path, capsys):
    trained, _ = checkpoint_dirs
    assert main(["bench", "step", "--model", str(trained), "--vocab", str(CKPT_VOCAB)]) == 2
    assert "error: bench step: --vocab: not with --model" in capsys.readouterr().err
    missing = tmp_path / "no_such_model"
    assert main(["bench", "step", "--model", str(missing), "--batch-sizes", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: bench step: --model {missing}: checkpoint: model directory {missing} not found" in err
    # the checkpoint's max_position_embeddings (48) bounds a request: prompt + one step's K + 1 tokens
    assert main(["bench", "step", "--model", str(trained), "--batch-sizes", "1", "--prompt-len", "45",
                 "--draft-len", "3"]) == 2
    assert "error: bench step: --prompt-len 45 with K=3 does not fit max_seq_len 48" in capsys.readouterr().err
