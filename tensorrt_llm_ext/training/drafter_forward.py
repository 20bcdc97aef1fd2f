"""The DSpark drafter's serving computation, written for training: many draft blocks per sequence in one pass.

Serving (:meth:`~tensorrt_llm_ext.models.dspark_drafter.DSparkDrafter.forward_block` and the worker's Markov
chain) drafts one block per request and step: the block ``[anchor, MASK, ..., MASK]`` at positions
``a .. a+K-1`` (``a`` = the anchor's absolute position) attends to the context latents of positions
``< a`` (projected from the target's captured features of the tokens the target verified) and to its own
latents (bidirectionally); block position ``k`` gives base logits through the target's LM head, and the
Markov head adds ``markov_w2 @ markov_w1[prev_k]`` with ``prev_0`` the anchor and ``prev_k`` the draft
before it. Draft ``k`` is a guess of the token at position ``a + k + 1``.

Training (teacher forcing): ``M`` anchors of a target-generated sequence are drafted in ONE pass -- the
``M * K`` block queries attend to the sequence's context latents masked to ``< a_m`` and to the latents of
their own block only, and ``prev_k`` is the sequence's token at ``a + k`` (the token an accepted draft
equals). The teacher for block position ``k`` is the target's distribution at position ``a + k`` (the
target's logits there predict position ``a + k + 1``).

Same weights and names as the drafter's state dict (:func:`~tensorrt_llm_ext.models.dspark_drafter.
full_weight_shapes`); the same operations as the drafter's eager path (RMSNorm as ``rms_norm_reference``,
rotate-half RoPE, softmax scale ``1 / sqrt(head_dim)``). ``tests/integration/test_train_drafter.py`` holds
:func:`block_logits` to ``forward_block`` + LM head + Markov bias of the serving drafter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tensorrt_llm_ext.kernels.rope import apply_rope, rope_cos_sin
from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafterConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def context_latents(params: dict[str, torch.Tensor], cfg: DSparkDrafterConfig, features: torch.Tensor) -> torch.Tensor:
    """``features [S, T, F]`` -> every layer's context latents ``[S, T, L, d_c]`` (serving: one GEMM, stored)."""
    ctx = rms_norm(F.linear(features, params["fc.weight"]), params["hidden_norm.weight"], cfg.rms_norm_eps)
    s, t = features.shape[:2]
    return F.linear(ctx, params["kv_a_proj.weight"]).view(s, t, cfg.num_layers, cfg.latent_dim)


