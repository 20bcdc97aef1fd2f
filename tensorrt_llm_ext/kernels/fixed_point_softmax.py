"""Fixed-point softmax weights: the exact, order-independent masses of rejection-sampling verification.

A temperature softmax summed in floating point depends on the summation order, hence on the TP size and
the tiling. We give every token an integer weight instead, computed without any transcendental:

    m = the row's largest finite logit (fp32; exchanged as an int32 ordered key, see ``ordered_key``)
    d = x - m                 (fp32)           s = div_rn(d, T)      (fp32, IEEE round-to-nearest)
    z = s * LOG2E             (fp32)           q = trunc(max(z, -64) * 2^24) as int64 (exact scaling)
    n = q >> 24  (floor)      f = q & (2^24 - 1)
    F = round(2^(30 + n + f / 2^24))  with integer ops only; F = 0 when n < -30 or x is not finite

``2^(f / 2^24)`` is a 256-entry Q30 table of ``2^(a / 256)`` (top 8 bits of f) times a cubic integer
polynomial of ``e^w``, ``w = b * ln2 / 2^24 < 2^-8 ln2`` (low 16 bits b), in Q30; the product is Q60 and one
rounding shift by ``30 - n`` gives F. Relative error against float64 ``2^(30 + q / 2^24)``: below 1e-8
(plus half a unit of F). No add follows a multiply in the float part, so FMA contraction cannot change
the rounding on GPU; Triton's ``div_rn`` and torch's fp32 division are both IEEE.

Consequences: F(max) = 2^30 exactly, so a row's mass ``Z = sum F < V * 2^30 < 2^62`` is an exact int64 sum,
the same in any order: shard sums plus one int64 all-reduce SUM are bitwise the TP-1 sum. F depends on
``(x, m, T)`` only, never on the tiling.

Kernels here (launchers + eager twins, bitwise equal):

* :func:`row_max_keys`: per row the largest finite logit (ordered int32 key as int64, ``EMPTY_KEY`` when the
  row has none) and, optionally, the ``torch.argmax``-order selection key (NaN first; as ``shard_select``).
* :func:`weight_sums`: per row ``Z``, the weight and radix key of one token of the row (the drafted one),
  and optionally the first exact top-p histogram (mass per top byte of the radix key, see ``top_p``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import (check_int, check_tensor, num_warps_for,
                                             refuse_allocation_while_capturing)
from tensorrt_llm_ext.kernels.ordered_key import (EMPTY_KEY, INT32_MIN, MAX_VOCAB, block_best, combine_best,
                                                  ordered_i32, ordered_i32_torch, pack_key, pack_key_torch)

__all__ = [
    "EXP2_Q30", "HIST_BUCKETS", "LOG2E_F32", "ONE_Q30", "SUMS_COLS", "decode_max_key_torch",
    "fixed_point_weight", "fixed_point_weight_torch", "radix_key_torch", "row_max_keys",
    "row_max_keys_reference", "weight_sums", "weight_sums_reference",
]

ONE_Q30 = 1 << 30
HIST_BUCKETS = 256
SUMS_COLS = 3  # weight_sums columns before the histogram: Z, F(token), radix key(token)
# fp32 value of log2(e) (the constant both Triton and torch multiply by, exactly representable).
LOG2E_F32 = float(torch.tensor(math.log2(math.e), dtype=torch.float32).item())
# 2^(a/256) in Q30, a = 0..255 (float64 is accurate to ~1e-16 here, far from any rounding tie).
EXP2_Q30 = [int(round(2.0 ** (a / 256.0) * ONE_Q30)) for a in range(256)]
_LN2_Q46_INT = int(round(math.log(2.0) * 2.0**46))

_LOG2E: tl.constexpr = tl.constexpr(LOG2E_F32)
_LN2_Q46: tl.constexpr = tl.constexpr(_LN2_Q46_INT)
_ONE: tl.constexpr = tl.constexpr(ONE_Q30)
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
_DEFAULT_BLOCK = 2048
_TABLES: dict[torch.device, torch.Tensor] = {}


def exp2_table(device: torch.device | str) -> torch.Tensor:
    """The ``[256]`` int64 Q30 table on ``device`` (cached; allocated outside capture on first use)."""
    device = torch.device(device)
    t = _TABLES.get(device)
    if t is None:
        refuse_allocation_while_capturing("exp2_table", device)
        t = torch.tensor(EXP2_Q30, dtype=torch.int64, device=device)
        _TABLES[device] = t
    return t


# ----------------------------------------------------------------------------------------------------
# Triton helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def fixed_point_weight(x, m, t, fin, exp2_ptr):
    """Integer weight F (int64) of fp32 logits ``x`` given the row max ``m`` and temperature ``t > 0``.

    ``fin`` marks the tokens that carry weight (finite, real vocabulary); the others get 0.
    """
    xs = tl.where(fin, x, m)
    d = xs - m
    s = tl.math.div_rn(d, t)
    z = s * _LOG2E
    z = tl.maximum(z, -64.0)
    q = (z * 16777216.0).to(tl.int64)
    n = q >> 24
    f = q & 16777215
    tab = tl.load(exp2_ptr + (f >> 16))
    b = f & 65535
    w = (b * _LN2_Q46) >> 40
    ww = w * w
    e = _ONE + w + (ww >> 31) + (((ww >> 30) * w) >> 30) // 6
    p = tab * e
    sh = tl.minimum(30 - n, 60)
    one = sh * 0 + 1
    big = (p + (one << (sh - 1))) >> sh
    return tl.where(fin & (n >= -30), big, 0)


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
def _row_max_keys_kernel(
    x_ptr,  # [R, V_local] logits
    keys_ptr,  # [R, 2] int64: (argmax key, finite-max key), EMPTY_KEY on entry
    stride_row,
    n_valid,
    vocab_start,
    chunk,
    BLOCK: tl.constexpr,
    ARGMAX: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    best_fin = tl.full([BLOCK], -2147483648, tl.int32)
    arg_k = -2147483648
    arg_c = 2147483647
    for start in range(col_begin, col_end, BLOCK):
        cols = start + lanes
        valid = cols < col_end
        x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        o = ordered_i32(x)
        best_fin = tl.maximum(best_fin, tl.where(valid & is_finite(x), o, -2147483648))
        if ARGMAX:
            bk, bc = block_best(o, cols, valid, 0)
            arg_k, arg_c = combine_best(arg_k, arg_c, bk, bc)
    fin = tl.max(best_fin, 0)
    fin_key = tl.where(fin == -2147483648, -9223372036854775808, fin.to(tl.int64))
    tl.atomic_max(keys_ptr + row * 2 + 1, fin_key)
    if ARGMAX:
        tl.atomic_max(keys_ptr + row * 2, pack_key(arg_k, arg_c.to(tl.int64) + vocab_start))


@triton.jit
def _weight_sums_kernel(
    x_ptr,  # [R, V_local] logits
    keys_ptr,  # [R, 2] int64 exchanged keys (finite max in column 1)
    temp_ptr,  # [R // row_div] fp32
    tok_ptr,  # [R // row_div, k_tok] int64 global ids (read only if HAS_TOK)
    sums_ptr,  # [R, sums_stride] int64, zero on entry: Z, F(tok), radix(tok), hist[256]
    exp2_ptr,
    stride_row,
    sums_stride,
    n_valid,
    vocab_start,
    chunk,
    row_div,
    k_tok,
    BLOCK: tl.constexpr,
    HAS_TOK: tl.constexpr,
    HIST: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // row_div
    kk = row % row_div
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    out_ptr = sums_ptr + row.to(tl.int64) * sums_stride
    temp = tl.load(temp_ptr + b)
    t = tl.where(temp > 0.0, temp, 1.0)
    m = decode_max_key(tl.load(keys_ptr + row * 2 + 1))
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    acc = tl.zeros([BLOCK], tl.int64)
    for start in range(col_begin, col_end, BLOCK):
        cols = start + lanes
        valid = cols < col_end
        x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        fin = valid & is_finite(x)
        w = fixed_point_weight(x, m, t, fin, exp2_ptr)
        acc += w
        if HIST:
            tl.atomic_add(out_ptr + 3 + (radix_key(x) >> 24), w, mask=w > 0)
    tl.atomic_add(out_ptr, tl.sum(acc, 0))
    if HAS_TOK:
        if kk < k_tok:
            tok = tl.load(tok_ptr + b.to(tl.int64) * k_tok + kk)
            col = tok - vocab_start
            if (col >= col_begin) & (col < col_end):
                xt = tl.load(row_ptr + col).to(tl.float32)
                ft = is_finite(xt)
                wt = fixed_point_weight(xt, m, t, ft, exp2_ptr)
                tl.atomic_add(out_ptr + 1, wt)
                tl.atomic_add(out_ptr + 2, tl.where(ft, radix_key(xt), 0))


# ----------------------------------------------------------------------------------------------------
# torch twins of the helpers
# ----------------------------------------------------------------------------------------------------
def fixed_point_weight_torch(x: torch.Tensor, m: torch.Tensor, t: torch.Tensor, fin: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`fixed_point_weight` (fp32 ``x``, broadcastable fp32 ``m``/``t``, bool ``fin``)."""
    table = exp2_table(x.device)
    xs = torch.where(fin, x, m)
    d = xs - m
    s = d / t
    z = s * torch.tensor(LOG2E_F32, dtype=torch.float32, device=x.device)
    z = torch.clamp_min(z, -64.0)
    q = (z * 16777216.0).to(torch.int64)
    n = q >> 24
    f = q & 16777215
    tab = table[f >> 16]
    b = f & 65535
    w = (b * _LN2_Q46_INT) >> 40
    ww = w * w
    e = ONE_Q30 + w + (ww >> 31) + (((ww >> 30) * w) >> 30) // 6
    p = tab * e
    sh = torch.clamp_max(30 - n, 60)
    big = (p + (torch.ones_like(sh) << (sh - 1))) >> sh
    return torch.where(fin & (n >= -30), big, torch.zeros_like(big))


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


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


