"""Reference DSpark block drafter (MLA-style single latent) with drafter TP fusion.

Data flow of one step (shape letters: N context positions, B requests, K block length, H hidden,
F = n_cap * H_t captured target features, L drafter layers, d_c latent width, V vocabulary):

1. Context: :meth:`DSparkDrafter.compute_context_latents` ``features [N, F] -> latents [N, L, d_c]``:
   ``ctx = hidden_norm(fc(features))`` ``[N, H]`` then ONE GEMM with ``kv_a_proj.weight [L*d_c, H]``
   (every layer's latent projection). The worker stores them into the paged pool with its own
   store kernel; the drafter never writes context latents.
2. Block decode: :meth:`DSparkDrafter.forward_block` embeds ``[anchor, MASK, ...]``, and in each layer
   projects the block's own latents (``kv_a_proj`` rows of that layer, applied to the input-normed
   block hidden), **writes them into the pool at the placement's pages/offsets** (entries with page
   id ``-1`` skipped; the only pool write the drafter does), then attends over the context latents
   (``< ctx_len``, via the block table) plus the block's own latents (bidirectional), then the MLP.
   Store and attention are ONE launch of the fused kernel
   (:func:`~tensorrt_llm_ext.kernels.latent_block_attention.latent_block_attention`) where Triton runs,
   its eager twin otherwise (chosen once at build, ``attention_backend``). It returns the final-normed hidden states ``[B, K, H]``; the worker applies the LM head it owns
   (vocab-parallel or gathered) and runs the Markov chain with :meth:`DSparkDrafter.markov_head_weights`.

Fused layers (``layer_backend``, one TP rank only): a served step's few rows (``B * K`` block rows,
``B * (K + 1)`` context rows) are bound by launch latency, not by the ~2 us of weight reads per layer, so each
layer runs as five launches of the target's small-M kernels
(:func:`~tensorrt_llm_ext.kernels.fused_linear.fused_linear`) around the block attention: input norm +
``[q_proj | this layer's kv_a rows]``; attention; ``o_proj`` + residual add; post-attention norm + gate-up +
SiLU-mul; ``down_proj`` + residual add (the next norm is the next launch's prologue), then the final norm. The
context projection is ``fc``, then ``hidden_norm`` + ``kv_a_proj`` in one launch. The unfused path below is its
eager twin: the same roundings (the residual stream rounded to the model dtype after each add, each norm reading
it), only the products' summation order differs.

TP layout (``Mapping.is_plain_tp``): heads split over ranks (column-parallel ``q_proj``/``k_up``/``v_up``,
row-parallel ``o_proj``), MLP column-parallel gate/up, row-parallel down; ``fc``, ``kv_a_proj``, the
norms and the embedding are replicated unless the plan splits ``fc``. Under attention DP every module is
replicated (no TP inside the drafter). The fusions are declared by the CLASS (``tp_fusions``) and
resolved once at build into :attr:`DSparkDrafter.tp_plan` (a frozen :class:`DrafterTPPlan`):

* ``fc_input_split``: ``fc`` keeps this rank's input-feature slice (weight ``[H, F/tp]``), multiplies
  the rank's slice of the features, and one all-reduce with ``RMS_NORM`` fusion sums the partials and
  applies ``hidden_norm``. An ``F`` that does not split over tp keeps the whole ``fc`` (logged once).
* ``residual_norm_fusion``: ``o_proj``/``down_proj`` return un-reduced partials and each all-reduce is
  fused with the residual add and the following RMSNorm (``RESIDUAL_RMS_NORM``): post-attention norm,
  the next layer's input norm, the final norm. Unfused (also at tp 1): reduced output, then the
  residual add, then the RMSNorm, as separate launches.

Only rounding changes between the plans: the sum order of the reductions, and the fused epilogue
norms the fp32 sum ``x + residual`` where the unfused path norms the sum rounded to the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.distributed import AllReduce, AllReduceFusionOp, AllReduceParams
from tensorrt_llm_ext.kernels.common import refuse_allocation_while_capturing
from tensorrt_llm_ext.kernels.fused_linear import EPI_RESIDUAL, EPI_SILU_MUL, fused_linear
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.mapping import Mapping, vocab_shards
from tensorrt_llm_ext.modules.attention import resolve_block_attention
from tensorrt_llm_ext.modules.embedding import Embedding
from tensorrt_llm_ext.modules.linear import Linear, TensorParallelMode, shard_range
from tensorrt_llm_ext.modules.rms_norm import RMSNorm
from tensorrt_llm_ext.models.weights import check_full_state_dict, load_sharded_modules
from tensorrt_llm_ext.contract import (NO_TP_FUSIONS, DrafterBlockInputs, DrafterCapabilities,
                                                   DrafterTPFusions, DrafterTPPlan, MarkovHeadWeights)


@dataclass(frozen=True)
class DSparkDrafterConfig:
    """Sizes of the drafter. ``F = num_capture_layers * target_hidden_size`` is fc's input width."""

    hidden_size: int = 64  # H
    target_hidden_size: int = 40  # H_t, width of one captured target layer
    num_capture_layers: int = 3  # n_cap, target layers concatenated into fc's input
    num_layers: int = 2  # L
    num_heads: int = 4
    head_dim: int = 16  # D (RoPE over the whole head)
    latent_dim: int = 32  # d_c, the single latent per position and layer
    intermediate_size: int = 96
    vocab_size: int = 1031  # V
    markov_rank: int = 8  # r
    mask_token_id: int = 1030
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "target_hidden_size", "num_capture_layers", "num_layers", "num_heads",
                     "head_dim", "latent_dim", "intermediate_size", "vocab_size", "markov_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"DSparkDrafterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"DSparkDrafterConfig.head_dim must be even (RoPE), got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")

    @property
    def fc_in_features(self) -> int:
        return self.num_capture_layers * self.target_hidden_size


