"""``trtllm-ext train-drafter DIR --out DIR/dspark_drafter``: a DSpark drafter trained on its target by
self-distillation (the recipe and its knobs: ``docs/real_model.md``).

1. **Data** (:mod:`.data`): the target continues ``num_prompts`` generated instructions (a fraction greedy,
   the rest sampled at ``gen_temperature`` / ``gen_top_p``) up to ``max_new_tokens``; one teacher pass keeps
   the captured features and the final hidden state per position. Cached in ``work_dir/data.pt``, or with
   ``answers_cache`` in that folder under a name derived from the target and the knobs that decide the answers
   (:func:`answers_cache_path`): another run with the same data knobs -- an ablation of the steps' knobs --
   reads them instead of decoding them again.
2. **Init** (:func:`initial_weights`, ``init``): the seeded backbone with a Markov head that starts at zero
   (``scratch``), or the serving engine's bigram initialisation (``bigram``); the embedding copied from the
   target's.
3. **Steps**: ``batch_seqs`` sequences, ``anchors`` random anchor positions each (in the generated part),
   ``draft_len`` block positions per anchor drafted in one teacher-forced pass (:mod:`.drafter_forward`);
   loss = TV + CE (+ KL) per block position (:func:`distillation_loss`; the vocabulary-wide part chunked with
   its gradient, :mod:`.fused_loss`), weighted ``position_decay ** k`` (early positions decide the acceptance
   length); AdamW, linear warm-up, cosine decay, gradient clipping; bfloat16 autocast on CUDA. The step's
   metrics stay on the device until a log line or a checkpoint reads them (one copy for many steps).
4. **Checkpoints** every ``save_every`` steps in ``work_dir/trainer_state.pt`` (weights, optimizer, step,
   RNG); ``--resume`` continues from it (and from the cached data). The drafter directory is written at the
   end in the format ``serve`` loads (``models/checkpoint.py``), with ``training.json`` (knobs, losses,
   held-out estimate).
5. **Held-out estimate** (:func:`greedy_walk_acceptance`): greedy continuations of held-out prompts, walked
   as the engine walks them (anchor, K drafts through the Markov chain, accept the matching prefix + the
   bonus token): the mean acceptance length at T = 0, at the initialisation and after training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorrt_llm_ext import _env
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.models.checkpoint import (DRAFTER_ARCHITECTURE, default_target_layer_ids, read_checkpoint_facts,
                                                read_target_config, save_drafter_checkpoint, save_safetensors)
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafterConfig, bigram_markov_head, full_weight_shapes
from tensorrt_llm_ext.models.dspark_drafter import generate_full_state_dict as generate_drafter_state_dict
from tensorrt_llm_ext.models.dspark_drafter import (CONFIDENCE_CALIBRATION, CONFIDENCE_HEAD_FILE,
                                                   apply_confidence_calibration, confidence_head_shapes)
from tensorrt_llm_ext.training.data import load_target, regenerate, render_prompts, teacher_pass
from tensorrt_llm_ext.training.feature_cache import GIB, FeatureCache
from tensorrt_llm_ext.training.drafter_forward import (TRAIN_ATTENTION, block_hidden, block_hidden_prev,
                                                        context_latents, markov_bias)
from tensorrt_llm_ext.training.fused_loss import LAYOUTS, eager_block_loss, fused_block_loss
from tensorrt_llm_ext.training.prompt_sources import mixed_samples, parse_source_spec


@dataclass
class TrainConfig:
    """The knobs of ``train-drafter`` (each is a CLI flag of the same name with dashes)."""

    # data
    prompts: tuple[str, ...] = ("templates",)  # sources mixed by weight: sharegpt, chitchat, templates, FILE.jsonl[:W]
    num_prompts: int = 512
    max_turns: int = 3  # user turns of one conversation used as prompts
    max_prompt_tokens: int = 768
    held_out_percent: float = 2.0
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
    markov_rank: int = 256
    target_layers: str = ""  # comma-separated target layer ids the drafter reads; "" = the default spread
    init: str = "scratch"  # scratch | bigram | embedding | target (initial_weights)
    # objective (the DSpark paper's: 0.1 CE + 0.9 total variation, position weights exp(-k/K), k = 0..K-1)
    tv_weight: float = 0.9
    ce_weight: float = 0.1
    kl_weight: float = 0.0
    confidence_weight: float = 0.1
    position_decay: float | None = None  # None: exp(-1/K) per position (the paper); else this factor
    # optimisation
    draft_len: int = 7
    steps: int = 2000
    batch_seqs: int = 16
    anchors: int = 16
    # where a training sequence's anchors are drawn: "answer" (the generated part, where serving drafts) or "all"
    # (every position from 1: the prompt's too, the teacher's distribution there -- more distinct blocks a sequence)
    anchor_region: str = "answer"
    # a sequence with fewer candidate positions than --anchors: "wrap" repeats them (each sequence fills every anchor
    # slot, so a short answer's blocks count several times), "mask" leaves the extra slots without loss, and a batch
    # takes at most its longest sequence's candidates (with --length-groups, the blocks a batch of short answers does
    # not compute)
    anchor_fill: str = "wrap"
    # > 1: each step draws length_groups x batch_seqs sequences, ranks them by candidate positions and trains on one
    # of the groups of batch_seqs (similar answer lengths in a batch: fewer masked blocks with --anchor-fill mask)
    length_groups: int = 1
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup: int = 100
    grad_clip: float = 1.0
    # a step whose loss or gradient norm is non-finite is skipped (AdamW leaves weights and moments as they were);
    # more than this many in a row stop the run as diverged (0: stop at the first, the former behaviour)
    max_skipped_steps: int = 8
    # bookkeeping
    save_every: int = 200
    seed: int = 0
    device: str = "auto"
    save_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU

    def __post_init__(self):
        """Every knob checked before any work (one line each, the CLI exits 2 on it)."""
        def bad(name, want, got):
            raise ValueError(f"train-drafter: --{name.replace('_', '-')} must be {want}, got {got!r}")

        # max_new_tokens >= 2: a block needs an answer of two tokens (one-token answers are dropped)
        for name, lo, hi in (("num_prompts", 1, 10_000_000), ("max_new_tokens", 2, 8192), ("gen_batch", 1, 4096),
                             ("num_layers", 1, 64), ("num_heads", 1, 256), ("head_dim", 2, 1024),
                             ("latent_dim", 1, 8192), ("intermediate_size", 1, 65536), ("draft_len", 1, 32),
                             ("steps", 1, 10_000_000), ("batch_seqs", 1, 4096), ("anchors", 1, 4096),
                             ("save_every", 1, 10_000_000), ("eval_prompts", 0, 100_000), ("warmup", 0, 10_000_000),
                             # seed: request seeds are seed * 1_000_003 + i, held below 2^63
                             ("seed", 0, 2**43 - 1), ("max_turns", 1, 64), ("max_prompt_tokens", 1, 65536),
                             ("max_skipped_steps", 0, 1_000_000), ("length_groups", 1, 4096)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                bad(name, f"an integer in [{lo}, {hi}]", v)
        if self.head_dim % 2:
            bad("head_dim", "even (RoPE rotates pairs)", self.head_dim)
        if self.anchor_region not in ANCHOR_REGIONS:
            bad("anchor_region", f"one of {', '.join(ANCHOR_REGIONS)}", self.anchor_region)
        if self.anchor_fill not in ANCHOR_FILLS:
            bad("anchor_fill", f"one of {', '.join(ANCHOR_FILLS)}", self.anchor_fill)
        if not isinstance(self.markov_rank, int) or not 1 <= self.markov_rank <= 65536:
            bad("markov_rank", "an integer in [1, 65536]", self.markov_rank)
        if self.position_decay is None:
            self.position_decay = math.exp(-1.0 / self.draft_len)
        if isinstance(self.prompts, str):
            self.prompts = (self.prompts,)
        self.prompts = tuple(self.prompts)
        if not self.prompts:
            bad("prompts", "at least one source", self.prompts)
        for spec in self.prompts:
            parse_source_spec(spec)
        try:
            layers = [int(x) for x in self.target_layers.split(",") if x.strip()] if self.target_layers else []
        except ValueError:
            bad("target_layers", "comma-separated integers", self.target_layers)
        if (self.target_layers and not layers) or any(x < 0 for x in layers) or len(set(layers)) != len(layers):
            bad("target_layers", "distinct layer ids >= 0", self.target_layers)
        for name, lo, hi, lo_open, hi_open in (("lr", 0.0, 1.0, True, False), ("weight_decay", 0.0, 1.0, False, True),
                                               ("greedy_fraction", 0.0, 1.0, False, False),
                                               ("gen_temperature", 0.0, 100.0, False, False),
                                               ("gen_top_p", 0.0, 1.0, True, False),
                                               ("position_decay", 0.0, 1.0, True, False),
                                               ("grad_clip", 0.0, 1e6, True, False),
                                               ("held_out_percent", 0.0, 50.0, False, False),
                                               ("tv_weight", 0.0, 100.0, False, False),
                                               ("ce_weight", 0.0, 100.0, False, False),
                                               ("kl_weight", 0.0, 100.0, False, False),
                                               ("confidence_weight", 0.0, 100.0, False, False)):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if lo_open else v >= lo) and \
                (v < hi if hi_open else v <= hi)
            if not ok:
                bad(name, f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}", v)
        if self.tv_weight + self.ce_weight + self.kl_weight <= 0:
            bad("tv_weight", "> 0 when --ce-weight and --kl-weight are 0 (nothing to train)", self.tv_weight)
        if self.init not in INITS:
            bad("init", _INITS_SAID, self.init)
        if self.save_dtype not in SAVE_DTYPES:
            bad("save_dtype", " / ".join(SAVE_DTYPES), self.save_dtype)
        _device(self.device)  # raises the one-line error for an unknown or absent device


SAVE_DTYPES = ("auto", "float32", "bfloat16")


class StopAtStepBoundary:
    """SIGINT / SIGTERM during the steps end the step being run, checkpoint, and then act (KeyboardInterrupt; the
    default SIGTERM): a Ctrl-C mid-step lost every step since the last ``--save-every`` checkpoint. A second signal
    acts at once. Installed from the main thread only (where Python runs signal handlers)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self.restore()
        logger.warning(f"train-drafter: {signal.Signals(signum).name}: stopping after this step with a checkpoint "
                       "(send it again to stop at once)")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def stop(self, step: int, steps: int, state_path: Path) -> None:
        name = signal.Signals(self.signum).name
        logger.warning(f"train-drafter: stopped by {name} at step {step}/{steps}; checkpointed in {state_path} "
                       "(--resume continues)")
        if self.signum == signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler is restored: the default action, as before
        raise KeyboardInterrupt


