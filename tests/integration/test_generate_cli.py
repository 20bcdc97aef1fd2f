"""``trtllm-ext generate``: the README's main job, on a small config (TP 1 in process, TP 2 over MPI)."""

from __future__ import annotations

import json

import pytest
import torch

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 516, "max_seq_len": 40})


@pytest.fixture(scope="module")
def small_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "small.yaml"
    path.write_text(json.dumps(load_config(**SMALL).model_dump(mode="json")))  # JSON is YAML
    return str(path)


def test_generate_check_tp1(small_yaml, tmp_path, capsys):
    out_json = tmp_path / "out.json"
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "6", "--check", "--no-progress",
               "--json", str(out_json), "1 2 3", "400,5", "[7, 8, 9, 10]"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "check passed" in text and "mean acceptance length" in text
    data = json.loads(out_json.read_text())
    res = data["ranks"][0]["results"]  # --json: versions, config, requests, check, ranks
    assert res["speculative"]["outputs"] == res["reference"]["outputs"]
    assert all(len(o) == 6 for o in res["speculative"]["outputs"])
    # At tp 1 the gathered path is the speculative path itself: not run, not claimed.
    assert "gathered" not in res and "not compared" in text and "speculative vs gathered" not in text


def test_generate_check_runs_every_step_speculatively_with_max_concurrency(tmp_path, capsys, caplog, monkeypatch):
    """``--check`` compares the speculative step with its references plan for plan: a config's max_concurrency
    (which would decode part of the plans target-only) is not applied there, and one line says so."""
    from tensorrt_llm_ext.runtime.engine import Engine

    path = tmp_path / "switched.yaml"
    path.write_text(json.dumps(load_config(**{**SMALL, "speculative_config.max_concurrency": 1}).model_dump(mode="json")))
    modes = []
    launch = Engine.launch_step

    def spy(self, slots, mode="speculative"):
        modes.append(mode)
        return launch(self, slots, mode)
    monkeypatch.setattr(Engine, "launch_step", spy)
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        rc = main(["generate", "--config", str(path), "--max-new-tokens", "5", "--check", "--no-progress",
                   "1 2 3", "400,5", "[7, 8, 9, 10]"])
    text = capsys.readouterr().out
    assert rc == 0 and "check passed" in text, text
    assert "max_concurrency=1 not applied" in caplog.text
    # three requests in flight against a max_concurrency of 1: applied, the served run would decode target-only
    assert "speculative" in modes and "target_only" not in modes, sorted(set(modes))


