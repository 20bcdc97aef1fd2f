"""`train-drafter` fails closed: every knob checked before any work (one line, exit 2), a step whose loss or
gradient is non-finite is skipped without an update and a run of more than --max-skipped-steps of them stops naming
the steps and writes no drafter, files are written whole (temporary name + rename), a
damaged or crafted work-dir file is named on `--resume` and never unpickled as code."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
from tensorrt_llm_ext.training import trainer

TINY = ["--num-prompts", "4", "--max-new-tokens", "8", "--gen-batch", "4", "--eval-prompts", "0", "--num-layers",
        "1", "--num-heads", "2", "--head-dim", "8", "--latent-dim", "8", "--intermediate-size", "16", "--draft-len",
        "2", "--batch-seqs", "2", "--anchors", "2", "--warmup", "1", "--no-progress"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = export_tiny_target(tmp_path_factory.mktemp("faults") / "tiny")
    return d


@pytest.mark.parametrize("flag,value", [("--lr", "inf"), ("--lr", "0"), ("--position-decay", "nan"),
                                        ("--grad-clip", "-1"), ("--save-dtype", "fp16"), ("--device", "foo"),
                                        ("--gen-temperature", "nan"), ("--batch-seqs", "100000000"),
                                        ("--markov-rank", "0"), ("--head-dim", "7"), ("--max-new-tokens", "1"),
                                        ("--target-layers", ",,,"), ("--seed", "1000000000000000")])
def test_bad_knobs_are_refused_before_any_work(tmp_path, capsys, flag, value):
    """The directory does not even exist: the refusal comes from the knob check, before the target loads."""
    assert main(["train-drafter", str(tmp_path / "absent"), *TINY, flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: train-drafter: {flag}") and value in err[0], err


def _nan_loss_at(steps):
    """A distillation_loss whose loss is NaN at the given 1-based calls (its gradient then NaN everywhere)."""
    real = trainer.distillation_loss
    calls = []

    def loss_fn(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls.append(1)
        if len(calls) in steps:
            return loss * float("nan"), {**metrics, "loss": float("nan")}
        return loss, metrics
    return loss_fn


def test_nonfinite_loss_stops_naming_the_step(target, tmp_path, monkeypatch, capsys):
    """--max-skipped-steps 0: the first non-finite loss stops the run, no drafter written."""
    monkeypatch.setattr(trainer, "distillation_loss", _nan_loss_at({3}))
    out = tmp_path / "drafter"
    assert main(["train-drafter", str(target), "--out", str(out), "--steps", "6", "--save-every", "2",
                 "--max-skipped-steps", "0", *TINY]) == 1
    err = capsys.readouterr().err
    assert "at step 3" in err and "last checkpoint, step 2" in err and "Traceback" not in err
    assert not out.exists()


def test_a_nonfinite_step_is_skipped_without_an_update(target, tmp_path, monkeypatch, caplog, capsys):
    """One NaN loss (every gradient NaN): the step is skipped on the device, logged, recorded in training.json, and
    the run completes with finite weights (an applied update would have made every weight NaN and the run refuse to
    write them); AdamW's step count is one fewer than the steps (the skipped step left the moments as they were)."""
    monkeypatch.setattr(trainer, "distillation_loss", _nan_loss_at({3}))
    out, work = tmp_path / "drafter", tmp_path / "work"
    with caplog.at_level("WARNING", logger="tensorrt_llm_ext"):
        assert main(["train-drafter", str(target), "--out", str(out), "--work-dir", str(work), "--steps", "5",
                     "--save-every", "5", *TINY]) == 0
    said = [r.getMessage() for r in caplog.records if "skipped, no update" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("train-drafter: step 3 skipped") and "loss nan" in said[0], said
    assert "skipped steps: 1 (non-finite loss or gradient, no update; steps 3;" in capsys.readouterr().out
    summary = json.loads((out / "training.json").read_text())
    assert [s["step"] for s in summary["skipped_steps"]] == [3] and summary["skipped_steps"][0]["loss"] == "nan"
    # the diagnosis: the NaN came after the loss rows (this test multiplies the loss), none of them is non-finite
    assert summary["skipped_steps"][0]["nonfinite"] == {"hidden values": 0, "valid rows": 0, "padding rows": 0,
                                                        "confidence logits": 0}
    assert summary["steps_this_run"] == 5 and len(summary["last_losses"]) == 4
    state = torch.load(work / "trainer_state.pt", weights_only=True)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {4.0}  # 5 steps, one skipped
    from safetensors.torch import load_file
    assert all(bool(torch.isfinite(t).all()) for t in load_file(out / "model.safetensors").values())


def test_a_run_of_nonfinite_steps_past_the_limit_stops(target, tmp_path, monkeypatch, capsys):
    """NaN from step 3 on with --max-skipped-steps 2: the third in a row stops the run naming the streak and the
    newest checkpoint (its weights untouched by the skipped steps); no drafter."""
    monkeypatch.setattr(trainer, "distillation_loss", _nan_loss_at(set(range(3, 100))))
    out = tmp_path / "drafter"
    assert main(["train-drafter", str(target), "--out", str(out), "--steps", "8", "--save-every", "2",
                 "--max-skipped-steps", "2", *TINY]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "non-finite in 3 steps in a row (3-5)" in err[0] and "last checkpoint, step 4" in err[0]
    assert not out.exists()


def test_a_kill_while_the_drafter_is_written_leaves_the_previous_one(target, tmp_path, monkeypatch):
    out = tmp_path / "drafter"
    assert main(["train-drafter", str(target), "--out", str(out), "--steps", "2", *TINY]) == 0
    before = (out / "model.safetensors").read_bytes()
    real = trainer.save_drafter_checkpoint

    def killed_after_config(directory, *args):
        real(directory, *args)
        (directory / "model.safetensors").unlink()  # as if SIGTERM came between the two files
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "save_drafter_checkpoint", killed_after_config)
    assert main(["train-drafter", str(target), "--out", str(out), "--steps", "3", *TINY]) == 130  # one line
    assert sorted(p.name for p in out.iterdir()) == ["confidence_head.safetensors", "config.json", "model.safetensors",
                                                     "training.json"]
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "drafter_work"]  # no temporary left behind


