"""``trtllm-ext bench prefill``: one admission's prefill, speculative vs target-only, the speculative one by stage
(CPU: a smoke run of the tiny model, its table printed with "-" timings; the stage timers checked directly)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.bench.prefill import STAGE_METHODS, STAGES, stage_timers
from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.testing.tiny_models import tiny_model


def test_bench_prefill_smoke_prints_one_row_per_cell(tmp_path, capsys):
    out = tmp_path / "prefill.md"
    assert main(["bench", "prefill", "--rows", "1,2", "--prompt-lens", "5,9", "--reps", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bench prefill: one admission" in text and "| spec draft |" in text
    cells = [line.split("|")[1:3] for line in text.splitlines() if line.startswith("| ") and "---" not in line
             and not line.startswith("| R ")]
    assert [(int(r), int(n)) for r, n in cells] == [(1, 5), (1, 9), (2, 5), (2, 9)], cells
    assert out.read_text().count("bench prefill: one admission") == 1


def test_stage_timers_time_each_stage_the_prefill_runs_and_leave_the_worker_as_it_was():
    """The speculative prefill passes through every stage once per admission (the target-only one through the forward
    and the selection only), each timed; on exit the worker's methods are its class's again."""
    eng = Engine(load_config(**tiny_model()))
    w = eng.worker("speculative")
    requests = [Request([3, 14, 15, 92, 65], max_new_tokens=6, sampling=SamplingParams(0.0)),
                Request([2, 71, 82], max_new_tokens=6, sampling=SamplingParams(0.9, seed=5))]
    slots = [eng.slots.acquire() for _ in requests]
    for slot, req in zip(slots, requests):
        eng.validate(req)
        eng.reserve(slot, req)
    plain = eng.prefill_slots(slots, requests, "speculative")
    calls: dict[str, int] = {}
    for mode, stages in (("speculative", STAGES), ("target_only", ("forward", "select"))):
        totals: dict[str, float] = {}
        with stage_timers(w, eng.device, totals):
            firsts = eng.prefill_slots(slots, requests, mode)
        assert sorted(totals) == sorted(stages) and all(t > 0 for t in totals.values()), (mode, totals)
        calls[mode] = len(totals)
        if mode == "speculative":
            assert firsts == plain  # the timers change no token
    assert calls == {"speculative": 4, "target_only": 2}
    assert all(name not in vars(w) for name in STAGE_METHODS.values())  # no instance attribute left behind
    for slot in slots:
        eng.release_slot(slot)


def test_bench_prefill_model_dir_times_the_checkpoint_with_its_drafter(tmp_path, capsys):
    """--model DIR: the checkpoint and its drafter, loaded as serve DIR loads them, named in the table's notes."""
    from tensorrt_llm_ext.runtime.export import export_model

    ckpt = tmp_path / "ckpt"
    export_model(load_config(**tiny_model(**{"model.target.vocab_size": 611})), ckpt)
    assert main(["bench", "prefill", "--model", str(ckpt), "--rows", "2", "--prompt-lens", "6", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    assert f"model: {ckpt}; drafter: {ckpt / 'dspark_drafter'}" in text and "| 2 | 6 |" in text, text[-1500:]


@pytest.mark.parametrize("argv, named", [
    (["--temperature", "nan"], "--temperature: expected a finite number >= 0, got nan"),
    (["--prompt-lens", "100000"], "--prompt-lens 100000: a prompt and"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model:"),
])
def test_bench_prefill_bad_input_is_one_line_exit_2(argv, named, capsys):
    assert main(["bench", "prefill", "--reps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: bench prefill: ") and named in err[0], err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_prefill_gpu_times_every_cell(capsys):
    assert main(["bench", "prefill", "--rows", "1,2", "--prompt-lens", "16", "--reps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 2 and all("| - " not in r for r in rows), rows


def test_default_prompt_lens_fit_the_model():
    """Without ``--prompt-lens`` the defaults that fit the model's max_seq_len (the embedded model's 160 tokens on a
    GPU: 128 only), else its longest prompt; never a refusal of the command's own defaults."""
    from tensorrt_llm_ext.bench.prefill import default_prompt_lens

    assert default_prompt_lens(True, 4096, 6) == [128, 512]
    assert default_prompt_lens(True, 160, 6) == [128]
    assert default_prompt_lens(True, 100, 6) == [94]
    assert default_prompt_lens(False, 64, 5) == [8]
    assert default_prompt_lens(False, 10, 5) == [5]
    assert default_prompt_lens(False, 3, 5) == [1]