class TrainingDiverged(RuntimeError):
    """More than ``--max-skipped-steps`` non-finite steps in a row, or a non-finite weight at the end: the run stops
    and writes no drafter (the work folder keeps its last checkpoint)."""


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
    layers = ([int(x) for x in tc.target_layers.split(",") if x.strip()] if tc.target_layers
              else default_target_layer_ids(tcfg.num_layers))
    if any(x >= tcfg.num_layers for x in layers):
        raise ValueError(f"train-drafter: --target-layers {tc.target_layers}: the target has layers 0.."
                         f"{tcfg.num_layers - 1}")
    return DSparkDrafterConfig(
        hidden_size=tcfg.hidden_size, target_hidden_size=tcfg.hidden_size, num_capture_layers=len(layers),
        num_layers=tc.num_layers, num_heads=tc.num_heads, head_dim=tc.head_dim, latent_dim=tc.latent_dim,
        intermediate_size=tc.intermediate_size, vocab_size=tcfg.vocab_size, markov_rank=tc.markov_rank,
        mask_token_id=tcfg.vocab_size - 1, rms_norm_eps=tcfg.rms_norm_eps), layers


def initial_weights(dcfg: DSparkDrafterConfig, target_sd: dict[str, torch.Tensor], seed: int,
                    init: str = "scratch") -> dict[str, torch.Tensor]:
    """The starting weights (fp32), the embedding copied from the target's, the confidence head at zero
    (every confidence 0.5).

    ``"bigram"``: the engine's seeded drafter (quiet backbone, Markov head = the target's embedding -> head
    bigram; rank = hidden size). On a tied real model that bigram puts most mass on repeating the previous
    token (SmolLM2: KL to the target ~100 nats), which training must first unlearn. ``"scratch"`` (default):
    the seeded backbone at full scale and a Markov head that starts at zero (``markov_w1 = 0``; ``markov_w2``
    seeded, so the gradient reaches ``w1``): the first drafts are the backbone's alone. ``"embedding"``: the
    same backbone, ``markov_w1`` the target's embedding through a seeded random projection to the rank (rows at
    unit RMS) and ``markov_w2 = 0``: the Markov bias starts at zero too, but as a linear map of the previous
    token's embedding, so what it learns for one token pair carries to tokens embedded nearby, where a table
    learned from zero knows only the pairs it has seen (the later block positions' only view of the drafts
    before them). ``"target"``: ``"scratch"``'s Markov head, and each drafter layer starts as one of the target's
    top ``num_layers`` layers (in order, the last drafter layer the target's last): both norms and the MLP whole,
    q_proj's first ``num_heads`` heads and o_proj's columns of them where the head dim matches (the keys and values
    come from the context latent, which the target has no counterpart of, so they stay seeded), and the final
    norm the target's: the block starts from the target's own next-token computation instead of from noise
    (``target_sd`` then holds the target's layers, :func:`target_layer_weights`).
    """
    if init not in INITS:
        raise ValueError(f"train-drafter: init must be {_INITS_SAID}, got {init!r}")
    sd = generate_drafter_state_dict(dcfg, seed, torch.float32)
    if init == "bigram":
        if dcfg.markov_rank != dcfg.hidden_size:
            raise ValueError(f"train-drafter: init 'bigram' needs markov-rank = hidden size {dcfg.hidden_size}, "
                             f"got {dcfg.markov_rank}")
        sd.update(bigram_markov_head(target_sd, dcfg.rms_norm_eps))
        sd["norm.weight"] = sd["norm.weight"] * 0.05  # quiet backbone, as the engine's seeded drafter
    elif init == "embedding":
        emb = target_sd["embed_tokens.weight"].float()
        g = torch.Generator().manual_seed(seed + 11)
        w1 = emb @ (torch.randn(emb.shape[1], dcfg.markov_rank, generator=g) / math.sqrt(emb.shape[1]))
        sd["markov_w1"] = w1 * torch.rsqrt(w1.pow(2).mean(-1, keepdim=True) + 1e-12)
        sd["markov_w2"] = torch.zeros_like(sd["markov_w2"])
    else:
        sd["markov_w1"] = torch.zeros_like(sd["markov_w1"])
    if init == "target":
        sd.update(_target_layers_as_drafter(dcfg, target_sd))
    sd["embed_tokens.weight"] = target_sd["embed_tokens.weight"].float().clone()
    sd.update({n: torch.zeros(shape) for n, shape in confidence_head_shapes(dcfg).items()})
    return sd


INITS = ("scratch", "bigram", "embedding", "target")
_INITS_SAID = ", ".join(f"'{i}'" for i in INITS[:-1]) + f" or '{INITS[-1]}'"


def target_layer_weights(target_sd: dict[str, torch.Tensor], num_layers: int, target_head_dim: int,
                         head_dim: int) -> dict[str, torch.Tensor]:
    """The target's top ``num_layers`` decoder layers renamed as the drafter's ``layers.0 ..`` (fp32, CPU), and
    its final norm: what ``init="target"`` starts from. ``target_sd``: the target's state dict (this project's
    names, :meth:`LlamaTarget.state_dict`). q_proj / o_proj are left out where the head dims differ (a head of
    one is no head of the other)."""
    ids = sorted({int(n.split(".")[1]) for n in target_sd if n.startswith("layers.")})
    if len(ids) < num_layers:
        raise ValueError(f"train-drafter: init 'target' needs at least {num_layers} target layers (one per drafter "
                         f"layer), the target has {len(ids)}")
    out = {"norm.weight": target_sd["norm.weight"].detach().float().cpu()}
    for i, src in enumerate(ids[len(ids) - num_layers:]):
        for n, t in target_sd.items():
            name = n.split(".", 2)[2] if n.startswith(f"layers.{src}.") else None
            if name and (target_head_dim == head_dim or name.split(".")[1] not in ("q_proj", "o_proj")):
                out[f"layers.{i}.{name}"] = t.detach().float().cpu()
    return out


def _target_layers_as_drafter(dcfg: DSparkDrafterConfig, layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter weights ``init="target"`` copies from :func:`target_layer_weights`' output (shapes checked)."""
    out = {"norm.weight": layers["norm.weight"]}
    for i in range(dcfg.num_layers):
        pre = f"layers.{i}."
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
                  "mlp.up_proj.weight", "mlp.down_proj.weight"):
            out[pre + n] = layers[pre + n]
        # The target's first num_heads heads (q's row blocks, o's column blocks), where it has as many.
        q, o = layers.get(pre + "self_attn.q_proj.weight"), layers.get(pre + "self_attn.o_proj.weight")
        width = dcfg.num_heads * dcfg.head_dim
        if q is not None and o is not None and q.shape[0] >= width:
            out[pre + "self_attn.q_proj.weight"] = q[:width].clone()
            out[pre + "self_attn.o_proj.weight"] = o[:, :width].clone()
        elif i == 0:
            logger.info("train-drafter: init 'target': q_proj / o_proj stay seeded (the target's heads are of another "
                        "head dim, or fewer than the drafter's); the norms and the MLP are the target's")
    want = full_weight_shapes(dcfg)
    for n, t in out.items():
        if tuple(t.shape) != tuple(want[n]):
            raise ValueError(f"train-drafter: init 'target': the target's {n} is {tuple(t.shape)}, the drafter's "
                             f"{tuple(want[n])} (the drafter's hidden and intermediate sizes must be the target's)")
    return out