# ----------------------------------------------------------------------------------------------------
# Launchers and eager twins
# ----------------------------------------------------------------------------------------------------
def _check_logits(name: str, logits, vocab_start: int, vocab_size: int) -> int:
    check_tensor(name, logits, dtype=_SUPPORTED, unit_last_stride=True)
    if logits.dim() != 2:
        raise ValueError(f"{name}: expected shape [R, V_local], got {list(logits.shape)}")
    check_int("vocab_size", vocab_size, lo=1, hi=MAX_VOCAB + 1)
    check_int("vocab_start", vocab_start, lo=0, hi=vocab_size)
    return max(0, min(logits.shape[1], vocab_size - vocab_start))


def plan_chunks(n_valid: int, block: int, num_splits: int) -> tuple[int, int]:
    """``(splits, chunk)``: ``chunk`` a multiple of ``block`` with ``splits * chunk >= n_valid``.

    Depends on the shard width and the requested split count only (never on data), so every pass of a
    call and a captured graph's warm-up agree on it.
    """
    tiles = max(1, triton.cdiv(max(n_valid, 1), block))
    splits = max(1, min(num_splits, tiles))
    chunk = triton.cdiv(tiles, splits) * block
    return max(1, triton.cdiv(max(n_valid, 1), chunk)), chunk


