"""Fixed-point softmax weights: the exact, order-independent masses of rejection-sampling verification.

A temperature softmax summed in floating point depends on the summation order, hence on the TP size and
the tiling. Every token gets an integer weight instead, and every mass is an exact int64 sum:

    m = the row's largest finite logit (fp32; exchanged as an int32 ordered key, see ``ordered_key``)
    c = div_rn(log2 e, T)          (fp32, once per row; T clamped to >= MIN_TEMPERATURE)
    z = (x - m) * c                (fp32, <= 0; IEEE sub then mul: no add after the multiply, no FMA)
    F = trunc(exp2(z) * 2^30)      (int32 <= 2^30, widened to int64); F = 0 for a non-finite x

``exp2`` is the hardware's ``ex2.approx.ftz.f32`` (one MUFU instruction) in compiled kernels and numpy's
``exp2`` under the Triton interpreter; the eager twins take numpy's on CPU tensors and torch's on CUDA
tensors. So: the same kernel gives the same F for the same ``(x, m, T)`` at every TP size, tiling and
kernel (one instruction sequence per element); under the interpreter kernel and twin agree bit for bit;
on a GPU the twin is within ``|F_kernel - F_twin| <= 2^-21 F + 1`` of the kernel (ex2.approx's relative
error is below 2^-22; tested). The kernel's weights define the distribution.

Consequences: F(max) = 2^30, tokens more than 30 binades below the max weigh 0, a row's mass
``Z = sum F < V * 2^30 < 2^62`` is an exact int64 sum, the same in any order: shard sums plus one int64
all-reduce SUM are bitwise the TP-1 sum. F depends on ``(x, m, T)`` only, never on the tiling.

Kernels here (launchers + eager twins), the first two passes of a verification call; each is ONE
launch over the target rows and the draft rows together and writes every slot of its output (per row and
column chunk: no memset, no global atomics shared between programs), so consumers reduce over the chunks:

* :func:`verify_keys` (pass 1): per (row, chunk) the ``torch.argmax``-order selection key of target rows
  (NaN first; as ``shard_select``) and the ordered int32 key of the largest finite logit (``EMPTY_KEY``
  when none). One int64 MAX exchange.
* :func:`verify_sums` (pass 2): per (row, chunk) ``Z``, the weight and radix key of the row's drafted
  token, and optionally the exact top-p window (the count of each of the 256 logit values of the row's dtype
  at and below the row max, see ``top_p``) in a per-program slot. One int64 SUM exchange.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.contract import MIN_TEMPERATURE
from tensorrt_llm_ext.kernels.common import check_int, check_tensor, num_warps_for
from tensorrt_llm_ext.kernels.ordered_key import (EMPTY_KEY, INT32_MIN, MAX_VOCAB, block_best,
                                                  ordered_i32, ordered_i32_torch, pack_key, pack_key_torch)

__all__ = [
    "HIST_BUCKETS", "LOG2E_F32", "ONE_Q30", "SUMS_COLS", "check_logits", "decode_max_key",
    "decode_max_key_torch", "fixed_point_weight", "fixed_point_weight_torch", "hist_add", "is_finite", "key_shift",
    "sfu_exp2",
    "sfu_exp2_torch", "sfu_log2", "sfu_log2_torch", "top_p_in_force", "top_p_in_force_torch", "weight_scale",
    "weight_scale_torch",
    "load_pair_tile", "plan_chunks", "radix_key", "radix_key_torch", "radix_to_f32", "radix_to_f32_torch",
    "subchunk_width", "row_max_from_keys", "row_max_from_keys_rows", "subchunk_index_torch", "split_reduce",
    "store_split_keys",
    "split_reduce_rows", "sums_layout", "verify_keys", "verify_keys_reference", "verify_sums",
    "verify_sums_reference",
]

ONE_Q30 = 1 << 30
HIST_BUCKETS = 256
SUMS_COLS = 3  # verify_sums columns before the histogram: Z, F(token), radix key(token)
# fp32 value of log2(e) (the constant both Triton and torch multiply by, exactly representable).
LOG2E_F32 = float(torch.tensor(math.log2(math.e), dtype=torch.float32).item())

_LOG2E: tl.constexpr = tl.constexpr(LOG2E_F32)
_MIN_T: tl.constexpr = tl.constexpr(MIN_TEMPERATURE)
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
_DEFAULT_BLOCK = 2048


# ----------------------------------------------------------------------------------------------------
# Triton helpers
# ----------------------------------------------------------------------------------------------------
# Compiled kernels take exp2 / log2 from the SFU (one MUFU instruction each); the interpreter has no inline
# asm and takes numpy's. Decided by what triton.jit made of this module (interpreted or compiled), by class
# name so that no interpreter module is imported.
@triton.jit
def _probe():
    pass


_SFU: tl.constexpr = tl.constexpr(type(_probe).__name__ != "InterpretedFunction")


@triton.jit
def sfu_exp2(x):
    """fp32 ``2^x``: ``ex2.approx.ftz.f32`` when compiled (relative error < 2^-22), numpy's when interpreted."""
    if _SFU:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def sfu_log2(x):
    """fp32 ``log2 x``: ``lg2.approx.ftz.f32`` when compiled, numpy's when interpreted."""
    if _SFU:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def hist_add(base, bucket, w):
    """``base[bucket] += w`` for int64 weights ``0 <= w < 2^31`` (int32 ``bucket``; ``w == 0`` adds nothing): one
    atomic per element into the calling program's own buckets. A warp-aggregated form (match.any + redux.sync,
    one atomic per distinct bucket of a warp) was measured on the H200 and made the top-p round 2.7-4x slower
    (B = 1 / 32 at 50016 columns), so the plain atomic stays."""
    tl.atomic_add(base + bucket, w, mask=w > 0)