def confidence_label(p_draft: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """The confidence head's target: ``1 - ½‖p_draft - p_target‖₁`` (one minus the total-variation distance;
    the probability that a draw from the draft is accepted by rejection sampling against the target)."""
    return 1.0 - 0.5 * (p_draft - p_target).abs().sum(-1)


def position_weights(draft_len: int, decay: float, device=None) -> torch.Tensor:
    """``decay ** k`` for block position ``k = 0 .. K-1`` (default ``decay = exp(-1/K)``: the paper's
    ``exp(-(k-1)/K)`` with ``k`` counted from 1)."""
    return decay ** torch.arange(draft_len, device=device, dtype=torch.float32)


def loss_layout() -> str | None:
    """The vocabulary-wide loss's layout forced by ``TLLM_EXT_LOSS_LAYOUT`` (one of :data:`.fused_loss.LAYOUTS`), or
    None: the trainer times every layout at its first step and keeps the fastest (:func:`pick_loss_path`). The
    layouts compute one objective (equal to the eager one at 2e-5 in fp32: tests/integration/test_drafter_loss_layouts.py):
    ``"rows"`` a teacher row per block row, ``"joint"`` one GEMM each way for the draft logits, ``"dedup"`` that
    and the teacher's logits once per position."""
    return _env.ENV.loss_layout


def distillation_loss(params, dcfg, lm_head_weight, batch: dict[str, torch.Tensor], anchors: torch.Tensor,
                      draft_len: int, tc: TrainConfig, confidence_samples: bool = False, fused: bool = True,
                      attention: str = TRAIN_ATTENTION, kernel: bool | None = None,
                      layout: str | None = None) -> tuple[torch.Tensor, dict]:
    """``tv_weight * TV + ce_weight * CE + kl_weight * KL`` (per block position, position-weighted, averaged
    over the valid positions) ``+ confidence_weight * BCE(c_k, 1 - TV)``; and metrics (per-position top-1
    agreement, the teacher-forced greedy acceptance length, mean confidence and label per position).

    TV = ½‖p_draft - p_target‖₁; CE = -log p_draft(the sequence's next token); KL = KL(target || draft). The
    confidence head reads detached inputs and a detached label: it learns to predict the drafter, never
    steers it.

    ``fused`` (default): the vocabulary-wide terms chunked with their gradients (:mod:`.fused_loss`; ``kernel``:
    its per-row passes in the Triton kernel, default on CUDA; ``layout``: one of :data:`.fused_loss.LAYOUTS`,
    default :func:`loss_layout`); else the eager twin. ``attention``:
    :func:`~.drafter_forward.block_hidden`'s. The metrics are device tensors (no host sync in any layout: ``"dedup"``
    reads each sequence's answer positions as a fixed grid of ``max_candidates + K - 1`` teacher rows)."""
    tokens, feats, final, lens = batch["tokens"], batch["features"], batch["final"], batch["lens"]
    layout = layout or loss_layout() or "rows"
    if layout not in LAYOUTS:
        raise ValueError(f"train-drafter: loss layout {layout!r}: expected one of {LAYOUTS}")
    grid = fused and layout == "dedup"
    if grid:  # anchors in order: a row's teacher rows are its neighbours' (read from L2); the loss is a sum
        anchors = anchors.sort(dim=1).values
    with torch.profiler.record_function("drafter_forward"):
        hidden, prev = block_hidden_prev(params, dcfg, feats, tokens, anchors, draft_len, attention)
    k = torch.arange(draft_len, device=anchors.device)
    pos = anchors[:, :, None] + k  # teacher position of block position k
    valid = pos <= (lens[:, None, None] - 2)  # the teacher's next token exists
    t_len, h = final.shape[1], hidden.shape[-1]
    with torch.profiler.record_function("loss.prepare"):
        teacher_index = groups = None
        if grid:  # one teacher row per answer position: a [S, W] grid from each prompt's end, no host read
            prompt_lens = batch["prompt_lens"]
            width = (batch["max_candidates"] if "max_candidates" in batch
                     else int(candidate_counts(lens, prompt_lens).max())) + draft_len - 1
            cols = (prompt_lens[:, None] + torch.arange(width, device=pos.device)).clamp(max=t_len - 1)
            teacher_h = final.gather(1, cols[..., None].expand(-1, -1, h)).reshape(-1, h)
            j = (pos.clamp(max=t_len - 1) - prompt_lens[:, None, None]).clamp(0, width - 1)
            teacher_index = (torch.arange(pos.shape[0], device=pos.device)[:, None, None] * width + j).flatten()
            groups = (pos.shape[1] * draft_len, width)  # a sequence's rows read its own W teacher rows
        else:
            at = pos.clamp(max=t_len - 1).flatten(1)[..., None].expand(-1, -1, h)
            teacher_h = final.gather(1, at).reshape(-1, h)
        nxt = tokens.gather(1, (pos + 1).clamp(max=tokens.shape[1] - 1).flatten(1)).view_as(pos).long()
        w = position_weights(draft_len, tc.position_decay, anchors.device)[None, None] * valid
        wn = (w / w.sum().clamp_min(1e-6)).flatten()
    # loss = sum over positions of wn * (tv_weight TV + ce_weight CE + kl_weight KL); the vocabulary-wide part in
    # chunks (fused_loss: the eager twin materialised [S*M*K, V] fp32 tensors for autograd)
    loss_fn = (functools.partial(fused_block_loss, kernel=kernel, joint=layout != "rows", teacher_index=teacher_index,
                                 teacher_groups=groups) if fused else eager_block_loss)
    loss, tv, ce, agree = loss_fn(hidden.reshape(-1, h), F.embedding(prev.flatten(), params["markov_w1"]),
                                  params["markov_w2"], lm_head_weight, teacher_h, nxt.flatten(),
                                  tc.tv_weight * wn, tc.ce_weight * wn, tc.kl_weight * wn if tc.kl_weight else None)
    tv, ce, agree = tv.view_as(pos), ce.view_as(pos), agree.view_as(pos)
    label = (1.0 - tv).detach().clamp(0.0, 1.0)
    with torch.profiler.record_function("drafter_forward"):
        conf_logit = confidence_logits(params, hidden.detach().float(), prev)
    v = valid.float()
    bce = (F.binary_cross_entropy_with_logits(conf_logit, label, reduction="none") * v).sum() / v.sum().clamp_min(1)
    total = loss + tc.confidence_weight * bce
    with torch.no_grad():  # device tensors: the trainer reads them at its log / checkpoint points (no sync per step)
        agree = agree & valid
        run = torch.cumprod(agree.long(), dim=-1)  # accepted prefix of each block (teacher forced)
        full = valid[..., 0].float()
        est = ((1 + run.sum(-1)).float() * full).sum() / full.sum()  # NaN when no block is valid
        n_k = valid.sum((0, 1)).clamp_min(1)
        top1 = agree.sum((0, 1)) / n_k
        conf = (torch.sigmoid(conf_logit) * v).sum((0, 1)) / n_k
        lab = (label * v).sum((0, 1)) / n_k
        tv_mean = (tv * v).sum() / v.sum().clamp_min(1)
        ce_mean = (ce * v).sum() / v.sum().clamp_min(1)
        bad_row = ~(torch.isfinite(tv) & torch.isfinite(ce))
        # where a non-finite loss came from (the trainer logs it with a skipped step): NONFINITE_COUNTS' order
        nonfinite = torch.stack([(~torch.isfinite(hidden)).sum(), (bad_row & valid).sum(), (bad_row & ~valid).sum(),
                                 (~torch.isfinite(conf_logit)).sum()]).float()
    metrics = {"loss": total.detach(), "tv": tv_mean, "ce": ce_mean, "bce": bce.detach(), "accept_est": est,
               "top1": top1, "confidence": conf, "label": lab, "nonfinite": nonfinite}
    if confidence_samples:  # the head's logits, labels and validity per block position, [S*M, K] each (detached)
        metrics["confidence_samples"] = (conf_logit.detach().float().flatten(0, 1).cpu(),
                                         label.float().flatten(0, 1).cpu(), valid.flatten(0, 1).cpu())
    return total, metrics


def pick_loss_path(params, dcfg, lm_head, batch, anchors, tc: TrainConfig, reps: int = 3,
                     layouts: tuple[str, ...] | None = None) -> dict:
    """The first batch's loss and gradients every way -- the per-row passes in the Triton kernel and in torch ops,
    in each of ``layouts`` (default: the one ``TLLM_EXT_LOSS_LAYOUT`` forces, else all of :data:`.fused_loss.LAYOUTS`)
    -- timed (the best of ``reps``, compiles in the first); the fastest of those whose loss agrees with the torch
    ops' in the first layout (within 1e-3 relative) is used (the trainer asks on CUDA; a CPU under
    TRITON_INTERPRET=1 runs it too: tests). Returns what ``training.json`` records: ``"kernel"`` and ``"layout"``
    (the choice), ``"ms"`` (per way), ``"kernel_ms"`` / ``"torch_ms"`` (the chosen layout's)."""
    layouts = layouts or ((loss_layout(),) if loss_layout() else LAYOUTS)
    trainable = [p for n, p in params.items() if p.requires_grad]
    cuda = lm_head.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict = {"ms": {}, "loss": {}}
    ways = [(layout, kernel) for layout in layouts for kernel in (False, True)]  # the reference (torch, first) first
    for layout, kernel in ways:
        way = f"{layout}/{'kernel' if kernel else 'torch'}"
        try:
            best = float("inf")
            for _ in range(reps):
                sync()
                t = time.perf_counter()
                with torch.autocast(lm_head.device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss, _ = distillation_loss(params, dcfg, lm_head, batch, anchors, tc.draft_len, tc, kernel=kernel,
                                                layout=layout)
                torch.autograd.grad(loss, trainable, allow_unused=True)
                sync()
                best = min(best, time.perf_counter() - t)
            out["ms"][way] = round(best * 1e3, 1)
            out["loss"][way] = float(loss.detach())
        except Exception as e:  # a way that does not build or run here (the reference must)
            if way == f"{layouts[0]}/torch":
                raise
            out.setdefault("errors", {})[way] = f"{type(e).__name__}: {str(e)[:200]}"
            logger.warning(f"train-drafter: the loss {way} failed ({out['errors'][way]}); not used")
    ref = out["loss"][f"{layouts[0]}/torch"]
    agreeing = {w: ms for w, ms in out["ms"].items() if abs(out["loss"][w] - ref) <= 1e-3 * abs(ref) + 1e-4}
    for w in sorted(set(out["ms"]) - set(agreeing)):
        logger.warning(f"train-drafter: the loss {w} disagrees with {layouts[0]}/torch ({out['loss'][w]} vs {ref}); "
                       "not used")
    way = min(agreeing, key=agreeing.get)
    out["layout"], out["kernel"] = way.split("/")[0], way.endswith("/kernel")
    out["kernel_ms"], out["torch_ms"] = out["ms"].get(f"{out['layout']}/kernel"), out["ms"][f"{out['layout']}/torch"]
    if "errors" in out:
        out["kernel_error"] = next(iter(out["errors"].values()))
    logger.info("train-drafter: vocabulary-wide loss per step, forward + backward on the first batch: "
                + ", ".join(f"{w} {ms} ms" for w, ms in out["ms"].items()) + f"; using {way}")
    return out


SCALAR_METRICS = ("loss", "tv", "ce", "bce", "accept_est")


def metrics_vector(metrics: dict) -> torch.Tensor:
    """A step's metrics as one fp32 device vector ``[loss, tv, ce, bce, accept_est, top1 x K]`` (floats accepted
    too): the trainer stacks the steps' vectors and reads them in one copy at its log and checkpoint points."""
    dev = metrics["top1"].device if isinstance(metrics["top1"], torch.Tensor) else None
    parts = [torch.as_tensor(metrics[n], dtype=torch.float32, device=dev).reshape(-1)
             for n in SCALAR_METRICS + ("top1",)]
    return torch.cat(parts)


def confidence_logits(params, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """``w·[h_k; W1[x_{k-1}]] + b`` for ``hidden [..., H]`` and ``prev [...]`` (the Markov head's ``W1`` row of
    the token before position ``k``)."""
    x = torch.cat((hidden, F.embedding(prev, params["markov_w1"]).detach().float()), dim=-1)
    return x @ params["confidence.weight"].float() + params["confidence.bias"].float()


# A batch's width is its longest sequence rounded up to this many positions (capped at the stored width). On a GPU
# torch's scaled_dot_product_attention runs cuDNN's kernels (the teacher's causal pass; the drafter's masked block
# attention, its keys padded to a multiple of 128: drafter_forward.TRAIN_ATTENTION), and cuDNN finalises an execution
# plan for every new shape -- tens of ms of host time in which the device idles; widths that repeat reuse the cached
# plans. The padding sits past every sequence's end: causal attention never lets it reach a real position, and the
# loss and anchors read only positions < lens.
SEQ_BUCKET = 64
ANCHOR_REGIONS = ("answer", "all")
ANCHOR_FILLS = ("wrap", "mask")
# --anchor-fill mask: a batch's anchor slots are its most candidates rounded up to this (at most --anchors), so the
# step's shapes -- the blocks, the attention's keys -- take few distinct values (each new one costs cuDNN plans and
# kernel builds once, as batch widths do: SEQ_BUCKET)
ANCHOR_BUCKET = 32


def anchor_starts(prompt_lens: torch.Tensor, anchor_region: str) -> torch.Tensor:
    """Each sequence's first anchor candidate: its prompt length (``"answer"``), or 1 (``"all"``)."""
    return torch.ones_like(prompt_lens) if anchor_region == "all" else prompt_lens


def candidate_counts(lens: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
    """Anchor positions of each sequence, ``[prompt_len, len - 2]`` (at least 1): what :func:`sample_anchors`
    draws from (``prompt_lens`` as :func:`anchor_starts` gives them)."""
    return (lens - 2).clamp_min(prompt_lens) - prompt_lens + 1


def trained_blocks(counts: torch.Tensor, idx: torch.Tensor, anchors: int, fill: str) -> int:
    """The blocks a step on sequences ``idx`` trains: every slot under ``"wrap"``, each sequence's candidates up to
    ``anchors`` under ``"mask"`` (its other slots have no loss)."""
    return int(counts[idx].clamp(max=anchors).sum()) if fill == "mask" else idx.shape[0] * anchors


def length_grouped_batch(counts: torch.Tensor, batch_seqs: int, groups: int, generator: torch.Generator
                         ) -> torch.Tensor:
    """``batch_seqs`` sequence indices: ``groups * batch_seqs`` drawn (with replacement) from ``counts`` (host, one
    entry a sequence), ranked by their count (ties by draw order), and one of the ``groups`` consecutive runs of
    ``batch_seqs`` taken at random -- a batch of similar lengths, every sequence as likely as with one plain draw.
    ``groups`` 1: the plain draw."""
    pool = torch.randint(counts.shape[0], (batch_seqs * groups,), generator=generator)
    if groups == 1:
        return pool
    ranked = pool[torch.sort(counts[pool], stable=True).indices]
    g = int(torch.randint(groups, (1,), generator=generator))
    return ranked[g * batch_seqs:(g + 1) * batch_seqs]


def batch_width(longest: int, stored: int, bucket: int | None = None) -> int:
    """The positions a batch whose longest sequence is ``longest`` keeps: a multiple of ``bucket``
    (:data:`SEQ_BUCKET`) at most ``stored`` (the data's width)."""
    bucket = SEQ_BUCKET if bucket is None else bucket
    if bucket < 1:
        raise ValueError(f"train-drafter: the batch width's bucket must be >= 1, got {bucket}")
    return min(-(-longest // bucket) * bucket, stored)


def _batch(data: dict[str, torch.Tensor], idx: torch.Tensor, device, target,
           bucket: int | None = None, anchor_region: str = "answer",
           cache: FeatureCache | None = None) -> dict[str, torch.Tensor]:
    """The sequences ``idx`` on ``device`` with the target's captured features and final hidden states,
    recomputed now (online), over :func:`batch_width` positions (``bucket``: its rounding, default
    :data:`SEQ_BUCKET`). ``anchor_region="all"``: the batch's ``prompt_lens`` are 1, so its anchors (and the loss's
    teacher grid, which starts where they do) cover the prompts too. ``cache``: the rows of the sequences it holds
    read from it instead (:class:`~.feature_cache.FeatureCache`; ``idx`` indexes ``data``'s sequences)."""
    lens, prompt_lens = data["lens"][idx], anchor_starts(data["prompt_lens"][idx], anchor_region)
    t = batch_width(int(lens.max()), data["tokens"].shape[1], bucket)
    tokens = data["tokens"][idx, :t].to(device).long()
    if cache is None:
        feats, final = teacher_pass(target, tokens)
    else:
        feats, final = cache.lookup(idx, tokens, lambda rows: teacher_pass(target, rows))
    return {"tokens": tokens, "lens": lens.to(device), "prompt_lens": prompt_lens.to(device),
            "features": feats, "final": final,
            # sample_anchors' width, known on the host (no device read)
            "max_candidates": int(candidate_counts(lens, prompt_lens).max())}


def sample_anchors(batch: dict[str, torch.Tensor], anchors: int, generator: torch.Generator,
                   fill: str = "wrap") -> torch.Tensor:
    """``[S, anchors]`` positions in ``[prompt_len, len - 2]`` (the generated part; the first anchor of serving
    is the first generated token, at ``prompt_len``), drawn WITHOUT replacement (as the paper's sampler): a
    sequence's anchors are distinct while it has that many positions, so a step trains on ``anchors`` different
    blocks of it, not on repeats. A shorter sequence (``fill``): ``"wrap"`` repeats its positions in the draw's
    order; ``"mask"`` gives ``[S, min(anchors, W)]`` (``W`` the batch's most candidates rounded up to
    :data:`ANCHOR_BUCKET`) and its slots past its own candidates the anchor ``len - 1``, whose every block position
    lies past the teacher's last (no loss, no metric: :func:`distillation_loss`'s ``valid``)."""
    lo = batch["prompt_lens"]
    n = candidate_counts(batch["lens"], lo)  # candidate positions per sequence (>= 1)
    width = batch["max_candidates"] if "max_candidates" in batch else int(n.max())
    u = torch.rand(lo.shape[0], width, generator=generator, device=generator.device).to(lo.device)
    u = u.masked_fill(torch.arange(width, device=lo.device)[None, :] >= n[:, None], 2.0)  # past the end: last
    order = u.argsort(dim=1)  # a random permutation of each sequence's candidates first
    if fill == "mask":
        m = min(anchors, -(-width // ANCHOR_BUCKET) * ANCHOR_BUCKET)
        j = torch.arange(m, device=lo.device)[None, :]
        live = lo[:, None] + order.gather(1, j.clamp(max=width - 1).expand(lo.shape[0], m))
        return torch.where(j < n[:, None], live, batch["lens"][:, None] - 1)
    if fill != "wrap":
        raise ValueError(f"sample_anchors: fill must be one of {ANCHOR_FILLS}, got {fill!r}")
    j = torch.arange(anchors, device=lo.device)[None, :] % n[:, None]  # wrap when fewer candidates than anchors
    return lo[:, None] + order.gather(1, j.clamp(max=width - 1))


@torch.no_grad()
def greedy_walk_acceptance(params, dcfg, lm_head_weight, data: dict[str, torch.Tensor], draft_len: int,
                           device, target, batch_seqs: int = 16) -> float:
    """Mean acceptance length at T = 0 of the drafter on greedy sequences, walked as the engine walks them
    (:func:`walk_accepted_lens`)."""
    lens = [n for row in walk_accepted_lens(params, dcfg, lm_head_weight, data, draft_len, device, target, batch_seqs)
            for n in row]
    return sum(lens) / len(lens) if lens else float("nan")


@torch.no_grad()
def walk_accepted_lens(params, dcfg, lm_head_weight, data: dict[str, torch.Tensor], draft_len: int, device, target,
                       batch_seqs: int = 16) -> list[list[int]]:
    """Per sequence, the tokens gained at each generation step when the engine decodes it greedily with this
    drafter: the anchor starts at the first generated token (``prompt_len``, the token prefill emits); the
    block's K drafts go through the Markov chain (``prev_0`` = the anchor, then each draft biases the next);
    the drafts matching the sequence and the bonus token are accepted, and the next anchor is the bonus token.
    On the target's own greedy continuation this is exactly what ``generate`` measures step by step
    (``tests/integration/test_drafter_train_serve_agreement.py``); a step at the sequence's end counts only the
    tokens the sequence still has."""
    out: list[list[int]] = []
    for start in range(0, data["tokens"].shape[0], batch_seqs):
        idx = torch.arange(start, min(start + batch_seqs, data["tokens"].shape[0]))
        b = _batch(data, idx, device, target)
        ctx = context_latents(params, dcfg, b["features"].to(lm_head_weight.dtype))
        tokens, lens = b["tokens"], b["lens"]
        a = b["prompt_lens"].clone()
        rows = torch.arange(len(idx), device=device)
        steps: list[list[int]] = [[] for _ in idx]
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
            for i in torch.nonzero(live).flatten().tolist():
                steps[i].append(int(step[i]))
            a = torch.where(live, a + step, a)
        out.extend(steps)
    return out


def train_drafter(model_dir: str | Path, out_dir: str | Path, tc: TrainConfig, *, work_dir: str | Path | None = None,
                  resume: bool = False, progress: bool = True, max_seconds: float | None = None,
                  keep_state: bool = True, fit_schedule: bool = False,
                  schedule_seconds: float | None = None, answers_cache: str | Path | None = None,
                  feature_cache_gib: float = 0.0) -> dict:
    """Train and save the drafter; returns the summary written to ``out_dir/training.json``.

    ``max_seconds``: stop stepping once this much wall time has passed since the call began (a device call's
    time limit), checkpoint, and write the drafter as it stands (``"complete": false`` in the summary);
    ``--resume`` continues to ``steps``. Not a knob: a resumed run may use another budget.

    ``keep_state=False`` (the CLI's ``--drop-state``): once a complete run's drafter is written, remove
    ``trainer_state.pt`` (weights and AdamW moments, the bulk of the work folder; only an unfinished run
    resumes from it, and ``steps`` is a knob), keeping the token data.

    ``fit_schedule`` (the CLI's ``--fit-schedule``, with ``max_seconds``): the cosine decay ends at the time
    budget instead of at ``steps``: each step's schedule progress is the larger of ``step / steps`` and the
    fraction of the time left at the first step that has passed, and the run is complete (learning rate at 0)
    when that reaches 1. Without it a budget that ends before ``steps`` leaves the weights of a high learning
    rate mid-schedule. Not a knob (wall time is not reproducible: the weights are not bitwise those of another
    run).

    ``schedule_seconds`` (``--schedule-seconds``, with ``fit_schedule``): the fitted cosine spans this many seconds
    of steps in all, over as many calls as it takes (the seconds already stepped are kept in ``trainer_state.pt``):
    each call still stops at ``max_seconds`` (checkpointed, ``"complete": false``) and ``--resume`` continues the
    same schedule, until the steps' total reaches it (learning rate 0, complete). A training budget longer than one
    device call. Fixed for a run: a resume with another value is refused.

    ``answers_cache`` (``--answers-cache``): a folder of regenerated answers shared by runs: each split's answers
    are read from :func:`answers_cache_path` when that file is there (any run with the same target and data knobs
    wrote it; a run whose steps' knobs differ, with ``resume`` or not) and written there once decoded, instead of
    ``work_dir``'s ``data.pt`` / ``held_out.pt``.

    ``feature_cache_gib`` (``--feature-cache-gib``, 0: off): keep up to this many GiB of the teacher pass's rows on
    the device, so a sequence's pass runs once (:mod:`~.feature_cache`). Not a knob: it changes what a step costs,
    not what it computes (on a GPU a cached sequence's rows are its first batch's roundings)."""
    if not (0.0 <= feature_cache_gib < float("inf")):
        raise ValueError(f"train-drafter: --feature-cache-gib must be a finite number >= 0, got {feature_cache_gib}")
    out_dir = Path(out_dir)
    work_dir = Path(work_dir) if work_dir is not None else out_dir.parent / f"{out_dir.name}_work"
    check_out_dir(out_dir, work_dir)  # before any work: the drafter replaces --out whole at the end
    if answers_cache is not None:
        answers_cache = Path(answers_cache)
        check_out_dir(out_dir, answers_cache, flag="--answers-cache")
        answers_cache.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    with work_dir_lock(work_dir):
        return _train_drafter(model_dir, out_dir, tc, work_dir=work_dir, resume=resume, progress=progress,
                              max_seconds=max_seconds, keep_state=keep_state, fit_schedule=fit_schedule,
                              schedule_seconds=schedule_seconds, answers_cache=answers_cache,
                              feature_cache_gib=feature_cache_gib)


WORK_DIR_LOCK = ".train-drafter.lock"


@contextlib.contextmanager
def work_dir_lock(work_dir: Path):
    """Hold ``work_dir`` for one run: a second ``train-drafter`` on it (another shell, a retried job) would write
    the same ``data.pt`` / ``trainer_state.pt`` under the first one's feet. An advisory ``flock`` on a file inside
    it, dropped by the OS if the process dies (a stale file locks nothing); the file is removed when the run ends."""
    import fcntl

    path = work_dir / WORK_DIR_LOCK
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"train-drafter: {work_dir} is in use by another train-drafter run ({holder}); wait for "
                         "it to end or choose another --work-dir") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        yield
    finally:
        path.unlink(missing_ok=True)
        f.close()


def _train_drafter(model_dir: str | Path, out_dir: Path, tc: TrainConfig, *, work_dir: Path, resume: bool,
                   progress: bool, max_seconds: float | None, keep_state: bool, fit_schedule: bool,
                   schedule_seconds: float | None, answers_cache: Path | None = None,
                   feature_cache_gib: float = 0.0) -> dict:
    """:func:`train_drafter` inside its work directory's lock."""
    t_call = time.time()
    device = _device(tc.device)
    model_dir = Path(model_dir)
    state_path, data_path, eval_path = work_dir / "trainer_state.pt", work_dir / "data.pt", work_dir / "held_out.pt"
    if answers_cache is not None:
        data_path, eval_path = (answers_cache_path(answers_cache, model_dir, tc, split)
                                for split in ("train", "held_out"))
    dcfg, layers = drafter_config(model_dir, tc)
    storage = torch.bfloat16 if device.type == "cuda" else torch.float32
    knobs = dataclasses.asdict(tc)
    knobs["prompts"] = list(tc.prompts)
    torch.manual_seed(tc.seed)

    state = None
    if resume and not state_path.is_file():
        logger.info(f"train-drafter: --resume: no {state_path.name} in {work_dir}; the steps start at 0"
                    + (f" (the answers in {data_path.name} are reused when their knobs match)" if data_path.is_file()
                       else ""))
    if resume and state_path.is_file():
        state = _load_resume_file(state_path, STATE_KEYS)
        changed = sorted(k for k in knobs if k not in RESUME_FREE_KNOBS and (
            not isinstance(state["knobs"], dict) or state["knobs"].get(k) != knobs[k]))
        if changed:  # before the shapes: a changed --num-layers / --draft-len is named as a flag
            raise ValueError(f"train-drafter --resume: {state_path} was written with other knobs ({changed}); "
                             "use the same flags or another --work-dir")
        _check_params(state_path, state["params"], dcfg)
        if state.get("schedule_seconds") != schedule_seconds:
            raise ValueError(f"train-drafter --resume: {state_path} was written with --schedule-seconds "
                             f"{state.get('schedule_seconds')}, this call asks {schedule_seconds}: the schedule "
                             "of a run is fixed; use the same value or another --work-dir")
    # Both splits' prompts before any answer is decoded: an empty held-out split or a prompt past the target's
    # context was refused only after the training answers (minutes to hours on a real set). A cached split's file
    # is named by its knobs: read whether the run resumes or not.
    prompts = {split: (None if (resume or answers_cache is not None) and path.is_file() else
                       _prompts(model_dir, tc, split, n, dcfg.vocab_size))
               for split, n, path in (("train", tc.num_prompts, data_path), ("held_out", tc.eval_prompts, eval_path))
               if n}
    data = _data(model_dir, tc, "train", prompts["train"], data_path, device, progress)
    eval_data = (_data(model_dir, tc, "held_out", prompts["held_out"], eval_path, device, progress)
                 if tc.eval_prompts else None)
    if eval_data is not None and not eval_data["tokens"].shape[0]:
        logger.warning("train-drafter: every held-out answer is shorter than 2 tokens; no held-out estimate")
        eval_data = None
    target = load_target(model_dir, layers, device, storage)  # after generation: one model on the device at a time
    lm_head = target.lm_head.weight.detach()

    target_sd = {"embed_tokens.weight": target.embed_tokens.weight.detach().float().cpu(),
                 "norm.weight": target.norm.weight.detach().float().cpu(),
                 "lm_head.weight": lm_head.float().cpu()}
    if tc.init == "target":
        target_sd.update(target_layer_weights(target.state_dict(), dcfg.num_layers, target.config.head_dim,
                                              dcfg.head_dim))
    init = initial_weights(dcfg, target_sd, tc.seed + 1, tc.init)
    # The embedding is the target's and stays frozen (shared, as serving shares it): not in the optimizer nor in
    # trainer_state.pt (a third of the state on SmolLM2).
    params = {n: (state["params"][n] if state and n not in FROZEN else init[n]).to(device).float()
              .requires_grad_(n not in FROZEN) for n in init}
    opt = torch.optim.AdamW([p for n, p in params.items() if n not in FROZEN], lr=tc.lr,
                            weight_decay=tc.weight_decay, betas=(0.9, 0.95),
                            fused=True)  # one kernel for every tensor; it skips a step on found_inf (below)
    step0 = 0
    history: list[dict] = []
    skipped: list[dict] = []  # the steps skipped for a non-finite loss or gradient, every call's
    if state:
        opt.load_state_dict(state["optimizer"])
        step0, history, skipped = state["step"], state["history"], list(state.get("skipped", []))
        logger.info(f"train-drafter: resumed from {state_path} at step {step0}")
    gen = torch.Generator(device=device).manual_seed(tc.seed + 7)
    if state:
        gen.set_state(state["generator"])  # the anchor and batch draws continue where the run stopped
    backbone = {n: p for n, p in params.items() if not n.startswith("confidence.")}

    init_eval = None
    if eval_data is not None and step0 == 0:
        init_eval = greedy_walk_acceptance({n: p.detach() for n, p in backbone.items()}, dcfg, lm_head.float(),
                                           eval_data, tc.draft_len, device, target)
        logger.info(f"train-drafter: held-out greedy acceptance length at init ({tc.init}): {init_eval:.3f}")
    elif state:
        init_eval = state.get("init_eval")
    bar = _progress(range(step0, tc.steps), progress, "train-drafter")
    n_seq = data["tokens"].shape[0]
    # each sequence's anchor candidates (host): the length groups' rank and the masked fill's block count
    counts = candidate_counts(data["lens"], anchor_starts(data["prompt_lens"], tc.anchor_region))
    feature_cache = (FeatureCache(data["lens"], int(feature_cache_gib * GIB), device) if feature_cache_gib > 0
                     else None)
    t0 = last_log = time.time()
    trained_positions = 0
    stopped_at = None
    fit = fit_schedule and max_seconds is not None
    fit_start = fit_span = None  # wall time of the first step and the budget left then (fit_schedule)
    # seconds of steps of the earlier calls of this run (schedule_seconds: the fitted cosine spans the calls)
    seconds_before = float(state.get("step_seconds", 0.0)) if state else 0.0

    def step_seconds() -> float:
        """Seconds of steps of this run so far, every call's (what ``schedule_seconds`` counts)."""
        return seconds_before + (time.time() - fit_start if fit_start is not None else 0.0)

    last_saved = step0  # the step of the newest trainer_state.pt (0: none yet)

    def save(step_done: int) -> None:
        nonlocal last_saved
        _save_state(state_path, params, opt, step_done, history, knobs, gen, init_eval, step_seconds(),
                    schedule_seconds, skipped)
        last_saved = step_done
    fitted_end = None  # the step at which the fitted schedule ended the run
    recent_top1: list[list[float]] = []  # the last steps' teacher-forced top-1 per block position (training batches)
    pending: list[tuple[int, torch.Tensor]] = []  # (step, metrics_vector + nonfinite + [grad norm, skipped])
    streak: list[int] = []  # the steps of the current run of skipped steps
    steps_run = 0  # this call's steps, skipped ones included
    loss_path = None  # pick_loss_path's choice, at the first step
    step_start = step0

    def flush() -> None:
        """Read the pending steps' metrics (one copy) into ``history``. A step with a non-finite loss or gradient
        norm was skipped on the device (no update): it is logged with its terms; more than
        ``tc.max_skipped_steps`` in a row stop the run naming the first, before a checkpoint past it is written."""
        nonlocal recent_top1, streak
        if not pending:
            return
        rows = torch.stack([v for _, v in pending]).cpu().tolist()
        steps = [st for st, _ in pending]
        pending.clear()
        n_scalar = len(SCALAR_METRICS)
        for st, row in zip(steps, rows):
            terms = dict(zip(SCALAR_METRICS, row[:n_scalar]))
            if row[-1]:  # skipped on the device
                streak.append(st + 1)
                # non-finite values as strings: training.json stays strict JSON
                counts = dict(zip(NONFINITE_COUNTS, (int(x) for x in row[-2 - len(NONFINITE_COUNTS):-2])))
                entry = {"step": st + 1, "grad_norm": row[-2], **{k: terms[k] for k in NONFINITE_TERMS}}
                skipped.append({**{k: v if math.isfinite(v) else str(v) for k, v in entry.items()},
                                "nonfinite": counts})
                said = ", ".join(f"{k} {terms[k]:.4g}" for k in NONFINITE_TERMS) + "; non-finite " + ", ".join(
                    f"{k} {n}" for k, n in counts.items())
                if len(streak) > tc.max_skipped_steps:
                    what = (f"the loss or gradient is non-finite at step {st + 1}" if len(streak) == 1 else
                            f"the loss or gradient was non-finite in {len(streak)} steps in a row "
                            f"({streak[0]}-{streak[-1]})")
                    raise TrainingDiverged(f"train-drafter: {what} ({said}, grad norm {row[-2]:.4g}); stopped, no "
                                           f"drafter written (lower --lr; the last checkpoint, step {last_saved}, is "
                                           f"in {work_dir})")
                logger.warning(f"train-drafter: step {st + 1} skipped, no update: non-finite loss or gradient "
                               f"({said}, grad norm {row[-2]:.4g}); {len(streak)} in a row, the run stops past "
                               f"--max-skipped-steps {tc.max_skipped_steps}")
                continue
            streak = []
            history.append({"step": st + 1, **terms})
            recent_top1.append(row[n_scalar:-2 - len(NONFINITE_COUNTS)])
        recent_top1 = recent_top1[-TRAIN_TOP1_STEPS:]

    stopper = StopAtStepBoundary()
    try:
        for step in bar:
            if stopper.signum is not None:  # Ctrl-C / SIGTERM during the previous step: it is complete
                flush()
                save(step)
                stopper.stop(step, tc.steps, state_path)
            time_frac = 0.0
            if fit:
                now = time.time()
                if fit_start is None:
                    fit_start = now
                    fit_span = schedule_seconds or max(1.0, max_seconds - (now - t_call))
                time_frac = (seconds_before + now - fit_start) / fit_span
                if time_frac >= 1.0:
                    fitted_end = step
                    flush()
                    save(step)
                    logger.info(f"train-drafter: --fit-schedule: the schedule ended with the time budget at step "
                                f"{step}/{tc.steps} (learning rate 0, {step_seconds():.0f} s of steps); the run is "
                                "complete")
                    break
            if (not fit or schedule_seconds) and max_seconds is not None and time.time() - t_call > max_seconds:
                stopped_at = step
                flush()
                save(step)
                logger.info(f"train-drafter: --max-seconds {max_seconds:g} reached at step {step}/{tc.steps}; "
                            "checkpointed (--resume continues), writing the drafter as it stands")
                break
            for g in opt.param_groups:
                g["lr"] = tc.lr * fitted_lr(step, tc, time_frac)  # time_frac 0 without --fit-schedule
            # the step's sequences from a host generator seeded by the step (resumable without state, and no device
            # round trip: the host slices the batch while the device still runs the previous step)
            # (--length-groups 1: the draw as before, the same indices)
            idx = length_grouped_batch(counts, tc.batch_seqs, tc.length_groups, torch.Generator().manual_seed(
                tc.seed * 1_000_003 + step))
            batch = _batch(data, idx, device, target, anchor_region=tc.anchor_region, cache=feature_cache)
            anchors = sample_anchors(batch, tc.anchors, gen, tc.anchor_fill)
            if loss_path is None:
                # TLLM_EXT_LOSS_KERNEL=off: the torch ops without trying the kernel (=on: the kernel without timing)
                choice = _env.ENV.loss_kernel
                if device.type != "cuda" or choice in ("off", "on"):
                    loss_path = {"kernel": device.type == "cuda" and choice == "on", "layout": loss_layout() or "rows",
                                 "set_by": (f"TLLM_EXT_LOSS_KERNEL={choice}" if device.type == "cuda"
                                            else "cpu: torch ops")}
                else:
                    loss_path = pick_loss_path(params, dcfg, lm_head, batch, anchors, tc)  # kernel and layout
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss, metrics = distillation_loss(params, dcfg, lm_head, batch, anchors, tc.draft_len, tc,
                                                  kernel=loss_path["kernel"], layout=loss_path["layout"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_([p for n, p in params.items() if n not in FROZEN],
                                                       tc.grad_clip)
            # a non-finite loss or gradient skips the update on the device (fused AdamW's found_inf: weights,
            # moments and step count stay), no host sync; flush() reads it with the step's metrics
            bad = ~(torch.isfinite(grad_norm) & torch.isfinite(loss.detach()))
            opt.found_inf = bad.float()
            opt.step()
            steps_run += 1
            trained_positions += trained_blocks(counts, idx, tc.anchors, tc.anchor_fill) * tc.draft_len
            pending.append((step, torch.cat([metrics_vector(metrics), metrics["nonfinite"],
                                             torch.stack([grad_norm.detach().float(), bad.float()])])))
            # The metrics stay on the device until a log line or a checkpoint needs them: one copy for many steps
            # (a .item() per step made the host wait for every step before launching the next).
            log_due = (step + 1) % max(1, tc.steps // 20) == 0 or time.time() - last_log > 30 or step + 1 == tc.steps
            save_due = (step + 1) % tc.save_every == 0 or step + 1 == tc.steps
            if log_due or save_due or len(pending) >= METRICS_EVERY or hasattr(bar, "set_postfix"):
                flush()
                metrics = history[-1] if history else {k: float("nan") for k in SCALAR_METRICS}
                rate = trained_positions / max(time.time() - t0, 1e-9)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", tv=f"{metrics['tv']:.3f}",
                                    accept=f"{metrics['accept_est']:.2f}", tok_s=f"{rate:.0f}")
                elif log_due:
                    last_log = time.time()  # no bar: a log line every 5 % of the run (and at least every 30 s)
                    logger.info(f"train-drafter: step {step + 1}/{tc.steps} loss {metrics['loss']:.4f} (TV "
                                f"{metrics['tv']:.4f}, CE {metrics['ce']:.3f}, conf BCE {metrics['bce']:.3f}) "
                                f"teacher-forced acceptance {metrics['accept_est']:.2f} top-1 by position "
                                f"{[round(x, 2) for x in (recent_top1 or [[]])[-1]]} {rate:.0f} block positions/s "
                                f"({(step + 1 - step_start) / max(time.time() - t0, 1e-9):.2f} steps/s, "
                                f"{time.time() - t0:.0f} s)")
            if save_due:
                save(step + 1)
        if stopper.signum is not None:  # during the last step (checkpointed): stop before the drafter
            flush()
            stopper.stop(tc.steps, tc.steps, state_path)
    finally:
        stopper.restore()
    flush()
    steps_wall = time.time() - t0
    final = {n: p.detach() for n, p in params.items()}
    final_eval = calibration = final_by_position = None
    if eval_data is not None:
        walked = [n for row in walk_accepted_lens({n: final[n] for n in backbone}, dcfg, lm_head.float(), eval_data,
                                                  tc.draft_len, device, target) for n in row]
        final_eval = sum(walked) / len(walked) if walked else float("nan")
        # bench acceptance's "acceptance by position" of the same walk: the serving number's training-side twin
        final_by_position = [round(sum(1 for n in walked if n - 1 >= j) / max(len(walked), 1), 4)
                             for j in range(1, tc.draft_len + 1)]
        calibration = held_out_calibration(final, dcfg, lm_head, eval_data, tc, device, target,
                                           kernel=bool(loss_path and loss_path["kernel"]),
                                           layout=loss_path["layout"] if loss_path else None)
    save_dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
                  "bfloat16": torch.bfloat16}[tc.save_dtype]
    weights = {n: t.to(save_dtype).cpu() for n, t in final.items()}
    if not all(bool(torch.isfinite(t).all()) for t in weights.values()):
        raise TrainingDiverged(f"train-drafter: a drafter weight is non-finite after step {tc.steps}; not written")
    summary = {"target": str(model_dir), "drafter": str(out_dir), "knobs": knobs, "target_layer_ids": layers,
               "sequences": n_seq, "tokens": int(data["lens"].sum()), "steps": tc.steps,
               "steps_done": (stopped_at if stopped_at is not None else fitted_end if fitted_end is not None
                              else tc.steps), "complete": stopped_at is None,
               "schedule": (f"cosine fitted to --schedule-seconds {schedule_seconds:g} (over the calls)"
                            if fit and schedule_seconds else "cosine fitted to --max-seconds" if fit
                            else "cosine over --steps"),
               "step_seconds_total": round(step_seconds(), 1),
               "train_seconds_this_run": round(time.time() - t0, 1),
               # this call's step rate (the held-out estimates after the steps excluded); the loss path chosen
               "steps_this_run": steps_run, "steps_seconds_this_run": round(steps_wall, 1),
               "steps_per_s": round(steps_run / max(steps_wall, 1e-9), 3),
               "skipped_steps": skipped,  # a non-finite loss or gradient: no update (--max-skipped-steps)
               "block_positions_per_s": round(trained_positions / max(steps_wall, 1e-9)), "loss_path": loss_path,
               # --feature-cache-gib: the sequences the teacher pass ran for and the ones read from the cache
               "feature_cache": ({"gib": feature_cache_gib, "disabled": feature_cache.disabled,
                                  "sequences_computed": feature_cache.rows_computed,
                                  "sequences_read": feature_cache.rows_read} if feature_cache is not None else None),
               "first_losses": [h["loss"] for h in history[:5]], "last_losses": [h["loss"] for h in history[-5:]],
               "first_tv": [h["tv"] for h in history[:5]], "last_tv": [h["tv"] for h in history[-5:]],
               "held_out_greedy_acceptance": {"init": init_eval, "trained": final_eval, "by_position": final_by_position,
                                              "draft_len": tc.draft_len, "prompts": tc.eval_prompts},
               "held_out_confidence": calibration,
               # beside held_out_confidence.teacher_forced_top1: the same measure on the batches the drafter trains
               # on (the last TRAIN_TOP1_STEPS steps of this call); their gap per position is the generalisation gap
               "train_top1_by_position": ([round(sum(col) / len(col), 4) for col in zip(*recent_top1)]
                                          if recent_top1 else None)}
    write_drafter_atomically(out_dir, dcfg, layers, weights, summary)
    if stopped_at is None and not keep_state and state_path.is_file():
        size = state_path.stat().st_size
        state_path.unlink()
        logger.info(f"train-drafter: removed {state_path} ({size / 2**20:.0f} MiB; the run is complete, "
                    f"--drop-state); {work_dir} keeps the token data")
    if final_eval is not None:
        logger.info(f"train-drafter: held-out greedy acceptance length K={tc.draft_len}: {init_eval} (init "
                    f"{tc.init}) -> {final_eval:.3f} (trained); by position {final_by_position}; teacher-forced "
                    f"top-1 on held-out {calibration['teacher_forced_top1']} (on the last training batches "
                    f"{summary['train_top1_by_position']})")
    return summary


def fitted_lr(step: int, tc: TrainConfig, time_frac: float) -> float:
    """The learning-rate factor: warm-up over ``warmup`` steps, then a cosine whose progress is the larger of
    ``step / steps`` and ``time_frac`` (``--fit-schedule``: the fraction of the time budget spent; 0 without it,
    the plain cosine over ``--steps``)."""
    progress = min(1.0, max(step / tc.steps, time_frac))
    return min(1.0, (step + 1) / max(1, tc.warmup)) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def held_out_calibration(params, dcfg, lm_head, eval_data, tc: TrainConfig, device, target,
                         kernel: bool = False, layout: str | None = None) -> dict:
    """The confidence head on the held-out sequences (32 random anchors per sequence): mean confidence and mean
    label ``1 - TV`` per block position (a calibrated head has them equal), the teacher-forced top-1 agreement per
    position (the training log's top-1 is on training batches; this one is on sequences training never saw), and
    a per-position calibration (:func:`fit_confidence_calibration`, ``"calibration"``: ``[2, K]``) fitted on the
    first half of the held-out batches and reported on the other half (raw and calibrated mean confidence against
    the mean label there)."""
    conf, lab, top1 = torch.zeros(tc.draft_len), torch.zeros(tc.draft_len), torch.zeros(tc.draft_len)
    samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    n = 0
    for start in range(0, eval_data["tokens"].shape[0], 2):
        idx = torch.arange(start, min(start + 2, eval_data["tokens"].shape[0]))
        b = _batch(eval_data, idx, device, target)
        g = torch.Generator(device=device).manual_seed(start)
        anchors = sample_anchors(b, 32, g)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, m = distillation_loss(params, dcfg, lm_head, b, anchors, tc.draft_len, tc, confidence_samples=True,
                                     kernel=kernel, layout=layout)
        conf += m["confidence"].float().cpu()
        lab += m["label"].float().cpu()
        top1 += m["top1"].float().cpu()
        samples.append(m["confidence_samples"])
        n += 1
    out = {"mean_confidence": [round(x, 4) for x in (conf / max(n, 1)).tolist()],
           "mean_label": [round(x, 4) for x in (lab / max(n, 1)).tolist()],
           "teacher_forced_top1": [round(x, 4) for x in (top1 / max(n, 1)).tolist()]}
    if len(samples) < 2:
        return out
    half = len(samples) // 2

    def cat(part):
        return [torch.cat([s[i] for s in part]) for i in range(3)]

    cal = fit_confidence_calibration(*cat(samples[:half]))
    cal = torch.tensor([[round(x, 5) for x in row] for row in cal.tolist()])  # what training.json and the head file hold
    z, y, v = cat(samples[half:])
    vf = v.float()
    n_k = vf.sum(0).clamp_min(1)

    def mean(x):
        return [round(t, 4) for t in ((x * vf).sum(0) / n_k).tolist()]

    out.update({"calibration": cal.tolist(), "report_mean_label": mean(y),
                "report_mean_confidence_raw": mean(torch.sigmoid(z)),
                "report_mean_confidence_calibrated": mean(torch.sigmoid(apply_confidence_calibration(z, cal)))})
    return out


def fit_confidence_calibration(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                               min_samples: int = 16) -> torch.Tensor:
    """Per block position ``k``, Platt scaling of the confidence head: ``(a_k, b_k)`` minimising the BCE of
    ``sigmoid(a_k z + b_k)`` against the soft label ``1 - TV`` over the valid samples (``logits``, ``labels``,
    ``valid``: ``[N, K]``); ``a_k > 0`` (the order of confidences is kept). A position with fewer than
    ``min_samples`` samples keeps the identity ``(1, 0)``. Returns ``[2, K]`` fp32 (CPU)."""
    z, y, v = logits.float().cpu(), labels.float().cpu(), valid.bool().cpu()
    k = z.shape[1]
    cal = torch.tensor([[1.0] * k, [0.0] * k])
    for j in range(k):
        zj, yj = z[v[:, j], j], y[v[:, j], j]
        if zj.numel() < min_samples:
            continue
        log_a = torch.zeros((), requires_grad=True)
        shift = torch.zeros((), requires_grad=True)
        opt = torch.optim.LBFGS([log_a, shift], lr=0.5, max_iter=100, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(log_a.exp() * zj + shift, yj)
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        a, b = float(log_a.detach().exp()), float(shift.detach())
        if math.isfinite(a) and math.isfinite(b) and a > 0:
            cal[0, j], cal[1, j] = a, b
    return cal


def _prompts(model_dir, tc: TrainConfig, split: str, n: int, vocab_size: int) -> list[list[int]]:
    """The token ids of ``split``'s prompts (mixed, rendered); each leaves ``max_new_tokens`` of the target's
    context (``max_position_embeddings``): a longer one loses its oldest turns or is skipped, as for
    ``max_prompt_tokens`` (logged). None fitting is a one-line error."""
    convs = mixed_samples(list(tc.prompts), split, n, seed=tc.seed, max_turns=tc.max_turns,
                          held_out_percent=tc.held_out_percent)
    if not convs:
        hint = (f" at --held-out-percent {tc.held_out_percent:g} (--eval-prompts 0: no held-out estimate)"
                if split == "held_out" else "")
        raise ValueError(f"train-drafter: --prompts {' '.join(tc.prompts)} gave no {split} prompts{hint}")
    budget, why = tc.max_prompt_tokens, f"--max-prompt-tokens {tc.max_prompt_tokens}"
    context = read_checkpoint_facts(model_dir).max_position_embeddings
    if context is not None and context - tc.max_new_tokens < budget:
        budget = context - tc.max_new_tokens
        why = f"the target's context {context} less --max-new-tokens {tc.max_new_tokens}"
        if budget < 1:
            raise ValueError(f"train-drafter: --max-new-tokens {tc.max_new_tokens} leaves no room for a prompt in the "
                             f"target's context (max_position_embeddings {context})")
        logger.info(f"prompts: {split} prompts kept to {budget} tokens ({why}; --max-prompt-tokens "
                    f"{tc.max_prompt_tokens})")
    prompts = render_prompts(model_dir, convs, vocab_size, seed=tc.seed + (split == "held_out"),
                             max_prompt_tokens=budget)
    if not prompts:
        raise ValueError(f"train-drafter: every {split} prompt is longer than {why}")
    return prompts


def _data(model_dir, tc: TrainConfig, split: str, prompts: list[list[int]] | None, path: Path, device,
          progress) -> dict[str, torch.Tensor]:
    """The token sequences of ``split``: loaded from ``path`` when ``prompts`` is None (``--resume`` with the file
    there), else the target's answers to ``prompts``, written whole."""
    knobs = _data_knobs(tc, split)
    if prompts is None:
        data = _load_resume_file(path, DATA_KEYS)
        _check_data(path, data)
        # trainer_state.pt's knob check misses a run stopped before its first checkpoint: the answers carry theirs
        saved = data.pop("knobs", None)
        if saved is None:
            logger.info(f"train-drafter: {path} does not record its knobs (an older file); used as it is")
        elif saved != knobs:
            changed = sorted(k for k in knobs if not isinstance(saved, dict) or saved.get(k) != knobs[k])
            raise ValueError(f"train-drafter --resume: {path} holds answers made with other knobs ({changed}); "
                             "use the same flags, delete it or use another --work-dir")
        logger.info(f"train-drafter: {split} sequences from {path} ({data['tokens'].shape[0]})")
        return data
    n_greedy = len(prompts) if split == "held_out" else round(len(prompts) * tc.greedy_fraction)
    temps = [0.0] * n_greedy + [tc.gen_temperature] * (len(prompts) - n_greedy)
    random.Random(tc.seed).shuffle(temps)
    bar = _progress(None, progress, f"generate {split}", total=len(prompts))
    try:
        data = regenerate(model_dir, prompts, max_new_tokens=tc.max_new_tokens, temperatures=temps, top_p=tc.gen_top_p,
                          seed=tc.seed * 1_000_003 + (10**6 if split == "held_out" else 0), batch_size=tc.gen_batch,
                          device=device, cuda_graph=device.type == "cuda", progress=getattr(bar, "update", None))
    finally:
        if hasattr(bar, "close"):
            bar.close()
    keep = data["lens"] >= data["prompt_lens"] + 2  # an answer of one token has no block to train on
    if split == "train" and not bool(keep.any()):
        raise ValueError(f"train-drafter: every one of the {len(prompts)} train answers is shorter than 2 tokens "
                         "(each stopped at an EOS at once); nothing to train on")
    data = {k: v[keep] for k, v in data.items()}
    if bool(keep.any()):  # (an empty held-out split is not kept: --resume would refuse the file)
        atomic_torch_save({**data, "knobs": knobs}, path)
    return data


DATA_KNOBS = ("prompts", "max_turns", "max_prompt_tokens", "held_out_percent", "max_new_tokens", "greedy_fraction",
              "gen_temperature", "gen_top_p", "seed")  # the knobs that decide a split's answers (and its size)


def _data_knobs(tc: TrainConfig, split: str) -> dict:
    knobs = {n: getattr(tc, n) for n in DATA_KNOBS}
    knobs["prompts"] = list(tc.prompts)
    count = "num_prompts" if split == "train" else "eval_prompts"
    knobs[count] = getattr(tc, count)
    return knobs


def answers_cache_path(cache_dir: Path, model_dir: str | Path, tc: TrainConfig, split: str) -> Path:
    """``cache_dir/answers-{split}-{digest}.pt``: the digest covers the split's data knobs and the target as it is
    on disk (resolved path, each file's name, size and modification time), so a re-imported or other target, or any
    knob that changes the answers, names another file -- a file of that name is the answers of this target."""
    model_dir = Path(model_dir).resolve()
    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in model_dir.iterdir() if f.is_file())
    key = json.dumps({"target": str(model_dir), "files": files, "knobs": _data_knobs(tc, split)}, sort_keys=True)
    return Path(cache_dir) / f"answers-{split}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.pt"


def _save_state(path: Path, params, opt, step, history, knobs, gen, init_eval, step_seconds: float,
                schedule_seconds: float | None, skipped: list[dict]) -> None:
    atomic_torch_save({"params": {n: p.detach().cpu() for n, p in params.items() if n not in FROZEN},
                       "optimizer": opt.state_dict(),
                       "step": step, "history": history, "knobs": knobs, "generator": gen.get_state(),
                       "init_eval": init_eval, "step_seconds": step_seconds, "schedule_seconds": schedule_seconds,
                       "skipped": skipped},
                      path)


TRAIN_TOP1_STEPS = 50  # training.json's train_top1_by_position averages this many last steps
METRICS_EVERY = 25  # steps whose metrics may wait on the device before one copy reads them
FROZEN = ("embed_tokens.weight",)  # copied from the target, never trained
STATE_KEYS = ("params", "optimizer", "step", "history", "knobs", "generator", "init_eval")
RESUME_FREE_KNOBS = ("max_skipped_steps",)  # a resumed run may tolerate more or fewer skipped steps
NONFINITE_TERMS = ("loss", "tv", "ce", "bce")  # a skipped step's log line and training.json entry
# distillation_loss's "nonfinite" counts (a skipped step's diagnosis): the drafter's block hidden values, the
# vocabulary-wide loss rows of valid and of padding block positions (weight 0, yet 0 x NaN is NaN), the
# confidence logits
NONFINITE_COUNTS = ("hidden values", "valid rows", "padding rows", "confidence logits")
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


def check_out_dir(out_dir: Path, work_dir: Path | None = None, flag: str = "--work-dir") -> None:
    """``--out`` may be replaced whole: absent, an empty directory or a drafter written before (its
    ``config.json`` names the drafter architecture). Anything else -- a file, the target's own directory, a
    folder of the user's -- is refused by name (the rename-into-place deleted it). The work dir must lie outside
    it (it would go with the replaced directory)."""
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir():
            raise ValueError(f"train-drafter: --out {out_dir} is a file, not a drafter directory; remove it or "
                             "choose another --out")
        if any(out_dir.iterdir()):
            try:
                arch = json.loads((out_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or []
            except (OSError, ValueError, AttributeError):
                arch = []
            if not isinstance(arch, list) or DRAFTER_ARCHITECTURE not in arch:
                raise ValueError(f"train-drafter: --out {out_dir} is a directory that holds something else than a "
                                 "drafter (it would be replaced whole); remove it or choose another --out")
    if work_dir is not None:
        if work_dir.exists() and not work_dir.is_dir():
            raise ValueError(f"train-drafter: {flag} {work_dir} is a file, not a directory; remove it or choose "
                             f"another {flag}")
        out, work = out_dir.resolve(), work_dir.resolve()
        if work == out or out in work.parents:
            raise ValueError(f"train-drafter: {flag} {work_dir} lies inside --out {out_dir} (which is replaced "
                             "whole at the end); choose a folder beside it")


def write_drafter_atomically(out_dir: Path, dcfg, layers, weights, summary: dict) -> None:
    """The drafter directory (``config.json``, ``model.safetensors``, ``training.json``) written whole into a
    temporary sibling and renamed into place: a kill leaves the previous drafter or none, never a config alone.
    Only a directory :func:`check_out_dir` accepts is replaced."""
    check_out_dir(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        backbone = {n: t for n, t in weights.items() if n not in confidence_head_shapes(dcfg)}
        save_drafter_checkpoint(tmp, dcfg, layers, backbone)
        head = {n: weights[n].float().contiguous() for n in confidence_head_shapes(dcfg) if n in weights}
        cal = (summary.get("held_out_confidence") or {}).get("calibration")
        if head and cal is not None:  # applied by the serving drafter at load
            head[CONFIDENCE_CALIBRATION] = torch.tensor(cal, dtype=torch.float32)
        if head:
            save_safetensors(head, tmp / CONFIDENCE_HEAD_FILE, {"format": "pt"})
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
    hint = "delete it (or use another --work-dir) to start that part over"
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
    shapes = {n: s for n, s in {**full_weight_shapes(dcfg), **confidence_head_shapes(dcfg)}.items() if n not in FROZEN}
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
