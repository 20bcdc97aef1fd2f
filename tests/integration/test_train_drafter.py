"""`trtllm-ext train-drafter`: the training forward is the serving drafter's computation, a few steps on a tiny
target lower the distillation loss, the saved drafter loads through the drafter loader and serves losslessly
(`generate --check`), and an interrupted run resumed from its checkpoint ends with the same weights."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from tensorrt_llm_ext.cli import main
from tensorrt_llm_ext.contract import DraftBlockPlacement, DrafterBlockInputs, PagedLatentCache
from tensorrt_llm_ext.models.checkpoint import load_drafter_state_dict, read_drafter_config
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafter, DSparkDrafterConfig, generate_full_state_dict
from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.testing.tiny_models import export_tiny_target
from tensorrt_llm_ext.training.drafter_forward import block_logits, masked_attention
from tensorrt_llm_ext.training.trainer import TrainConfig, train_drafter

# Tiny knobs: 16 prompts x 20 tokens, K = 3, a 1-layer drafter; seconds on 2 cores.
TINY_TRAIN = ["--num-prompts", "16", "--max-new-tokens", "20", "--gen-batch", "8", "--eval-prompts", "4",
              "--num-layers", "1", "--num-heads", "2", "--head-dim", "8", "--latent-dim", "16",
              "--intermediate-size", "64", "--draft-len", "3", "--batch-seqs", "4", "--anchors", "4",
              "--lr", "3e-3", "--warmup", "2", "--markov-rank", "8", "--no-progress"]


@pytest.mark.parametrize("backend,latent", [("eager", 12), ("fused", 12), ("fused", 512)],
                         ids=["eager", "fused", "fused_wide"])
def test_training_forward_equals_the_serving_drafter(backend, latent):
    """block_logits (many anchors in one pass, teacher-forced Markov chain) == for each anchor the serving
    drafter's forward_block over a paged context of the positions before it + LM head + Markov bias.
    ``fused_wide``: recipe 6's 512-wide context latent (the fused kernel's latent tile at 512, as served)."""
    cfg = DSparkDrafterConfig(hidden_size=24, target_hidden_size=24, num_capture_layers=2, num_layers=2,
                              num_heads=3, head_dim=8, latent_dim=latent, intermediate_size=40, vocab_size=53,
                              markov_rank=6, mask_token_id=52)
    sd = generate_full_state_dict(cfg, 5, torch.float32)
    g = torch.Generator().manual_seed(0)
    t, k, page = 19, 4, 4
    feats = torch.randn(1, t, cfg.fc_in_features, generator=g)
    tokens = torch.randint(0, cfg.vocab_size - 1, (1, t), generator=g)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) / 5
    anchors = torch.tensor([[1, 7, 12, 15]])
    ours = block_logits(sd, cfg, head, feats, tokens, anchors, k)[0]  # [M, K, V]
    # the SDPA block attention (default) and its eager twin
    torch.testing.assert_close(ours, block_logits(sd, cfg, head, feats, tokens, anchors, k, attention="eager")[0],
                               atol=2e-5, rtol=2e-5)
    drafter = DSparkDrafter(cfg, dtype=torch.float32, attention_backend=backend)
    drafter.load_full_state_dict(sd)
    for m, a in enumerate(anchors[0].tolist()):
        pages = -(-(a + k) // page)
        pool = torch.zeros(cfg.num_layers, pages, page, cfg.latent_dim)
        table = torch.arange(pages, dtype=torch.int32)[None]
        lat = drafter.compute_context_latents(feats[0, :a])  # [a, L, d_c]
        for p in range(a):
            pool[:, p // page, p % page] = lat[p]
        pos = torch.arange(a, a + k, dtype=torch.int32)[None]
        placement = DraftBlockPlacement(pos, pos // page, pos % page, torch.tensor([a], dtype=torch.int32),
                                        torch.tensor([a + k], dtype=torch.int32))
        ids = torch.full((1, k), cfg.mask_token_id)
        ids[0, 0] = tokens[0, a]
        hidden = drafter.forward_block(DrafterBlockInputs(ids, torch.zeros(1, dtype=torch.int32), placement,
                                                          PagedLatentCache(pool, table)))[0]
        prev = tokens[0, a:a + k]
        serving = F.linear(hidden, head) + F.linear(sd["markov_w1"][prev], sd["markov_w2"])
        torch.testing.assert_close(ours[m], serving, atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    d = export_tiny_target(tmp_path_factory.mktemp("target") / "tiny")
    return d


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    d = tmp_path_factory.mktemp("trained") / "tiny"
    shutil.copytree(tiny_target, d)
    assert main(["train-drafter", str(d), "--steps", "40", "--save-every", "20", *TINY_TRAIN]) == 0
    return d


def _attention_case(device, dtype, q_len=64, k_len=320, d=32, shift=-120.0):
    """Masked-attention inputs whose every score is ``shift`` (+ noise): a row's log-sum-exp far below -88.7
    with ``k_len`` 64 mod 128 -- cuDNN's backward NaN case (drafter_forward.SDPA_BACKENDS). Every row keeps at
    least one key (its diagonal)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, q_len, d, generator=g) * 0.05
    k = torch.randn(2, 2, k_len, d, generator=g) * 0.05
    v = torch.randn(2, 2, k_len, d, generator=g)
    q[..., 0], k[..., 0] = 1.0, shift * d ** 0.5  # q.k / sqrt(d) ~ shift for every pair
    mask = torch.rand(2, 1, q_len, k_len, generator=g) < 0.5
    mask[..., torch.arange(q_len), torch.arange(q_len)] = True
    grad_out = torch.randn(2, 2, q_len, d, generator=g)
    return [t.to(device, dtype) for t in (q, k, v)], mask.to(device), grad_out.to(device, dtype)