@triton.jit
def weight_scale(temp):
    """Per-row ``c = div_rn(log2 e, T)`` (fp32) of the weights; ``T`` clamped to >= MIN_TEMPERATURE (the
    API refuses smaller positive T outside capture; the clamp keeps a captured call finite), greedy rows
    (``T <= 0``) use ``T = 1``."""
    t = tl.where(temp > 0.0, tl.maximum(temp, _MIN_T), 1.0)
    return tl.math.div_rn(tl.full(t.shape, _LOG2E, tl.float32), t)


@triton.jit
def top_p_in_force(temp, p):
    """Whether a request's top-p is in force (``T > 0`` and ``p < 1``): its target and draft rows weigh against the
    row max (this module's weights), every other request's rows use block weights (kernels/block_stats.py)."""
    return (temp > 0.0) & (p < 1.0)


@triton.jit
def fixed_point_weight(x, m, c, fin):
    """Integer weight F (int64) of fp32 logits ``x`` given the row max ``m`` and the row's ``c``
    (:func:`weight_scale`): ``trunc(exp2((x - m) * c) * 2^30)``. ``fin`` marks the tokens that carry weight
    (finite, real vocabulary); the others get 0."""
    xs = tl.where(fin, x, m)
    z = (xs - m) * c
    e = sfu_exp2(tl.maximum(z, -126.0))
    f = (e * 1073741824.0).to(tl.int32)
    return tl.where(fin, f, 0).to(tl.int64)


@triton.jit
def radix_key(x):
    """fp32 -> int64 in [0, 2^32): the ordered key made unsigned (radix-select digits, logit order)."""
    return ordered_i32(x).to(tl.int64) + 2147483648


@triton.jit
def radix_to_f32(u):
    """Inverse of :func:`radix_key` for non-NaN keys (int64 -> fp32)."""
    k = (u - 2147483648).to(tl.int32)
    bits = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def decode_max_key(key):
    """int64 finite-max key -> fp32 row max; 0.0 for a row without a finite logit (EMPTY_KEY)."""
    k = tl.where(key == -9223372036854775808, 0, key).to(tl.int32)
    bits = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def is_finite(x):
    return (x == x) & (tl.abs(x) < float("inf"))


@triton.jit
def load_pair_tile(t_row, q_row, is_t, cols, valid):
    """fp32 tile of a row that is a target row (``is_t``) or a draft row: one masked load per tensor, so
    one launch serves both tensors (even of different dtypes) and only the row's own bytes are read."""
    xt = tl.load(t_row + cols, mask=valid & is_t, other=0.0).to(tl.float32)
    xq = tl.load(q_row + cols, mask=valid & (~is_t), other=0.0).to(tl.float32)
    return tl.where(is_t, xt, xq)


