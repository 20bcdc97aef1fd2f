#!/usr/bin/env python3
"""Where train-drafter's GPU time goes: the training step (per configuration: steps/s, block positions/s, peak
memory, and the teacher pass alone) and the answer generation (tokens/s), on a random-weight target of a given
shape (default SmolLM2-135M's) -- no checkpoint needed, so it fits one short device call.

    python3 scripts/drafter_throughput.py OUT_DIR [--prompt-file .gpu_data/prompts.jsonl.gz] [--old-data PATH]
        [--train "bs=16,anchors=128,loss=eager,attention=eager,teacher=paged" ...] [--profile] [--gen-batches 256 1024]
        [--serve "layers=5,latent=512,targets=1/7/14/21/27/29" ...] [--max-turns 3]

``--train`` keys: bs, anchors, layers, latent (the context latent width d_c), targets (captured target layers,
``/``-separated), steps; loss = eager (autograd over [N, V]) | fused (chunked; the Triton row kernel on CUDA) | kernel
| torch (chunked, the per-row passes in torch ops), each chunked one with an optional layout suffix (``fused_joint``,
``kernel_dedup``, ...; training/fused_loss.py's layouts: none = ``rows``, the first layout; ``joint``: the draft
logits and their gradient one GEMM each; ``dedup``: ``joint`` plus the teacher's logits once per position, the
trainer's default); attention = sdpa | sdpa_cudnn | sdpa_cudnn_pad128 | eager (training/drafter_forward.py:
sdpa without cuDNN's backend; sdpa_cudnn with it; sdpa_cudnn_pad128 with it over keys padded to 128, the trainer's);
teacher = dense | paged; seq_bucket = the batch width's rounding (trainer.SEQ_BUCKET; 0 = the trainer's, 1 = the
longest sequence exactly, as before the twenty-second session); fill = wrap | mask and groups = G (train-drafter's
``--anchor-fill`` / ``--length-groups``: a step's blocks are then its live ones, which ``block_positions_per_s``
counts; the synthetic answers are 128-256 tokens, narrower than real ones, so it understates what they save).

``--profile``: after each ``--train`` configuration's timed steps, ``--profile-steps`` more steps under
``torch.profiler`` (CUDA kernels on the GPU; CPU ops with ``--tiny``): the kernel time per step grouped by where
it was launched (the teacher pass, the drafter forward and backward, the loss's GEMMs -- draft logits, teacher
logits, gradients --, its row passes, its preparation, the optimizer, other) and the top kernels, in the
configuration's ``profile``; ``profile_summary`` sets each configuration's groups beside the first's.

``--serve`` (CUDA): what a drafter of that shape costs per decode step when served -- the context projection of the
step's accepted positions (B x (K + 1) rows: fc, hidden_norm, every layer's latent), the block decode
(``DSparkDrafter.forward_block``, the fused block attention) and the LM head over the block, timed under CUDA-graph
replay at each ``--serve-batches`` B with ``--serve-ctx`` context positions per request (the Markov chain does not
depend on these shapes).

Prompt lengths come from the prompt file's conversations (~3.6 characters per token, + 12 tokens of chat template per
message): the prompt of the i-th conversation is its first user turn, or with ``--max-turns N`` a user turn drawn
among its first N with the messages before it (as ``train-drafter --max-turns`` renders them; capped at 768 tokens);
the ids are seeded random tokens (a random-weight target reads any ids alike). Each answer's length is drawn
uniformly from [max_new_tokens / 4, max_new_tokens] (the real answers stop at EOS at varied lengths).
``--old-data``: a data.py of an earlier version whose ``regenerate`` (and, with ``--teacher-widths``,
``teacher_pass_dense``) is measured beside this one's. ``--teacher-widths`` (CUDA): the dense teacher pass over 64
sequences per synchronised call, every call a new width vs one width repeated, SDPA's choice vs flash only -- what a
new shape costs cuDNN (trainer.SEQ_BUCKET's reason).
Results: OUT_DIR/throughput.json and a log line per measurement.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

SMOLLM2 = {"model.target.vocab_size": 49152, "model.target.hidden_size": 576, "model.target.num_layers": 30,
           "model.target.num_heads": 9, "model.target.num_kv_heads": 3, "model.target.head_dim": 64,
           "model.target.intermediate_size": 1536, "model.target.capture_layers": [1, 15, 28],
           "model.drafter_init": "random", "model.drafter.num_layers": 1, "model.drafter.latent_dim": 64,
           "max_seq_len": 2048}


def log(out: Path, results: dict, key: str, value) -> None:
    results[key] = value
    print(f"[throughput] {key}: {json.dumps(value)}", flush=True)
    (out / "throughput.json").write_text(json.dumps(results, indent=1))


def prompt_lengths(path: str | None, n: int, seed: int, max_turns: int = 1) -> list[int]:
    """Estimated prompt lengths in tokens (module docstring): the first user turn of each training conversation, or
    a user turn drawn among its first ``max_turns`` with the messages before it."""
    rng = random.Random(seed)
    if path and Path(path).is_file():
        out = []
        with gzip.open(path, "rt") as f:
            for line in f:
                r = json.loads(line)
                if r.get("set", "train") != "train":
                    continue
                msgs = r.get("messages", [])
                turns = [i for i, m in enumerate(msgs) if m.get("role") == "user"][:max_turns]
                if turns:
                    end = turns[rng.randrange(len(turns))]
                    out.append(min(768, sum(12 + max(1, int(len(m["content"]) / 3.6)) for m in msgs[:end + 1])))
                if len(out) >= n:
                    break
        if out:
            return out
    return [rng.randint(16, 400) for _ in range(n)]


def build_model(d: Path, tiny: bool) -> None:
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.export import export_model
    from tensorrt_llm_ext.testing.tiny_models import tiny_model

    export_model(load_config(**(tiny_model(**{"max_seq_len": 2048}) if tiny else SMOLLM2)), d,
                 dtype="float32" if tiny else "bfloat16")
    shutil.rmtree(d / "dspark_drafter")


def train_configs(specs: list[str]) -> list[dict]:
    from tensorrt_llm_ext.training.drafter_forward import TRAIN_ATTENTION

    out = []
    for spec in specs:
        c = {"bs": 16, "anchors": 128, "loss": "fused", "attention": TRAIN_ATTENTION, "teacher": "dense", "layers": 3,
             "latent": 256, "targets": "1/7/14/21/27", "steps": 6, "seq_bucket": 0, "fill": "wrap", "groups": 1}
        for kv in spec.split(","):
            k, v = kv.split("=")
            if k not in c:
                raise ValueError(f"--train/--serve: unknown key {k!r} in {spec!r}; expected one of {sorted(c)}")
            c[k] = v if k in ("loss", "attention", "teacher", "targets", "fill") else int(v)
        out.append(c)
    return out


def load_old_data(path: str):
    """``--old-data``: an earlier version's training/data.py, imported as a module of its own."""
    spec = importlib.util.spec_from_file_location("old_data", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure_teacher_widths(model_dir: Path, device, old_data: str | None) -> list[dict]:
    """The dense teacher pass over 64 sequences, ms per synchronised call (the first three, then the median of the
    rest): every call a new width vs one width repeated, SDPA's own choice vs flash only, this data.py's pass and
    ``--old-data``'s. cuDNN (SDPA's kernels on sm_90) plans each new shape; a repeated one reuses the plan."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tensorrt_llm_ext.training import data as data_mod

    passes = [("this", data_mod.teacher_pass_dense)]
    if old_data:
        passes.insert(0, ("old", load_old_data(old_data).teacher_pass_dense))
    target = data_mod.load_target(model_dir, [1, 7, 14, 21, 27], device, torch.bfloat16)
    vocab = target.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(0)
    rows, offset = [], 0
    for name, fn in passes:
        for backend in ("default", "flash"):
            for widths in ("new", "repeated"):
                offset += 3  # new widths never seen by an earlier row
                ws = [901 + offset + 12 * i for i in range(10)] if widths == "new" else [1024] * 10
                ms = []
                for w in ws:
                    seq = torch.randint(0, vocab, (64, w), device=device, generator=gen)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if backend == "flash":
                        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                            fn(target, seq)
                    else:
                        fn(target, seq)
                    torch.cuda.synchronize()
                    ms.append((time.perf_counter() - t0) * 1e3)
                rows.append({"pass": name, "sdpa": backend, "widths": widths, "first_ms": [round(x, 1) for x in ms[:3]],
                             "median_ms": round(sorted(ms[3:])[len(ms[3:]) // 2], 1)})
    return rows


def _targets(cfg: dict, tiny: bool) -> str:
    return "0,1" if tiny else cfg["targets"].replace("/", ",")


# profiler ranges (trainer / fused_loss / this script) -> the groups of --profile, innermost range first
PROFILE_GROUPS = {"loss.gemm_draft": "loss_gemm_draft_logits", "loss.gemm_teacher": "loss_gemm_teacher_logits",
                  "loss.gemm_grad": "loss_gemm_gradients", "loss.rows": "loss_row_passes",
                  "loss.teacher_stats": "loss_row_passes", "loss.prepare": "loss_prepare",
                  "drafter_forward": "drafter_forward", "teacher_pass": "teacher_pass", "optimizer": "optimizer",
                  "backward": "drafter_backward"}


def _group_of(evt) -> str:
    e = evt
    while e is not None:
        if e.name in PROFILE_GROUPS:
            return PROFILE_GROUPS[e.name]
        if e.name.startswith("autograd::engine"):  # backward ops run on autograd's own thread on CUDA
            return "drafter_backward"
        e = e.cpu_parent
    return "other"


def profile_summary(prof, steps: int, cuda: bool, top: int = 25) -> dict:
    """Milliseconds per step by group and the top kernels (CPU ops' self time without CUDA). A CUDA kernel is
    charged to the innermost range around the op that launched it; kernels no op claims are ``unlinked``."""
    from torch.autograd import DeviceType

    groups: dict[str, float] = {}
    names: dict[tuple[str, str], list] = {}

    def add(group, name, us):
        groups[group] = groups.get(group, 0.0) + us
        slot = names.setdefault((group, name), [0.0, 0])
        slot[0] += us
        slot[1] += 1

    device_total = 0.0
    device_names: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            if evt.is_user_annotation or evt.name in PROFILE_GROUPS or evt.name.startswith("loss."):
                continue  # a range's span on the GPU timeline, not a kernel
            us = evt.time_range.end - evt.time_range.start
            device_total += us
            device_names[evt.name] = device_names.get(evt.name, 0.0) + us
            continue
        if cuda:
            for k in evt.kernels:
                add(_group_of(evt), k.name, k.duration)
        elif not evt.is_async:
            add(_group_of(evt), evt.name, evt.self_cpu_time_total)
    linked = sum(groups.values())
    if cuda and device_total > linked + 1.0:  # kernels the profiler did not tie to an op: still counted
        groups["unlinked"] = device_total - linked
    per = 1e-3 / steps
    out = {"steps": steps, "clock": "cuda kernels" if cuda else "cpu ops (self time)",
           "total_ms": round(max(linked, device_total) * per, 2),
           "groups_ms": {g: round(v * per, 2) for g, v in sorted(groups.items(), key=lambda x: -x[1])},
           "top": [{"group": g, "name": n[:90], "ms": round(v[0] * per, 3), "calls": round(v[1] / steps, 1)}
                   for (g, n), v in sorted(names.items(), key=lambda x: -x[1][0])[:top]]}
    if "unlinked" in groups:
        out["device_top"] = [{"name": n[:90], "ms": round(v * per, 3)}
                             for n, v in sorted(device_names.items(), key=lambda x: -x[1])[:top]]
    return out


def measure_training(model_dir: Path, data: dict, cfg: dict, device, profile_steps: int = 0) -> dict:
    from tensorrt_llm_ext.training import data as data_mod
    from tensorrt_llm_ext.training import trainer

    tiny = device.type == "cpu"
    tc = trainer.TrainConfig(num_layers=cfg["layers"], latent_dim=cfg["latent"], markov_rank=16 if tiny else 256,
                             target_layers=_targets(cfg, tiny),
                             tv_weight=1.8, ce_weight=0.1, position_decay=0.7788, batch_seqs=cfg["bs"],
                             anchors=cfg["anchors"], draft_len=7, lr=1e-3, steps=100000)
    dcfg, layers = trainer.drafter_config(model_dir, tc)
    target = data_mod.load_target(model_dir, layers, device, torch.float32 if tiny else torch.bfloat16)
    lm_head = target.lm_head.weight.detach()
    sd = {"embed_tokens.weight": target.embed_tokens.weight.detach().float().cpu()}
    init = trainer.initial_weights(dcfg, sd, 1, "scratch")
    params = {n: t.to(device).float().requires_grad_(n not in trainer.FROZEN) for n, t in init.items()}
    opt = torch.optim.AdamW([p for n, p in params.items() if n not in trainer.FROZEN], lr=1e-4, betas=(0.9, 0.95),
                            fused=not tiny)
    gen = torch.Generator(device=device).manual_seed(0)
    dense = cfg["teacher"] == "dense"
    base, _, layout = cfg["loss"].partition("_")
    if base not in ("eager", "fused", "kernel", "torch") or layout not in ("", "rows", "joint", "dedup"):
        raise ValueError(f"--train: loss={cfg['loss']!r}: eager, or fused / kernel / torch with an optional "
                         "_rows / _joint / _dedup layout")
    real_tp = data_mod.teacher_pass
    counts = trainer.candidate_counts(data["lens"], data["prompt_lens"])
    live_blocks = []  # per timed step: the blocks with a loss (fill=mask) or the slots (wrap)

    def batch_of(step):
        idx = trainer.length_grouped_batch(counts, cfg["bs"], cfg["groups"], torch.Generator().manual_seed(step))
        live_blocks.append(trainer.trained_blocks(counts, idx, cfg["anchors"], cfg["fill"]))
        trainer.teacher_pass = lambda tg, seq: real_tp(tg, seq, dense=dense)
        try:
            return trainer._batch(data, idx, device, target, bucket=cfg["seq_bucket"] or None)
        finally:
            trainer.teacher_pass = real_tp

    def step(i):
        with torch.profiler.record_function("teacher_pass"):
            b = batch_of(i)
        anchors = trainer.sample_anchors(b, cfg["anchors"], gen, cfg["fill"])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not tiny):
            loss, m = trainer.distillation_loss(params, dcfg, lm_head, b, anchors, 7, tc, fused=base != "eager",
                                                attention=cfg["attention"],
                                                kernel=None if base == "fused" else base == "kernel",
                                                layout=layout or "rows")
        opt.zero_grad(set_to_none=True)
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer"):
            torch.nn.utils.clip_grad_norm_([p for n, p in params.items() if n not in trainer.FROZEN], 1.0)
            opt.step()
        return trainer.metrics_vector(m)

    sync = torch.cuda.synchronize if not tiny else (lambda: None)
    if not tiny:
        torch.cuda.reset_peak_memory_stats()
    for i in range(2):
        step(i)
    sync()
    t0 = time.perf_counter()
    live_blocks.clear()
    vecs = [step(100 + i) for i in range(cfg["steps"])]
    blocks = sum(live_blocks[:cfg["steps"]]) / cfg["steps"]
    torch.stack(vecs).cpu()
    dt = (time.perf_counter() - t0) / cfg["steps"]
    prof_out = None
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([] if tiny else [ProfilerActivity.CUDA])
        try:
            with profile(activities=acts) as prof:
                for i in range(profile_steps):
                    step(300 + i)
                sync()
            prof_out = profile_summary(prof, profile_steps, not tiny)
            prof_out["step_ms_unprofiled"] = round(dt * 1e3, 1)
            if not tiny:  # one stream: what the kernels leave of the step is the GPU waiting (host, syncs)
                prof_out["idle_ms"] = round(dt * 1e3 - prof_out["total_ms"], 1)
        except Exception as e:  # the timing above stands without the profile
            prof_out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    # the teacher pass alone (the same batches)
    b = None
    sync()
    t1 = time.perf_counter()
    for i in range(3):
        b = batch_of(200 + i)
    sync()
    tp = (time.perf_counter() - t1) / 3
    pos = blocks * 7  # block positions a step trains (live ones under fill=mask)
    out = {**cfg, "step_ms": round(dt * 1e3, 1), "steps_per_s": round(1 / dt, 2),
           "block_positions_per_s": round(pos / dt), "teacher_pass_ms": round(tp * 1e3, 1),
           "batch_tokens": int(b["tokens"].numel()), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if not tiny else 0,
           "loss_last": round(float(vecs[-1][0]), 4)}
    if prof_out is not None:
        out["profile"] = prof_out
    del params, opt, target
    if not tiny:
        torch.cuda.empty_cache()
    return out


def measure_serving(model_dir: Path, cfg: dict, batches: list[int], ctx: int, device) -> dict:
    """Microseconds per decode step of a drafter of ``cfg``'s shape (module docstring), random weights, K = 7."""
    import torch.nn.functional as F

    from tensorrt_llm_ext.bench.drafter import served_step_inputs
    from tensorrt_llm_ext.bench.harness import BenchTimer
    from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafter, generate_full_state_dict
    from tensorrt_llm_ext.training import trainer

    tiny = device.type == "cpu"
    tc = trainer.TrainConfig(num_layers=cfg["layers"], latent_dim=cfg["latent"], markov_rank=16 if tiny else 256,
                             target_layers=_targets(cfg, tiny))
    dcfg, _ = trainer.drafter_config(model_dir, tc)
    dtype = torch.float32 if tiny else torch.bfloat16
    drafter = DSparkDrafter(dcfg, dtype=dtype, device=device)
    drafter.load_full_state_dict(generate_full_state_dict(dcfg, 0, dtype, device=device))
    g = torch.Generator(device=device).manual_seed(0)
    lm_head = torch.randn(dcfg.vocab_size, dcfg.hidden_size, generator=g, device=device, dtype=dtype) * 0.02
    timer = BenchTimer(device)
    k, page = 7, 64
    out = {**{key: cfg[key] for key in ("layers", "latent", "targets")}, "ctx": ctx}
    for b in batches:
        inputs, feats = served_step_inputs(drafter, b, ctx, k, page, g)

        def block():
            return F.linear(drafter.forward_block(inputs), lm_head)

        def step():
            drafter.compute_context_latents(feats)
            return block()

        with torch.no_grad():
            out[f"B{b}_step_us"] = round(timer.time_graph([step]), 1)
            out[f"B{b}_block_us"] = round(timer.time_graph([block]), 1)
    del drafter, pool
    if not tiny:
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--prompt-file", default=".gpu_data/prompts.jsonl.gz")
    ap.add_argument("--old-data", default=None)
    ap.add_argument("--train", nargs="*", default=[])
    ap.add_argument("--train-seqs", type=int, default=2048)
    ap.add_argument("--max-turns", type=int, default=1, help="prompt lengths of up to N user turns (docstring)")
    ap.add_argument("--serve", nargs="*", default=[], help="drafter shapes timed as served (docstring)")
    ap.add_argument("--serve-batches", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--serve-ctx", type=int, default=512)
    ap.add_argument("--gen-prompts", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--gen-batches", type=int, nargs="*", default=[])
    ap.add_argument("--old-gen-batch", type=int, default=0)
    ap.add_argument("--model-dir", default=None, help="where the random-weight checkpoint goes (OUT/model)")
    ap.add_argument("--tiny", action="store_true", help="the tiny test model on the CPU (checks this script)")
    ap.add_argument("--profile", action="store_true", help="kernel time per step by group (docstring)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--teacher-widths", action="store_true",
                    help="the teacher pass per call with every width new vs one width repeated (docstring)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    import tensorrt_llm_ext

    log(out, results, "env", {"module": tensorrt_llm_ext.__file__, "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"})
    device = torch.device("cpu" if a.tiny else "cuda")
    vocab = 517 if a.tiny else 49152
    model_dir = Path(a.model_dir) if a.model_dir else out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    t0 = time.time()
    build_model(model_dir, a.tiny)
    log(out, results, "build_s", round(time.time() - t0, 1))

    # training: synthetic sequences of the prompt file's prompt lengths + 256 answer tokens
    lens_p = prompt_lengths(a.prompt_file, a.train_seqs, 0, a.max_turns)
    if a.tiny:
        lens_p = [min(n, 40) for n in lens_p]
    g = torch.Generator().manual_seed(0)
    width = max(lens_p) + 256
    tokens = torch.randint(0, vocab - 1, (len(lens_p), width), generator=g, dtype=torch.int32)
    prompt_lens = torch.tensor(lens_p)
    lens = prompt_lens + torch.randint(128, 257, (len(lens_p),), generator=g)
    data = {"tokens": tokens, "lens": lens, "prompt_lens": prompt_lens}
    log(out, results, "train_data", {"seqs": len(lens_p), "mean_len": round(float(lens.float().mean()), 1),
                                     "mean_prompt": round(float(prompt_lens.float().mean()), 1)})
    if a.teacher_widths and not a.tiny:
        log(out, results, "teacher_widths", measure_teacher_widths(model_dir, device, a.old_data))
    profiled = []
    for i, cfg in enumerate(train_configs(a.train)):
        try:
            r = measure_training(model_dir, data, cfg, device, a.profile_steps if a.profile else 0)
            log(out, results, f"train_{i}", r)
            if "groups_ms" in r.get("profile", {}):
                profiled.append(r)
        except Exception as e:  # an out-of-memory configuration is a result too
            log(out, results, f"train_{i}", {**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if len(profiled) > 1:  # each configuration's groups beside the first's (ms per step; negative: saved)
        first = profiled[0]["profile"]["groups_ms"]
        log(out, results, "profile_summary", [
            {"loss": r["loss"], "bs": r["bs"], "anchors": r["anchors"], "step_ms": r["step_ms"],
             "kernel_ms": r["profile"]["total_ms"],
             "vs_first_ms": {g: round(r["profile"]["groups_ms"].get(g, 0.0) - first.get(g, 0.0), 2)
                             for g in sorted(set(first) | set(r["profile"]["groups_ms"]))}} for r in profiled])
    for i, cfg in enumerate(train_configs(a.serve)):
        try:
            log(out, results, f"serve_{i}", measure_serving(model_dir, cfg, a.serve_batches, a.serve_ctx, device))
        except Exception as e:
            log(out, results, f"serve_{i}", {**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})

    # generation: the prompt file's lengths, answers of varied length
    if a.gen_batches or a.old_gen_batch:
        from tensorrt_llm_ext.runtime import requests as req_mod
        from tensorrt_llm_ext.training import data as data_mod

        lens_g = prompt_lengths(a.prompt_file, a.gen_prompts, 1)
        if a.tiny:
            lens_g = [min(n, 20) for n in lens_g]
        rng = random.Random(1)
        prompts = [[rng.randrange(vocab - 1) for _ in range(n)] for n in lens_g]
        temps = [0.0 if i % 2 else 1.0 for i in range(len(prompts))]
        real = req_mod.Request
        draw = random.Random(2)

        class Varied(real):  # an EOS at a varied length, as real answers
            def __init__(self, *args, **kw):
                n = kw["max_new_tokens"]
                kw["max_new_tokens"] = draw.randint(n // 4, n)
                super().__init__(*args, **kw)

        runs = [("new", b) for b in a.gen_batches]
        if a.old_gen_batch and a.old_data:  # after the first new run (its kernels compiled: a fairer clock)
            runs.insert(min(1, len(runs)), ("old", a.old_gen_batch))
        for name, bsz in runs:
            mod = load_old_data(a.old_data) if name == "old" else data_mod
            req_mod.Request = Varied
            draw.seed(2)
            try:
                t = time.time()
                res = mod.regenerate(model_dir, prompts, max_new_tokens=a.gen_tokens, temperatures=temps, top_p=0.95,
                                     seed=0, batch_size=bsz, device=device, cuda_graph=not a.tiny, log_every_s=10.0)
                wall = time.time() - t
                made = int((res["lens"] - res["prompt_lens"]).sum())
                log(out, results, f"gen_{name}_{bsz}", {"prompts": len(prompts), "tokens": made,
                                                         "wall_s_with_build_and_capture": round(wall, 1),
                                                         "tokens_per_s_with_build": round(made / wall)})
            except Exception as e:
                log(out, results, f"gen_{name}_{bsz}", {"error": f"{type(e).__name__}: {str(e)[:300]}"})
            finally:
                req_mod.Request = real
            if not a.tiny:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