def test_generate_is_the_default_command_and_reads_a_prompts_file(small_yaml, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two prompts\n3 4 5\n9\n")
    rc = main(["--config", small_yaml, "--max-new-tokens", "2", "--no-progress", "--prompts-file", str(prompts),
               "--temperature", "0.7", "--seed", "3"])
    text = capsys.readouterr().out
    assert rc == 0 and "[1] prompt (1 ids)" in text and "temperature=0.7" in text


def test_generate_reports_bad_config_and_bad_prompt(small_yaml, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("speculative_config:\n  max_draft_len: -1\n")
    assert main(["generate", "--config", str(bad)]) == 2
    assert "speculative_config.max_draft_len" in capsys.readouterr().err
    no_tokenizer = tmp_path / "tiny_vocab.yaml"  # 200 ids: too few for the embedded byte-level tokenizer
    no_tokenizer.write_text("model: {target: {vocab_size: 200}}\n")
    assert main(["generate", "--config", str(no_tokenizer), "1 x 3"]) == 2
    assert "not token ids, and text needs a tokenizer" in capsys.readouterr().err
    # An out-of-vocabulary prompt is rejected on its own; the other prompt is served; the run exits 3.
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--no-progress", "999", "1 2"])
    text = capsys.readouterr().out
    assert rc == 3 and "[0] rejected" in text and "[1] prompt" in text and "1 of 2 request(s) rejected" in text


@pytest.mark.parametrize("flags, message", [
    (("--max-new-tokens", "0"), "--max-new-tokens 0: expected an integer in [1, "),
    (("--max-new-tokens", "-5"), "--max-new-tokens -5: expected an integer in [1, "),
    (("--max-new-tokens", "100000"), "--max-new-tokens 100000: expected an integer in [1, "),
    (("--stop", "7", "-1"), "--stop: token id(s) [-1] outside the vocabulary [0, "),
], ids=["zero", "negative", "past-max-seq-len", "negative-stop"])
def test_flags_no_request_can_be_served_with_are_usage_errors(small_yaml, capsys, monkeypatch, flags, message):
    """A --max-new-tokens or --stop value that every request shares and none can be served with is one line naming
    the flag, exit 2, before the model is built (was: the model built, every prompt "rejected: request 0:
    max_new_tokens must be an int >= 1", exit 3 -- the code of a run that served some requests)."""
    from tensorrt_llm_ext.runtime import generate_cli

    monkeypatch.setattr(generate_cli, "run_generate", lambda *a, **k: pytest.fail("the run started"))
    assert main(["generate", "--config", small_yaml, "--no-progress", "1 2 3", *flags]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "[TRT-LLM-EXT]" not in line]
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe1 2 3\n", "not UTF-8 text (byte 0xff at offset 0)"),
    (b"[" * 100000 + b"]" * 100000, "not a JSON list of prompts (nested too deeply)"),
], ids=["utf16-bytes", "deep-json"])
def test_a_prompts_file_that_is_not_text_or_too_deep_is_one_line(small_yaml, tmp_path, capsys, content, message):
    """--prompts-file with bytes that are not UTF-8 named neither the file nor the flag ("'utf-8' codec can't
    decode byte 0xff ..."); 100 000 nested brackets were a RecursionError traceback, exit 1. Both: one line naming
    the file, exit 2."""
    path = tmp_path / "prompts.txt"
    path.write_bytes(content)
    assert main(["generate", "--config", small_yaml, "--no-progress", "--prompts-file", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "[TRT-LLM-EXT]" not in line]
    assert err == [f"error: {path}: {message}"], err


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_generate_check_tp2_over_mpi(small_yaml, capsys):
    """The README's main job at TP 2 (MPI-spawned ranks, gloo on CPU): all paths agree on every rank."""
    rc = main(["generate", "--config", small_yaml, "--tp", "2", "--max-new-tokens", "5", "--check", "--no-progress",
               "1 2 3", "300 301"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "target vocab-parallel; draft vocab-parallel" in text
    assert "all 2 ranks produced identical tokens: yes" in text


def test_check_fails_on_rejections_and_when_nothing_is_compared(small_yaml, capsys):
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--check", "--no-progress", "999"])
    text = capsys.readouterr().out
    assert rc == 1 and "nothing was compared" in text and "check FAILED" in text and "check passed" not in text
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--check", "--no-progress", "999", "1 2"])
    text = capsys.readouterr().out
    assert rc == 3 and "check FAILED: requests were rejected" in text and "rejected, not compared: [0]" in text


def _rejection_sampling_config(tmp_path):
    cfg = tmp_path / "rs.yaml"
    small = tiny_model(**{"model.target.vocab_size": 67, "model.target.num_layers": 1,
                          "model.target.capture_layers": [0], "max_seq_len": 24})
    cfg.write_text(json.dumps(load_config(**small).model_dump(mode="json")))
    return cfg


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="generate --tp 2 needs 2 GPUs (CPU: gloo ranks)")
def test_generate_rejection_sampling_check(tmp_path, capsys):
    """``--tp 2 --rejection-sampling --check`` (docs/end_to_end.md): sharded == gathered verification bitwise,
    greedy copies == the target decode, every token in the target's top-p set."""
    cfg = _rejection_sampling_config(tmp_path)
    out_json = tmp_path / "out.json"
    rc = main(["generate", "--config", str(cfg), "--max-new-tokens", "4", "--temperature", "1", "--top-p", "0.9",
               "--rejection-sampling", "--check", "--no-progress", "--json", str(out_json), "--tp", "2", "1 2 3"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "verification=rejection sampling" in text and "check passed: sharded == gathered" in text
    assert "speculative vs gathered verification (bitwise, tokens + acceptance): agree" in text
    data = json.loads(out_json.read_text())
    assert data["check"]["passed"] and data["requests"][0]["top_p"] == 0.9
    res = data["ranks"][0]["results"]["speculative"]
    assert len(res["outputs"]) == 2 and res["outside_top_p"] == [0, 0]  # the prompt + its greedy copy


def test_generate_rejection_sampling_check_tp1(tmp_path, capsys):
    """At tp 1 there is nothing sharded to compare and the check does not claim it; a bad --top-p is one
    line, exit 2."""
    cfg = _rejection_sampling_config(tmp_path)
    assert main(["generate", "--config", str(cfg), "--top-p", "1.5"]) == 2
    rc = main(["generate", "--config", str(cfg), "--max-new-tokens", "2", "--temperature", "1", "--top-p", "0.9",
               "--rejection-sampling", "--check", "--no-progress", "1 2 3"])
    text = capsys.readouterr().out
    assert rc == 0 and "check passed: greedy rows" in text and "not compared" in text, text


def test_generate_takes_text_and_chat_prompts_with_a_tokenizer(small_yaml, capsys):
    from tensorrt_llm_ext.configs.embedded_tokenizer import build_embedded_tokenizer

    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "3", "--no-progress", "hello world", "5 6"])
    text = capsys.readouterr().out
    tok = build_embedded_tokenizer(516)
    assert rc == 0 and f"[0] prompt ({len(tok.encode('hello world'))} ids)" in text and "[1] prompt (2 ids): 5 6" in text
    assert text.count("    text: '") == 2  # the outputs as text too
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--no-progress", "--chat", "hi"])
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert rc == 0 and f"[0] prompt ({len(ids)} ids): {' '.join(map(str, ids))}" in capsys.readouterr().out


def test_a_prompts_file_takes_text_lines_as_the_arguments_do(small_yaml, tmp_path, capsys):
    """A --prompts-file line is a prompt as an argument is: ids, or text for the model's tokenizer (with --chat one user
    message), and so is a string of the JSON form. Text lines were "expected token ids separated by spaces or commas",
    exit 2, where the same prompt given as an argument was served."""
    from tensorrt_llm_ext.configs.embedded_tokenizer import build_embedded_tokenizer

    tok = build_embedded_tokenizer(516)
    path = tmp_path / "prompts.txt"
    path.write_text("# text and ids\nhello world\n5 6\n")
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--no-progress", "--prompts-file", str(path)])
    text = capsys.readouterr().out
    assert rc == 0 and f"[0] prompt ({len(tok.encode('hello world'))} ids)" in text and "[1] prompt (2 ids): 5 6" in text
    path.write_text('["[hi]", [5, 6]]')  # the JSON form: a string is text (one starting with '[' needs it), a list ids
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--no-progress", "--prompts-file", str(path)])
    text = capsys.readouterr().out
    assert rc == 0 and f"[0] prompt ({len(tok.encode('[hi]'))} ids)" in text and "[1] prompt (2 ids): 5 6" in text
    path.write_text("hi\n")
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--no-progress", "--chat", "--prompts-file",
               str(path)])
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert rc == 0 and f"[0] prompt ({len(ids)} ids): {' '.join(map(str, ids))}" in capsys.readouterr().out


