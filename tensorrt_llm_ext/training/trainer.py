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
        for name in ("num_prompts", "max_new_tokens", "gen_batch", "num_layers", "num_heads", "head_dim", "latent_dim",
                     "intermediate_size", "draft_len", "steps", "batch_seqs", "anchors", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train-drafter: {name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.greedy_fraction <= 1.0 or not 0.0 < self.gen_top_p <= 1.0:
            raise ValueError(f"train-drafter: greedy-fraction must be in [0, 1] and gen-top-p in (0, 1], got "
                             f"{self.greedy_fraction} / {self.gen_top_p}")
        if self.init not in ("scratch", "bigram"):
            raise ValueError(f"train-drafter: init must be 'scratch' or 'bigram', got {self.init!r}")
        if self.eval_prompts < 0:
            raise ValueError(f"train-drafter: eval-prompts must be >= 0, got {self.eval_prompts}")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        if state["knobs"] != knobs:
            changed = sorted(k for k in knobs if state["knobs"].get(k) != knobs[k])
            raise ValueError(f"train-drafter --resume: {state_path} was written with other knobs ({changed}); "
                             "use the same flags or another --work-dir")
    if resume and data_path.is_file():
        data = torch.load(data_path, map_location="cpu", weights_only=True)
        logger.info(f"train-drafter: data from {data_path} ({data['tokens'].shape[0]} sequences)")
    else:
        data = _make_data(target, model_dir, tc, "train", tc.num_prompts, storage, progress)
        torch.save(data, data_path)
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
    save_drafter_checkpoint(out_dir, dcfg, layers, {n: t.to(save_dtype).cpu() for n, t in final.items()})
    summary = {"target": str(model_dir), "drafter": str(out_dir), "knobs": knobs, "target_layer_ids": layers,
               "sequences": n_seq, "steps": tc.steps, "train_seconds_this_run": round(time.time() - t0, 1),
               "first_losses": [h["loss"] for h in history[:5]], "last_losses": [h["loss"] for h in history[-5:]],
               "held_out_greedy_acceptance": {"init": init_eval, "trained": final_eval,
                                              "draft_len": tc.draft_len, "prompts": tc.eval_prompts}}
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
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
    tmp = path.with_suffix(".tmp")
    torch.save({"params": {n: p.detach().cpu() for n, p in params.items()}, "optimizer": opt.state_dict(),
                "step": step, "history": history, "knobs": knobs, "generator": gen.get_state(),
                "init_eval": init_eval}, tmp)
    tmp.replace(path)  # a kill mid-save leaves the previous checkpoint whole


def _progress(iterable, enabled: bool, desc: str, total: int | None = None):
    if not enabled:
        return iterable if iterable is not None else None
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True)
