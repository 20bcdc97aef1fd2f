"""What both kernels of the DSpark Markov chain share: the bias and logits roundings, the selection score,
and the eager twin of one chain step.

The kernels are :mod:`~tensorrt_llm_ext.kernels.markov_fused_step` (``mode="fused"``: one launch per
block position, bias in-kernel) and :mod:`~tensorrt_llm_ext.kernels.markov_exact_step` (``mode="exact"``:
the resolve and select kernels around the ``F.linear`` GEMM); the chain itself (workspace, stepping,
exchange) is orchestrated by :mod:`tensorrt_llm_ext.speculative.markov_chain`.

One step, for rows ``b`` with previous tokens ``prev`` (:func:`markov_step_reference`)::

    bias   = F.linear(w1[prev], w2).to(logits dtype)   # a zero w1 row for an invalid prev
    biased = base[:, k] + bias                          # logits dtype
    key[b] = selection key of the row's best column     # torch.argmax order; keyed Gumbel-max if T > 0

The Triton helpers below reproduce those roundings with integer ops, so the interpreter (whose bf16
store truncates) and the GPU agree: :func:`round_bf16`, :func:`bias_to_logits`,
:func:`add_in_logits_dtype`; :func:`selection_score` is the keyed Gumbel-max score of
:mod:`~tensorrt_llm_ext.kernels.ordered_key`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.ordered_key import (gumbel2_noise_grouped, gumbel_score, keyed_gumbel_scores_torch,
                                                  shard_argmax_key_reference)

__all__ = ["W_BF16", "W_FP16", "W_FP32", "add_in_logits_dtype", "bias_to_logits", "markov_step_reference",
           "round_bf16", "selection_score"]

# Weights dtype codes (constexpr W_KIND): how the fp32 accumulator is rounded to F.linear's output dtype.
W_FP32, W_BF16, W_FP16 = 0, 1, 2


@triton.jit
def round_bf16(x):
    """fp32 -> fp32 holding the bf16 round-to-nearest-even value (torch's cast; NaN -> canonical NaN).

    Integer ops so the interpreter (whose bf16 store truncates) and the GPU agree; the result is exactly
    representable in bf16, so a later ``.to(tl.bfloat16)`` store is exact on both.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    y = rounded.to(tl.float32, bitcast=True)
    return tl.where(x != x, float("nan"), y)


@triton.jit
def bias_to_logits(acc, W_KIND: tl.constexpr, OUT_BF16: tl.constexpr):
    """fp32 accumulator -> F.linear's output dtype -> logits dtype, returned as fp32."""
    if W_KIND == 1:
        acc = round_bf16(acc)
    elif W_KIND == 2:
        acc = acc.to(tl.float16).to(tl.float32)  # fp16 casts round to nearest even on GPU and interpreter
    if OUT_BF16:
        acc = round_bf16(acc)
    return acc


@triton.jit
def add_in_logits_dtype(base, bias, OUT_BF16: tl.constexpr):
    """``base + bias`` as torch computes it in the logits dtype (fp32 add, one RNE rounding for bf16)."""
    s = base + bias
    if OUT_BF16:
        s = round_bf16(s)
    return s


@triton.jit
def selection_score(s, first_gid, sampled, scale, seed, offset, SAMPLE: tl.constexpr, ALIGNED: tl.constexpr,
                    SALT: tl.constexpr, JOIN: tl.constexpr = True):
    """Greedy rows: the biased logit. Sampled rows (``sampled``, i.e. ``T > 0``): the keyed Gumbel-max
    score ``s * scale + G2(seed, offset, gid)``, ``scale = gumbel_scale(T)`` computed once per row.

    ``s`` holds ``R * 4G`` scores in column order (any shape: ``[4G]`` with ``R = 1`` or ``[R, 4G]``);
    ``first_gid`` ``[R, G]`` (or ``[1, G]``) the global id of each run of four consecutive columns,
    ``seed`` / ``offset`` broadcast to ``[R, G]`` (per row ``[R, 1]``, or scalars).
    :func:`~tensorrt_llm_ext.kernels.ordered_key.gumbel2_noise_grouped` computes one Philox block per run
    (``ALIGNED``: the runs start on multiples of 4; ``JOIN``: its schedule choice), the same noise, bit for
    bit, as the per-element ``gumbel2_noise(seed, offset, gid, SALT)``.

    Cost (2026-12-04; B = 32, K = 7, V = 128256: 28.7 M sampled elements per chain, 7.2 M per TP-4 rank).
    A Philox-4x32-10 block is 10 rounds of two 32x32 -> 64-bit products (4 IMAD-class: ``mul.hi`` +
    ``mul.lo``), two 3-input xors (2 LOP3) and the key schedule (2 IADD, per row), ~70-80 integer
    instructions with the counter setup; the per-element form asked for one block per element plus a 3-way
    word select (the compiler merged the blocks of columns one thread holds in the same run: two per run on
    the MMA layouts, so it paid less than 4x). Now one block per run of four (two on a shard whose first id
    is not a multiple of 4). The Gumbel map stays per element: 2 ``MUFU.LG2`` (SFU, 16 / clk / SM), ~12 fp32
    ALU, one fma. Registers do not grow. Static counts, sm_90, Triton 3.6.0, bf16 (compile-check): exact
    select 2016-2260 -> 1236-1486 SASS instructions for 16 columns per thread (~48 fewer per element),
    122-125 -> 95-96 registers; fused 16-row tile's loop 1242 -> 910 per 8 elements per thread (~41 fewer
    per element), 128 -> 128 registers. At ~45 instructions x 28.7 M elements = 40 M warp instructions
    per chain, the H200 (132 SMs, 4 issues / clk, IMAD / LOP3 at half that, ~1.98 GHz) issues them in
    ~40-80 us: the most it can save of the 223 us the sampled draft costs over the greedy one (B = 32), if
    the kernels are issue-bound; ~10-20 us per chain on a TP-4 rank. Less where they wait on memory.
    """
    if SAMPLE:
        g = tl.reshape(gumbel2_noise_grouped(seed, offset, first_gid, ALIGNED, SALT, JOIN), s.shape)
        s = tl.where(sampled, gumbel_score(s, scale, g), s)
    return s


def markov_step_reference(base_k, prev, markov_w1, markov_w2, *, vocab_start: int, vocab_size: int,
                          temperatures=None, seeds=None, offsets=None, salt: int):
    """Eager twin of one chain step: ``(biased [B, V_local] logits dtype, keys [B] int64)``.

    ``bias = F.linear(w1[prev], w2)`` (a zero row for invalid ``prev``), ``biased = base_k + bias`` in the
    logits dtype, and each row's selection key over this shard (``torch.argmax`` order; keyed Gumbel-max
    at ``offsets`` for rows with ``T > 0``). The stock chain the upstream worker ran, bit for bit; the
    exact mode's kernels equal it bit for bit, the fused mode up to the fp32 sum order of its bias.
    """
    valid = (prev >= 0) & (prev < vocab_size)
    h = markov_w1[torch.where(valid, prev, 0)]
    h = torch.where(valid[:, None], h, torch.zeros_like(h))
    bias = F.linear(h, markov_w2).to(base_k.dtype)
    biased = base_k + bias
    score = biased.float()
    if temperatures is not None:
        score = keyed_gumbel_scores_torch(score, temperatures, seeds, offsets, vocab_start, salt)
    return biased, shard_argmax_key_reference(score, vocab_start, vocab_size)
