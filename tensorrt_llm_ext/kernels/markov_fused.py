"""One-launch-per-step DSpark Markov chain kernel (``mode="fused"``) and the Triton helpers both modes share.

Per block position ``k`` one launch: each program owns ``BLOCK_N`` vocabulary columns of this rank's
shard for ALL rows (looping over fixed ``BLOCK_B`` row tiles). It

1. resolves each row's previous token: the anchor at ``k == 0``, else the id of the row's selection key
   of step ``k-1`` (already reduced over programs by the previous launch's atomics and, on a vocab shard,
   all-reduced over ranks by the pair exchange);
2. gathers the previous tokens' ``markov_w1`` rows and computes its columns' bias in-kernel
   (``bias[b, n] = sum_r w1[prev_b, r] * w2[n, r]``, fp32 accumulate), so no bias tensor touches HBM;
3. rounds the bias to the weights dtype (what ``F.linear`` would return) then to the logits dtype, adds the
   base logits, rounds to the logits dtype, stores the biased row and folds its best selection key into
   the row's step key with one int64 atomic MAX per (program, row).

Exactness across vocab shards and batch sizes: the bias of column ``n`` for row ``b`` depends only on
``w1[prev_b]`` and ``w2[n]``: every program runs the same instruction sequence over the same tile shapes
(``BLOCK_B x BLOCK_R @ BLOCK_R x BLOCK_N``, r-chunks in increasing order), fixed per ``r`` and independent
of ``B``, of the shard width and of the column's position in its tile. Hence a shard's columns are
bitwise the columns of the TP-1 run, and a row's result does not depend on the other rows.

Step keys live in a ring of three ``[B]`` slots (``keys[3, max_B]``): launch ``k`` reads slot
``(k-1) % 3``, MAX-es into slot ``k % 3`` and resets slot ``(k+1) % 3`` to ``EMPTY_KEY`` (nobody touches it
during launch ``k``). Slot 0 must be ``EMPTY_KEY`` when a chain starts: the chain's finishing launch
re-establishes that for the next chain.

Interpreter: ``tl.dot`` on bf16 is wrong there, so ``DOT_FP32`` computes each r-chunk as an fp32
broadcast product summed over r (position-independent too). GPU: ``tl.dot`` on the weights dtype (bf16
tensor cores; fp32 weights with ``input_precision="ieee"``, never TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.ordered_key import block_best, gumbel_noise, key_to_id, ordered_i32, pack_key

# Weights dtype codes (constexpr W_KIND): how the fp32 accumulator is rounded to F.linear's output dtype.
W_FP32, W_BF16, W_FP16 = 0, 1, 2


# ----------------------------------------------------------------------------------------------------
# Shared Triton helpers (also used by the exact mode's select kernel)
# ----------------------------------------------------------------------------------------------------
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
def selection_score(s, gid, temp, seed, offset, SAMPLE: tl.constexpr, SALT: tl.constexpr):
    """Greedy: the biased logit. Keyed Gumbel-max rows (temp > 0): ``s / temp + G(seed, offset, gid)``."""
    if SAMPLE:
        g = gumbel_noise(seed, offset, gid, SALT)
        t = tl.where(temp > 0, temp, 1.0)
        noisy = tl.math.div_rn(s, t) + g
        s = tl.where(temp > 0, noisy, s)
    return s


# ----------------------------------------------------------------------------------------------------
# Fused step kernel
# ----------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["k", "vocab_start", "prev_slot", "cur_slot", "next_slot", "offset_k"])
def _markov_fused_step_kernel(
    base_ptr, w1_ptr, w2_ptr, out_ptr, anchors_ptr, keys_ptr, tokens_ptr,
    temps_ptr, seeds_ptr, offsets_ptr,
    B, v_local, vocab_start, vocab_size, k, prev_slot, cur_slot, next_slot, offset_k,
    stride_bb, stride_bk, stride_ob, stride_ok, stride_w1, stride_w2, stride_slot, stride_tok,
    R: tl.constexpr, IS_FIRST: tl.constexpr, SAMPLE: tl.constexpr, SALT: tl.constexpr,
    W_KIND: tl.constexpr, OUT_BF16: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # int32 local column ids
    cmask = cols < v_local
    gid = cols.to(tl.int64) + vocab_start
    col_ok = cmask & (gid < vocab_size)  # padded shard columns (gid >= V) never win
    rr = tl.arange(0, BLOCK_R)
    cols64 = cols.to(tl.int64)
    for b0 in range(0, B, BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)
        rmask = rows < B
        rows64 = rows.to(tl.int64)
        if IS_FIRST:
            prev = tl.load(anchors_ptr + rows64, mask=rmask, other=-1).to(tl.int64)
        else:
            key = tl.load(keys_ptr + prev_slot * stride_slot + rows64, mask=rmask, other=-9223372036854775808)
            prev = key_to_id(key)
            # Program 0 records step k-1's token and clears the slot launch k+1 will MAX into.
            tl.store(tokens_ptr + rows64 * stride_tok + (k - 1), prev, mask=rmask & (pid == 0))
        tl.store(keys_ptr + next_slot * stride_slot + rows64,
                 tl.full([BLOCK_B], -9223372036854775808, tl.int64), mask=rmask & (pid == 0))
        # Invalid previous ids (padding/dummy anchors) gather a zero w1 row: zero bias, never out of bounds.
        pvalid = rmask & (prev >= 0) & (prev < vocab_size)
        psafe = tl.where(pvalid, prev, 0)

        acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rk = r0 + rr
            h = tl.load(w1_ptr + psafe[:, None] * stride_w1 + rk[None, :],
                        mask=pvalid[:, None] & (rk[None, :] < R), other=0.0)  # [BLOCK_B, BLOCK_R]
            w = tl.load(w2_ptr + cols64[None, :] * stride_w2 + rk[:, None],
                        mask=cmask[None, :] & (rk[:, None] < R), other=0.0)  # [BLOCK_R, BLOCK_N]
            if DOT_FP32:
                acc += tl.sum(h.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
            elif W_KIND == 0:
                acc = tl.dot(h, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(h, w, acc)

        bias = bias_to_logits(acc, W_KIND, OUT_BF16)
        m2 = rmask[:, None] & cmask[None, :]
        base = tl.load(base_ptr + rows64[:, None] * stride_bb + k * stride_bk + cols64[None, :], mask=m2,
                       other=0.0).to(tl.float32)
        s = add_in_logits_dtype(base, bias, OUT_BF16)
        tl.store(out_ptr + rows64[:, None] * stride_ob + k * stride_ok + cols64[None, :],
                 s.to(out_ptr.dtype.element_ty), mask=m2)
        if SAMPLE:
            temp = tl.load(temps_ptr + rows64, mask=rmask, other=0.0)
            seed = tl.load(seeds_ptr + rows64, mask=rmask, other=0)
            off = tl.load(offsets_ptr + rows64, mask=rmask, other=0) + offset_k
            zeros = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.int64)
            s = selection_score(s, gid[None, :] + zeros, temp[:, None], seed[:, None] + zeros,
                                off[:, None] + zeros, SAMPLE, SALT)
        best, col = block_best(ordered_i32(s), cols[None, :] + tl.zeros([BLOCK_B, BLOCK_N], tl.int32),
                               rmask[:, None] & col_ok[None, :], 1)
        keys = pack_key(best, col.to(tl.int64) + vocab_start)
        tl.atomic_max(keys_ptr + cur_slot * stride_slot + rows64, keys, mask=rmask)


@dataclass(frozen=True)
class FusedConfig:
    """Tile config of the fused step. Fixed per (r, interpreter): never chosen by B or the shard width,
    because the tile shapes fix each column's reduction order (the cross-TP / cross-B bitwise guarantee)."""

    block_b: int
    block_n: int
    block_r: int
    num_warps: int
    num_stages: int