def row_max_keys(logits: torch.Tensor, vocab_start: int, vocab_size: int, *, argmax: bool = True,
                 out: torch.Tensor | None = None, block_size: int = _DEFAULT_BLOCK,
                 num_splits: int = 1) -> torch.Tensor:
    """Per row of ``logits [R, V_local]``: ``out [R, 2]`` int64 = (argmax selection key, finite-max key).

    Column 0 is ``shard_select``'s greedy key (``torch.argmax`` order; left ``EMPTY_KEY`` when ``argmax``
    is False); column 1 the ordered int32 key of the largest finite logit, ``EMPTY_KEY`` if none. Both are
    exchanged with one int64 MAX. ``out`` is overwritten (filled here). CUDA-graph safe with ``out=``.
    """
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    rows = logits.shape[0]
    if out is None:
        refuse_allocation_while_capturing("row_max_keys", logits.device)
        out = torch.empty((rows, 2), dtype=torch.int64, device=logits.device)
    check_tensor("out", out, shape=(rows, 2), dtype=torch.int64, device=logits.device, contiguous=True)
    out.fill_(EMPTY_KEY)
    if rows == 0 or n_valid == 0:
        return out
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    _row_max_keys_kernel[(rows, splits)](
        logits, out, logits.stride(0), n_valid, vocab_start, chunk, BLOCK=block_size, ARGMAX=argmax,
        num_warps=num_warps_for(block_size))
    return out


def row_max_keys_reference(logits: torch.Tensor, vocab_start: int, vocab_size: int, *, argmax: bool = True,
                           out: torch.Tensor | None = None, block_size: int = _DEFAULT_BLOCK,
                           num_splits: int = 1) -> torch.Tensor:
    """Eager twin of :func:`row_max_keys` (tiling arguments accepted and ignored)."""
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    rows = logits.shape[0]
    res = torch.full((rows, 2), EMPTY_KEY, dtype=torch.int64, device=logits.device)
    if rows and n_valid:
        x = logits[:, :n_valid].float()
        o = ordered_i32_torch(x).to(torch.int64)
        fin = torch.where(_finite(x), o, torch.full_like(o, INT32_MIN)).max(dim=1).values
        res[:, 1] = torch.where(fin == INT32_MIN, torch.full_like(fin, EMPTY_KEY), fin)
        if argmax:
            best = o.max(dim=1).values
            col = (o == best[:, None]).to(torch.uint8).argmax(dim=1)
            res[:, 0] = pack_key_torch(best.to(torch.int32), col + vocab_start)
    return res if out is None else out.copy_(res)