def test_the_largest_seed_serves_every_prompt(small_yaml, tmp_path, capsys):
    """Prompt i samples with ``--seed + i`` wrapped into [0, 2^63): ``--seed 2^63 - 1`` with two prompts gave prompt
    1 the seed 2^63, refused only after prompt 0 had run (exit 3, "1 of 2 request(s) rejected")."""
    out_json = tmp_path / "seeds.json"
    rc = main(["generate", "--config", small_yaml, "--max-new-tokens", "2", "--no-progress", "--temperature", "0.7",
               "--seed", str(2**63 - 1), "--json", str(out_json), "1 2 3", "4 5"])
    text = capsys.readouterr().out
    assert rc == 0 and "rejected" not in text, text
    assert [r["seed"] for r in json.loads(out_json.read_text())["requests"]] == [2**63 - 1, 0]



def test_the_top_p_check_replays_sequences_longer_than_a_page():
    """The check's top-p membership (``Engine.top_p_membership``) replays prompt + output through the target on a
    slot holding pages for all of it: the check replayed on slot 0 after the run had freed its pages, so past the
    first page every position read the scratch page (the README's ``--rejection-sampling --check`` failed: 243 of
    288 tokens "inside" at 24 new tokens)."""
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.testing.requests import make_request

    cfg = load_config(**tiny_model(**{"model.target.vocab_size": 516, "max_seq_len": 64,
                                      "speculative_config.use_rejection_sampling": True}))
    eng = Engine(cfg, torch_ops=True)
    req = make_request(prompt_ids=[5, 17, 300, 42, 7], max_new_tokens=24, temperature=1.0, top_p=0.9, seed=3)
    out = eng.generate([req])[0][0].output_ids
    assert len(out) == 24 and len(req.prompt_ids) + len(out) > 3 * cfg.kv_cache_config.tokens_per_block
    assert eng.top_p_membership(req, out) == [True] * 24
    assert eng.slots.num_free == cfg.max_batch_size and eng.pages.num_free == eng.pages.num_pages
    # the old replay, on a slot without pages: past the first page it reads the scratch page
    stale = eng.reference().top_p_membership(0, list(req.prompt_ids), out, 1.0, 0.9)
    assert not all(stale)


def test_an_output_path_in_the_way_is_one_line_before_any_work(small_yaml, tmp_path, capsys):
    """``--log-dir`` naming a file (or a path under one) was a FileExistsError / NotADirectoryError traceback after
    the config and the prompts were read; now one line and exit 2 before any work, as ``--json`` is."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    for log_dir in (blocker, blocker / "logs"):
        rc = main(["generate", "--config", small_yaml, "--no-progress", "--log-dir", str(log_dir), "1 2"])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith(f"error: --log-dir {log_dir}: not a directory") and "Traceback" not in err
    rc = main(["generate", "--config", small_yaml, "--no-progress", "--json", str(tmp_path / "no" / "out.json"), "1"])
    assert rc == 2 and "--json" in capsys.readouterr().err and not (tmp_path / "no").exists()