ATTENTION = ("sdpa", "sdpa_cudnn", "sdpa_cudnn_pad128", "eager")
TRAIN_ATTENTION = "sdpa_cudnn_pad128"  # the trainer's (every function's default here)
# cuDNN's SDPA backward (torch 2.11 and later on sm_90, the GPU machine's) returns NaN in dq with an explicit mask
# when the key length is 64 mod 128 and a query row's log-sum-exp is below -88.7 (pytorch/pytorch#196678): the padded
# half of the last key tile is scored 0, exp(0 - lse) overflows. The drafter's mask is explicit and its key length
# (batch width, a multiple of 64, + M K) is 64 mod 128 for half the batches: recipe 5 skipped 19 steps between 1,155
# and 1,413 with a finite loss and a NaN gradient norm. "sdpa_cudnn_pad128" (the default) pads the keys, masked out,
# to a multiple of 128 and keeps cuDNN's speed: 239.8 ms a step against 237.6 for "sdpa_cudnn" (the dispatcher's own
# choice) and 284.3 for "sdpa" (every fused backend but cuDNN's); recipe 5 over 1,100 s of steps with it skipped
# none (H100, torch 2.11, 2026-12-06; docs/real_model.md). "eager" is the twin the tests hold the others to.
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     attention: str = TRAIN_ATTENTION) -> torch.Tensor:
    """``softmax(q kᵀ scale, masked) v`` for ``q [S, heads, Q, d]``, ``k, v [S, heads, T, d]`` and a boolean
    ``mask [S, 1, Q, T]`` (True: attend) through ``F.scaled_dot_product_attention`` (``"sdpa"``: cuDNN's backend
    excluded, :data:`SDPA_BACKENDS`; ``"sdpa_cudnn"``: any backend; ``"sdpa_cudnn_pad128"``: any backend over keys
    padded with masked-out zeros to a multiple of 128)."""
    if attention == "sdpa_cudnn_pad128":
        pad = -k.shape[-2] % 128
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=False)
        attention = "sdpa_cudnn"
    if attention == "sdpa_cudnn":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if attention != "sdpa":
        raise ValueError(f"masked_attention: attention must be sdpa, sdpa_cudnn or sdpa_cudnn_pad128, got "
                         f"{attention!r}")
    with sdpa_kernel(list(SDPA_BACKENDS)):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def block_hidden(params: dict[str, torch.Tensor], cfg: DSparkDrafterConfig, ctx_latents: torch.Tensor,
                 anchor_tokens: torch.Tensor, anchors: torch.Tensor, draft_len: int,
                 attention: str = TRAIN_ATTENTION) -> torch.Tensor:
    """Final-normed block hidden states ``[S, M, K, H]``.

    Args:
        ctx_latents: ``[S, T, L, d_c]`` (:func:`context_latents`); position ``p`` of sequence ``s``.
        anchor_tokens: ``[S, M]`` the anchor (bonus) token of each block.
        anchors: ``[S, M]`` int64 absolute anchor positions ``a`` (context attended: positions ``< a``).
        attention: ``"sdpa"`` (:func:`masked_attention`: ``F.scaled_dot_product_attention`` with the boolean mask, a
            fused kernel that keeps no ``[S, heads, MK, T + MK]`` probabilities for the backward, cuDNN's excluded),
            ``"sdpa_cudnn"`` (the same with cuDNN's allowed), ``"sdpa_cudnn_pad128"`` (and the keys padded to a
            multiple of 128) or ``"eager"`` (its twin: scores, masked softmax in fp32 and the weighted sum as
            separate ops).
    """
    if attention not in ATTENTION:
        raise ValueError(f"block_hidden: attention must be one of {ATTENTION}, got {attention!r}")
    s, t = ctx_latents.shape[:2]
    m, k = anchors.shape[1], draft_len
    nh, d, d_c = cfg.num_heads, cfg.head_dim, cfg.latent_dim
    dev = ctx_latents.device
    ids = torch.full((s, m, k), cfg.mask_token_id, dtype=torch.long, device=dev)
    ids[:, :, 0] = anchor_tokens
    block_pos = (anchors[:, :, None] + torch.arange(k, device=dev)).reshape(s, m * k)  # [S, MK]
    key_pos = torch.cat((torch.arange(t, device=dev).expand(s, t), block_pos), dim=1)  # [S, T+MK]
    # Query (m, j) sees context positions < a_m and the K latents of its own block.
    blk = torch.arange(m, device=dev).repeat_interleave(k)  # [MK]
    ctx_ok = torch.arange(t, device=dev)[None, None, :] < anchors.repeat_interleave(k, dim=1)[:, :, None]
    own = (blk[:, None] == blk[None, :]).expand(s, m * k, m * k)
    valid = torch.cat((ctx_ok, own), dim=2)  # [S, MK, T+MK]
    cos_k, sin_k = rope_cos_sin(key_pos, d, cfg.rope_theta)
    cos_q, sin_q = rope_cos_sin(block_pos, d, cfg.rope_theta)
    scale = 1.0 / math.sqrt(d)
    hidden = F.embedding(ids.view(s, m * k), params["embed_tokens.weight"])
    residual = hidden
    x = rms_norm(hidden, params["layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        q = F.linear(x, params[p + "self_attn.q_proj.weight"]).view(s, m * k, nh, d)
        blat = F.linear(x, params["kv_a_proj.weight"][i * d_c:(i + 1) * d_c])  # [S, MK, d_c]
        lat = torch.cat((ctx_latents[:, :, i].to(x.dtype), blat), dim=1)  # [S, T+MK, d_c]
        keys = apply_rope(F.linear(lat, params[p + "self_attn.k_up_proj.weight"]).view(s, -1, nh, d), cos_k, sin_k)
        vals = F.linear(lat, params[p + "self_attn.v_up_proj.weight"]).view(s, -1, nh, d)
        qr = apply_rope(q, cos_q, sin_q)
        if attention != "eager":
            dt = vals.dtype  # the projections' dtype (bfloat16 under autocast); RoPE returns fp32
            o = masked_attention(qr.to(dt).transpose(1, 2), keys.to(dt).transpose(1, 2), vals.transpose(1, 2),
                                 valid[:, None], scale, attention)
            o = o.transpose(1, 2).to(x.dtype).reshape(s, m * k, nh * d)
        else:
            scores = torch.einsum("sqhd,skhd->shqk", qr, keys) * scale
            probs = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1)
            o = torch.einsum("shqk,skhd->sqhd", probs, vals.float()).to(x.dtype).reshape(s, m * k, nh * d)
        residual = F.linear(o, params[p + "self_attn.o_proj.weight"]) + residual
        x = rms_norm(residual, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = F.silu(F.linear(x, params[p + "mlp.gate_proj.weight"]))
        mlp = F.linear(gate * F.linear(x, params[p + "mlp.up_proj.weight"]), params[p + "mlp.down_proj.weight"])
        residual = mlp + residual
        nxt = f"layers.{i + 1}.input_layernorm.weight" if i + 1 < cfg.num_layers else "norm.weight"
        x = rms_norm(residual, params[nxt], cfg.rms_norm_eps)
    return x.view(s, m, k, -1)


def markov_bias(params: dict[str, torch.Tensor], prev_tokens: torch.Tensor) -> torch.Tensor:
    """``markov_w2 @ markov_w1[prev]``: ``prev_tokens [...]`` -> ``[..., V]``."""
    return F.linear(F.embedding(prev_tokens, params["markov_w1"]), params["markov_w2"])


def block_logits(params: dict[str, torch.Tensor], cfg: DSparkDrafterConfig, lm_head_weight: torch.Tensor,
                 features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, draft_len: int,
                 attention: str = TRAIN_ATTENTION) -> torch.Tensor:
    """Teacher-forced draft logits ``[S, M, K, V]`` of the blocks anchored at ``anchors [S, M]`` of the
    sequences ``tokens [S, T]`` with captured target features ``features [S, T, F]``; ``prev_k`` is the
    sequence's token at ``a + k`` (positions past ``T - 1`` read the last token; callers mask them)."""
    return block_forward(params, cfg, lm_head_weight, features, tokens, anchors, draft_len, attention)[0]


def block_forward(params, cfg: DSparkDrafterConfig, lm_head_weight: torch.Tensor, features: torch.Tensor,
                  tokens: torch.Tensor, anchors: torch.Tensor, draft_len: int, attention: str = TRAIN_ATTENTION):
    """:func:`block_logits` and what the confidence head reads: ``(logits [S, M, K, V], hidden [S, M, K, H],
    prev [S, M, K])``."""
    hidden, prev = block_hidden_prev(params, cfg, features, tokens, anchors, draft_len, attention)
    return F.linear(hidden, lm_head_weight) + markov_bias(params, prev), hidden, prev


def block_hidden_prev(params, cfg: DSparkDrafterConfig, features: torch.Tensor, tokens: torch.Tensor,
                      anchors: torch.Tensor, draft_len: int, attention: str = TRAIN_ATTENTION):
    """:func:`block_forward` without the vocabulary-wide logits (the fused loss forms them chunk by chunk):
    ``(hidden [S, M, K, H], prev [S, M, K])``."""
    t = tokens.shape[1]
    anchor_tokens = tokens.gather(1, anchors)
    hidden = block_hidden(params, cfg, context_latents(params, cfg, features), anchor_tokens, anchors, draft_len,
                          attention)
    prev_pos = (anchors[:, :, None] + torch.arange(draft_len, device=anchors.device)).clamp(max=t - 1)
    prev = tokens.gather(1, prev_pos.flatten(1)).view_as(prev_pos)
    return hidden, prev
