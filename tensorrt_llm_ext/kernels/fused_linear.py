"""A small-M linear with the layer's neighbours fused in: RMSNorm prologue, bias, SiLU-mul or residual epilogue.

``y = epilogue(norm(x) @ W^T + b)`` for the few rows of a decode / verify step (``M = B * T`` up to a few
dozen), where a layer of separate launches (norm, GEMM, SiLU-mul, residual add) is bound by launch latency,
not bytes: one program per ``BLOCK_N`` output columns (and ``BLOCK_M`` rows), streaming its weight rows once.
Up to ``GEMV_MAX_ROWS`` rows the product skips ``tl.dot`` (whose 16 x 16 minimum tile leaves most SMs idle on
a 576-wide output) for a broadcast product over narrow column blocks (:func:`fused_gemv_settings`).

* **Prologue** (``norm_weight`` given): RMSNorm of each input row, the numerics of
  :mod:`~tensorrt_llm_ext.kernels.rms_norm` -- ``x * rsqrt(mean(x^2) + eps)`` in fp32 rounded to the input
  dtype, times the weight, rounded again -- applied to each ``[BLOCK_M, BLOCK_K]`` tile before the product.
  Every program first sums the squares of its rows over all of ``K`` (``M x K`` elements, read from L2 by
  every program: cheap next to its ``BLOCK_N x K`` weight rows at ``K`` = 576 .. 14336).
* **Epilogues**: ``EPI_NONE``; ``EPI_SILU_MUL`` (the weight is a fused gate-up ``[2N, K]``: each program
  keeps the gate and the up accumulators of the same ``N`` columns and writes ``silu(gate) * up``, the
  numerics of :mod:`~tensorrt_llm_ext.kernels.silu_mul`); ``EPI_RESIDUAL`` (``y + residual`` formed in fp32
  from the rounded ``y``, rounded once: the residual stream's next value, as the fused add + norm forms it).
  The bias is added to the fp32 accumulator before the output rounding.

Determinism: each output row is a function of that row only (tiles never mix rows; the reduction order over
``K`` is fixed by the settings), so a row's bits do not depend on its neighbours; the settings
(:func:`fused_linear_settings`) depend on the shape and dtype only (``M`` through ``BLOCK_M``).

Exactness vs the eager twin (:func:`fused_linear_reference`): the twin composes the same roundings with
``F.linear``; the product's summation order differs (fp32 within ``1e-5`` relative; 16-bit within the output
rounding, a unit in the last place, more where a rounding of the prologue flips).

Programmatic dependent launch (Hopper, :func:`~tensorrt_llm_ext.kernels.common.programmatic_launch`): before
``gdc_wait()`` the program's weight rows are brought to L2 (``prefetch.global.L2``, no registers held:
:func:`prefetch_lines`) -- the few-row form (and the dot tiles with :data:`DOT_PEEL_FIRST_BLOCK`) loads its first
``BLOCK_K`` block into registers instead, its products the loop's first, peeled, in the same order --; ``x`` after
it. The residual is read before the wait too where the caller says an earlier launch wrote it (``early_residual``, the
layers' two residual products: :data:`EARLY_EPILOGUE`), and the norm prologue's chunks are unrolled so their loads
leave together (:data:`NORM_UNROLL_MAX`): after the wait a program's chain is the input's round trip and the
pipelined loop's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.kernels.common import check_tensor, programmatic_launch
from tensorrt_llm_ext.kernels.rms_norm import rms_norm_reference
from tensorrt_llm_ext.kernels.silu_mul import silu_mul_reference

__all__ = ["EPI_NONE", "EPI_RESIDUAL", "EPI_SILU_MUL", "GEMV_MAX_ROWS", "dot_block_m", "dot_settings",
           "fused_gemv_settings", "fused_linear", "fused_linear_reference", "fused_linear_settings", "norm_unroll",
           "prefetch_lines", "stage_block_k"]

EPI_NONE, EPI_SILU_MUL, EPI_RESIDUAL = 0, 1, 2
MAX_BLOCK_M = 64  # rows per program; larger M takes several row tiles (cuBLAS is the better choice there)
# Steps of at most this many rows take 16-row dot tiles: a small-M product's speed is the number of weight streams in
# flight, and two 16-row tiles of a 32-row step launch twice the programs of one 32-row tile (measured on the H200,
# SmolLM2's [32, 1] step: 1310.6 vs 1341.0 us, every hidden bit the same: each row's products and their K order
# do not depend on the tile's other rows).
SMALL_STEP_ROWS = 32
# Steps of at most this many rows take the dot-free few-row form (_mac). Measured on the H200 (SmolLM2 shape):
# at 1 row it cuts the fused GEMMs from 4.4 to 3.2 us and the QKV kernel from 6.0 to 3.9 us. The whole forward at
# more rows (H100, 2026-12-06): 2 rows 4 % faster than the dot tiles, 4 rows 41 % slower, 8 rows 82 % slower (the
# broadcast product's reduction grows with the rows; a 16-row dot tile costs the same from 2 to 16), so one row
# (TLLM_EXT_GEMV_MAX_ROWS overrides it for an A/B; docs/target_forward.md).
GEMV_MAX_ROWS = ENV.gemv_max_rows
GEMV_MAX_TILE = 16384  # fp32 elements of one weight tile (BLOCK_N x BLOCK_K, x2 for gate-up) times BLOCK_M
# Lines of each weight row brought to L2 before the programmatic wait beyond the first BLOCK_K block (8 KB of a
# bf16 row: all of SmolLM2's K = 576 / 1536; the 8B shape runs cuBLAS).
MAX_PREFETCH_LINES = 64
# Whether the launchers bring those lines to L2 (no bit of a result changes; scripts/profile_target_kernels.py
# flips it, as it flips GEMV_MAX_ROWS, to time the forward without).
WEIGHT_PREFETCH = True
# A program's latency is its chain of dependent memory round trips (a few-row product streams ~20 KB of weights
# per program): the norm prologue's BLOCK_K chunks, up to this many, are unrolled so their loads leave together
# (SmolLM2's K = 576: three chunks, one round trip instead of three; the same sums in the same order, the same
# bits); 0 keeps the loop. Also read by fused_qkv.
NORM_UNROLL_MAX = 8
# Whether the epilogue's inputs that no earlier launch of the step is still writing -- a residual its caller marks
# ``early_residual``, fused_qkv's positions, slots, page table and cos / sin -- are read before the programmatic
# wait, off the chain after it (no bit changes). With NORM_UNROLL_MAX, measured (H100, fifteenth session, graph
# replay at 1k keys): [32, 1] 1151 -> 1094 us, [1, 1] 504 -> 488, [4, 8] 883 -> 841 (docs/target_forward.md).
EARLY_EPILOGUE = True
# Software-pipeline stages of the dot tiles' K loop (Triton's default): its weight and input blocks leave stages - 1
# iterations ahead (cp.async). 2 and 4 measured slower (H100, fifteenth session: [32, 1] 1211 / 1196 us against 1094).
DOT_STAGES = 3
# Whether the dot tiles, under programmatic launch, hold their first weight block in registers across the wait and
# peel its products off the loop (the few-row form always does: its one block is the whole product). Off: every block
# brought to L2 before the wait, and after it the pipelined loop issues the first stages' inputs and weights at once
# (one round trip where the peeled block's input and then the loop's cost two; 48 / 96 / 120 registers instead of
# 62 / 128 / 142 at [32, 1]); the same products in the same order. Measured off (H100, fifteenth session, graph
# replay at 1k keys, two runs each): [32, 1] 1104 / 1081 -> 1060 / 1044 us, [4, 8] 856 / 846 -> 812 / 798,
# [1, 8] 692 / 691 -> 670 / 665, [1, 1] unchanged (the few-row form).
DOT_PEEL_FIRST_BLOCK = False
# Parts each BLOCK_K block of a 16-row dot tile is split into, a batch of one batched dot each, summed at the end
# (1: off). A 16 x 16 tile runs on mma.sync (wgmma needs 64 rows), one warp's accumulator chain of K / 16 dependent
# MMAs (36 at K = 576, 96 at down's 1536); split in 4 on 4 warps the chain is 4x shorter and the parts' sum one
# reduction. Another summation order over K (bits differ from 1, within the product's rounding), shape-only.
# 4 since 2026-12-08 (H100, graph replay, 1k keys, against 1 in the same run: the [32, 1] forward 1037-1047 ->
# 1028 us, [1, 8] 665-676 -> 657, [4, 8] 807-815 -> 797, the target-only step at B = 32 1112 -> 1082; 2 no faster
# than 1 at [32, 1]; [1, 1] takes the few-row form, unchanged). TLLM_EXT_DOT_K_SPLIT=1 turns it off.
DOT_K_SPLIT = ENV.dot_k_split


@triton.jit
def _chunk_sq_sum(x_ptr, rows, row_ok, stride_xm, k0, k, BLOCK_K: tl.constexpr):
    """Each row's sum of ``x^2`` (fp32) over inputs ``k0 .. k0 + BLOCK_K - 1`` (below ``k``)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & (kk < k)[None, :],
                other=0.0).to(tl.float32)
    return tl.sum(x * x, axis=1)