def fused_config(r: int, interpret: bool) -> FusedConfig:
    if interpret:
        return FusedConfig(block_b=16, block_n=64, block_r=32, num_warps=4, num_stages=1)
    # Hopper: BLOCK_B = 64 rows is one wgmma M tile; w2 tiles [64 x 128] bf16 stream through shared
    # memory once per row tile (at B <= 64 exactly once per step; at B = 128 the second pass hits L2).
    return FusedConfig(block_b=64, block_n=128, block_r=64, num_warps=4, num_stages=3)


def launch_fused_step(
    base, w1, w2, out, anchors, keys, tokens, temps, seeds, offsets, *,
    vocab_start: int, vocab_size: int, k: int, offset_k: int, salt: int, w_kind: int, out_bf16: bool,
    config: FusedConfig, interpret: bool,
) -> None:
    """Launch step ``k`` of the fused chain (internal; validated by the caller). CUDA-graph safe."""
    B, _, v_local = base.shape
    r = w1.shape[1]
    sample = temps is not None
    grid = (triton.cdiv(v_local, config.block_n),)
    _markov_fused_step_kernel[grid](
        base, w1, w2, out, anchors, keys, tokens,
        temps if sample else base, seeds if sample else anchors, offsets if sample else anchors,
        B, v_local, vocab_start, vocab_size, k, (k - 1) % 3, k % 3, (k + 1) % 3, offset_k,
        base.stride(0), base.stride(1), out.stride(0), out.stride(1), w1.stride(0), w2.stride(0),
        keys.stride(0), tokens.stride(0),
        R=r, IS_FIRST=k == 0, SAMPLE=sample, SALT=salt, W_KIND=w_kind, OUT_BF16=out_bf16,
        DOT_FP32=interpret, BLOCK_B=config.block_b, BLOCK_N=config.block_n, BLOCK_R=config.block_r,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