def _grads(attention, q, k, v, mask, grad_out):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if attention == "reference":  # float64 masked softmax, separate ops
        s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
        out = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double()
    else:
        out = masked_attention(q, k, v, mask, 1 / q.shape[-1] ** 0.5, attention)
    out.double().backward(grad_out.double())
    return out.detach().double(), [t.grad.double() for t in (q, k, v)]


def _assert_close_to_reference(out, grads, ref_out, ref_grads, tol):
    """Every value finite; out, dk, dv and dq but its first column within ``tol`` of the float64 reference (dq's
    first column sums dS k[..., 0], ~ -120 sqrt(d) each with dS summing to 0 per row: all cancellation)."""
    assert all(bool(torch.isfinite(t).all()) for t in (out, *grads))
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    (dq, dk, dv), (rq, rk, rv) = grads, ref_grads
    for a, b in ((dq[..., 1:], rq[..., 1:]), (dk, rk), (dv, rv)):
        torch.testing.assert_close(a, b, atol=tol * float(b.abs().max()), rtol=tol)


def test_training_attention_excludes_cudnn_and_matches_the_reference(monkeypatch):
    """"sdpa" runs F.scaled_dot_product_attention with cuDNN's backend disabled, "sdpa_cudnn" with it allowed; on
    the CPU both are the same kernel (equal bitwise) and equal the fp32 reference on scores far below -88.7."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    (q, k, v), mask, grad_out = _attention_case("cpu", torch.float32)
    out, grads = _grads("sdpa", q, k, v, mask, grad_out)
    out_c, grads_c = _grads("sdpa_cudnn", q, k, v, mask, grad_out)
    assert seen == [False, True] and torch.backends.cuda.cudnn_sdp_enabled()  # restored after the call
    assert torch.equal(out, out_c) and all(torch.equal(a, b) for a, b in zip(grads, grads_c))
    ref_out, ref_grads = _grads("reference", q, k, v, mask, grad_out)
    _assert_close_to_reference(out, grads, ref_out, ref_grads, tol=1e-4)
    # keys padded to 448 (320 + 128 masked-out zeros): the same attention, not the same summation order
    out_p, grads_p = _grads("sdpa_cudnn_pad128", q, k, v, mask, grad_out)
    _assert_close_to_reference(out_p, grads_p, ref_out, ref_grads, tol=1e-4)
    with pytest.raises(ValueError, match="sdpa, sdpa_cudnn or sdpa_cudnn_pad128"):
        masked_attention(q, k, v, mask, 1.0, "eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the backward of the GPU's fused kernels")
def test_training_attention_backward_is_finite_where_cudnn_returns_nan():
    """bf16 on the GPU, key length 64 mod 128, every score ~ -120: the trainer's attention (cuDNN's over keys padded
    to a multiple of 128, "sdpa_cudnn_pad128") and "sdpa" (cuDNN's backend excluded) return finite gradients equal
    to the float64 reference within bf16 rounding. What cuDNN's backend returns on the same inputs is
    printed (NaN in dq on torch 2.11 sm_90 is pytorch/pytorch#196678), not asserted: a fixed torch is no failure."""
    (q, k, v), mask, grad_out = _attention_case("cuda", torch.bfloat16)
    reference = _grads("reference", q, k, v, mask, grad_out)
    for attention in ("sdpa", "sdpa_cudnn_pad128"):
        _assert_close_to_reference(*_grads(attention, q, k, v, mask, grad_out), *reference, tol=3e-2)
    _, grads_c = _grads("sdpa_cudnn", q, k, v, mask, grad_out)
    print("sdpa_cudnn non-finite gradient elements (dq, dk, dv):",
          [int((~torch.isfinite(t)).sum()) for t in grads_c])


def test_train_drafter_lowers_the_loss_and_serves_losslessly(trained, capsys):
    d = trained
    summary = json.loads((d / "dspark_drafter" / "training.json").read_text())
    first, last = summary["first_tv"], summary["last_tv"]  # the total-variation part of the objective
    assert sum(last) / len(last) < 0.95 * sum(first) / len(first), (first, last)
    assert (d / "dspark_drafter" / "confidence_head.safetensors").is_file()
    calib = summary["held_out_confidence"]
    assert len(calib["mean_confidence"]) == 3 and all(0 < c < 1 for c in calib["mean_confidence"])
    work = d / "dspark_drafter_work"  # online mode: token ids only on disk
    assert sum(f.stat().st_size for f in work.iterdir()) < 2_000_000
    acc = summary["held_out_greedy_acceptance"]
    assert 1.0 <= acc["init"] <= 4.0 and 1.0 <= acc["trained"] <= 4.0
    by_pos = acc["by_position"]  # the walk's acceptance by position: E[accepted drafts] = their sum
    assert len(by_pos) == 3 and by_pos == sorted(by_pos, reverse=True) and abs(sum(by_pos) - (acc["trained"] - 1)) < 1e-3
    assert len(calib["teacher_forced_top1"]) == 3 and all(0 <= x <= 1 for x in calib["teacher_forced_top1"])
    # the per-position calibration (fitted on half the held-out batches) is in the head file the server loads
    from safetensors.torch import load_file
    head = load_file(str(d / "dspark_drafter" / "confidence_head.safetensors"))
    assert head["confidence.calibration"].tolist() == calib["calibration"] and len(calib["calibration"][0]) == 3
    assert len(calib["report_mean_confidence_calibrated"]) == 3
    meta = read_drafter_config(d / "dspark_drafter")  # the drafter loader's header checks
    assert meta["target_layer_ids"] == [0, 1] and meta["drafter"]["num_layers"] == 1
    # recipe 6's inputs in miniature: the target's last layer (1 of 0..1) captured, the latent the full query width
    dr = meta["drafter"]
    assert dr["latent_dim"] == dr["num_heads"] * dr["head_dim"] == 16
    assert meta["markov_rank"] == 8  # a rank-r head (r != hidden 32): loads and serves losslessly below
    assert (d / "dspark_drafter_work" / "trainer_state.pt").is_file()
    # serve DIR finds DIR/dspark_drafter; the output equals the target's own decode
    assert main(["generate", "--model", str(d), "--no-progress", "--max-new-tokens", "10", "--check",
                 "--draft-len", "3", "5 17 305 42"]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "K=3" in out


@pytest.mark.parametrize("sampling", ["greedy", "T=1 top-p 0.95"], ids=["greedy", "t1_top_p"])
def test_bench_acceptance_compares_trained_and_bigram(trained, capsys, sampling, tmp_path, monkeypatch):
    """The engine's acceptance on held-out prompts, both drafters (T=1: rejection sampling; the interpreter
    makes it the slow one, so CPU CI runs greedy and the H200 list both); acceptance by position; nothing
    left in the temporary directory."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["bench", "acceptance", "--model", str(trained), "--draft-lens", "3", "--num-prompts", "1",
                 "--max-new-tokens", "8", "--batch-size", "1", "--samplings", sampling]) == 0
    assert list(tmp_path.iterdir()) == []
    table = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| trained") or
            line.startswith("| bigram")]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [("trained", sampling), ("bigram", sampling)]
    for r in rows:
        steps, tokens, mean = int(r[4]), int(r[5]), float(r[6])
        assert 1.0 <= mean <= 4.0 and abs(mean - tokens / steps) < 1e-3 and steps >= 2
        per_pos = [float(x) for x in r[7].split()]  # fraction of steps with the first k drafts accepted
        assert len(per_pos) == 3 and all(0 <= a <= 1 for a in per_pos) and per_pos == sorted(per_pos, reverse=True)
        assert abs(sum(per_pos) - (mean - 1)) < 2e-2  # E[accepted drafts] = sum over k of P(first k accepted)


def test_bench_acceptance_draft_temperature_scales_add_sampled_rows(trained, capsys):
    """--draft-temperature-scales: the sampled rows again per scale (drafts drawn at S T, labelled), the greedy row
    once; a scale outside (0, 1] is a usage error naming the flag, before any measurement."""
    argv = ["bench", "acceptance", "--model", str(trained), "--draft-lens", "3", "--num-prompts", "1",
            "--max-new-tokens", "8", "--batch-size", "1", "--variants", "trained"]
    assert main(argv + ["--draft-temperature-scales", "1", "0.5"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| trained")]
    assert [r[2].strip() for r in rows] == ["greedy", "T=1 top-p 0.95", "T=1 top-p 0.95, drafts at 0.5 T"]
    assert all(1.0 <= float(r[6]) <= 4.0 for r in rows)
    assert main(argv + ["--draft-temperature-scales", "0"]) == 2
    err = capsys.readouterr().err
    assert "--draft-temperature-scales 0" in err and "draft_temperature_scale" in err


def test_interrupted_training_resumes_to_the_same_weights(tiny_target, tmp_path, monkeypatch):
    knobs = TrainConfig(num_prompts=8, max_new_tokens=12, gen_batch=8, eval_prompts=0, num_layers=1, num_heads=2,
                        head_dim=8, latent_dim=16, intermediate_size=64, draft_len=3, steps=6, batch_seqs=2,
                        anchors=3, lr=3e-3, warmup=2, save_every=3)
    whole = train_drafter(tiny_target, tmp_path / "a" / "drafter", knobs, progress=False)
    clip, calls = torch.nn.utils.clip_grad_norm_, []

    def killed_in_step_5(*args, **kwargs):  # a Ctrl-C in the 5th step, after the step-3 checkpoint
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", killed_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(tiny_target, tmp_path / "b" / "drafter", knobs, progress=False)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    resumed = train_drafter(tiny_target, tmp_path / "b" / "drafter", knobs, progress=False, resume=True)
    assert resumed["last_losses"] == whole["last_losses"]
    cfg = DSparkDrafterConfig(**{k: v for k, v in read_drafter_config(tmp_path / "a" / "drafter")["drafter"].items()},
                              hidden_size=32, target_hidden_size=32, num_capture_layers=2, vocab_size=517,
                              markov_rank=256, mask_token_id=516)
    a = load_drafter_state_dict(tmp_path / "a" / "drafter", cfg)
    b = load_drafter_state_dict(tmp_path / "b" / "drafter", cfg)
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(ValueError, match=r"other knobs \(\['steps'\]\)"):
        train_drafter(tiny_target, tmp_path / "b" / "drafter", TrainConfig(**{**vars(knobs), "steps": 9}),
                      progress=False, resume=True)


def test_anchor_region_all_draws_blocks_in_the_prompts_too(tiny_target, tmp_path, monkeypatch):
    """--anchor-region all: a step's anchors cover the prompt (from position 1) as well as the answer, the run trains
    (a finite, lower loss) and writes a drafter; "answer" keeps every anchor in the answer; another value is refused."""
    import tensorrt_llm_ext.training.trainer as trainer_mod

    knobs = TrainConfig(num_prompts=8, max_new_tokens=12, gen_batch=8, eval_prompts=0, num_layers=1, num_heads=2,
                        head_dim=8, latent_dim=16, intermediate_size=64, draft_len=3, steps=12, batch_seqs=2,
                        anchors=12, lr=3e-3, warmup=2, save_every=12)
    real_batch, real_anchors, seen = trainer_mod._batch, trainer_mod.sample_anchors, []

    def batch(data, idx, *a, **kw):
        b = real_batch(data, idx, *a, **kw)
        b["true_prompt_lens"] = data["prompt_lens"][idx].to(b["lens"].device)
        return b

    def anchors(b, n, gen, *fill):
        out = real_anchors(b, n, gen, *fill)
        if "true_prompt_lens" in b:
            seen.append((out, b["true_prompt_lens"], b["lens"]))
        return out

    monkeypatch.setattr(trainer_mod, "_batch", batch)
    monkeypatch.setattr(trainer_mod, "sample_anchors", anchors)
    summary = train_drafter(tiny_target, tmp_path / "all" / "drafter", TrainConfig(**{**vars(knobs),
                            "anchor_region": "all"}), progress=False)
    assert len(seen) == 12 and summary["steps_done"] == 12
    a = torch.cat([s[0] for s in seen]).flatten()
    below = torch.cat([(s[0] < s[1][:, None]).flatten() for s in seen])
    assert int(a.min()) >= 1 and bool(below.any()) and not bool(below.all())  # prompts and answers both
    assert all(bool((s[0] <= (s[2] - 2)[:, None]).all()) for s in seen)
    assert all(math.isfinite(x) for x in summary["last_losses"])
    assert sum(summary["last_losses"]) < sum(summary["first_losses"])
    assert (tmp_path / "all" / "drafter" / "config.json").is_file()
    seen.clear()
    train_drafter(tiny_target, tmp_path / "answer" / "drafter", TrainConfig(**{**vars(knobs), "steps": 2}),
                  progress=False)
    assert seen and all(bool((s[0] >= s[1][:, None]).all()) for s in seen)
    with pytest.raises(ValueError, match="--anchor-region must be one of answer, all"):
        TrainConfig(anchor_region="prompt")


def test_masked_anchor_fill_and_length_groups_train(tiny_target, tmp_path, monkeypatch):
    """--anchor-fill mask --length-groups 2 through the trainer: every step's anchors are the masked draw (a batch of
    short answers has fewer slots than --anchors, none repeated), the loss is finite and falls, the block count is
    the live blocks'."""
    import tensorrt_llm_ext.training.trainer as trainer_mod

    real, seen = trainer_mod.sample_anchors, []

    def anchors(b, n, gen, fill="wrap"):
        out = real(b, n, gen, fill)
        seen.append((fill, out, b["lens"]))
        return out

    monkeypatch.setattr(trainer_mod, "sample_anchors", anchors)
    tc = TrainConfig(num_prompts=8, max_new_tokens=12, gen_batch=8, eval_prompts=0, num_layers=1, num_heads=2,
                     head_dim=8, latent_dim=16, intermediate_size=64, draft_len=3, steps=10, batch_seqs=2,
                     anchors=48, lr=3e-3, warmup=2, save_every=10, anchor_fill="mask", length_groups=2)
    summary = train_drafter(tiny_target, tmp_path / "drafter", tc, progress=False)
    assert summary["steps_done"] == 10 and len(seen) == 10 and all(f == "mask" for f, _, _ in seen)
    for _, a, lens in seen:  # no repeated live anchor; the filler only as the last slots
        for row, ln in zip(a.tolist(), lens.tolist()):
            live = [x for x in row if x != ln - 1]
            assert len(set(live)) == len(live) and row[:len(live)] == live
    assert all(a.shape[1] == 32 for _, a, _ in seen)  # at most 11 candidates: one bucket of 32 slots, not 48
    assert all(math.isfinite(x) for x in summary["last_losses"])
    assert sum(summary["last_losses"]) < sum(summary["first_losses"])
    assert summary["knobs"]["anchor_fill"] == "mask" and summary["knobs"]["length_groups"] == 2


def test_answers_cache_is_shared_by_runs_with_the_same_data_knobs(tiny_target, tmp_path, monkeypatch, capsys):
    """--answers-cache: a run with the same target and data knobs reads another run's answers (nothing decoded)
    and, with the same steps' knobs, ends with the same losses as the run that decoded them; another learning rate
    reads them too; a data knob (max_new_tokens) names other files, decoded anew. A cache inside --out is refused."""
    import tensorrt_llm_ext.training.trainer as trainer_mod

    knobs = TrainConfig(num_prompts=8, max_new_tokens=12, gen_batch=8, eval_prompts=2, num_layers=1, num_heads=2,
                        head_dim=8, latent_dim=16, intermediate_size=64, draft_len=3, steps=3, batch_seqs=2,
                        anchors=3, lr=3e-3, warmup=1, save_every=3)
    cache, decoded, regenerate = tmp_path / "answers", [], trainer_mod.regenerate

    def counted(model_dir, prompts, **kw):
        decoded.append(len(prompts))
        return regenerate(model_dir, prompts, **kw)

    monkeypatch.setattr(trainer_mod, "regenerate", counted)
    first = train_drafter(tiny_target, tmp_path / "a" / "drafter", knobs, progress=False, answers_cache=cache)
    assert decoded == [8, 2]
    written = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}
    assert len(written) == 2 and all(n.startswith(("answers-train-", "answers-held_out-")) for n in written)
    assert not (tmp_path / "a" / "drafter_work" / "data.pt").exists()

    again = train_drafter(tiny_target, tmp_path / "b" / "drafter", knobs, progress=False, answers_cache=cache)
    assert decoded == [8, 2] and again["last_losses"] == first["last_losses"]
    other_lr = train_drafter(tiny_target, tmp_path / "c" / "drafter", TrainConfig(**{**vars(knobs), "lr": 1e-3}),
                             progress=False, answers_cache=cache)
    assert decoded == [8, 2] and other_lr["last_losses"] != first["last_losses"]
    assert {f.name: f.stat().st_mtime_ns for f in cache.iterdir()} == written  # read, never rewritten

    train_drafter(tiny_target, tmp_path / "d" / "drafter", TrainConfig(**{**vars(knobs), "max_new_tokens": 10}),
                  progress=False, answers_cache=cache)
    assert decoded == [8, 2, 8, 2] and len(list(cache.iterdir())) == 4

    out = tmp_path / "e" / "drafter"
    assert main(["train-drafter", str(tiny_target), "--out", str(out), "--answers-cache", str(out / "answers"),
                 *TINY_TRAIN]) == 2
    assert "--answers-cache" in capsys.readouterr().err and not out.exists()


def test_served_drafter_exposes_per_position_confidences(trained):
    """serve's loader picks up confidence_head.safetensors; each step leaves c_k of every next draft in the
    worker's draft_confidences (the step output's field the scheduler reads)."""
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.requests import Request

    engine = Engine(load_config(model_dir=str(trained), **{"speculative_config.max_draft_len": 3}))
    assert engine.drafter.has_confidence_head
    results, _ = engine.generate([Request(prompt_ids=[5, 17, 305, 42], max_new_tokens=6)])
    assert results[0].error is None and results[0].num_steps >= 1
    conf = engine.worker().draft_confidences[:1]
    assert conf.shape == (1, 3) and bool(((conf > 0) & (conf < 1)).all()), conf


def test_the_first_step_times_the_loss_kernel_against_its_twin(tiny_target):
    """pick_loss_path: both loss paths run on the first batch (the Triton kernel under the interpreter here),
    agree, are timed, and one is chosen; a kernel that fails falls back to the torch ops."""
    from tensorrt_llm_ext.kernels.common import triton_runs_on
    from tensorrt_llm_ext.training import fused_loss, trainer

    if not triton_runs_on(torch.zeros(1)):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    tc = TrainConfig(num_layers=1, num_heads=2, head_dim=8, latent_dim=8, intermediate_size=16, markov_rank=4,
                     draft_len=3, batch_seqs=2, anchors=3)
    dcfg, layers = trainer.drafter_config(tiny_target, tc)
    target = trainer.load_target(tiny_target, layers, torch.device("cpu"), torch.float32)
    head = target.lm_head.weight.detach()
    init = trainer.initial_weights(dcfg, {"embed_tokens.weight": target.embed_tokens.weight.detach()}, 1)
    params = {n: t.requires_grad_(n not in trainer.FROZEN) for n, t in init.items()}
    data = {"tokens": torch.randint(0, 500, (2, 12), dtype=torch.int32), "lens": torch.tensor([12, 10]),
            "prompt_lens": torch.tensor([3, 4])}
    batch = trainer._batch(data, torch.arange(2), torch.device("cpu"), target)
    anchors = trainer.sample_anchors(batch, 3, torch.Generator().manual_seed(0))
    got = trainer.pick_loss_path(params, dcfg, head, batch, anchors, tc, reps=1)
    # every layout both ways, all agreeing, the fastest chosen
    assert sorted(got["ms"]) == sorted(f"{lay}/{w}" for lay in fused_loss.LAYOUTS for w in ("kernel", "torch"))
    assert max(got["loss"].values()) - min(got["loss"].values()) < 1e-4 and min(got["ms"].values()) > 0
    way = f"{got['layout']}/{'kernel' if got['kernel'] else 'torch'}"
    assert got["ms"][way] == min(got["ms"].values())
    assert got["torch_ms"] == got["ms"][f"{got['layout']}/torch"]
    forced = trainer.pick_loss_path(params, dcfg, head, batch, anchors, tc, reps=1, layouts=("dedup",))
    assert forced["layout"] == "dedup" and sorted(forced["ms"]) == ["dedup/kernel", "dedup/torch"]
    real = fused_loss.block_loss_rows

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel here")

    fused_loss.block_loss_rows = broken
    try:
        got = trainer.pick_loss_path(params, dcfg, head, batch, anchors, tc, reps=1)
    finally:
        fused_loss.block_loss_rows = real
    assert got["kernel"] is False and "no such kernel" in got["kernel_error"] and got["torch_ms"] > 0
    assert all(w.endswith("/torch") for w in got["ms"]) and len(got["errors"]) == len(fused_loss.LAYOUTS)