def resolve_drafter_tp_plan(declared: DrafterTPFusions, mapping: Mapping, fc_in_features: int,
                            owner: str = "drafter") -> DrafterTPPlan:
    """The immutable TP plan of a drafter class's declaration under ``mapping`` (no side effects)."""
    if mapping.tp_size == 1:
        return DrafterTPPlan(False, False, "tp_size=1: no all-reduce to fuse")
    if mapping.enable_attention_dp:
        return DrafterTPPlan(False, False, "attention DP: the drafter is replicated, no TP all-reduce")
    if declared == NO_TP_FUSIONS:
        return DrafterTPPlan(False, False, f"{owner} declares no TP fusions: whole fc, unfused norms")
    split = declared.fc_input_split
    notes = []
    if split and fc_in_features % mapping.tp_size != 0:
        split = False
        notes.append(f"fc input width {fc_in_features} does not split over tp_size={mapping.tp_size}: "
                     "keeping the unsplit fc and hidden_norm")
    elif split:
        notes.append(f"fc split along input features ({fc_in_features // mapping.tp_size} per rank), "
                     "all-reduce fused with hidden_norm")
    if declared.residual_norm_fusion:
        notes.append("o_proj/down_proj all-reduces fused with residual add + RMSNorm")
    return DrafterTPPlan(split, declared.residual_norm_fusion,
                         f"{owner} at tp_size={mapping.tp_size}: " + "; ".join(notes or ["no fusion declared"]))


# Rows (``B * K`` block rows, ``B * (K + 1)`` context rows) up to which the fused layer path runs; a larger
# call takes the unfused path, where cuBLAS tiles pay. Measured on the H200 (2026-12-04, `bench drafter --tables
# serve`, 5 layers, K 7): the fused layers win at B = 8 (56 / 64 rows: 323.9 vs 358.1 us per served step at
# latent 256) and lose at B = 32 (224 / 256 rows: 730.8 vs 647.1), hence 64.
FUSED_LAYER_MAX_ROWS = 64
LAYER_BACKENDS = ("fused", "eager")


def resolve_layer_backend(requested: str, device, mapping: Mapping, owner: str = "drafter") -> str:
    """``"fused"`` or ``"eager"`` for the drafter's layers (module docstring), resolved once at build.

    ``"auto"``: fused on CUDA at one TP rank, eager otherwise (on CPU the unfused torch ops are faster than the
    interpreter; under TP the all-reduce fusions own the epilogues). ``"fused"`` is refused where Triton cannot
    run (CPU without ``TRITON_INTERPRET=1``) or under TP. Logged once per choice."""
    dev = torch.device(device if device is not None else "cpu")
    if requested not in ("auto", *LAYER_BACKENDS):
        raise ValueError(f"{owner}: layer_backend must be 'auto', 'fused' or 'eager', got {requested!r}")
    one_rank = mapping.tp_size == 1
    triton_ok = dev.type == "cuda" or ENV.triton_interpret
    if requested == "fused" and not (one_rank and triton_ok):
        raise ValueError(f"{owner}: layer_backend='fused' needs one TP rank and CUDA or TRITON_INTERPRET=1 "
                         f"(tp_size={mapping.tp_size}, parameters on {dev})")
    if requested != "auto":
        name, why = requested, "requested"
    elif dev.type == "cuda" and one_rank:
        name, why = "fused", "CUDA, one TP rank"
    else:
        name, why = "eager", (f"tp_size={mapping.tp_size}" if not one_rank else f"parameters on {dev.type}")
    info_once(f"{owner} layers: {name} ({why})", key=f"drafter-layers-{owner}-{name}-{dev.type}-{requested}")
    return name