def _check_sums_args(logits, keys, temperatures, tokens, row_div, hist, out):
    rows = logits.shape[0]
    check_int("row_div", row_div, lo=1)
    if rows % row_div:
        raise ValueError(f"logits: expected a row count divisible by row_div={row_div}, got {rows}")
    check_tensor("keys", keys, shape=(rows, 2), dtype=torch.int64, device=logits.device, contiguous=True)
    check_tensor("temperatures", temperatures, shape=(rows // row_div,), dtype=torch.float32,
                 device=logits.device, contiguous=True)
    if tokens is not None:
        check_tensor("tokens", tokens, shape=(rows // row_div, None), dtype=torch.int64, device=logits.device,
                     contiguous=True)
    width = SUMS_COLS + (HIST_BUCKETS if hist else 0)
    if out is not None:
        check_tensor("out", out, shape=(rows, width), dtype=torch.int64, device=logits.device, contiguous=True)
    return width


def weight_sums(logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor, vocab_start: int,
                vocab_size: int, *, tokens: torch.Tensor | None = None, row_div: int = 1, hist: bool = False,
                out: torch.Tensor | None = None, block_size: int = _DEFAULT_BLOCK,
                num_splits: int = 1) -> torch.Tensor:
    """This shard's integer masses: ``out [R, 3 (+256)]`` int64, zeroed here, then summed over columns.

    Row ``r`` belongs to request ``r // row_div`` (its temperature; ``T <= 0`` rows use ``T = 1``). Columns:
    ``Z`` (sum of F over owned finite columns), ``F(tok)`` and ``radix_key(tok)`` of the row's token
    ``tokens[r // row_div, r % row_div]`` where this shard owns it (0 elsewhere, and for rows with
    ``r % row_div >= tokens.shape[1]``), then with ``hist`` the mass per top byte of the radix key. Exact
    under one int64 SUM across ranks. ``keys`` are :func:`row_max_keys` after the exchange.
    """
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    width = _check_sums_args(logits, keys, temperatures, tokens, row_div, hist, out)
    rows = logits.shape[0]
    if out is None:
        refuse_allocation_while_capturing("weight_sums", logits.device)
        out = torch.empty((rows, width), dtype=torch.int64, device=logits.device)
    out.zero_()
    if rows == 0 or n_valid == 0:
        return out
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    k_tok = tokens.shape[1] if tokens is not None else 0
    _weight_sums_kernel[(rows, splits)](
        logits, keys, temperatures, tokens if tokens is not None else keys, out, exp2_table(logits.device),
        logits.stride(0), width, n_valid, vocab_start, chunk, row_div, k_tok,
        BLOCK=block_size, HAS_TOK=tokens is not None and k_tok > 0, HIST=hist, num_warps=num_warps_for(block_size))
    return out


def weight_sums_reference(logits: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor, vocab_start: int,
                          vocab_size: int, *, tokens: torch.Tensor | None = None, row_div: int = 1,
                          hist: bool = False, out: torch.Tensor | None = None, block_size: int = _DEFAULT_BLOCK,
                          num_splits: int = 1) -> torch.Tensor:
    """Eager twin of :func:`weight_sums` (tiling arguments accepted and ignored)."""
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    width = _check_sums_args(logits, keys, temperatures, tokens, row_div, hist, out)
    rows = logits.shape[0]
    dev = logits.device
    res = torch.zeros((rows, width), dtype=torch.int64, device=dev)
    if rows and n_valid:
        x = logits[:, :n_valid].float()
        fin = _finite(x)
        m = decode_max_key_torch(keys[:, 1])[:, None]
        temp = temperatures.repeat_interleave(row_div)[:, None]
        t = torch.where(temp > 0, temp, torch.ones_like(temp))
        w = fixed_point_weight_torch(x, m, t, fin)
        res[:, 0] = w.sum(dim=1)
        if hist:
            res[:, SUMS_COLS:].scatter_add_(1, radix_key_torch(x) >> 24, w)
        if tokens is not None and tokens.shape[1] > 0:
            k_tok = tokens.shape[1]
            kk = torch.arange(rows, device=dev) % row_div
            tok = torch.where(kk < k_tok, tokens.repeat_interleave(row_div, dim=0).gather(
                1, kk.clamp(max=k_tok - 1)[:, None])[:, 0], torch.full_like(kk, -1))
            col = tok - vocab_start
            own = (col >= 0) & (col < n_valid)
            colc = torch.where(own, col, torch.zeros_like(col))[:, None]
            res[:, 1] = torch.where(own, w.gather(1, colc)[:, 0], torch.zeros_like(col))
            xt = x.gather(1, colc)[:, 0]
            res[:, 2] = torch.where(own & _finite(xt), radix_key_torch(xt), torch.zeros_like(col))
    return res if out is None else out.copy_(res)