@triton.jit
def _row_rstd(x_ptr, rows, row_ok, stride_xm, k, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              K_UNROLL: tl.constexpr = 0):
    """``rsqrt(mean(x^2) + eps)`` of each row (fp32), summed over ``K`` in ``BLOCK_K`` chunks, in order.
    ``K_UNROLL`` > 0 (``cdiv(K, BLOCK_K)``): the chunks unrolled, so their loads are issued together -- one
    round trip instead of one per chunk; the same sums in the same order (the same bits)."""
    ss = tl.zeros([BLOCK_M], tl.float32)
    if K_UNROLL > 0:
        for i in tl.static_range(K_UNROLL):
            ss += _chunk_sq_sum(x_ptr, rows, row_ok, stride_xm, i * BLOCK_K, k, BLOCK_K)
    else:
        for k0 in range(0, k, BLOCK_K):
            ss += _chunk_sq_sum(x_ptr, rows, row_ok, stride_xm, k0, k, BLOCK_K)
    return tl.math.rsqrt(ss / k + eps)


@triton.jit
def _normed_tile(x, rstd, norm_w_ptr, kk, k_ok):
    """The RMSNorm of an input tile in the input dtype (rms_norm's two roundings): ``rstd``, ``kk`` and ``k_ok``
    broadcast to the tile (``[BLOCK_M, 1]`` and ``[1, BLOCK_K]`` for ``[BLOCK_M, BLOCK_K]``)."""
    dt = x.dtype
    normed = (x.to(tl.float32) * rstd).to(dt).to(tl.float32)
    w = tl.load(norm_w_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    return (normed * w).to(dt)


@triton.jit
def _split_input(x_ptr, rows, row_ok, stride_xm, k0, k, rstd, norm_w_ptr, NORM: tl.constexpr,
                 KSPLIT: tl.constexpr, KS: tl.constexpr):
    """The ``[KSPLIT, BLOCK_M, KS]`` input tile of inputs ``k0 .. k0 + KSPLIT * KS - 1`` (part ``s`` holds
    ``k0 + s KS ..``), normed when ``NORM``: the K-split dot tiles' operand (:data:`DOT_K_SPLIT`)."""
    ka = k0 + tl.arange(0, KSPLIT)[:, None, None] * KS + tl.arange(0, KS)[None, None, :]
    ka_ok = ka < k
    a = tl.load(x_ptr + rows[None, :, None] * stride_xm + ka, mask=row_ok[None, :, None] & ka_ok, other=0.0)
    if NORM:
        a = _normed_tile(a, rstd[None, :, None], norm_w_ptr, ka, ka_ok)
    return a


@triton.jit
def _split_weight(w_ptr, w_rows, col_ok, k0, k, KSPLIT: tl.constexpr, KS: tl.constexpr):
    """The ``[KSPLIT, KS, BLOCK_N]`` weight tile matching :func:`_split_input` (``w_rows``: element offsets)."""
    kw = k0 + tl.arange(0, KSPLIT)[:, None, None] * KS + tl.arange(0, KS)[None, :, None]
    return tl.load(w_ptr + w_rows[None, None, :] + kw, mask=(kw < k) & col_ok[None, None, :], other=0.0)


@triton.jit
def _mac(acc, a, w, GEMV: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ w`` for ``a [BLOCK_M, BLOCK_K]``, ``w [BLOCK_K, BLOCK_N]``: ``tl.dot`` (16 rows / columns at
    least), or for the few-row form (``GEMV``) a broadcast product summed over ``K`` in fp32, which takes any
    power-of-two tile -- so a program can own as few as 2 output columns and more SMs stream the weight."""
    if GEMV:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)


@triton.jit
def _products(x_ptr, rows, row_ok, stride_xm, k, rstd, norm_w_ptr, w1_ptr, w1_rows, w2_ptr, w2_rows, col_ok,
              w1_first, w2_first, k_begin, TWO: tl.constexpr, PAIRED_LOADS: tl.constexpr, NORM: tl.constexpr,
              GEMV: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PEEL: tl.constexpr,
              KSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The input rows (RMS-normed when ``NORM``) times the weight rows ``w1_rows`` of ``w1_ptr`` -- and, when ``TWO``,
    ``w2_rows`` of ``w2_ptr`` (gate and up; a head's two rotary halves) -- as two fp32 ``[BLOCK_M, BLOCK_N]``
    accumulators: K-split dot tiles (``KSPLIT > 1``), or the first K block's weights loaded before the programmatic
    wait (``PEEL``: ``w1_first`` / ``w2_first``) and the loop from ``k_begin``. Both weight-streaming kernels' K
    loop (this one and fused_qkv's). ``PAIRED_LOADS``: the loop loads both weight tiles before the products
    (fused_qkv's order) instead of each before its own (this kernel's gate / up): the two orders compile to other
    registers and schedules (e.g. 146 -> 128 and 159 -> 178 registers on gate-up tiles under Triton 3.6.0), and each
    kernel keeps the one it was timed with."""
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if KSPLIT > 1:
        # Each BLOCK_K block split into KSPLIT parts, one batch of a batched dot each (its own warp and
        # accumulator), summed at the end: a 16-row tile's MMAs otherwise form one dependent chain of K / 16
        # steps per warp. The parts' order of summation is fixed by the settings (shape-only), as BLOCK_K's is.
        KS: tl.constexpr = BLOCK_K // KSPLIT
        acc1_3 = tl.zeros([KSPLIT, BLOCK_M, BLOCK_N], tl.float32)
        acc2_3 = tl.zeros([KSPLIT, BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k, BLOCK_K):
            a = _split_input(x_ptr, rows, row_ok, stride_xm, k0, k, rstd, norm_w_ptr, NORM, KSPLIT, KS)
            acc1_3 = _mac(acc1_3, a, _split_weight(w1_ptr, w1_rows, col_ok, k0, k, KSPLIT, KS), False, DOT_DTYPE,
                          PRECISION)
            if TWO:
                acc2_3 = _mac(acc2_3, a, _split_weight(w2_ptr, w2_rows, col_ok, k0, k, KSPLIT, KS), False, DOT_DTYPE,
                              PRECISION)
        acc1 = tl.sum(acc1_3, axis=0)
        acc2 = tl.sum(acc2_3, axis=0)
        k_begin = k  # the loop below runs no iteration
    if PEEL:  # the first K block with its prefetched weights (the same products, in the same order)
        kk0 = tl.arange(0, BLOCK_K)
        k_ok0 = kk0 < k
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk0[None, :], mask=row_ok[:, None] & k_ok0[None, :],
                    other=0.0)
        if NORM:
            a = _normed_tile(a, rstd[:, None], norm_w_ptr, kk0[None, :], k_ok0[None, :])
        acc1 = _mac(acc1, a, w1_first, GEMV, DOT_DTYPE, PRECISION)
        if TWO:
            acc2 = _mac(acc2, a, w2_first, GEMV, DOT_DTYPE, PRECISION)
    for k0 in range(k_begin, k, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            a = _normed_tile(a, rstd[:, None], norm_w_ptr, kk[None, :], k_ok[None, :])
        w_mask = k_ok[:, None] & col_ok[None, :]
        w1 = tl.load(w1_ptr + w1_rows[None, :] + kk[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if TWO and PAIRED_LOADS:
            w2 = tl.load(w2_ptr + w2_rows[None, :] + kk[:, None], mask=w_mask, other=0.0)
        acc1 = _mac(acc1, a, w1, GEMV, DOT_DTYPE, PRECISION)
        if TWO:
            if not PAIRED_LOADS:
                w2 = tl.load(w2_ptr + w2_rows[None, :] + kk[:, None], mask=w_mask, other=0.0)
            acc2 = _mac(acc2, a, w2, GEMV, DOT_DTYPE, PRECISION)
    return acc1, acc2


@triton.jit
def _prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of each address under ``mask`` (the line holding it; nothing is returned or held)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows_l2(w_ptr, w_rows, col_ok, k_from, k, LINE: tl.constexpr, LINES: tl.constexpr):
    """``prefetch.global.L2`` of inputs ``k_from .. k-1`` of the weight rows ``w_rows`` (element offsets), one
    address per ``LINE`` elements (a 128-byte line), at most ``LINES`` lines per row: no register is held, the
    loop's loads after the programmatic wait then hit L2."""
    kk = k_from + tl.arange(0, LINES) * LINE
    _prefetch_l2(w_ptr + w_rows[None, :] + kk[:, None], (kk < k)[:, None] & col_ok[None, :])


def prefetch_lines(k: int, block_k: int, elem_bytes: int, pdl: bool) -> int:
    """``PREFETCH_LINES`` of a weight-streaming kernel: the 128-byte lines of each weight row past its first
    ``BLOCK_K`` block (loaded before the programmatic wait), as a power of two, at most ``MAX_PREFETCH_LINES``;
    0 without programmatic launch (there is no earlier kernel to overlap) or when one block covers ``K``."""
    lines = triton.cdiv(max(k - block_k, 0), 128 // elem_bytes)
    return min(triton.next_power_of_2(lines), MAX_PREFETCH_LINES) if pdl and lines else 0


@triton.jit
def _fused_linear_kernel(
    x_ptr, w_ptr, bias_ptr, norm_w_ptr, res_ptr, out_ptr,
    m, n, k, stride_xm, stride_wn, stride_rm, stride_om, eps,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, GEMV: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, WEIGHT_LINE: tl.constexpr, K_UNROLL: tl.constexpr, EARLY_RES: tl.constexpr,
    PEEL: tl.constexpr, KSPLIT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_rows = cols.to(tl.int64) * stride_wn
    mask = row_ok[:, None] & col_ok[None, :]
    if EPILOGUE == 2:
        if EARLY_RES:  # written before the previous launch began (the caller's word): read before the wait
            r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    k_begin = 0
    w_first = 0  # the first K block's weights (PEEL), else unused
    w2_first = 0
    if PDL:
        # Programmatic dependent launch: the first K block of the weights (written by no kernel) streams in while
        # the previous kernel finishes (PEEL: into registers, its products peeled off the loop; else to L2 with
        # the rest); x (and the residual, unless EARLY_RES) are read after the wait.
        if PEEL:
            kk0 = tl.arange(0, BLOCK_K)
            w_mask0 = (kk0 < k)[:, None] & col_ok[None, :]
            w_first = tl.load(w_ptr + w_rows[None, :] + kk0[:, None], mask=w_mask0, other=0.0)
            if EPILOGUE == 1:
                w2_first = tl.load(w_ptr + n * stride_wn + w_rows[None, :] + kk0[:, None], mask=w_mask0, other=0.0)
            k_begin = BLOCK_K
        if PREFETCH_LINES > 0:  # the rest of the program's weight rows to L2 (the loop reads them after the wait)
            _prefetch_rows_l2(w_ptr, w_rows, col_ok, k_begin, k, WEIGHT_LINE, PREFETCH_LINES)
            if EPILOGUE == 1:
                _prefetch_rows_l2(w_ptr + n * stride_wn, w_rows, col_ok, k_begin, k, WEIGHT_LINE, PREFETCH_LINES)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        rstd = _row_rstd(x_ptr, rows, row_ok, stride_xm, k, eps, BLOCK_M, BLOCK_K, K_UNROLL)
    else:
        rstd = tl.full([BLOCK_M], 1.0, tl.float32)  # unused
    acc, acc_up = _products(x_ptr, rows, row_ok, stride_xm, k, rstd, norm_w_ptr, w_ptr, w_rows, w_ptr + n * stride_wn,
                            w_rows, col_ok, w_first, w2_first, k_begin, EPILOGUE == 1, False, NORM, GEMV, DOT_DTYPE,
                            PRECISION, PEEL, KSPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if EPILOGUE == 1:
            acc_up += tl.load(bias_ptr + n + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    y = acc.to(out_ty)
    if EPILOGUE == 1:
        g = y.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        y = (s * acc_up.to(out_ty).to(tl.float32)).to(out_ty)
    if EPILOGUE == 2:
        if not EARLY_RES:
            r = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(out_ty)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y, mask=mask)


def dot_settings(x: torch.Tensor, w: torch.Tensor):
    """``(DOT_DTYPE, PRECISION)`` for ``tl.dot`` of ``x`` by ``w``: 16-bit operands on the GPU's tensor cores
    (fp32 accumulate), IEEE fp32 products for fp32 models, and fp32 under the interpreter (its ``tl.dot`` on
    16-bit operands is wrong)."""
    fp32 = x.dtype == torch.float32 or w.dtype == torch.float32
    if not x.is_cuda or fp32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if w.dtype == torch.bfloat16 else tl.float16), "tf32"


def stage_block_k(k: int, block_m: int, w_cols: int, elem_bytes: int) -> int:
    """``BLOCK_K``: up to 256 inputs per iteration (wide weight loads), halved while one pipeline stage (the
    ``[BLOCK_M, BLOCK_K]`` input tile and the ``[BLOCK_K, w_cols]`` weight tiles) passes 40 KB of shared memory
    or the input tile 8192 elements (registers: the prologue holds it in fp32)."""
    bk = min(256, max(16, triton.next_power_of_2(k)))
    while bk > 16 and ((block_m + w_cols) * bk * elem_bytes > 40960 or block_m * bk > 8192):
        bk //= 2
    return bk


def dot_block_m(m: int) -> int:
    """Rows per program of the dot tiles for an ``m``-row step: 16 up to :data:`SMALL_STEP_ROWS` rows, else the
    next power of two up to :data:`MAX_BLOCK_M`."""
    return 16 if m <= SMALL_STEP_ROWS else min(MAX_BLOCK_M, triton.next_power_of_2(m))


# fp32 accumulator elements a K-split program may hold (KSPLIT x BLOCK_M x the accumulators' columns): 16 registers
# a thread at 4 warps. Wider tiles keep one part (a Qwen3-like head-dim-128 QKV tile, 2 x 64 columns, spilled
# 20-56 B split in 2 / 4 at 255 registers, sm_90, Triton 3.6.0).
SPLIT_MAX_ACC = 2048


def dot_k_split(block_m: int, block_k: int, acc_cols: int) -> int:
    """``KSPLIT`` of the dot tiles: :data:`DOT_K_SPLIT` for 16-row tiles (steps of at most
    :data:`SMALL_STEP_ROWS` rows, where a tile's MMAs are few and chained) whose ``BLOCK_K`` gives each part 16
    inputs or more and whose accumulators (``acc_cols`` columns in all) fit :data:`SPLIT_MAX_ACC` split, else 1.
    Shape-only, like the other settings."""
    split = DOT_K_SPLIT
    ok = split > 1 and block_m == 16 and block_k >= 16 * split and split * block_m * acc_cols <= SPLIT_MAX_ACC
    return split if ok else 1


def fused_linear_settings(m: int, n: int, k: int, elem_bytes: int = 2, gate_up: bool = False,
                          sms: int = 132) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` for ``M`` rows, ``N`` output columns, ``K`` inputs.

    ``BLOCK_N`` is the widest of 64 / 32 / 16 that still gives two programs per SM (``sms``, the H200's 132
    by default): a small-M product reads its weight once, so its speed is the number of weight streams in
    flight. ``BLOCK_K`` from :func:`stage_block_k` (``gate_up``: two weight tiles per stage). 8 warps for
    64-row tiles. Fixed per shape and dtype: never from lengths or data."""
    block_m = dot_block_m(m)
    block_n = 16
    for cand in (64, 32):
        if triton.cdiv(n, cand) >= 2 * sms:
            block_n = cand
            break
    block_k = stage_block_k(k, block_m, block_n * (2 if gate_up else 1), elem_bytes)
    return block_m, block_n, block_k, 8 if block_m >= 64 else 4


def fused_gemv_settings(m: int, n: int, k: int, gate_up: bool = False, sms: int = 132) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` of the few-row form (``m <= GEMV_MAX_ROWS``, :func:`_mac`).

    ``BLOCK_K`` covers ``K`` when the tile fits (one round trip), ``BLOCK_N`` the widest of 16 .. 2 that
    still gives a program per SM (``sms``) and fits the tile (``GEMV_MAX_TILE``). Shape-only, like
    :func:`fused_linear_settings`."""
    block_m = triton.next_power_of_2(max(1, m))
    tiles = 2 if gate_up else 1
    block_k = min(triton.next_power_of_2(k), 2048)
    block_n = 2
    for cand in (16, 8, 4):
        if triton.cdiv(n, cand) >= sms:
            block_n = cand
            break
    while block_k > 256 and block_m * block_n * block_k * tiles > GEMV_MAX_TILE:
        block_k //= 2
    while block_n > 1 and block_m * block_n * block_k * tiles > GEMV_MAX_TILE:
        block_n //= 2
    return block_m, block_n, block_k, 8


def _check(x, weight, bias, norm_weight, residual, epilogue):
    check_tensor("fused_linear x [M, K]", x, shape=(None, None), unit_last_stride=True,
                 dtype=(torch.bfloat16, torch.float16, torch.float32))
    m, k = x.shape
    check_tensor("fused_linear weight [N, K]", weight, shape=(None, k), unit_last_stride=True, device=x.device)
    if epilogue not in (EPI_NONE, EPI_SILU_MUL, EPI_RESIDUAL):
        raise ValueError(f"fused_linear: epilogue must be EPI_NONE, EPI_SILU_MUL or EPI_RESIDUAL, got {epilogue!r}")
    if epilogue == EPI_SILU_MUL and weight.shape[0] % 2:
        raise ValueError(f"fused_linear: the SiLU-mul epilogue needs a gate-up weight of 2N rows, got "
                         f"{weight.shape[0]}")
    if bias is not None:
        check_tensor("fused_linear bias [N]", bias, shape=(weight.shape[0],), contiguous=True, device=x.device)
    if norm_weight is not None:
        check_tensor("fused_linear norm_weight [K]", norm_weight, shape=(k,), contiguous=True, device=x.device)
    n_out = weight.shape[0] // (2 if epilogue == EPI_SILU_MUL else 1)
    if (residual is not None) != (epilogue == EPI_RESIDUAL):
        raise ValueError("fused_linear: residual= goes with (and only with) the EPI_RESIDUAL epilogue")
    if residual is not None:
        check_tensor("fused_linear residual [M, N]", residual, shape=(m, n_out), dtype=x.dtype,
                     unit_last_stride=True, device=x.device)
    return m, n_out, k


def norm_unroll(k: int, block_k: int) -> int:
    """``K_UNROLL`` of a norm prologue: its ``cdiv(k, block_k)`` chunks when at most :data:`NORM_UNROLL_MAX`,
    else 0 (the loop)."""
    chunks = triton.cdiv(k, block_k)
    return chunks if chunks <= NORM_UNROLL_MAX else 0


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, epilogue: int = EPI_NONE,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 early_residual: bool = False) -> torch.Tensor:
    """``epilogue(rms_norm(x) @ weight^T + bias)`` in one launch (see the module doc).

    Args:
        x: ``[M, K]`` bf16 / fp16 / fp32, unit last stride (rows may be strided); the norm's input when
            ``norm_weight`` is given, else the product's.
        weight: ``[N, K]`` (``[2N, K]`` gate rows then up rows for ``EPI_SILU_MUL``); bias: ``[N]`` / ``[2N]``.
        norm_weight: ``[K]`` RMSNorm weight (None: no prologue); eps: its epsilon.
        epilogue: ``EPI_NONE``, ``EPI_SILU_MUL`` or ``EPI_RESIDUAL`` (then ``residual [M, N]``).
        out: optional ``[M, N]`` of ``x``'s dtype (may alias ``residual``: each element is read before it is
            written, by the same program).
        early_residual: the caller's word that ``residual`` was written before the previous launch on the stream
            began (by an earlier launch, not the previous one): under programmatic launch the kernel then reads it
            before waiting on that launch. A previous launch that waits before it lets its dependents start
            (every kernel here) has seen the one before it complete.

    Returns ``out [M, N]``. CUDA-graph safe (allocates only its output, from the capture's pool).

    Example::

        act = fused_linear(h, gate_up_w, norm_weight=ln_w, eps=1e-5, epilogue=EPI_SILU_MUL)
        h = fused_linear(act, down_w, epilogue=EPI_RESIDUAL, residual=h)
    """
    m, n, k = _check(x, weight, bias, norm_weight, residual, epilogue)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    check_tensor("fused_linear out [M, N]", out, shape=(m, n), dtype=x.dtype, device=x.device, unit_last_stride=True)
    if m == 0:
        return out
    res = residual if residual is not None else out
    gemv = m <= GEMV_MAX_ROWS
    if gemv:
        block_m, block_n, block_k, warps = fused_gemv_settings(m, n, k, epilogue == EPI_SILU_MUL)
    else:
        block_m, block_n, block_k, warps = fused_linear_settings(
            m, n, k, max(x.element_size(), weight.element_size()), epilogue == EPI_SILU_MUL)
    dot_dtype, precision = dot_settings(x, weight)
    pdl = programmatic_launch(x)
    ksplit = 1 if gemv else dot_k_split(block_m, block_k, block_n * (2 if epilogue == EPI_SILU_MUL else 1))
    peel = pdl and (gemv or (DOT_PEEL_FIRST_BLOCK and ksplit == 1))
    _fused_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight, res, out,
        m, n, k, x.stride(0), weight.stride(0), res.stride(0), out.stride(0), float(eps),
        NORM=norm_weight is not None, HAS_BIAS=bias is not None, EPILOGUE=epilogue,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_DTYPE=dot_dtype, PRECISION=precision, GEMV=gemv,
        PDL=pdl, PEEL=peel, KSPLIT=ksplit,
        PREFETCH_LINES=prefetch_lines(k, block_k if peel else 0, weight.element_size(), pdl and WEIGHT_PREFETCH),
        WEIGHT_LINE=128 // weight.element_size(), K_UNROLL=norm_unroll(k, block_k) if norm_weight is not None else 0,
        EARLY_RES=bool(early_residual and EARLY_EPILOGUE and residual is not None),
        num_warps=warps, num_stages=DOT_STAGES, launch_pdl=pdl,
    )
    return out


def fused_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                           norm_weight: torch.Tensor | None = None, eps: float = 1e-6, epilogue: int = EPI_NONE,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
    """Eager twin of :func:`fused_linear`: ``rms_norm_reference``, ``F.linear``, ``silu_mul_reference`` / the
    fp32 residual add, each rounding where the kernel rounds."""
    m, n, k = _check(x, weight, bias, norm_weight, residual, epilogue)
    if norm_weight is not None:
        x, _ = rms_norm_reference(x, norm_weight, eps)
    y = F.linear(x, weight, bias)
    if epilogue == EPI_SILU_MUL:
        y = silu_mul_reference(y)
    elif epilogue == EPI_RESIDUAL:
        y = (y.float() + residual.float()).to(x.dtype)
    return y