@triton.jit
def store_split_keys(keys_ptr, row, split, num_splits, lane_k, lane_c, best_fin, vocab_start):
    """A (row, column chunk) program's two keys from its per-lane running maxima: the argmax key (the first column
    of the largest ordered key) and the finite-max key (``EMPTY_KEY`` when the chunk holds no finite value)."""
    arg_k, arg_c = block_best(lane_k, lane_c, lane_c < 2147483647, 0)
    fin = tl.max(best_fin, 0)
    out = keys_ptr + (row.to(tl.int64) * num_splits + split) * 2
    tl.store(out, pack_key(arg_k, arg_c.to(tl.int64) + vocab_start))
    tl.store(out + 1, tl.where(fin == -2147483648, -9223372036854775808, fin.to(tl.int64)))


@triton.jit
def split_reduce(ptr, num_splits, stride, mask, SPLITS: tl.constexpr, MAX: tl.constexpr):
    """Sum (or max, ``MAX``) of ``ptr[s * stride]`` over the column chunks ``s < num_splits`` in one vector load
    (``SPLITS`` = next power of two >= num_splits); ``ptr`` / ``mask`` a scalar (-> scalar)."""
    s = tl.arange(0, SPLITS)
    ok = (s < num_splits) & mask
    if MAX:
        return tl.max(tl.load(ptr + s * stride, mask=ok, other=-9223372036854775808), 0)
    else:
        return tl.sum(tl.load(ptr + s * stride, mask=ok, other=0), 0)


@triton.jit
def split_reduce_rows(ptr, num_splits, stride, mask, SPLITS: tl.constexpr, MAX: tl.constexpr):
    """:func:`split_reduce` for a block of pointers ``ptr [X]`` (mask ``[X]``) -> ``[X]``, one 2-D load."""
    s = tl.arange(0, SPLITS)
    ok = (s[None, :] < num_splits) & mask[:, None]
    addr = ptr[:, None] + s[None, :] * stride
    if MAX:
        return tl.max(tl.load(addr, mask=ok, other=-9223372036854775808), 1)
    else:
        return tl.sum(tl.load(addr, mask=ok, other=0), 1)


@triton.jit
def row_max_from_keys(keys_ptr, row, num_splits, SPLITS: tl.constexpr):
    """The row's exchanged finite-max key, reduced over its per-split slots ``keys [R, S, 2]`` column 1."""
    return split_reduce(keys_ptr + row.to(tl.int64) * num_splits * 2 + 1, num_splits, 2, row >= 0, SPLITS, True)


@triton.jit
def row_max_from_keys_rows(keys_ptr, rows, num_splits, mask, SPLITS: tl.constexpr):
    """:func:`row_max_from_keys` of a block of rows."""
    return split_reduce_rows(keys_ptr + rows.to(tl.int64) * num_splits * 2 + 1, num_splits, 2, mask, SPLITS, True)