def test_atomic_save_keeps_the_previous_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "data.pt"
    trainer.atomic_torch_save({"a": torch.ones(3)}, path)

    def disk_full(obj, f):
        open(f, "wb").write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        trainer.atomic_torch_save({"a": torch.zeros(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["data.pt"]


@pytest.fixture(scope="module")
def work(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("work")
    assert main(["train-drafter", str(target), "--out", str(d / "drafter"), "--steps", "2", "--save-every", "1",
                 *TINY]) == 0
    return d / "drafter_work"


@pytest.mark.parametrize("name,damage", [("trainer_state.pt", "truncate"), ("trainer_state.pt", "empty"),
                                         ("data.pt", "truncate"), ("data.pt", "empty"),
                                         ("trainer_state.pt", "other dict")])
def test_resume_names_a_damaged_file(target, work, tmp_path, capsys, name, damage):
    w = tmp_path / "drafter_work"
    shutil.copytree(work, w)
    blob = (w / name).read_bytes()
    if damage == "other dict":
        torch.save({"params": {}}, w / name)
    else:
        (w / name).write_bytes(blob[: len(blob) // 2] if damage == "truncate" else b"")
    assert main(["train-drafter", str(target), "--out", str(tmp_path / "drafter"), "--steps", "2", "--save-every",
                 "1", "--resume", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(w / name) in err[0] and "--resume" in err[0], err


def test_resume_never_runs_code_from_the_state_file(target, work, tmp_path, capsys):
    w = tmp_path / "drafter_work"
    shutil.copytree(work, w)
    torch.load(w / "trainer_state.pt", weights_only=True)  # a genuine state file loads this way
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"params": {}, "knobs": Evil()}, w / "trainer_state.pt")
    assert main(["train-drafter", str(target), "--out", str(tmp_path / "drafter"), "--steps", "2", "--resume",
                 *TINY]) == 2
    assert not marker.exists()
    assert "trainer_state.pt is damaged or not a train-drafter file" in capsys.readouterr().err


def test_drop_state_leaves_a_small_work_folder_and_an_unfinished_run_its_state(target, tmp_path, caplog):
    """--drop-state removes trainer_state.pt (weights and AdamW moments) once a complete run's drafter is written,
    saying so; the token data stays. A run stopped by --max-seconds keeps it (--resume continues from it)."""
    import logging

    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        assert main(["train-drafter", str(target), "--out", str(tmp_path / "a"), "--steps", "2", "--drop-state",
                     *TINY]) == 0
    assert sorted(p.name for p in (tmp_path / "a_work").iterdir()) == ["data.pt"]
    assert (tmp_path / "a" / "model.safetensors").is_file()
    assert any("trainer_state.pt" in r.getMessage() and "--drop-state" in r.getMessage() for r in caplog.records)
    assert main(["train-drafter", str(target), "--out", str(tmp_path / "b"), "--steps", "2", "--max-seconds",
                 "1e-9", "--drop-state", *TINY]) == 0
    assert (tmp_path / "b_work" / "trainer_state.pt").is_file()


def test_out_that_is_not_a_drafter_is_refused_before_any_work(target, tmp_path, capsys):
    """--out is replaced whole at the end: the target's own directory, a folder of the user's or a file were
    deleted with exit 0. Now each is refused in one line before the target loads; a drafter written before
    (the GPU script trains over one) and an empty directory are still replaced."""
    target_files = sorted(p.name for p in target.iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (tmp_path / "file").write_text("keep")
    cases = [(target, "holds something else than a drafter"), (mine, "holds something else than a drafter"),
             (tmp_path / "file", "is a file")]
    for out, why in cases:
        assert main(["train-drafter", str(target), "--out", str(out), *TINY]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: train-drafter: --out {out}") and why in err[0], err
    assert sorted(p.name for p in target.iterdir()) == target_files
    assert (mine / "notes.txt").read_text() == "keep" and (tmp_path / "file").read_text() == "keep"
    assert not (tmp_path / "mine_work").exists()  # refused before the work dir was made
    out = tmp_path / "drafter"
    assert main(["train-drafter", str(target), "--out", str(out), "--work-dir", str(out / "w"), *TINY]) == 2
    assert "--work-dir" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # (a drafter over a drafter: test_a_kill_while_the_drafter_is_written_...)
    assert main(["train-drafter", str(target), "--out", str(tmp_path / "empty"), "--steps", "1", *TINY]) == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny target with a chat tokenizer (`w9 w30` <-> [9, 30]) and a context of 64 positions."""
    from tensorrt_llm_ext.testing.hf_checkpoints import save_tiny_llama3_checkpoint

    d = tmp_path_factory.mktemp("chat") / "tiny"
    save_tiny_llama3_checkpoint(d, max_position_embeddings=64)
    return d


def test_prompts_are_checked_before_any_answer_is_decoded(chat_target, tmp_path, monkeypatch, capsys):
    """An empty held-out split was refused only after every training answer was decoded; a prompt that leaves
    no room for --max-new-tokens in the target's context failed the run when the answer loop reached it (the
    loop goes shortest first: after the others were decoded). Now both splits are prompted first: an empty split
    is refused naming the way out, a prompt past the context loses its oldest turns or is skipped (logged), as
    one past --max-prompt-tokens."""
    def no_answers(*args, **kwargs):
        raise AssertionError("the answer loop started")

    monkeypatch.setattr(trainer, "regenerate", no_answers)
    pinned = tmp_path / "train_only.jsonl"
    pinned.write_text("".join(json.dumps({"prompt": f"w{10 + i} w{20 + i}", "set": "train"}) + "\n"
                              for i in range(8)))
    args = ["train-drafter", str(chat_target), "--out", str(tmp_path / "d"), "--prompts", str(pinned),
            *TINY, "--eval-prompts", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gave no held_out prompts" in err[0] and "--eval-prompts 0" in err[0], err
    long_and_short = tmp_path / "mixed.jsonl"
    long_and_short.write_text(json.dumps({"prompt": " ".join(f"w{10 + i}" for i in range(50))}) + "\n"
                              + json.dumps({"prompt": "w11 w12"}) + "\n")
    tc = trainer.TrainConfig(prompts=(str(long_and_short),), num_prompts=2, max_new_tokens=20, held_out_percent=0.0)
    prompts = trainer._prompts(chat_target, tc, "train", 2, 509)
    assert len(prompts) == 1 and len(prompts[0]) + 20 <= 64  # the 50-word prompt cannot fit 64 - 20: skipped
    assert main([*args[:6], str(long_and_short), *TINY, "--max-new-tokens", "64"]) == 2
    assert "--max-new-tokens 64 leaves no room for a prompt" in capsys.readouterr().err


def test_answers_too_short_to_train_on_are_one_line(target, tmp_path, monkeypatch, capsys):
    """Every answer stopped after one token (an EOS at once): no sequence is left, and the run died in a
    traceback (torch.randint over 0 sequences) after the generation. Now one line, exit 2, no data file."""
    def one_token_answers(model_dir, prompts, **kwargs):
        lens = torch.tensor([len(p) + 1 for p in prompts])
        return {"tokens": torch.ones(len(prompts), int(lens.max()), dtype=torch.int32), "lens": lens,
                "prompt_lens": torch.tensor([len(p) for p in prompts])}

    monkeypatch.setattr(trainer, "regenerate", one_token_answers)
    assert main(["train-drafter", str(target), "--out", str(tmp_path / "d"), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shorter than 2 tokens" in err[0] and "nothing to train on" in err[0], err
    assert not (tmp_path / "d_work" / "data.pt").exists()


def test_bench_acceptance_checks_every_config_before_measuring(target, chat_target, tmp_path, monkeypatch, capsys):
    """`bench acceptance` built each variant's engine config when its turn came: a drafter of another target was
    a ConfigError traceback after the variants before it had been measured, --draft-lens 100 / --batch-size 0
    tracebacks, --max-prompt-tokens below every prompt `max() arg is an empty sequence`, a NaN in the trained
    drafter's weights a traceback after the bigram variant was measured, --seed -5 every request's failure (exit
    1). Now every config, the trained drafter's weights, the seed and the prompts are checked first; each refusal
    is one line naming the flags, exit 2, no engine built."""
    import dataclasses

    from tensorrt_llm_ext.models.checkpoint import default_target_layer_ids, read_target_config, save_drafter_checkpoint
    from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafterConfig, generate_full_state_dict
    from tensorrt_llm_ext.runtime import engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(engine, "Engine", no_engine)
    tcfg, _ = read_target_config(target)
    other = DSparkDrafterConfig(hidden_size=tcfg.hidden_size + 8, target_hidden_size=tcfg.hidden_size + 8,
                                num_capture_layers=1, num_layers=1, num_heads=2, head_dim=8, latent_dim=8,
                                intermediate_size=16, vocab_size=tcfg.vocab_size, markov_rank=4,
                                mask_token_id=tcfg.vocab_size - 1)
    save_drafter_checkpoint(tmp_path / "other", other, [0], generate_full_state_dict(other, 0, torch.float32))
    layers = default_target_layer_ids(tcfg.num_layers)  # a drafter of this target whose weights hold a NaN
    fits = dataclasses.replace(other, hidden_size=tcfg.hidden_size, target_hidden_size=tcfg.hidden_size,
                               num_capture_layers=len(layers))
    nan = generate_full_state_dict(fits, 0, torch.float32)
    nan["fc.weight"][0, 0] = float("nan")
    save_drafter_checkpoint(tmp_path / "nan", fits, layers, nan)
    small = ["--num-prompts", "1", "--max-new-tokens", "2", "--samplings", "greedy"]
    cases = [(target, ["--drafter", str(tmp_path / "other"), "--variants", "bigram", "trained", "--draft-lens", "2"],
              f"trained (--drafter {tmp_path / 'other'}, --draft-lens 2"),
             (target, ["--drafter", str(tmp_path / "nan"), "--variants", "bigram", "trained", "--draft-lens", "2"],
              "non-finite"),
             (target, ["--variants", "bigram", "--draft-lens", "100"], "bigram (--draft-lens 100"),
             (target, ["--variants", "bigram", "--batch-size", "0"], "--batch-size 0)"),
             (target, ["--variants", "bigram", "--seed", "-5"], "--seed must be an integer"),
             (chat_target, ["--variants", "bigram", "--max-prompt-tokens", "1"], "longer than --max-prompt-tokens 1"),
             # a missing model directory is named as such (it was "no drafter at MISSING/dspark_drafter")
             (tmp_path / "missing", ["--variants", "bigram", "trained"], f"--model {tmp_path / 'missing'}: no checkpoint")]
    for model, flags, names in cases:
        assert main(["bench", "acceptance", "--model", str(model), *small, *flags]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: bench acceptance: ") and names in err[0], err


def test_resume_refuses_answers_made_with_other_knobs(target, work, tmp_path, capsys, caplog):
    """A work dir with data.pt but no trainer_state.pt yet (stopped before the first checkpoint): --resume with
    other data knobs trained on the old answers silently (the knob check was trainer_state.pt's only). Now the
    answers carry their knobs: another --max-new-tokens is refused by name; the same flags reuse them (and the
    steps starting over without a state is logged)."""
    import logging

    w = tmp_path / "drafter_work"
    shutil.copytree(work, w)
    (w / "trainer_state.pt").unlink()
    args = ["train-drafter", str(target), "--out", str(tmp_path / "drafter"), "--steps", "2", "--resume"]
    assert main([*args, *TINY, "--max-new-tokens", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(w / "data.pt") in err[0] and "['max_new_tokens']" in err[0], err
    before = (w / "data.pt").read_bytes()
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        assert main([*args, *TINY]) == 0
    assert (w / "data.pt").read_bytes() == before  # reused, not regenerated
    assert any("--resume: no trainer_state.pt" in r.getMessage() for r in caplog.records)  # said, not silent


def test_ctrl_c_mid_step_checkpoints_that_step(target, tmp_path, monkeypatch, capsys):
    """SIGINT in a step stopped it at once: every step since the last --save-every checkpoint was lost. Now the
    step finishes, is checkpointed, and then the command ends with one line and exit 130 (was: a KeyboardInterrupt
    traceback); the handlers are the previous ones again, and --resume continues from there."""
    import os
    import signal

    real, calls = trainer.distillation_loss, []
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # the process's own, restored after

    def ctrl_c_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "distillation_loss", ctrl_c_in_step_3)
    args = ["train-drafter", str(target), "--out", str(tmp_path / "d"), "--steps", "6", "--save-every", "100", *TINY]
    assert main(args) == 130  # one line naming --resume, not a KeyboardInterrupt traceback
    assert "--resume continues" in capsys.readouterr().err
    assert torch.load(tmp_path / "d_work" / "trainer_state.pt", weights_only=True)["step"] == 3
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert not (tmp_path / "d").exists()
    monkeypatch.setattr(trainer, "distillation_loss", real)
    old = os.umask(0o022)
    try:
        assert main([*args, "--resume"]) == 0 and (tmp_path / "d" / "model.safetensors").is_file()
    finally:
        os.umask(old)
    # the drafter's files take the process's modes (safetensors alone writes them owner-only: another user's server
    # could not load them)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "d").glob("*.safetensors")} == {
        "model.safetensors": 0o644, "confidence_head.safetensors": 0o644}


@pytest.mark.parametrize("flag,value,knob", [("--num-layers", "2", "num_layers"), ("--draft-len", "3", "draft_len"),
                                             ("--markov-rank", "8", "markov_rank")])
def test_resume_with_other_shape_flags_names_them(target, work, tmp_path, capsys, flag, value, knob):
    """--resume with another drafter shape was refused as "holds weights of another drafter shape", naming no
    flag; the knob check (which names them) now comes first."""
    shutil.copytree(work, tmp_path / "drafter_work")
    assert main(["train-drafter", str(target), "--out", str(tmp_path / "drafter"), "--steps", "2", "--save-every",
                 "1", "--resume", *TINY, flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other knobs ([" in err[0] and f"'{knob}'" in err[0], err


def test_resume_accepts_another_skip_limit(target, work, tmp_path, caplog):
    """--max-skipped-steps is a tolerance, not a shape or a schedule: a resumed run may change it."""
    shutil.copytree(work, tmp_path / "drafter_work")
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        assert main(["train-drafter", str(target), "--out", str(tmp_path / "drafter"), "--steps", "2", "--save-every",
                     "1", "--resume", "--max-skipped-steps", "0", *TINY]) == 0
    assert any("resumed from" in r.getMessage() and "at step 2" in r.getMessage() for r in caplog.records)


def test_a_work_dir_that_is_a_file_and_huge_weights_are_plain_errors(tmp_path, capsys):
    """--work-dir naming a file was "[Errno 17] File exists" (no flag); two --prompts weights near the float limit
    summed to inf ("cannot convert float NaN to integer"): now the flag's line, and the mix by share."""
    from tensorrt_llm_ext.training.prompt_sources import mixed_samples

    (tmp_path / "w").write_text("keep")
    assert main(["train-drafter", str(tmp_path / "absent"), "--work-dir", str(tmp_path / "w"), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: train-drafter: --work-dir {tmp_path / 'w'} is a file"), err
    assert (tmp_path / "w").read_text() == "keep"
    mix = mixed_samples(["templates:1e308", "templates:5e307"], "train", 9, seed=0, max_turns=1, held_out_percent=2.0)
    assert len(mix) == 9


def test_bench_acceptance_that_measures_no_step_is_not_exit_0(target, monkeypatch, capsys):
    """--max-new-tokens 1 (the prefill's token only) printed rows of 0 steps and '-' and exited 0; now it is
    refused up front, and a row without any step (every request ended at its first token) exits 1 naming it."""
    from tensorrt_llm_ext.runtime import engine

    small = ["bench", "acceptance", "--model", str(target), "--variants", "bigram", "--draft-lens", "2",
             "--num-prompts", "1", "--samplings", "greedy"]
    assert main([*small, "--max-new-tokens", "1"]) == 2
    assert "--max-new-tokens must be >= 2" in capsys.readouterr().err
    real = engine.Engine.generate

    def eos_at_once(self, reqs, **kwargs):
        results, stats = real(self, reqs, **kwargs)
        for r in results:
            r.accepted_lens = []  # as if each request stopped at its prefill token
        return results, stats

    monkeypatch.setattr(engine.Engine, "generate", eos_at_once)
    assert main([*small, "--max-new-tokens", "2"]) == 1
    assert "no generation step in bigram K=2 greedy" in capsys.readouterr().err


def test_a_second_run_on_a_work_dir_in_use_is_refused(target, tmp_path, capsys):
    """Two train-drafter runs on one work directory would write the same data and state files under each other's
    feet: while one holds it (here: its lock taken as a run takes it), another is refused in one line naming the
    holder, exit 2; once it ends the directory is free again and keeps no lock file."""
    from tensorrt_llm_ext.training.trainer import WORK_DIR_LOCK, work_dir_lock

    work = tmp_path / "w"
    work.mkdir()
    args = ["train-drafter", str(target), "--out", str(tmp_path / "d"), "--work-dir", str(work), "--steps", "2", *TINY]
    with work_dir_lock(work):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in use by another train-drafter run (pid " in err[0], err
    assert not (work / WORK_DIR_LOCK).exists()
    assert main(args) == 0 and not (work / WORK_DIR_LOCK).exists()