class SingleLatentAttention(nn.Module):
    """Per-layer attention weights: q, per-head K/V up-projections of the latent, output projection."""

    def __init__(self, cfg: DSparkDrafterConfig, mapping: Mapping, tp_mode_ok: bool, reduce_o: bool,
                 dtype: torch.dtype, device):
        super().__init__()
        col = TensorParallelMode.COLUMN if tp_mode_ok else None
        row = TensorParallelMode.ROW if tp_mode_ok else None
        qdim = cfg.num_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, qdim, dtype=dtype, device=device, mapping=mapping,
                             tensor_parallel_mode=col)
        self.k_up_proj = Linear(cfg.latent_dim, qdim, dtype=dtype, device=device, mapping=mapping,
                                tensor_parallel_mode=col)
        self.v_up_proj = Linear(cfg.latent_dim, qdim, dtype=dtype, device=device, mapping=mapping,
                                tensor_parallel_mode=col)
        self.o_proj = Linear(qdim, cfg.hidden_size, dtype=dtype, device=device, mapping=mapping,
                             tensor_parallel_mode=row, reduce_output=reduce_o)
        self.num_local_heads = self.q_proj.local_out_features // cfg.head_dim
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def forward(self, x: torch.Tensor, kv_a_weight: torch.Tensor, pool_layer: torch.Tensor,
                inputs: DrafterBlockInputs, attention) -> torch.Tensor:
        """``x [B, K, H]`` (input-normed) -> o_proj output ``[B, K, H]`` (partial when not reducing).

        ``attention``: the block attention the drafter resolved at build (fused kernel or its eager
        twin, same arguments); it writes the block's latents of this layer into ``pool_layer`` at
        ``inputs.placement``.
        """
        b, k, _ = x.shape
        q = self.q_proj(x).view(b, k, self.num_local_heads, self.head_dim)
        # Stored for later steps' bookkeeping; attention reads the computed values (same bits as
        # stored), so entries without a page (-1) still attend their own block.
        block_latents = F.linear(x, kv_a_weight).to(pool_layer.dtype)
        # The output is an activation like F.linear's (allocated by torch, in the graph's pool under capture).
        o = attention(q, block_latents, pool_layer, inputs.cache.block_table, inputs.slot_ids, inputs.placement,
                      self.k_up_proj.weight, self.v_up_proj.weight, self.rope_theta, self.scale,
                      out=torch.empty_like(q))
        return self.o_proj(o.reshape(b, k, self.num_local_heads * self.head_dim))


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: DSparkDrafterConfig, mapping: Mapping, tp_mode_ok: bool, reduce_down: bool,
                 dtype: torch.dtype, device):
        super().__init__()
        col = TensorParallelMode.COLUMN if tp_mode_ok else None
        row = TensorParallelMode.ROW if tp_mode_ok else None
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(h, i, dtype=dtype, device=device, mapping=mapping, tensor_parallel_mode=col)
        self.up_proj = Linear(h, i, dtype=dtype, device=device, mapping=mapping, tensor_parallel_mode=col)
        self.down_proj = Linear(i, h, dtype=dtype, device=device, mapping=mapping, tensor_parallel_mode=row,
                                reduce_output=reduce_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DSparkDecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkDrafterConfig, mapping: Mapping, tp_mode_ok: bool, fused: bool,
                 dtype: torch.dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = SingleLatentAttention(cfg, mapping, tp_mode_ok, not fused, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(cfg, mapping, tp_mode_ok, not fused, dtype, device)


def full_weight_shapes(cfg: DSparkDrafterConfig) -> dict[str, tuple[int, ...]]:
    """Names and FULL (unsharded) shapes of the drafter's state dict, in init order."""
    h, d_c, qdim = cfg.hidden_size, cfg.latent_dim, cfg.num_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, h),
        "fc.weight": (h, cfg.fc_in_features),
        "hidden_norm.weight": (h,),
        "kv_a_proj.weight": (cfg.num_layers * d_c, h),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (qdim, h),
            p + "self_attn.k_up_proj.weight": (qdim, d_c),
            p + "self_attn.v_up_proj.weight": (qdim, d_c),
            p + "self_attn.o_proj.weight": (h, qdim),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
    shapes.update({
        "norm.weight": (h,),
        "markov_w1": (cfg.vocab_size, cfg.markov_rank),
        "markov_w2": (cfg.vocab_size, cfg.markov_rank),
    })
    return shapes


CONFIDENCE_HEAD_FILE = "confidence_head.safetensors"  # beside the drafter's model.safetensors; optional


def confidence_head_shapes(cfg: DSparkDrafterConfig) -> dict[str, tuple[int, ...]]:
    """The confidence head ``c_k = sigmoid(w·[h_k; W1[x_{k-1}]] + b)``: ``w`` over the block hidden state and
    the Markov head's ``W1`` row of the token before position ``k``. Kept out of :func:`full_weight_shapes` (a
    drafter without it loads and serves as before)."""
    return {"confidence.weight": (cfg.hidden_size + cfg.markov_rank,), "confidence.bias": (1,)}


# Optional entry of the confidence head file: a per-position calibration fitted on held-out data by train-drafter,
# ``[2, K_cal]`` fp32 (row 0 the scale a_k, row 1 the shift b_k): c_k = sigmoid(a_k * z_k + b_k) where z_k is the
# head's logit; block positions past K_cal use the last column. A head without it serves its raw sigmoid.
CONFIDENCE_CALIBRATION = "confidence.calibration"


def block_confidences(hidden: torch.Tensor, prev_tokens: torch.Tensor, markov_w1: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor, calibration: torch.Tensor | None = None) -> torch.Tensor:
    """Per-position confidences ``[B, K]`` (fp32) of a block: ``hidden [B, K, H]`` (final-normed),
    ``prev_tokens [B, K]`` (the anchor, then each draft but the last); ``calibration`` (optional
    ``[2, K_cal]``, :data:`CONFIDENCE_CALIBRATION`) applied per position in logit space."""
    x = torch.cat((hidden.float(), markov_w1[prev_tokens].float()), dim=-1)
    z = x @ weight.float() + bias.float()
    if calibration is not None:
        z = apply_confidence_calibration(z, calibration)
    return torch.sigmoid(z)


def apply_confidence_calibration(logits: torch.Tensor, calibration: torch.Tensor) -> torch.Tensor:
    """``a_k * z_k + b_k`` over the last axis (block position ``k``; past ``K_cal`` the last column's)."""
    k = logits.shape[-1]
    idx = torch.arange(k, device=logits.device).clamp(max=calibration.shape[1] - 1)
    cal = calibration.float().to(logits.device)
    return logits * cal[0, idx] + cal[1, idx]


def generate_full_state_dict(cfg: DSparkDrafterConfig, seed: int, dtype: torch.dtype = torch.bfloat16,
                             device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Deterministic FULL weights: one fp32 generator on ``device`` drawn in :func:`full_weight_shapes` order.

    Independent of the rank and the TP size (shard afterwards); the CPU stream (the default) is the
    reference, a CUDA generator gives other but equally deterministic weights (fast for benchmarks).
    Norm weights ``1 + 0.1 N(0,1)``, linear weights ``N(0,1)/sqrt(fan_in)``, embedding ``N(0,1)``,
    Markov factors ``N(0,1)/sqrt(r)``.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in full_weight_shapes(cfg).items():
        w = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
        if len(shape) == 1:
            w = 1.0 + 0.1 * w
        elif name.startswith("markov"):
            w = w / math.sqrt(cfg.markov_rank)
        elif name != "embed_tokens.weight":
            w = w / math.sqrt(shape[1])
        out[name] = w.to(dtype)
    return out


def bigram_markov_head(target_sd: dict[str, torch.Tensor], eps: float) -> dict[str, torch.Tensor]:
    """Markov factors that reproduce the target's bigram part: ``w2 @ w1[prev] = head @ norm(embed[prev])``.

    A target whose layers add little to the residual stream predicts roughly ``head @ norm_final(embed[prev])``;
    with ``r = H`` this is exactly representable by the DSpark vanilla Markov head.
    """
    emb = target_sd["embed_tokens.weight"].float()
    g = target_sd["norm.weight"].float()
    w1 = g * emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + eps)
    return {"markov_w1": w1, "markov_w2": target_sd["lm_head.weight"].float().clone()}


def init_from_target_bigram(drafter_sd: dict[str, torch.Tensor], target_sd: dict[str, torch.Tensor],
                            eps: float) -> None:
    """The seeded drafter's ``target_bigram`` init, in place: the Markov head reproduces the target's bigram
    part (:func:`bigram_markov_head`), and a quiet backbone (final norm x 0.05) keeps the draft logits the
    Markov bias plus a small backbone term -- real acceptance on a seeded target without a trained drafter."""
    drafter_sd.update(bigram_markov_head(target_sd, eps))
    drafter_sd["norm.weight"] = drafter_sd["norm.weight"] * 0.05


class DSparkDrafter(nn.Module, DrafterCapabilities):
    """MLA-style DSpark drafter. Declares both TP fusions; see the module docstring for the data flow.

    Args:
        config: sizes.
        mapping: the rank layout; the TP plan is resolved from it once, here.
        dtype, device: parameter dtype/device (the paged pool must use ``dtype``).
        attention_backend: the block attention, resolved once here and logged
            (:func:`~tensorrt_llm_ext.modules.attention.resolve_block_attention`): ``"auto"`` (the fused
            kernel where Triton runs, else the eager twin), ``"fused"`` or ``"eager"``.
        layer_backend: the rest of each layer and the context projection (:func:`resolve_layer_backend`):
            ``"auto"`` (fused on CUDA at one TP rank), ``"fused"`` or ``"eager"``.
    """

    tp_fusions = DrafterTPFusions(fc_input_split=True, residual_norm_fusion=True)

    def __init__(self, config: DSparkDrafterConfig, mapping: Mapping | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 attention_backend: str = "auto", layer_backend: str = "auto"):
        super().__init__()
        self.config = cfg = config
        self.mapping = mapping = mapping or Mapping()
        self.dtype = dtype
        self.tp_plan: DrafterTPPlan = resolve_drafter_tp_plan(type(self).tp_fusions, mapping,
                                                              cfg.fc_in_features, type(self).__name__)
        info_once(f"{type(self).__name__} TP plan: {self.tp_plan}", key=f"drafter-plan-{type(self).__name__}-"
                  f"{mapping.tp_size}-{mapping.enable_attention_dp}-{cfg.fc_in_features}")
        tp_mode_ok = mapping.is_plain_tp  # attention DP: the drafter is replicated
        if tp_mode_ok:
            for name, size in (("num_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
                if size % mapping.tp_size:
                    raise ValueError(f"DSparkDrafter: {name}={size} must be divisible by tp_size={mapping.tp_size}")
        fused = self.tp_plan.residual_norm_fusion
        h = cfg.hidden_size
        self.embed_tokens = Embedding(cfg.vocab_size, h, dtype, device, mapping)
        if self.tp_plan.fc_input_split:
            self.fc = Linear(cfg.fc_in_features, h, dtype=dtype, device=device, mapping=mapping,
                             tensor_parallel_mode=TensorParallelMode.ROW, reduce_output=False)
        else:
            self.fc = Linear(cfg.fc_in_features, h, dtype=dtype, device=device, mapping=mapping)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.kv_a_proj = Linear(h, cfg.num_layers * cfg.latent_dim, dtype=dtype, device=device, mapping=mapping)
        self.layers = nn.ModuleList(
            DSparkDecoderLayer(cfg, mapping, tp_mode_ok, fused, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        # Markov factors: w1 whole (indexed by the previous global token id); w2 padded with zero rows past V to
        # the vocabulary split of a column-parallel LM head at this TP (mapping.vocab_shards, default rule: the
        # widest, so a head of either rule slices within it). A vocabulary too small for this TP has no COLUMN
        # head (it raises there): w2 stays [V, r], used whole (attention DP, replicated head).
        try:
            self.padded_vocab_size = vocab_shards(cfg.vocab_size, mapping.tp_size).padded_vocab_size
        except ValueError:
            self.padded_vocab_size = cfg.vocab_size
        self.markov_w1 = nn.Parameter(torch.empty(cfg.vocab_size, cfg.markov_rank, dtype=dtype, device=device),
                                      requires_grad=False)
        self.markov_w2 = nn.Parameter(torch.zeros(self.padded_vocab_size, cfg.markov_rank, dtype=dtype,
                                                  device=device), requires_grad=False)
        self.all_reduce = AllReduce(mapping) if (self.tp_plan.fc_input_split or fused) else None
        # The optional confidence head (confidence_head_shapes); None until a checkpoint provides one.
        self.confidence_weight: torch.Tensor | None = None
        self.confidence_bias: torch.Tensor | None = None
        self.confidence_calibration: torch.Tensor | None = None  # [2, K_cal] when the head file has one
        self._lm_head: nn.Module | None = None
        self.attention_backend, self._block_attention = resolve_block_attention(
            attention_backend, self.kv_a_proj.weight.device, type(self).__name__)
        self.layer_backend = resolve_layer_backend(layer_backend, self.kv_a_proj.weight.device, mapping,
                                                   type(self).__name__)
        # The fused path's concatenated weights ([q_proj | kv_a rows], [gate | up] per layer), built outside
        # capture and rebuilt when a source weight changes (its storage or version counter).
        self._fused_weights: tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def set_layer_backend(self, name: str) -> None:
        """Re-resolve the layer path (``"auto"``, ``"fused"``, ``"eager"``), e.g. for a benchmark's unfused
        column. Not inside a step: a captured graph keeps the kernels it was captured with."""
        self.layer_backend = resolve_layer_backend(name, self.kv_a_proj.weight.device, self.mapping,
                                                   type(self).__name__)

    def set_attention_backend(self, name: str) -> None:
        """Re-resolve the block attention (``"auto"``, ``"fused"``, ``"eager"``), e.g. for a benchmark's stock
        column. Not inside a step: a captured graph keeps the kernels it was captured with."""
        self.attention_backend, self._block_attention = resolve_block_attention(
            name, self.kv_a_proj.weight.device, type(self).__name__)

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    # -- weights -------------------------------------------------------------------------------
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load FULL (unsharded) weights named as in :func:`full_weight_shapes`; each module slices its
        rank's part. Raises ValueError on a missing, unexpected or mis-shaped entry."""
        check_full_state_dict("DSparkDrafter", full_weight_shapes(self.config), state_dict)
        load_sharded_modules(self, state_dict, (Linear, RMSNorm, Embedding), self.dtype)
        with torch.no_grad():
            self.markov_w1.copy_(state_dict["markov_w1"])
            self.markov_w2.zero_()
            self.markov_w2[: self.config.vocab_size].copy_(state_dict["markov_w2"])
        if self._fused_weights is not None:  # graphs captured earlier read the concatenated copies: refresh now
            self._layer_weights()

    def load_confidence_head(self, head: dict[str, torch.Tensor]) -> None:
        """Load the confidence head (names and shapes of :func:`confidence_head_shapes`, fp32, replicated on
        every rank), with its per-position calibration when the file has one (:data:`CONFIDENCE_CALIBRATION`,
        applied to every step's confidences from then on). Raises ValueError on a missing, mis-shaped or
        non-finite entry."""
        shapes = confidence_head_shapes(self.config)
        for name, shape in shapes.items():
            t = head.get(name)
            if t is None or tuple(t.shape) != shape:
                raise ValueError(f"DSparkDrafter confidence head: {name} must be {shape}, got "
                                 f"{None if t is None else tuple(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"DSparkDrafter confidence head: {name} holds non-finite values")
        cal = head.get(CONFIDENCE_CALIBRATION)
        if cal is not None and (cal.dim() != 2 or cal.shape[0] != 2 or cal.shape[1] < 1 or
                                not bool(torch.isfinite(cal).all()) or not bool((cal[0] > 0).all())):
            raise ValueError(f"DSparkDrafter confidence head: {CONFIDENCE_CALIBRATION} must be a finite [2, K] "
                             f"(positive scales), got {tuple(cal.shape)}")
        dev = self.markov_w1.device
        self.confidence_weight = head["confidence.weight"].to(device=dev, dtype=torch.float32).contiguous()
        self.confidence_bias = head["confidence.bias"].to(device=dev, dtype=torch.float32).contiguous()
        self.confidence_calibration = (None if cal is None else
                                       cal.to(device=dev, dtype=torch.float32).contiguous())

    @property
    def has_confidence_head(self) -> bool:
        return self.confidence_weight is not None

    def block_confidences(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Per-position confidences ``[B, K]`` (fp32) of a drafted block (:func:`block_confidences`):
        ``hidden [B, K, H]`` from :meth:`forward_block`, ``prev_tokens [B, K]`` = the anchor then the drafts
        but the last. Fixed shapes, no host sync (graph-capturable)."""
        if self.confidence_weight is None:
            raise RuntimeError("DSparkDrafter: no confidence head loaded")
        return block_confidences(hidden, prev_tokens, self.markov_w1, self.confidence_weight, self.confidence_bias,
                                 self.confidence_calibration)

    def init_weights(self, seed: int) -> None:
        """Deterministic init: the same FULL weights on every rank and TP size, then sliced."""
        self.load_full_state_dict(generate_full_state_dict(self.config, seed, self.dtype))

    def take_over_lm_head(self, lm_head: nn.Module) -> None:
        """Use the target's LM head (the drafter has none). Kept unregistered: not in the state dict."""
        object.__setattr__(self, "_lm_head", lm_head)

    @property
    def lm_head(self) -> nn.Module:
        if self._lm_head is None:
            raise RuntimeError("DSparkDrafter has no LM head of its own; call take_over_lm_head(target_head)")
        return self._lm_head

    def markov_head_weights(self, vocab_parallel: bool | None = None) -> MarkovHeadWeights:
        """The Markov factors for the worker's chain (views, no copy).

        ``vocab_parallel`` (default ``mapping.is_plain_tp``): ``markov_w2`` is this rank's rows of the
        padded vocabulary, ``[W, r]`` from ``vocab_start`` (zero rows past V), the very columns of the LM head
        the drafter took over (its ``vocab_start`` and ``shard_width``; before that, the default split of
        :func:`~tensorrt_llm_ext.mapping.vocab_shards`); otherwise the whole ``[V, r]``.
        """
        if vocab_parallel is None:
            vocab_parallel = self.mapping.is_plain_tp
        w2 = self.markov_w2[: self.config.vocab_size]
        start = 0
        tp = self.mapping.tp_size
        if vocab_parallel and tp > 1:
            head = self._lm_head
            if getattr(head, "tp_size", None) == tp and hasattr(head, "shard_width"):
                start, width = head.vocab_start, head.shard_width  # the biased logits are this head's columns
            else:
                shards = vocab_shards(self.config.vocab_size, tp)
                start, width = shards.start(self.mapping.tp_rank), shards.width
            if start + width > self.markov_w2.shape[0]:
                raise ValueError(f"DSparkDrafter: the LM head's shard [{start}, {start + width}) lies past the "
                                 f"Markov rows ({self.markov_w2.shape[0]})")
            w2 = self.markov_w2[start:start + width]
        return MarkovHeadWeights(markov_w1=self.markov_w1, markov_w2=w2, vocab_start=start,
                                 vocab_size=self.config.vocab_size)

    # -- sizes the worker needs ------------------------------------------------------------------
    @property
    def num_latent_layers(self) -> int:
        return self.config.num_layers

    @property
    def latent_dim(self) -> int:
        return self.config.latent_dim

    def latent_pool_shape(self, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        """``[L, num_pages, page_size, d_c]`` for :class:`PagedLatentCache.pool` (dtype = drafter dtype)."""
        return (self.config.num_layers, num_pages, page_size, self.config.latent_dim)

    # -- forward -------------------------------------------------------------------------------
    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: ``[N, F] -> [N, H]``; identical on every rank.

        Split plan: this rank's ``[N, F/tp]`` slice times its fc slice, one all-reduce with RMS_NORM
        fusion. Otherwise: the whole fc, then hidden_norm.
        """
        cfg = self.config
        if features.dim() != 2 or features.shape[1] != cfg.fc_in_features:
            raise ValueError(f"project_context: expected features [N, {cfg.fc_in_features}], "
                             f"got {tuple(features.shape)}")
        if self.tp_plan.fc_input_split:
            start, end = shard_range(cfg.fc_in_features, self.mapping.tp_size, self.mapping.tp_rank)
            partial = self.fc(features.narrow(1, start, end - start))
            return self.all_reduce(partial, all_reduce_params=AllReduceParams(
                fusion_op=AllReduceFusionOp.RMS_NORM, norm_weight=self.hidden_norm.weight,
                eps=self.hidden_norm.eps))
        return self.hidden_norm(self.fc(features))

    def compute_context_latents(self, features: torch.Tensor) -> torch.Tensor:
        """``features [N, F]`` (captured target layers concatenated) -> ``[N, L, d_c]`` latents.

        All layers' latent projections in one GEMM; the caller stores them into the paged pool. Fused layers
        (up to :data:`FUSED_LAYER_MAX_ROWS` rows): ``fc``, then ``hidden_norm`` + ``kv_a_proj`` in one launch.
        """
        cfg = self.config
        if (self.layer_backend == "fused" and features.dim() == 2 and features.shape[1] == cfg.fc_in_features
                and features.shape[0] <= FUSED_LAYER_MAX_ROWS and features.dtype == self.dtype
                and features.stride(-1) == 1):
            ctx = fused_linear(features, self.fc.weight)
            lat = fused_linear(ctx, self.kv_a_proj.weight, norm_weight=self.hidden_norm.weight,
                               eps=self.hidden_norm.eps)
            return lat.view(features.shape[0], cfg.num_layers, cfg.latent_dim)
        ctx = self.project_context(features)
        return self.kv_a_proj(ctx).view(ctx.shape[0], self.config.num_layers, self.config.latent_dim)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm):
        """Residual add + RMSNorm after a row-parallel projection; fused into its all-reduce when planned."""
        if self.tp_plan.residual_norm_fusion:
            return self.all_reduce(x, all_reduce_params=AllReduceParams(
                fusion_op=AllReduceFusionOp.RESIDUAL_RMS_NORM, residual=residual, norm_weight=norm.weight,
                eps=norm.eps))
        # Unfused ("before"): the row-parallel projection already reduced; add and norm are separate
        # launches, the norm reading the residual rounded to the model dtype.
        residual = x + residual
        return norm(residual), residual

    def forward_block(self, inputs: DrafterBlockInputs) -> torch.Tensor:
        """One block decode: ``inputs.block_input_ids [B, K]`` -> final-normed hidden ``[B, K, H]``.

        Side effect: for every layer ``l`` the block's own latents are written into
        ``inputs.cache.pool[l]`` at ``inputs.placement.page_ids/page_offsets`` where ``page_ids >= 0``
        (nothing else is written; ``-1`` entries -- dummy rows, unallocated pages -- are skipped).
        Dummy rows (``seq_lens == 0``) produce finite output. Identical on every TP rank. Fixed shapes,
        no host sync: CUDA-graph capturable (given graph-safe collectives).
        """
        ids = inputs.block_input_ids
        pool = inputs.cache.pool
        if pool.dim() != 4 or pool.shape[0] != self.config.num_layers or pool.shape[3] != self.config.latent_dim:
            raise ValueError(f"forward_block: pool must be [{self.config.num_layers}, pages, page_size, "
                             f"{self.config.latent_dim}], got {tuple(pool.shape)}")
        if pool.dtype != self.dtype:
            raise ValueError(f"forward_block: pool dtype must be {self.dtype}, got {pool.dtype}")
        if inputs.placement.page_ids.shape != ids.shape:
            raise ValueError(f"forward_block: placement [B, K] must match block ids {tuple(ids.shape)}, "
                             f"got {tuple(inputs.placement.page_ids.shape)}")
        if self.layer_backend == "fused" and ids.numel() <= FUSED_LAYER_MAX_ROWS:
            return self._forward_block_fused(inputs)
        d_c = self.config.latent_dim
        hidden = self.embed_tokens(ids)
        residual = hidden
        x = self.layers[0].input_layernorm(hidden)
        for i, layer in enumerate(self.layers):
            kv_a_weight = self.kv_a_proj.weight[i * d_c:(i + 1) * d_c]
            attn = layer.self_attn(x, kv_a_weight, pool[i], inputs, self._block_attention)
            x, residual = self._add_norm(attn, residual, layer.post_attention_layernorm)
            mlp = layer.mlp(x)
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, residual = self._add_norm(mlp, residual, next_norm)
        return x

    def _layer_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(w_qc [h*D + d_c, H], w_gate_up [2I, H])``, cached. When a source weight's storage or version
        counter changed (a reload, an in-place update) they are refreshed IN PLACE, so a captured graph that reads
        them sees the new weights; allocated (outside capture) only the first time or when a shape changes."""
        d_c = self.config.latent_dim
        srcs = [self.kv_a_proj.weight]
        for layer in self.layers:
            srcs += [layer.self_attn.q_proj.weight, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]
        key = tuple((w.data_ptr(), w._version) for w in srcs)
        if self._fused_weights is not None and self._fused_weights[0] == key:
            return self._fused_weights[1]
        parts = [((layer.self_attn.q_proj.weight, self.kv_a_proj.weight[i * d_c:(i + 1) * d_c]),
                  (layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight)) for i, layer in enumerate(self.layers)]
        with torch.no_grad():
            old = self._fused_weights[1] if self._fused_weights is not None else None
            if old is not None and all(w.shape[0] == a.shape[0] + b.shape[0] and w.shape[1:] == a.shape[1:]
                                       and w.device == a.device and w.dtype == a.dtype
                                       for pair, ws in zip(parts, old) for w, (a, b) in zip(ws, pair)):
                for pair, ws in zip(parts, old):
                    for w, (a, b) in zip(ws, pair):
                        torch.cat((a, b), out=w)
                ws_all = old
            else:
                refuse_allocation_while_capturing("DSparkDrafter fused layers (weight concatenation; run one step "
                                                  "before capture)", self.kv_a_proj.weight.device)
                ws_all = [tuple(torch.cat(pair) for pair in layer_parts) for layer_parts in parts]
        # The key after the refresh (torch.cat(out=) bumps no source version).
        self._fused_weights = (tuple((w.data_ptr(), w._version) for w in srcs), ws_all)
        return ws_all

    def _forward_block_fused(self, inputs: DrafterBlockInputs) -> torch.Tensor:
        """:meth:`forward_block` in five launches per layer plus the attention (module docstring); one TP rank.
        The residual stream ``h [B*K, H]`` is rounded to the model dtype after each add, as in the unfused path."""
        ids = inputs.block_input_ids
        b, k = ids.shape
        pool = inputs.cache.pool
        qdim = self.layers[0].self_attn.num_local_heads * self.config.head_dim
        h = self.embed_tokens(ids).reshape(b * k, -1)
        for i, (layer, (w_qc, w_gu)) in enumerate(zip(self.layers, self._layer_weights())):
            attn = layer.self_attn
            ln = layer.input_layernorm
            qc = fused_linear(h, w_qc, norm_weight=ln.weight, eps=ln.eps)  # [B*K, h*D + d_c]
            q = qc[:, :qdim].view(b, k, attn.num_local_heads, attn.head_dim)
            block_latents = qc[:, qdim:].view(b, k, -1)  # strided views: the kernel takes row strides
            o = self._block_attention(q, block_latents, pool[i], inputs.cache.block_table, inputs.slot_ids,
                                      inputs.placement, attn.k_up_proj.weight, attn.v_up_proj.weight, attn.rope_theta,
                                      attn.scale, out=torch.empty(b, k, attn.num_local_heads, attn.head_dim,
                                                                  dtype=h.dtype, device=h.device))
            # h was written two or more launches before each residual product (early_residual)
            h = fused_linear(o.view(b * k, qdim), attn.o_proj.weight, epilogue=EPI_RESIDUAL, residual=h,
                             early_residual=True)
            post = layer.post_attention_layernorm
            act = fused_linear(h, w_gu, norm_weight=post.weight, eps=post.eps, epilogue=EPI_SILU_MUL)
            h = fused_linear(act, layer.mlp.down_proj.weight, epilogue=EPI_RESIDUAL, residual=h, out=h,
                             early_residual=True)
        return self.norm(h).view(b, k, -1)


class DSparkDrafterNoFusion(DSparkDrafter):
    """The same drafter without the TP fusion declaration (a drafter family not yet measured with it):
    the whole fc, the unfused hidden_norm, reduced o_proj/down_proj, then residual add and RMSNorm."""

    tp_fusions = NO_TP_FUSIONS