@triton.jit(do_not_specialize=["rows_t"])  # a row count: one build for every batch
def _verify_keys_kernel(
    t_ptr, q_ptr,  # [rows_t, V_local], [rows_q, V_local] logits (q_ptr = t_ptr when rows_q = 0)
    keys_ptr,  # [rows_t + rows_q, S, 2] int64 out: (argmax key, finite-max key) per (row, split)
    stride_t, stride_q, rows_t, n_valid, vocab_start, chunk, num_splits,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    is_t = row < rows_t
    t_row = t_ptr + tl.minimum(row, rows_t - 1).to(tl.int64) * stride_t
    q_row = q_ptr + tl.maximum(row - rows_t, 0).to(tl.int64) * stride_q
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    # per-lane running maxima (a lane's columns increase, so a strictly greater key keeps the first column);
    # one reduction across lanes at the end instead of two per tile
    best_fin = tl.full([BLOCK], -2147483648, tl.int32)
    lane_k = tl.full([BLOCK], -2147483648, tl.int32)
    lane_c = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(col_begin, col_end, BLOCK):
        cols = start + lanes
        valid = cols < col_end
        x = load_pair_tile(t_row, q_row, is_t, cols, valid)
        o = ordered_i32(x)
        best_fin = tl.maximum(best_fin, tl.where(valid & is_finite(x), o, -2147483648))
        take = valid & is_t & (o > lane_k)  # draft rows need no argmax: EMPTY_KEY
        lane_k = tl.where(take, o, lane_k)
        lane_c = tl.where(take, cols, lane_c)
    store_split_keys(keys_ptr, row, split, num_splits, lane_k, lane_c, best_fin, vocab_start)


@triton.jit(do_not_specialize=["rows_t", "sums_q_off"])  # row counts: one build for every batch
def _verify_sums_kernel(
    t_ptr, q_ptr,  # logits as in _verify_keys_kernel
    keys_ptr,  # [rows_t + rows_q, S, 2] int64, exchanged (MAX)
    temp_ptr,  # [B] fp32
    tok_ptr,  # [B, k_tok] int64 global ids (read only if HAS_TOK)
    sums_ptr,  # flat int64 out: [rows_t, S, cols_t] then (at sums_q_off) [rows_q, S, 3]
    p_ptr,  # [B] fp32 top-p (read only if TOP_P_ONLY)
    stride_t, stride_q, rows_t, cols_t, sums_q_off, n_valid, vocab_start, chunk, num_splits, div_t, div_q, k_tok,
    BLOCK: tl.constexpr, HAS_TOK: tl.constexpr, HIST: tl.constexpr, SPLITS: tl.constexpr,
    SHIFT: tl.constexpr = 0,  # HIST: the radix-key bits the target dtype leaves constant (key_shift)
    TOP_P_ONLY: tl.constexpr = False,  # only the rows of requests with top-p in force (T > 0, p < 1) read their columns
):
    # programs walk the rows and chunks backwards: the first ones read what verify_keys read last (still in L2)
    row = tl.num_programs(0) - 1 - tl.program_id(0)
    split = tl.num_programs(1) - 1 - tl.program_id(1)
    is_t = row < rows_t
    rq = tl.maximum(row - rows_t, 0)
    b = tl.where(is_t, row // div_t, rq // div_q)
    kk = tl.where(is_t, row % div_t, rq % div_q)
    t_row = t_ptr + tl.minimum(row, rows_t - 1).to(tl.int64) * stride_t
    q_row = q_ptr + rq.to(tl.int64) * stride_q
    m = decode_max_key(row_max_from_keys(keys_ptr, row, num_splits, SPLITS))
    c = weight_scale(tl.load(temp_ptr + b))
    out = sums_ptr + tl.where(is_t, (row.to(tl.int64) * num_splits + split) * cols_t,
                              sums_q_off + (rq.to(tl.int64) * num_splits + split) * 3)
    # top-p window: bin j counts the tokens whose dtype value is the j-th below the row max (the value's key is
    # the max's minus j in units of 2^SHIFT). A count, not a mass: every token of a bin weighs the same, so the
    # consumer multiplies. Counted in the program's own register histogram (tl.histogram: shared memory inside
    # the program, no global atomics) and stored once: on a model's rows the window holds nearly every token (a
    # bf16 row whose max is in [16, 32) spans 32 logit units in its 256 values), where one global atomic per token
    # into ~100 hot bins serialised on their addresses. Integer counts: the same bins in any order.
    # int32 keys: (radix_key(m) >> s) - (radix_key(x) >> s) == (om >> s) - (o >> s) (2^31 is a multiple of 2^s); a
    # difference that wraps (s = 0 only: >= 2^31) turns negative and is out of the window either way
    wtop = ordered_i32(m) >> SHIFT
    win = tl.zeros([256], tl.int32)
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    if TOP_P_ONLY:  # the other rows use block weights (kernels/block_stats.py): their slots are written as empty
        col_end = tl.where(top_p_in_force(tl.load(temp_ptr + b), tl.load(p_ptr + b)), col_end, col_begin)
    acc = tl.zeros([BLOCK], tl.int64)
    for start in range(col_begin, col_end, BLOCK):
        cols = start + lanes
        valid = cols < col_end
        x = load_pair_tile(t_row, q_row, is_t, cols, valid)
        fin = valid & is_finite(x)
        acc += fixed_point_weight(x, m, c, fin)
        if HIST:
            if is_t:
                jw = wtop - (ordered_i32(x) >> SHIFT)
                inw = fin & (jw >= 0) & (jw < 256)
                win += tl.histogram(tl.where(inw, jw, 0), 256, mask=inw)
    ftok = tl.sum(acc, 0) * 0
    utok = ftok
    if HAS_TOK:
        if kk < k_tok:
            col = tl.load(tok_ptr + b.to(tl.int64) * k_tok + kk) - vocab_start
            if (col >= col_begin) & (col < col_end):
                xt = tl.where(is_t, tl.load(t_row + col).to(tl.float32), tl.load(q_row + col).to(tl.float32))
                ft = is_finite(xt)
                ftok = fixed_point_weight(xt, m, c, ft)
                utok = tl.where(ft, radix_key(xt), 0)
    tl.store(out, tl.sum(acc, 0))
    tl.store(out + 1, ftok)
    tl.store(out + 2, utok)
    if HIST:
        if is_t:
            tl.store(out + 3 + tl.arange(0, 256), win.to(tl.int64))


# ----------------------------------------------------------------------------------------------------
# torch twins of the helpers
# ----------------------------------------------------------------------------------------------------
def _on_numpy(x: torch.Tensor, fn) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(getattr(np, fn)(x.detach().contiguous().numpy()))


def sfu_exp2_torch(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^x`` as the kernels compute it on this device: numpy's on CPU tensors (the interpreter's),
    torch's on CUDA tensors (within 2^-22 relative of the kernel's ``ex2.approx``)."""
    return _on_numpy(x, "exp2") if x.device.type == "cpu" else torch.exp2(x)


def sfu_log2_torch(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``log2 x`` as the kernels compute it on this device (see :func:`sfu_exp2_torch`)."""
    return _on_numpy(x, "log2") if x.device.type == "cpu" else torch.log2(x)


def top_p_in_force_torch(temperatures: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`top_p_in_force`."""
    return (temperatures > 0) & (top_p < 1)


def weight_scale_torch(temperatures: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`weight_scale` (fp32, IEEE division)."""
    t = temperatures.to(torch.float32)
    t = torch.where(t > 0, torch.clamp_min(t, MIN_TEMPERATURE), torch.ones_like(t))
    return torch.full_like(t, LOG2E_F32) / t


def fixed_point_weight_torch(x: torch.Tensor, m: torch.Tensor, c: torch.Tensor, fin: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`fixed_point_weight` (fp32 ``x``, broadcastable fp32 ``m`` / ``c``, bool ``fin``)."""
    xs = torch.where(fin, x, m)
    z = (xs - m) * c
    e = sfu_exp2_torch(torch.clamp_min(z, -126.0))
    f = (e * 1073741824.0).to(torch.int32).to(torch.int64)
    return torch.where(fin, f, torch.zeros_like(f))


def radix_key_torch(x: torch.Tensor) -> torch.Tensor:
    return ordered_i32_torch(x).to(torch.int64) + 2147483648


def radix_to_f32_torch(u: torch.Tensor) -> torch.Tensor:
    k = (u - 2147483648).to(torch.int32)
    bits = torch.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.view(torch.float32)


def decode_max_key_torch(key: torch.Tensor) -> torch.Tensor:
    k = torch.where(key == EMPTY_KEY, torch.zeros_like(key), key).to(torch.int32)
    bits = torch.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.view(torch.float32)


def key_shift(dtype: torch.dtype) -> int:
    """Low radix-key bits that a logit of ``dtype`` leaves constant given its sign (bf16 16, fp16 13, fp32 0):
    ``key >> key_shift`` numbers the dtype's values in order, one apart. A static fact of the call."""
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


# ----------------------------------------------------------------------------------------------------
# Launchers and eager twins
# ----------------------------------------------------------------------------------------------------
def check_logits(name: str, logits, vocab_start: int, vocab_size: int) -> int:
    """Validate ``[R, V_local]`` shard logits and the vocabulary range; returns the owned column count."""
    check_tensor(name, logits, dtype=_SUPPORTED, unit_last_stride=True)
    if logits.dim() != 2:
        raise ValueError(f"{name}: expected shape [R, V_local], got {list(logits.shape)}")
    check_int("vocab_size", vocab_size, lo=1, hi=MAX_VOCAB + 1)
    check_int("vocab_start", vocab_start, lo=0, hi=vocab_size)
    return max(0, min(logits.shape[1], vocab_size - vocab_start))


def plan_chunks(width: int, block: int, num_splits: int) -> tuple[int, int]:
    """``(splits, chunk)``: ``chunk`` a multiple of ``block`` with ``splits * chunk >= width``.

    Launchers pass the shard's width (not its count of real ids), so every rank of a TP group, whose last
    shard holds the padding, plans the same chunks and exchanges buffers of the same shape; chunks past the
    real ids are empty. Depends on the width and the requested split count only (never on data), so every
    pass of a call and a captured graph's warm-up agree on it.
    """
    tiles = max(1, triton.cdiv(max(width, 1), block))
    splits = max(1, min(num_splits, tiles))
    chunk = triton.cdiv(tiles, splits) * block
    return max(1, triton.cdiv(max(width, 1), chunk)), chunk


def subchunk_width(chunk: int, block: int, n_sub: int) -> int:
    """Columns per sub-chunk when a column chunk is split into ``n_sub`` sub-chunks (a multiple of ``block``;
    trailing sub-chunks may be short or empty). The draw runs one program per (request, sub-chunk): it reads
    two rows per request, so it needs finer chunks than the passes over every row."""
    return triton.cdiv(max(1, chunk // block), n_sub) * block


def subchunk_index_torch(n_valid: int, chunk: int, n_sub: int, sub: int, device) -> torch.Tensor:
    """The (chunk, sub-chunk) slot ``chunk_index * n_sub + sub_index`` of each owned column ``[n_valid]``."""
    col = torch.arange(n_valid, device=device)
    return (col // chunk) * n_sub + (col % chunk) // sub


def _pair(target, draft, vocab_start, vocab_size):
    n_valid = check_logits("target_logits", target, vocab_start, vocab_size)
    if draft is not None:
        check_logits("draft_logits", draft, vocab_start, vocab_size)
        if draft.shape[1] != target.shape[1] or draft.device != target.device:
            raise ValueError(f"draft_logits: expected [*, {target.shape[1]}] on {target.device}, got "
                             f"{list(draft.shape)} on {draft.device}")
    return n_valid, target.shape[0], 0 if draft is None else draft.shape[0]


def verify_keys(target: torch.Tensor, draft: torch.Tensor | None, vocab_start: int, vocab_size: int, *,
                out: torch.Tensor, block_size: int = _DEFAULT_BLOCK, num_splits: int = 1) -> torch.Tensor:
    """Pass 1 of verification, one launch over the target rows and the draft rows.

    ``target [R_t, V_local]``, ``draft [R_q, V_local]`` or None. ``out [R_t + R_q, S, 2]`` int64 (S = the
    column plan's split count, :func:`plan_chunks`), every slot written: per (row, column chunk) the
    ``torch.argmax``-order selection key (target rows; ``EMPTY_KEY`` for draft rows) and the ordered key of
    the largest finite logit (``EMPTY_KEY`` if none). Exchanged with one int64 MAX; consumers reduce over
    S. CUDA-graph safe.
    """
    n_valid, rt, rq = _pair(target, draft, vocab_start, vocab_size)
    splits, chunk = plan_chunks(target.shape[1], block_size, num_splits)
    check_tensor("out", out, shape=(rt + rq, splits, 2), dtype=torch.int64, device=target.device, contiguous=True)
    if rt + rq == 0:
        return out
    if rt == 0:
        raise ValueError("target_logits: expected at least one row")
    q = draft if draft is not None and rq else target
    _verify_keys_kernel[(rt + rq, splits)](
        target, q, out, target.stride(0), q.stride(0), rt, n_valid, vocab_start, chunk, splits,
        BLOCK=block_size, num_warps=num_warps_for(block_size))
    return out


def _chunked(x: torch.Tensor, n_valid: int, splits: int, chunk: int, fill) -> torch.Tensor:
    """``[R, n_valid] -> [R, S, chunk]`` padded with ``fill`` (the twins' view of the column plan)."""
    pad = torch.full((x.shape[0], splits * chunk), fill, dtype=x.dtype, device=x.device)
    pad[:, :n_valid] = x
    return pad.view(x.shape[0], splits, chunk)


def _rows_f32(target, draft, n_valid):
    rows = [target[:, :n_valid].float()]
    if draft is not None and draft.shape[0]:
        rows.append(draft[:, :n_valid].float())
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def verify_keys_reference(target: torch.Tensor, draft: torch.Tensor | None, vocab_start: int, vocab_size: int, *,
                          out: torch.Tensor, block_size: int = _DEFAULT_BLOCK, num_splits: int = 1) -> torch.Tensor:
    """Eager twin of :func:`verify_keys` (the same per-split slots)."""
    n_valid, rt, rq = _pair(target, draft, vocab_start, vocab_size)
    splits, chunk = plan_chunks(target.shape[1], block_size, num_splits)
    check_tensor("out", out, shape=(rt + rq, splits, 2), dtype=torch.int64, device=target.device, contiguous=True)
    x = _rows_f32(target, draft, n_valid)
    o = _chunked(ordered_i32_torch(x), n_valid, splits, chunk, INT32_MIN)
    fin = _chunked(torch.isfinite(x), n_valid, splits, chunk, False)
    fmax = torch.where(fin, o, torch.full_like(o, INT32_MIN)).max(-1).values.to(torch.int64)
    best = o.max(-1).values
    col = (o == best[..., None]).to(torch.uint8).argmax(-1)
    gid = torch.arange(splits, device=x.device)[None, :] * chunk + col + vocab_start
    arg = pack_key_torch(best, gid)
    arg[rt:] = EMPTY_KEY
    out[..., 0] = arg
    out[..., 1] = torch.where(fmax == INT32_MIN, torch.full_like(fmax, EMPTY_KEY), fmax)
    return out


def sums_layout(rows_t: int, rows_q: int, splits: int, hist: bool) -> tuple[int, int]:
    """``(cols_t, size)`` of the flat sums buffer: ``[rows_t, S, cols_t]`` then ``[rows_q, S, 3]``."""
    cols_t = SUMS_COLS + (HIST_BUCKETS if hist else 0)
    return cols_t, rows_t * splits * cols_t + rows_q * splits * SUMS_COLS


def _check_sums(target, draft, keys, temperatures, tokens, div_t, div_q, hist, out, block_size, num_splits,
                vocab_start, vocab_size):
    n_valid, rt, rq = _pair(target, draft, vocab_start, vocab_size)
    splits, chunk = plan_chunks(target.shape[1], block_size, num_splits)
    dev = target.device
    check_int("row_div", div_t, lo=1)
    check_int("row_div_q", div_q, lo=1)
    if rt % div_t or rq % div_q:
        raise ValueError(f"rows: expected row counts divisible by {div_t} / {div_q}, got {rt} / {rq}")
    check_tensor("keys", keys, shape=(rt + rq, splits, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("temperatures", temperatures, shape=(rt // div_t,), dtype=torch.float32, device=dev,
                 contiguous=True)
    if tokens is not None:
        check_tensor("tokens", tokens, shape=(rt // div_t, None), dtype=torch.int64, device=dev, contiguous=True)
    cols_t, size = sums_layout(rt, rq, splits, hist)
    check_tensor("out", out, shape=(size,), dtype=torch.int64, device=dev, contiguous=True)
    return n_valid, rt, rq, splits, chunk, cols_t


def verify_sums(target: torch.Tensor, draft: torch.Tensor | None, keys: torch.Tensor, temperatures: torch.Tensor,
                vocab_start: int, vocab_size: int, *, tokens: torch.Tensor | None = None, row_div: int = 1,
                row_div_q: int = 1, hist: bool = False, out: torch.Tensor, block_size: int = _DEFAULT_BLOCK,
                num_splits: int = 1, top_p_only: torch.Tensor | None = None) -> torch.Tensor:
    """Pass 2 of verification, one launch over the target rows and the draft rows: this shard's masses.

    ``out`` is the flat buffer of :func:`sums_layout`, every slot written: per (row, column chunk) ``Z``
    (sum of F over owned finite columns), ``F(tok)`` and ``radix_key(tok)`` of the row's token where the
    chunk owns it (0 elsewhere), and for target rows with ``hist`` the top-p window: the count of finite tokens
    at each of the 256 values of the target's dtype at and below the row max (bin ``j``: radix key
    ``(radix_key(m) >> s) - j`` for ``s = key_shift(dtype)``; a per-program slot, no other program adds into it).
    Target row ``r`` belongs to request ``r // row_div`` (token ``tokens[b, r % row_div]`` if that index < K),
    draft row ``r`` to request ``r // row_div_q``; ``T <= 0`` rows use ``T = 1``. ``keys`` are :func:`verify_keys` after the
    MAX exchange. Exact under one int64 SUM across ranks. With ``top_p_only`` (``[B]`` fp32 top-p) only the rows of
    requests with top-p in force (``T > 0``, ``p < 1``) read their columns; the others' slots are written as 0 (they
    use block weights). CUDA-graph safe.
    """
    n_valid, rt, rq, splits, chunk, cols_t = _check_sums(target, draft, keys, temperatures, tokens, row_div,
                                                          row_div_q, hist, out, block_size, num_splits,
                                                          vocab_start, vocab_size)
    if rt + rq == 0:
        return out
    q = draft if draft is not None and rq else target
    k_tok = tokens.shape[1] if tokens is not None else 0
    if top_p_only is not None:
        check_tensor("top_p_only", top_p_only, shape=(rt // row_div,), dtype=torch.float32, device=target.device,
                     contiguous=True)
    _verify_sums_kernel[(rt + rq, splits)](
        target, q, keys, temperatures, tokens if tokens is not None else keys, out,
        top_p_only if top_p_only is not None else temperatures,
        target.stride(0), q.stride(0), rt, cols_t, rt * splits * cols_t, n_valid, vocab_start, chunk, splits,
        row_div, row_div_q, k_tok, BLOCK=block_size, HAS_TOK=k_tok > 0, HIST=hist,
        SPLITS=triton.next_power_of_2(splits), SHIFT=key_shift(target.dtype), TOP_P_ONLY=top_p_only is not None,
        num_warps=num_warps_for(block_size))
    return out


def verify_sums_reference(target: torch.Tensor, draft: torch.Tensor | None, keys: torch.Tensor,
                          temperatures: torch.Tensor, vocab_start: int, vocab_size: int, *,
                          tokens: torch.Tensor | None = None, row_div: int = 1, row_div_q: int = 1,
                          hist: bool = False, out: torch.Tensor, block_size: int = _DEFAULT_BLOCK,
                          num_splits: int = 1, top_p_only: torch.Tensor | None = None) -> torch.Tensor:
    """Eager twin of :func:`verify_sums` (the same per-split slots)."""
    n_valid, rt, rq, splits, chunk, cols_t = _check_sums(target, draft, keys, temperatures, tokens, row_div,
                                                          row_div_q, hist, out, block_size, num_splits,
                                                          vocab_start, vocab_size)
    dev = target.device
    rows = rt + rq
    x = _rows_f32(target, draft, n_valid)
    fin = torch.isfinite(x)
    kmax = keys[:, :, 1].max(1).values
    m = decode_max_key_torch(kmax)[:, None]
    bi = torch.cat([torch.arange(rt, device=dev) // row_div, torch.arange(rq, device=dev) // row_div_q])
    kk = torch.cat([torch.arange(rt, device=dev) % row_div, torch.arange(rq, device=dev) % row_div_q])
    c = weight_scale_torch(temperatures[bi])[:, None]
    if top_p_only is not None:  # the other rows read nothing: every slot 0
        fin = fin & top_p_in_force_torch(temperatures[bi], top_p_only[bi])[:, None]
    w = fixed_point_weight_torch(x, m, c, fin)
    res = torch.zeros((rows, splits, SUMS_COLS), dtype=torch.int64, device=dev)
    res[:, :, 0] = _chunked(w, n_valid, splits, chunk, 0).sum(-1)
    if tokens is not None and tokens.shape[1] > 0:
        k_tok = tokens.shape[1]
        tok = torch.where(kk < k_tok, tokens[bi, kk.clamp(max=k_tok - 1)], torch.full_like(kk, -1))
        col = tok - vocab_start
        own = (col >= 0) & (col < n_valid)
        colc = torch.where(own, col, torch.zeros_like(col))
        s_own = colc // chunk
        ri = torch.arange(rows, device=dev)
        ft = torch.where(own, w[ri, colc], torch.zeros_like(col))
        xt = x[ri, colc]
        ut = torch.where(own & fin[ri, colc], radix_key_torch(xt), torch.zeros_like(col))
        res[ri, s_own, 1] = ft
        res[ri, s_own, 2] = ut
    flat_t = out[: rt * splits * cols_t].view(rt, splits, cols_t)
    flat_t[:, :, :SUMS_COLS] = res[:rt]
    if hist:
        shift = key_shift(target.dtype)
        jw = (radix_key_torch(m[:rt]) >> shift) - (radix_key_torch(x[:rt]) >> shift)
        inw = fin[:rt] & (jw < HIST_BUCKETS)
        h = torch.zeros((rt, splits * HIST_BUCKETS), dtype=torch.int64, device=dev)
        scol = torch.arange(n_valid, device=dev) // chunk
        bins = scol[None, :] * HIST_BUCKETS + torch.where(inw, jw, torch.zeros_like(jw))
        h.scatter_add_(1, bins, inw.to(torch.int64))
        flat_t[:, :, SUMS_COLS:] = h.view(rt, splits, HIST_BUCKETS)
    out[rt * splits * cols_t:].view(rq, splits, SUMS_COLS).copy_(res[rt:])
    return out
