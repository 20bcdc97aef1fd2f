"""``trtllm-ext train-drafter DIR --out DIR/dspark_drafter``: a DSpark drafter trained on its target by
self-distillation (the recipe and its knobs: ``docs/real_model.md``).

1. **Data** (:mod:`.data`): the target continues ``num_prompts`` generated instructions (a fraction greedy,
   the rest sampled at ``gen_temperature`` / ``gen_top_p``) up to ``max_new_tokens``; one teacher pass keeps
   the captured features and the final hidden state per position. Cached in ``work_dir/data.pt``.
2. **Init** (:func:`initial_weights`, ``init``): the seeded backbone with a Markov head that starts at zero
   (``scratch``), or the serving engine's bigram initialisation (``bigram``); the embedding copied from the
   target's.
3. **Steps**: ``batch_seqs`` sequences, ``anchors`` random anchor positions each (in the generated part),
   ``draft_len`` block positions per anchor drafted in one teacher-forced pass (:mod:`.drafter_forward`);
   loss = KL(target || draft) per block position, weighted ``position_decay ** k`` (early positions decide
   the acceptance length); AdamW, linear warm-up, cosine decay, gradient clipping; bfloat16 autocast on CUDA.
4. **Checkpoints** every ``save_every`` steps in ``work_dir/trainer_state.pt`` (weights, optimizer, step,
   RNG); ``--resume`` continues from it (and from the cached data). The drafter directory is written at the
   end in the format ``serve`` loads (``models/checkpoint.py``), with ``training.json`` (knobs, losses,
   held-out estimate).
5. **Held-out estimate** (:func:`greedy_walk_acceptance`): greedy continuations of held-out prompts, walked
   as the engine walks them (anchor, K drafts through the Markov chain, accept the matching prefix + the
   bonus token): the mean acceptance length at T = 0, at the initialisation and after training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.models.checkpoint import (default_target_layer_ids, read_target_config,
                                                save_drafter_checkpoint)
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafterConfig, bigram_markov_head, full_weight_shapes
from tensorrt_llm_ext.models.dspark_drafter import generate_full_state_dict as generate_drafter_state_dict
from tensorrt_llm_ext.training.data import eos_token_ids, generate_dataset, load_target
from tensorrt_llm_ext.training.drafter_forward import block_hidden, block_logits, context_latents, markov_bias
from tensorrt_llm_ext.training.prompts import prompt_token_ids


@dataclass
class TrainConfig:
    """The knobs of ``train-drafter`` (each is a CLI flag of the same name with dashes)."""

    # data
    num_prompts: int = 512
    max_new_tokens: int = 192
    greedy_fraction: float = 0.5
    gen_temperature: float = 1.0
    gen_top_p: float = 0.95
    gen_batch: int = 64
    eval_prompts: int = 32
    # drafter sizes (hidden and vocabulary are the target's)
    num_layers: int = 2
    num_heads: int = 8
    head_dim: int = 64
    latent_dim: int = 128
    intermediate_size: int = 1536
    markov_rank: int | None = None  # None: the target's hidden size (the bigram init needs it)
    init: str = "scratch"  # scratch | bigram (initial_weights)
    # optimisation
    draft_len: int = 7
    steps: int = 2000
    batch_seqs: int = 16
    anchors: int = 16
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup: int = 100
    position_decay: float = 0.8
    grad_clip: float = 1.0
    # bookkeeping
    save_every: int = 200
    seed: int = 0
    device: str = "auto"
    save_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU

    def __post_init__(self):
        """Every knob checked before any work (one line each, the CLI exits 2 on it)."""
        def bad(name, want, got):
            raise ValueError(f"train-drafter: --{name.replace('_', '-')} must be {want}, got {got!r}")

        for name, lo, hi in (("num_prompts", 1, 10_000_000), ("max_new_tokens", 1, 8192), ("gen_batch", 1, 4096),
                             ("num_layers", 1, 64), ("num_heads", 1, 256), ("head_dim", 2, 1024),
                             ("latent_dim", 1, 8192), ("intermediate_size", 1, 65536), ("draft_len", 1, 32),
                             ("steps", 1, 10_000_000), ("batch_seqs", 1, 4096), ("anchors", 1, 4096),
                             ("save_every", 1, 10_000_000), ("eval_prompts", 0, 100_000), ("warmup", 0, 10_000_000),
                             ("seed", 0, 2**63 - 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                bad(name, f"an integer in [{lo}, {hi}]", v)
        if self.head_dim % 2:
            bad("head_dim", "even (RoPE rotates pairs)", self.head_dim)
        if self.markov_rank is not None and (not isinstance(self.markov_rank, int) or not 1 <= self.markov_rank <= 65536):
            bad("markov_rank", "an integer in [1, 65536]", self.markov_rank)
        for name, lo, hi, lo_open, hi_open in (("lr", 0.0, 1.0, True, False), ("weight_decay", 0.0, 1.0, False, True),
                                               ("greedy_fraction", 0.0, 1.0, False, False),
                                               ("gen_temperature", 0.0, 100.0, False, False),
                                               ("gen_top_p", 0.0, 1.0, True, False),
                                               ("position_decay", 0.0, 1.0, True, False),
                                               ("grad_clip", 0.0, 1e6, True, False)):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and \
                (v < hi if hi_open else v <= hi)
            if not ok:
                bad(name, f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}", v)
        if self.init not in ("scratch", "bigram"):
            bad("init", "'scratch' or 'bigram'", self.init)
        if self.save_dtype not in SAVE_DTYPES:
            bad("save_dtype", " / ".join(SAVE_DTYPES), self.save_dtype)
        _device(self.device)  # raises the one-line error for an unknown or absent device


SAVE_DTYPES = ("auto", "float32", "bfloat16")


class TrainingDiverged(RuntimeError):
    """The loss went non-finite: the run stops (nothing saved past the last finite checkpoint)."""


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"train-drafter: --device must be auto, cpu, cuda or cuda:N, got {name!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"train-drafter: --device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"train-drafter: --device {name}: no such CUDA device here "
                         f"({torch.cuda.device_count()} visible)")
    return dev


def drafter_config(model_dir: str | Path, tc: TrainConfig) -> tuple[DSparkDrafterConfig, list[int]]:
    """The drafter sizes for the target of ``model_dir`` and the target layers it reads."""
    tcfg, _ = read_target_config(model_dir)
    layers = default_target_layer_ids(tcfg.num_layers)
    return DSparkDrafterConfig(
        hidden_size=tcfg.hidden_size, target_hidden_size=tcfg.hidden_size, num_capture_layers=len(layers),
        num_layers=tc.num_layers, num_heads=tc.num_heads, head_dim=tc.head_dim, latent_dim=tc.latent_dim,
        intermediate_size=tc.intermediate_size, vocab_size=tcfg.vocab_size,
        markov_rank=tc.markov_rank or tcfg.hidden_size, mask_token_id=tcfg.vocab_size - 1,
        rms_norm_eps=tcfg.rms_norm_eps), layers


def initial_weights(dcfg: DSparkDrafterConfig, target_sd: dict[str, torch.Tensor], seed: int,
                    init: str = "scratch") -> dict[str, torch.Tensor]:
    """The starting weights (fp32), the embedding copied from the target's.

    ``"bigram"``: the engine's seeded drafter (quiet backbone, Markov head = the target's embedding -> head
    bigram; rank = hidden size). On a tied real model that bigram puts most mass on repeating the previous
    token (SmolLM2: KL to the target ~100 nats), which training must first unlearn. ``"scratch"`` (default):
    the seeded backbone at full scale and a Markov head that starts at zero (``markov_w1 = 0``; ``markov_w2``
    seeded, so the gradient reaches ``w1``): the first drafts are the backbone's alone.
    """
    if init not in ("scratch", "bigram"):
        raise ValueError(f"train-drafter: init must be 'scratch' or 'bigram', got {init!r}")
    sd = generate_drafter_state_dict(dcfg, seed, torch.float32)
    if init == "bigram":
        if dcfg.markov_rank != dcfg.hidden_size:
            raise ValueError(f"train-drafter: init 'bigram' needs markov-rank = hidden size {dcfg.hidden_size}, "
                             f"got {dcfg.markov_rank}")
        sd.update(bigram_markov_head(target_sd, dcfg.rms_norm_eps))
        sd["norm.weight"] = sd["norm.weight"] * 0.05  # quiet backbone, as the engine's seeded drafter
    else:
        sd["markov_w1"] = torch.zeros_like(sd["markov_w1"])
    sd["embed_tokens.weight"] = target_sd["embed_tokens.weight"].float().clone()
    return sd


def distillation_loss(params, dcfg, lm_head_weight, batch: dict[str, torch.Tensor], anchors: torch.Tensor,
                      draft_len: int, position_decay: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted KL(target || draft) over the valid block positions, and metrics (per-position top-1 agreement,
    the teacher-forced greedy acceptance length)."""
    tokens, feats, final, lens = batch["tokens"], batch["features"], batch["final"], batch["lens"]
    logits = block_logits(params, dcfg, lm_head_weight, feats, tokens, anchors, draft_len).float()
    k = torch.arange(draft_len, device=anchors.device)
    pos = anchors[:, :, None] + k  # teacher position of block position k
    valid = pos <= (lens[:, None, None] - 2)  # the teacher's next token exists
    teacher_h = final.gather(1, pos.clamp(max=final.shape[1] - 1).flatten(1)[..., None].expand(-1, -1, final.shape[2]))
    teacher = F.linear(teacher_h.to(lm_head_weight.dtype), lm_head_weight).float().view_as(logits)
    p_log = torch.log_softmax(teacher, -1)
    q_log = torch.log_softmax(logits, -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)  # [S, M, K]
    w = (position_decay ** k.float())[None, None] * valid
    loss = (kl * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        agree = (logits.argmax(-1) == teacher.argmax(-1)) & valid
        run = torch.cumprod(agree.long(), dim=-1)  # accepted prefix of each block (teacher forced)
        full = valid[..., 0]
        est = (1 + run.sum(-1)).float()[full].mean().item() if bool(full.any()) else float("nan")
        per_pos = [(agree[..., j].sum() / valid[..., j].sum().clamp_min(1)).item() for j in range(draft_len)]
    return loss, {"loss": loss.item(), "accept_est": est, "top1": per_pos}


def _batch(data: dict[str, torch.Tensor], idx: torch.Tensor, device) -> dict[str, torch.Tensor]:
    t = int(data["lens"][idx].max())
    return {"tokens": data["tokens"][idx, :t].to(device), "lens": data["lens"][idx].to(device),
            "prompt_lens": data["prompt_lens"][idx].to(device),
            "features": data["features"][idx, :t].to(device), "final": data["final"][idx, :t].to(device)}


def sample_anchors(batch: dict[str, torch.Tensor], anchors: int, generator: torch.Generator) -> torch.Tensor:
    """``[S, anchors]`` positions in ``[prompt_len, len - 2]`` (the generated part; the first anchor of serving
    is the first generated token, at ``prompt_len``)."""
    lo, hi = batch["prompt_lens"], (batch["lens"] - 2).clamp_min(batch["prompt_lens"])
    u = torch.rand(lo.shape[0], anchors, generator=generator, device=generator.device).to(lo.device)
    return (lo[:, None] + (u * (hi - lo + 1)[:, None].float()).long()).clamp(max=hi[:, None])


@torch.no_grad()
def greedy_walk_acceptance(params, dcfg, lm_head_weight, data: dict[str, torch.Tensor], draft_len: int,
                           device, batch_seqs: int = 32) -> float:
    """Mean acceptance length at T = 0 of the drafter on greedy sequences, walked as the engine walks them:
    the anchor starts at the first generated token; the block's K drafts go through the Markov chain (each
    draft biased by the previous draft); the matching prefix and the bonus token are accepted."""
    total, steps = 0, 0
    for start in range(0, data["tokens"].shape[0], batch_seqs):
        idx = torch.arange(start, min(start + batch_seqs, data["tokens"].shape[0]))
        b = _batch(data, idx, device)
        ctx = context_latents(params, dcfg, b["features"].to(lm_head_weight.dtype))
        tokens, lens = b["tokens"], b["lens"]
        a = b["prompt_lens"].clone()
        rows = torch.arange(len(idx), device=device)
        while True:
            live = a <= lens - 2
            if not bool(live.any()):
                break
            ac = a.clamp(max=tokens.shape[1] - 1)
            hidden = block_hidden(params, dcfg, ctx, tokens[rows, ac][:, None], ac[:, None], draft_len)
            base = F.linear(hidden[:, 0], lm_head_weight).float()  # [S, K, V]
            prev = tokens[rows, ac]
            drafts = []
            for k in range(draft_len):
                prev = (base[:, k] + markov_bias(params, prev).float()).argmax(-1)
                drafts.append(prev)
            drafts = torch.stack(drafts, 1)
            nxt = (ac[:, None] + 1 + torch.arange(draft_len, device=device))
            truth = tokens[rows[:, None], nxt.clamp(max=tokens.shape[1] - 1)]
            match = (drafts == truth) & (nxt <= (lens - 1)[:, None])
            n_acc = torch.cumprod(match.long(), 1).sum(1)
            # the bonus token exists while the sequence continues; the walk ends at the sequence's end
            step = torch.minimum(n_acc + 1, lens - 1 - ac)
            total += int(step[live].sum())
            steps += int(live.sum())
            a = torch.where(live, a + step, a)
    return total / steps if steps else float("nan")


def train_drafter(model_dir: str | Path, out_dir: str | Path, tc: TrainConfig, *, work_dir: str | Path | None = None,
                  resume: bool = False, progress: bool = True) -> dict:
    """Train and save the drafter; returns the summary written to ``out_dir/training.json``."""
    device = _device(tc.device)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    work_dir = Path(work_dir) if work_dir is not None else out_dir.parent / f"{out_dir.name}_work"
    work_dir.mkdir(parents=True, exist_ok=True)
    state_path, data_path = work_dir / "trainer_state.pt", work_dir / "data.pt"
    dcfg, layers = drafter_config(model_dir, tc)
    storage = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(model_dir, layers, device, storage)
    lm_head = target.lm_head.weight.detach()
    knobs = dataclasses.asdict(tc)
    torch.manual_seed(tc.seed)

    state = None
    if resume and state_path.is_file():
        state = _load_resume_file(state_path, STATE_KEYS)
        _check_params(state_path, state["params"], dcfg)
        if state["knobs"] != knobs:
            changed = sorted(k for k in knobs if state["knobs"].get(k) != knobs[k])
            raise ValueError(f"train-drafter --resume: {state_path} was written with other knobs ({changed}); "
                             "use the same flags or another --work-dir")
    if resume and data_path.is_file():
        data = _load_resume_file(data_path, DATA_KEYS)
        _check_data(data_path, data)
        logger.info(f"train-drafter: data from {data_path} ({data['tokens'].shape[0]} sequences)")
    else:
        data = _make_data(target, model_dir, tc, "train", tc.num_prompts, storage, progress)
        atomic_torch_save(data, data_path)
    eval_data = (_make_data(target, model_dir, tc, "held_out", tc.eval_prompts, storage, progress, greedy_only=True)
                 if tc.eval_prompts else None)

    target_sd = {"embed_tokens.weight": target.embed_tokens.weight.detach().float().cpu(),
                 "norm.weight": target.norm.weight.detach().float().cpu(),
                 "lm_head.weight": lm_head.float().cpu()}
    init = initial_weights(dcfg, target_sd, tc.seed + 1, tc.init)
    params = {n: (state["params"][n] if state else init[n]).to(device).float().requires_grad_(True)
              for n in full_weight_shapes(dcfg)}
    opt = torch.optim.AdamW(params.values(), lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    step0 = 0
    history: list[dict] = []
    if state:
        opt.load_state_dict(state["optimizer"])
        step0, history = state["step"], state["history"]
        logger.info(f"train-drafter: resumed from {state_path} at step {step0}")
    gen = torch.Generator(device=device).manual_seed(tc.seed + 7)
    if state:
        gen.set_state(state["generator"])  # the anchor and batch draws continue where the run stopped
    sched = lambda s: min(1.0, (s + 1) / max(1, tc.warmup)) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / tc.steps)))

    init_eval = None
    if eval_data is not None and step0 == 0:
        init_eval = greedy_walk_acceptance({n: p.detach() for n, p in params.items()}, dcfg, lm_head.float(),
                                           eval_data, tc.draft_len, device)
        logger.info(f"train-drafter: held-out greedy acceptance length at init ({tc.init}): {init_eval:.3f}")
    elif state:
        init_eval = state.get("init_eval")
    bar = _progress(range(step0, tc.steps), progress, "train-drafter")
    n_seq = data["tokens"].shape[0]
    t0 = time.time()
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = tc.lr * sched(step)
        idx = torch.randint(n_seq, (tc.batch_seqs,), generator=gen, device=gen.device).cpu()
        batch = _batch(data, idx, device)
        anchors = sample_anchors(batch, tc.anchors, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, metrics = distillation_loss(params, dcfg, lm_head, batch, anchors, tc.draft_len, tc.position_decay)
        if not math.isfinite(metrics["loss"]):
            last = (step // tc.save_every) * tc.save_every
            raise TrainingDiverged(f"train-drafter: the loss is {metrics['loss']} at step {step + 1}; stopped, no "
                                   f"drafter written (lower --lr; the last checkpoint, step {last}, is in {work_dir})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), tc.grad_clip)
        opt.step()
        history.append({"step": step + 1, "loss": metrics["loss"], "accept_est": metrics["accept_est"]})
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", accept=f"{metrics['accept_est']:.2f}")
        elif (step + 1) % max(1, tc.steps // 20) == 0:  # no bar: a log line every 5 % of the run
            logger.info(f"train-drafter: step {step + 1}/{tc.steps} loss {metrics['loss']:.4f} teacher-forced "
                        f"acceptance {metrics['accept_est']:.2f} top-1 by position "
                        f"{[round(x, 2) for x in metrics['top1']]} ({time.time() - t0:.0f} s)")
        if (step + 1) % tc.save_every == 0 or step + 1 == tc.steps:
            _save_state(state_path, params, opt, step + 1, history, knobs, gen, init_eval)
    final = {n: p.detach() for n, p in params.items()}
    final_eval = (greedy_walk_acceptance(final, dcfg, lm_head.float(), eval_data, tc.draft_len, device)
                  if eval_data is not None else None)
    save_dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
                  "bfloat16": torch.bfloat16}[tc.save_dtype]
    weights = {n: t.to(save_dtype).cpu() for n, t in final.items()}
    if not all(bool(torch.isfinite(t).all()) for t in weights.values()):
        raise TrainingDiverged(f"train-drafter: a drafter weight is non-finite after step {tc.steps}; not written")
    summary = {"target": str(model_dir), "drafter": str(out_dir), "knobs": knobs, "target_layer_ids": layers,
               "sequences": n_seq, "steps": tc.steps, "train_seconds_this_run": round(time.time() - t0, 1),
               "first_losses": [h["loss"] for h in history[:5]], "last_losses": [h["loss"] for h in history[-5:]],
               "held_out_greedy_acceptance": {"init": init_eval, "trained": final_eval,
                                              "draft_len": tc.draft_len, "prompts": tc.eval_prompts}}
    write_drafter_atomically(out_dir, dcfg, layers, weights, summary)
    if final_eval is not None:
        logger.info(f"train-drafter: held-out greedy acceptance length K={tc.draft_len}: {init_eval} (init "
                    f"{tc.init}) -> {final_eval:.3f} (trained)")
    return summary


def _make_data(target, model_dir, tc: TrainConfig, split: str, n: int, storage, progress, greedy_only=False):
    prompts = prompt_token_ids(model_dir, split, n, target.config.vocab_size, seed=tc.seed)
    n_greedy = n if greedy_only else round(n * tc.greedy_fraction)
    temps = [0.0] * n_greedy + [tc.gen_temperature] * (n - n_greedy)
    bar = _progress(None, progress, f"generate {split}", total=n)
    try:
        return generate_dataset(target, prompts, max_new_tokens=tc.max_new_tokens, temperatures=temps,
                                top_p=tc.gen_top_p, eos_ids=eos_token_ids(model_dir),
                                seed=tc.seed + (1 if split == "held_out" else 0),
                                batch_size=tc.gen_batch, storage_dtype=storage,
                                progress=getattr(bar, "update", None))
    finally:
        if hasattr(bar, "close"):
            bar.close()


def _save_state(path: Path, params, opt, step, history, knobs, gen, init_eval) -> None:
    atomic_torch_save({"params": {n: p.detach().cpu() for n, p in params.items()}, "optimizer": opt.state_dict(),
                       "step": step, "history": history, "knobs": knobs, "generator": gen.get_state(),
                       "init_eval": init_eval}, path)


STATE_KEYS = ("params", "optimizer", "step", "history", "knobs", "generator", "init_eval")
DATA_KEYS = ("tokens", "lens", "prompt_lens")


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` to a temporary name beside ``path``, then rename: a kill mid-write leaves the previous
    file (or none), never a truncated one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_drafter_atomically(out_dir: Path, dcfg, layers, weights, summary: dict) -> None:
    """The drafter directory (``config.json``, ``model.safetensors``, ``training.json``) written whole into a
    temporary sibling and renamed into place: a kill leaves the previous drafter or none, never a config alone."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter_checkpoint(tmp, dcfg, layers, weights)
        (tmp / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _load_resume_file(path: Path, keys: tuple[str, ...]) -> dict:
    """A work-dir file loaded with ``weights_only=True`` (no code runs from a crafted pickle); a damaged one
    is named in one line."""
    hint = f"delete it (or use another --work-dir) to start that part over"
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, empty, not a torch file, or a pickle weights_only refuses
        msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ValueError(f"train-drafter --resume: {path} is damaged or not a train-drafter file ({msg}); {hint}")
    if not isinstance(obj, dict) or any(k not in obj for k in keys):
        missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
        raise ValueError(f"train-drafter --resume: {path} lacks {missing}; {hint}")
    return obj


def _check_params(path: Path, params, dcfg) -> None:
    shapes = full_weight_shapes(dcfg)
    if not isinstance(params, dict) or set(params) != set(shapes) or any(
            not isinstance(params[n], torch.Tensor) or tuple(params[n].shape) != s for n, s in shapes.items()):
        raise ValueError(f"train-drafter --resume: {path} holds weights of another drafter shape; delete it or "
                         "use another --work-dir")


def _check_data(path: Path, data: dict) -> None:
    n = data["tokens"].shape[0] if isinstance(data["tokens"], torch.Tensor) and data["tokens"].dim() == 2 else -1
    if n < 1 or any(not isinstance(data[k], torch.Tensor) or data[k].shape[0] != n for k in data if k in DATA_KEYS):
        raise ValueError(f"train-drafter --resume: {path} is inconsistent (row counts differ); delete it or use "
                         "another --work-dir")


def _progress(iterable, enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return iterable if iterable is not None else None
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True)
