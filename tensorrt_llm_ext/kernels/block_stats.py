"""One-pass verification statistics over fixed 1024-id blocks (issue 41; the first piece of the one-pass design).

Today's verification reads every owned column twice: the row max ``m`` first (``verify_keys``), then the integer
weights ``trunc(exp2((x - m) c) 2^30)`` that need it (``verify_sums``). Here every block ``b`` of global ids
``[G j, G (j + 1))`` (``G = STAT_BLOCK = 1024``, a constant of the definition, never the launch's tile) is weighed
against its own maximum, and the blocks combine exactly afterwards (docs/rejection_sampling.md, "One pass over
block-aligned shards"):

    m_b = the block's largest finite logit (fp32)        c = div_rn(log2 e, T)  (as fixed_point_softmax)
    R_b = ceil(m_b c)  and  g_b = exp2(m_b c - R_b) in (1/2, 1]: the product in float64 (exact for two fp32
          values), its distance to the grid point rounded once to fp32, then the SFU exp2
    F_b(x) = trunc(exp2((x - m_b) c) g_b 2^30)   (fp32 sub, mul, SFU exp2, mul, mul, truncate; 0 if not finite)
    Z_b = sum F_b < 2^40

so a token weighs ``F_b(x) 2^-(R - R_b)`` with ``R = max_b R_b`` the row's grid point: the same weight whatever
rank, chunk or launch reads its block. A program writes, per (row, column chunk), its own top ``R_c`` and
``STAT_BINS`` int64 bins, bin ``i`` the sum of ``Z_b`` of its blocks with ``R_c - R_b = i`` (``< V 2^30``): after
``R`` is known, shifting each slot's bins by ``R - R_c`` is an index shift, so the row's bins are exact int64 sums
in any order (:func:`row_bins_reference`), and ``Z = sum_i bin_i 2^-i`` (float64 from two exact int64 sums,
:func:`mass_from_bins`) is the same at every TP size and tiling. Blocks with ``R - R_b >= STAT_BINS`` weigh 0
(tokens ~30 binades below the row's grid point, as today's weights drop them).

The launch also writes the keys of ``verify_keys`` (argmax key of target rows, finite-max key), so it replaces
pass 1 and pass 2 of a call with one read of the logits. It needs block-aligned chunks: ``vocab_start`` a multiple
of ``G`` (the shards of the zero-padded LM head) and chunks of whole blocks (the launcher plans them).
:func:`block_combine` shifts each chunk's bins to the row's grid point ``R`` once the keys' MAX exchange has given
it (``R = ceil(m c)`` of the row max ``m``: ``R_b`` is monotone in ``m_b``).

The fallback on any shard (today's ``ceil(V / tp)`` widths, tiles smaller than a block) computes the same weights
in two passes: :func:`block_keys` (the keys, and the maxima of each shard's partial first and last block, exchanged
with the keys in one MAX round) and :func:`block_bins` (tiles of whole global blocks, the bins directly against the
known ``R``). Both give the same exchanged row bins (tested). The consumers -- the decisions and the draw of
:mod:`~tensorrt_llm_ext.kernels.rejection_sample` -- read them through :func:`block_row_mass` and weigh the draw's
tiles with :func:`tile_block_max` (docs/rejection_sampling.md, "One pass over block-aligned shards").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_int, check_tensor, num_warps_for, sm_count
from tensorrt_llm_ext.kernels.fixed_point_softmax import (_pair, _rows_f32, decode_max_key, decode_max_key_torch,
                                                          is_finite, load_pair_tile, plan_chunks, row_max_from_keys,
                                                          sfu_exp2, sfu_exp2_torch, split_reduce, split_reduce_rows,
                                                          store_split_keys, top_p_in_force, top_p_in_force_torch,
                                                          verify_keys_reference, weight_scale, weight_scale_torch)
from tensorrt_llm_ext.kernels.ordered_key import (EMPTY_KEY, INT32_MIN, nan_max, ordered_i32, ordered_i32_torch,
                                                  pack_key)

__all__ = ["BINS_COLS", "STAT_BINS", "STAT_BLOCK", "STATS_COLS", "block_bins", "block_bins_reference",
           "block_combine", "block_combine_reference", "block_keys", "block_keys_reference", "block_stats",
           "block_stats_reference",
           "row_bins_reference", "row_mass_reference", "shard_block_weights_torch", "stats_num_warps"]

STAT_BLOCK = 1024
STATS_PREFETCH = True  # block_stats loads the next tile before this one's reductions (bench verify --one-pass-stats)
# block_stats' warps (stats_num_warps). Measured 2026-12-08 on an H100 (bench verify --one-pass-stats, V = 200064,
# K = 7, bf16): 2 warps issue ~30 % less per element than 4 -- the per-tile reductions and grid point run in every
# warp -- and won on the TP-4 shard at B = 8 / 32 / 128 (-6 / -12 / -17 %) and at TP 1 at B = 8 / 32 (-7 / -16 %).
# 4 won where the grid is under one wave of 4-warp programs (B = 1, 375-420 programs: -1 to -5 %; twice the warps
# in flight) and where a program's chunk is long (98 tiles, TP 1 at B = 128: -26 %; a bandwidth-bound scan over
# many waves keeps 36 warps an SM in flight at 4 warps, 20 at 2).
STATS_WARPS_WAVE = 9  # 4-warp block_stats programs an SM holds (52 registers a thread, sm_90, Triton 3.6)
STATS_WARPS_LONG_TILES = 64  # a program's chunk of more tiles than this: 4 warps
STAT_BINS = 32
STATS_COLS = STAT_BINS + 3  # R_c, bins[STAT_BINS], F_b(token), R_b(token)
BINS_COLS = STAT_BINS + 2  # the exchanged row bins: bins[STAT_BINS] (bin i = grid distance i to R), F_b(token), R - R_b(token)
GRID_CLAMP = 1073741824.0  # |m_b c| clamped to 2^30: R_b stays an int32 for any finite logit and temperature
_CLAMP: tl.constexpr = tl.constexpr(GRID_CLAMP)


@triton.jit
def _block_scale(m, c):
    """``(R_b, g_b)`` of a block with largest finite logit ``m`` (fp32 scalars; ``c`` from weight_scale)."""
    p = m.to(tl.float64) * c.to(tl.float64)  # exact: 24 x 24 significant bits
    p = tl.minimum(tl.maximum(p, -_CLAMP), _CLAMP)
    t = p.to(tl.int64)  # toward zero, then up to the ceiling
    r = t + (t.to(tl.float64) < p).to(tl.int64)
    return r.to(tl.int32), sfu_exp2((p - r.to(tl.float64)).to(tl.float32))


@triton.jit
def _block_weight(x, m, c, g, fin):
    """int64 ``F_b(x)``: ``trunc(exp2((x - m) c) g 2^30)``; 0 where ``fin`` is false. No add follows a
    multiply (no FMA contraction), as in fixed_point_weight."""
    xs = tl.where(fin, x, m)
    e = sfu_exp2(tl.maximum((xs - m) * c, -126.0))
    f = ((e * g) * 1073741824.0).to(tl.int32)
    return tl.where(fin, f, 0).to(tl.int64)


@triton.jit
def _row_tile(t_row, q_row, is_t, cols, valid):
    """fp32 tile of a target row (``is_t``) or a draft row, -inf past the valid columns: one load (the branch is
    uniform per program), and padding that neither holds a maximum nor weighs."""
    if is_t:
        x = tl.load(t_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    else:
        x = tl.load(q_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
    return x


@triton.jit
def _block_mass(x, m, c, g, G: tl.constexpr):
    """int64 ``sum F_b(x)`` of a tile whose values are finite or -inf (-inf weighs exp2(-inf) = 0): the integers of
    :func:`_block_weight` -- ``(e g) 2^30 = e (g 2^30)`` exactly, and an exp2 argument below -126 truncates to 0 with
    or without its clamp. Each weight is in [0, 2^30] and the mass < 2^40, summed as two int32 sums of 16-bit pieces
    (exact: G 2^16 <= 2^26), each warp's part one ``redux`` instead of an int64 shuffle tree."""
    f = (sfu_exp2((x - m) * c) * (g * 1073741824.0)).to(tl.int32)
    lo = tl.sum(f & 65535, 0)
    hi = tl.sum(f >> 16, 0)
    return (hi.to(tl.int64) << 16) + lo


@triton.jit
def _stats_tile_loop(t_row, q_row, is_t, weigh, c, col_begin, col_end, col_tok, t_ptr_tok, q_ptr_tok,
                     G: tl.constexpr, MAXB: tl.constexpr, HAS_TOK: tl.constexpr, PREFETCH: tl.constexpr):
    """A chunk's tiles, per element only what the weight needs (docs/rejection_sampling.md, "Issue 41, thirty-ninth
    session"): the tile's max (NaN-propagating, so the one reduction also says whether the tile holds a NaN or
    +inf), the weight and its sum. The finite-max key comes from the tile maxima; the argmax reads a tile's columns
    again only when its max beats the row's best so far; a tile with a NaN or +inf takes a masked branch.
    Returns ``(argmax key, its column, finite-max key, R_b [MAXB], Z_b [MAXB], F_b(token), R_b(token))``."""
    lanes = tl.arange(0, G)
    best_fin = tl.full([], float("-inf"), tl.float32)
    arg_k = tl.full([], -2147483648, tl.int32)
    arg_c = tl.full([], 2147483647, tl.int32)
    idx = tl.arange(0, MAXB)
    rb = tl.full([MAXB], -2147483648, tl.int32)
    zb = tl.zeros([MAXB], tl.int64)
    ftok = tl.full([], 0, tl.int64)
    rtok = tl.full([], -9223372036854775808, tl.int64)
    # the tile that holds the row's token (-1: none in this chunk): one compare per tile
    tok_i = tl.where((col_tok >= col_begin) & (col_tok < col_end), (col_tok - col_begin) // G, -1).to(tl.int32)
    if PREFETCH:  # the next tile's load is issued before this tile's reductions (their latency overlaps it)
        x_next = _row_tile(t_row, q_row, is_t, col_begin + lanes, (col_begin + lanes) < col_end)
    for i in range(0, tl.cdiv(col_end - col_begin, G)):
        cols = col_begin + i * G + lanes
        valid = cols < col_end
        if PREFETCH:
            x = x_next
            x_next = _row_tile(t_row, q_row, is_t, cols + G, (cols + G) < col_end)
        else:
            x = _row_tile(t_row, q_row, is_t, cols, valid)
        top = nan_max(x, 0)  # NaN if the tile holds one, else +inf if it holds one, else the finite max
        fast = top < float("inf")  # finite values and -inf only: x weighs as it is
        if fast:
            m = top
        else:
            m = tl.max(tl.where(is_finite(x), x, float("-inf")), 0)
        best_fin = tl.maximum(best_fin, m)
        if is_t:  # strictly better than every earlier tile: its first column of that key (NaN highest)
            tk = ordered_i32(top)
            if tk > arg_k:
                arg_c = tl.min(tl.where(valid & (ordered_i32(x) == tk), cols, 2147483647), 0)
                arg_k = tk
        if weigh:
            # the block's own max (+0.0: a -0.0 max weighs as the keys' decoded +0.0), grid point and mass
            empty = m == float("-inf")
            m = tl.where(empty, 0.0, m + 0.0)
            r, g = _block_scale(m, c)
            if fast:  # the branch keeps the common tile free of the masking and of copies of x
                z = _block_mass(x, m, c, g, G)
            else:
                z = _block_mass(tl.where(is_finite(x), x, float("-inf")), m, c, g, G)
            r = tl.where(empty, -2147483648, r)
            rb = tl.where(idx == i, r, rb)
            zb = tl.where(idx == i, z, zb)
            if HAS_TOK:
                if i == tok_i:
                    xt = tl.where(is_t, tl.load(t_ptr_tok).to(tl.float32), tl.load(q_ptr_tok).to(tl.float32))
                    ft = is_finite(xt)
                    ftok = _block_weight(xt, m, c, g, ft)
                    rtok = tl.where(ft, r.to(tl.int64), -9223372036854775808)
    fin_key = tl.where(best_fin == float("-inf"), -9223372036854775808, ordered_i32(best_fin).to(tl.int64))
    return arg_k, arg_c, fin_key, rb, zb, ftok, rtok


@triton.jit
def _block_stats_kernel(
    t_ptr, q_ptr,  # [rows_t, V_local], [rows_q, V_local] logits (q_ptr = t_ptr when rows_q = 0)
    temp_ptr,  # [B] fp32
    p_ptr,  # [B] fp32 top-p (read only if SKIP_TOP_P)
    tok_ptr,  # [B, k_tok] int64 global ids (read only if HAS_TOK)
    keys_ptr,  # [rows_t + rows_q, S, 2] int64 out: as verify_keys
    stats_ptr,  # [rows_t + rows_q, S, STATS_COLS] int64 out
    stride_t, stride_q, rows_t, n_valid, vocab_start, chunk, num_splits, div_t, div_q, k_tok,
    G: tl.constexpr, MAXB: tl.constexpr, NB: tl.constexpr, HAS_TOK: tl.constexpr, PREFETCH: tl.constexpr,
    SKIP_TOP_P: tl.constexpr = False,  # rows of requests with top-p in force (T > 0, p < 1): keys only
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    is_t = row < rows_t
    rq = tl.maximum(row - rows_t, 0)
    b = tl.where(is_t, row // div_t, rq // div_q)
    kk = tl.where(is_t, row % div_t, rq % div_q)
    t_row = t_ptr + tl.minimum(row, rows_t - 1).to(tl.int64) * stride_t
    q_row = q_ptr + rq.to(tl.int64) * stride_q
    temp = tl.load(temp_ptr + b)
    c = weight_scale(temp)
    # A request with top-p in force weighs its rows against the row max (verify_sums), never by the bins: such a
    # row's program reads its columns for the keys alone and writes an empty chunk's statistics.
    weigh = True
    if SKIP_TOP_P:
        weigh = ~top_p_in_force(temp, tl.load(p_ptr + b))
    col_tok = tl.full([], -1, tl.int64)
    if HAS_TOK:
        if kk < k_tok:
            col_tok = tl.load(tok_ptr + b.to(tl.int64) * k_tok + kk) - vocab_start
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    tok_off = tl.maximum(col_tok, 0)  # read only when the chunk owns the token
    arg_k, arg_c, fin_key, rb, zb, ftok, rtok = _stats_tile_loop(
        t_row, q_row, is_t, weigh, c, col_begin, col_end, col_tok, t_row + tok_off, q_row + tok_off,
        G, MAXB, HAS_TOK, PREFETCH)
    out = keys_ptr + (row.to(tl.int64) * num_splits + split) * 2
    tl.store(out, pack_key(arg_k, arg_c.to(tl.int64) + vocab_start))
    tl.store(out + 1, fin_key)
    # bins by grid distance below this program's top block (empty blocks never count)
    rc = tl.max(rb, 0)
    d = rc.to(tl.int64) - rb.to(tl.int64)
    ok = (rb != -2147483648) & (d < NB)
    nb = tl.arange(0, NB)
    bins = tl.sum(tl.where((d[:, None] == nb[None, :]) & ok[:, None], zb[:, None], 0), 0)
    sout = stats_ptr + (row.to(tl.int64) * num_splits + split) * (NB + 3)
    tl.store(sout, tl.where(rc == -2147483648, -9223372036854775808, rc.to(tl.int64)))
    tl.store(sout + 1 + nb, bins)
    tl.store(sout + 1 + NB, ftok)
    tl.store(sout + 2 + NB, rtok)


def _check(target, draft, temperatures, tokens, div_t, div_q, keys_out, stats_out, num_splits, vocab_start,
           vocab_size, block_size=STAT_BLOCK, top_p=None):
    n_valid, rt, rq = _pair(target, draft, vocab_start, vocab_size)
    if vocab_start % STAT_BLOCK:
        raise ValueError(f"vocab_start: expected a multiple of {STAT_BLOCK} (a block-aligned shard), got {vocab_start}")
    if block_size % STAT_BLOCK:
        raise ValueError(f"block_size: expected a multiple of {STAT_BLOCK} (chunks of whole blocks), got {block_size}")
    check_int("num_splits", num_splits, lo=1)
    splits, chunk = plan_chunks(target.shape[1], block_size, num_splits)
    dev = target.device
    check_int("row_div", div_t, lo=1)
    check_int("row_div_q", div_q, lo=1)
    if rt % div_t or rq % div_q:
        raise ValueError(f"rows: expected row counts divisible by {div_t} / {div_q}, got {rt} / {rq}")
    check_tensor("temperatures", temperatures, shape=(rt // div_t,), dtype=torch.float32, device=dev,
                 contiguous=True)
    if tokens is not None:
        check_tensor("tokens", tokens, shape=(rt // div_t, None), dtype=torch.int64, device=dev, contiguous=True)
    if top_p is not None:
        check_tensor("top_p", top_p, shape=(rt // div_t,), dtype=torch.float32, device=dev, contiguous=True)
    check_tensor("keys_out", keys_out, shape=(rt + rq, splits, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("stats_out", stats_out, shape=(rt + rq, splits, STATS_COLS), dtype=torch.int64, device=dev,
                 contiguous=True)
    return n_valid, rt, rq, splits, chunk


def block_stats(target: torch.Tensor, draft: torch.Tensor | None, temperatures: torch.Tensor, vocab_start: int,
                vocab_size: int, *, tokens: torch.Tensor | None = None, row_div: int = 1, row_div_q: int = 1,
                keys_out: torch.Tensor, stats_out: torch.Tensor, num_splits: int = 1,
                block_size: int = STAT_BLOCK, num_warps: int | None = None,
                prefetch: bool | None = None, top_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over the target rows and the draft rows of a block-aligned shard: every slot of ``keys_out
    [R_t + R_q, S, 2]`` (as :func:`~tensorrt_llm_ext.kernels.fixed_point_softmax.verify_keys`) and of
    ``stats_out [R_t + R_q, S, STATS_COLS]`` int64 written: per (row, column chunk of whole blocks) ``R_c``
    (``EMPTY_KEY`` if the chunk has no finite logit), the ``STAT_BINS`` bins, and ``F_b`` and ``R_b`` of the
    row's token where the chunk owns it (0 and ``EMPTY_KEY`` elsewhere). Rows, ``row_div`` / ``row_div_q``,
    ``tokens`` and temperatures as ``verify_sums``. ``S`` = ``plan_chunks(V_local, block_size, num_splits)``
    (``block_size`` a multiple of ``STAT_BLOCK``). ``num_warps``: the launch's warps (None:
    :func:`stats_num_warps`) and ``prefetch`` (the next tile loaded before this one's reductions; None:
    :data:`STATS_PREFETCH`): schedule choices only, every value gives the same bits (integer sums and maxima).
    ``top_p`` (``[B]`` fp32): the rows of
    the requests with top-p in force (``T > 0``, ``p < 1``; they weigh against the row max, ``verify_sums``) read
    their columns for the keys only and write an empty chunk's statistics (``EMPTY_KEY``, zero bins, token
    ``(0, EMPTY_KEY)``), which no consumer reads for them. CUDA-graph safe (no allocation, no sync).
    """
    n_valid, rt, rq, splits, chunk = _check(target, draft, temperatures, tokens, row_div, row_div_q, keys_out,
                                            stats_out, num_splits, vocab_start, vocab_size, block_size, top_p)
    if rt + rq == 0:
        return keys_out, stats_out
    if rt == 0:
        raise ValueError("target_logits: expected at least one row")
    q = draft if draft is not None and rq else target
    k_tok = tokens.shape[1] if tokens is not None else 0
    maxb = max(2, triton.next_power_of_2(chunk // STAT_BLOCK))
    _block_stats_kernel[(rt + rq, splits)](
        target, q, temperatures, top_p if top_p is not None else temperatures,
        tokens if tokens is not None else keys_out, keys_out, stats_out,
        target.stride(0), q.stride(0), rt, n_valid, vocab_start, chunk, splits, row_div, row_div_q, k_tok,
        G=STAT_BLOCK, MAXB=maxb, NB=STAT_BINS, HAS_TOK=k_tok > 0,
        PREFETCH=STATS_PREFETCH if prefetch is None else bool(prefetch), SKIP_TOP_P=top_p is not None,
        num_warps=stats_num_warps(rt + rq, splits, chunk, sm_count(target.device)) if num_warps is None else num_warps)
    return keys_out, stats_out


def stats_num_warps(rows: int, splits: int, chunk: int, sms: int) -> int:
    """:func:`block_stats`' warps for ``rows`` x ``splits`` programs of ``chunk`` columns on ``sms`` SMs (the rule
    measured beside :data:`STATS_WARPS_WAVE`): 4 where the grid is under one wave of 4-warp programs or a program's
    chunk is over ``STATS_WARPS_LONG_TILES`` tiles; else 2."""
    if rows * splits < STATS_WARPS_WAVE * sms or chunk // STAT_BLOCK > STATS_WARPS_LONG_TILES:
        return 4
    return 2


# ----------------------------------------------------------------------------------------------------
# consumers of the statistic: the row grid point, the combine, and the two-pass fallback on any shard
# ----------------------------------------------------------------------------------------------------
@triton.jit
def row_grid(keys_ptr, row, num_splits, c, SPLITS: tl.constexpr):
    """``(m, R, live)`` of a row from its exchanged keys: the largest finite logit, the row's grid point ``R = max_b
    R_b = ceil(m c)`` (``_block_scale`` is monotone in the block max, so the max block gives it) and whether the row
    has a finite logit."""
    mk = row_max_from_keys(keys_ptr, row, num_splits, SPLITS)
    m = decode_max_key(mk)
    r, _ = _block_scale(m, c)
    return m, r.to(tl.int64), mk != -9223372036854775808


@triton.jit
def row_edges(edges_ptr, row, num_splits, ne, rank, SPLITS: tl.constexpr):
    """The exchanged maxima (ordered keys) of the blocks at this rank's shard start and end (``edges [R, S, ne]``
    slots ``rank`` and ``rank + 1``, reduced over the chunks)."""
    base = edges_ptr + row.to(tl.int64) * num_splits * ne
    e_first = split_reduce(base + rank, num_splits, ne, row >= 0, SPLITS, True)
    e_end = split_reduce(base + rank + 1, num_splits, ne, row >= 0, SPLITS, True)
    return e_first, e_end


@triton.jit
def tile_block_max(x, fin, blk, first_blk, end_blk, e_first, e_end, EDGES: tl.constexpr):
    """``(m_b, live)`` of the block ``blk`` loaded as one tile (``fin``: its finite real columns on this shard); with
    ``EDGES`` a block that crosses the shard's start or end also takes the other ranks' part from the exchanged
    edge maxima."""
    mk = tl.max(tl.where(fin, ordered_i32(x), -2147483648), 0)
    mk64 = tl.where(mk == -2147483648, -9223372036854775808, mk.to(tl.int64))
    if EDGES:
        mk64 = tl.maximum(mk64, tl.where(blk == first_blk, e_first, -9223372036854775808))
        mk64 = tl.maximum(mk64, tl.where(blk == end_blk, e_end, -9223372036854775808))
    return decode_max_key(mk64), mk64 != -9223372036854775808


@triton.jit
def pow2_neg_f64(d):
    """``2^-d`` (float64, exact) for an int64 ``d`` in [0, 1022]."""
    return ((1023 - d) << 52).to(tl.float64, bitcast=True)


@triton.jit
def pow2_neg_f32(d):
    """``2^-d`` (fp32, exact) for an int ``d`` in [0, 126]."""
    return ((127 - d) << 23).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def mass_from_bins(bins, NB: tl.constexpr):
    """``Z = sum_i bin_i 2^-i`` (float64) of bins ``[..., NB]`` (int64, non-negative, summing to < 2^62), exact up to
    one final rounding and independent of any summation order: ``Z 2^31 = H 2^31 + L`` with the integer sums
    ``H = sum_i (bin_i >> i)`` (< 2^62) and ``L = sum_i (bin_i mod 2^i) 2^(31 - i)`` (< NB 2^31), so
    ``Z = f64(H) + f64(L) 2^-31``. One vector of bins in, no loop over the bins (each iteration of one was a dependent
    load in the draw)."""
    i = tl.arange(0, NB).to(tl.int64)
    hi = tl.sum(bins >> i, axis=-1)
    lo = tl.sum((bins & ((tl.full([NB], 1, tl.int64) << i) - 1)) << (31 - i), axis=-1)
    return hi.to(tl.float64) + lo.to(tl.float64) * 4.656612873077392578125e-10  # 2^-31


@triton.jit
def block_row_mass(bins_ptr, row, bin_slots, NB: tl.constexpr, SB: tl.constexpr):
    """``(Z, F_b(tok), R - R_b(tok))`` of a row (a scalar) from the exchanged bins ``[R, bin_slots, NB + 2]``: the
    slots' bins summed (exact int64), then :func:`mass_from_bins` -- the same bits at every TP size. One 2-D load of
    the row's ``[SB, NB]`` bins."""
    base = bins_ptr + row.to(tl.int64) * bin_slots * (NB + 2)
    s = tl.arange(0, SB)
    j = tl.arange(0, NB)
    ok = (s < bin_slots) & (row >= 0)
    bins = tl.sum(tl.load(base + s[:, None] * (NB + 2) + j[None, :], mask=ok[:, None], other=0), 0)
    ftok = split_reduce(base + NB, bin_slots, NB + 2, row >= 0, SB, False)
    stok = split_reduce(base + NB + 1, bin_slots, NB + 2, row >= 0, SB, False)
    return mass_from_bins(bins, NB), ftok, stok


@triton.jit
def block_row_mass_rows(bins_ptr, rows, ok, bin_slots, NB: tl.constexpr, SB: tl.constexpr):
    """:func:`block_row_mass` of a block of rows ``rows [X]`` (mask ``ok``): one 3-D load of ``[X, SB, NB]`` bins."""
    base = bins_ptr + rows.to(tl.int64) * bin_slots * (NB + 2)
    s = tl.arange(0, SB)
    j = tl.arange(0, NB)
    m = ok[:, None, None] & (s < bin_slots)[None, :, None]
    bins = tl.sum(tl.load(base[:, None, None] + (s[None, :, None] * (NB + 2) + j[None, None, :]), mask=m, other=0), 1)
    ftok = split_reduce_rows(base + NB, bin_slots, NB + 2, ok, SB, False)
    stok = split_reduce_rows(base + NB + 1, bin_slots, NB + 2, ok, SB, False)
    return mass_from_bins(bins, NB), ftok, stok


@triton.jit
def _block_combine_kernel(
    stats_ptr,  # [rows, S, NB + 3] int64: this rank's block_stats slots (not exchanged)
    keys_ptr,  # [rows, S, 2] int64, exchanged (MAX)
    temp_ptr,  # [B] fp32
    out_ptr,  # [rows, 1, NB + 2] int64 out: bins relative to the row's R, F_b(tok), R - R_b(tok)
    rows_t, num_splits, div_t, div_q,
    NB: tl.constexpr, SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    is_t = row < rows_t
    b = tl.where(is_t, row // div_t, tl.maximum(row - rows_t, 0) // div_q)
    c = weight_scale(tl.load(temp_ptr + b))
    _, r, _ = row_grid(keys_ptr, row, num_splits, c, SPLITS)
    nb = tl.arange(0, NB)
    # every chunk's slot at once (integer sums: any order gives the same bits): its R_c, then its bins gathered at
    # the shifted index in one 2-D load -- no loop of dependent loads over the chunks
    s = tl.arange(0, SPLITS)
    sok = s < num_splits
    slot = stats_ptr + (row.to(tl.int64) * num_splits + s) * (NB + 3)  # [SPLITS]
    rc = tl.load(slot, mask=sok, other=-9223372036854775808)
    live = rc != -9223372036854775808
    shift = r - tl.where(live, rc, r)  # >= 0: R is the max of every block's R_b
    src = nb[None, :] - shift[:, None]  # global bin j holds the slot's bin j - shift (an index shift: nothing rounds)
    acc = tl.sum(tl.load(slot[:, None] + 1 + src, mask=live[:, None] & (src >= 0), other=0), 0)
    rt = tl.load(slot + NB + 2, mask=sok, other=-9223372036854775808)
    own = rt != -9223372036854775808
    d = r - tl.where(own, rt, r)
    keep = own & (d < NB)
    ftok = tl.sum(tl.where(keep, tl.load(slot + NB + 1, mask=keep, other=0), 0), 0)
    stok = tl.sum(tl.where(keep, d, 0), 0)
    out = out_ptr + row.to(tl.int64) * (NB + 2)
    tl.store(out + nb, acc)
    tl.store(out + NB, ftok)
    tl.store(out + NB + 1, stok)


@triton.jit
def _block_keys_kernel(
    t_ptr, q_ptr,  # [rows_t, V_local], [rows_q, V_local] logits
    keys_ptr,  # [rows, S, 2] int64 out: as verify_keys
    edges_ptr,  # [rows, S, ne] int64 out: slot j = this chunk's max over block (j width) // G (EMPTY_KEY if none)
    stride_t, stride_q, rows_t, n_valid, vocab_start, width, chunk, num_splits, ne,
    BLOCK: tl.constexpr, G: tl.constexpr, NE: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    is_t = row < rows_t
    t_row = t_ptr + tl.minimum(row, rows_t - 1).to(tl.int64) * stride_t
    q_row = q_ptr + tl.maximum(row - rows_t, 0).to(tl.int64) * stride_q
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    first_blk = vocab_start // G
    last_blk = (vocab_start + tl.maximum(n_valid, 1) - 1) // G
    best_fin = tl.full([BLOCK], -2147483648, tl.int32)
    lane_f = best_fin
    lane_l = best_fin
    lane_k = best_fin
    lane_c = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(col_begin, col_end, BLOCK):
        cols = start + lanes
        valid = cols < col_end
        x = load_pair_tile(t_row, q_row, is_t, cols, valid)
        o = ordered_i32(x)
        of = tl.where(valid & is_finite(x), o, -2147483648)
        best_fin = tl.maximum(best_fin, of)
        blk = (vocab_start + cols) // G
        lane_f = tl.maximum(lane_f, tl.where(blk == first_blk, of, -2147483648))
        lane_l = tl.maximum(lane_l, tl.where(blk == last_blk, of, -2147483648))
        take = valid & is_t & (o > lane_k)
        lane_k = tl.where(take, o, lane_k)
        lane_c = tl.where(take, cols, lane_c)
    store_split_keys(keys_ptr, row, split, num_splits, lane_k, lane_c, best_fin, vocab_start)
    # the partial maxima of this shard's first and last block, at every boundary slot whose block they are (a
    # block can span several ranks when the shard is narrower than a block)
    pf = tl.max(lane_f, 0)
    pl = tl.max(lane_l, 0)
    pf64 = tl.where(pf == -2147483648, -9223372036854775808, pf.to(tl.int64))
    pl64 = tl.where(pl == -2147483648, -9223372036854775808, pl.to(tl.int64))
    j = tl.arange(0, NE)
    bj = (j.to(tl.int64) * width) // G
    val = tl.maximum(tl.where(bj == first_blk, pf64, -9223372036854775808),
                     tl.where(bj == last_blk, pl64, -9223372036854775808))
    tl.store(edges_ptr + (row.to(tl.int64) * num_splits + split) * ne + j, val, mask=j < ne)


@triton.jit
def _block_bins_kernel(
    t_ptr, q_ptr,  # logits as _block_keys_kernel
    keys_ptr,  # [rows, S, 2] int64 exchanged
    edges_ptr,  # [rows, S, ne] int64 exchanged (MAX)
    temp_ptr, tok_ptr,  # [B] fp32, [B, k_tok] int64
    out_ptr,  # [rows, S, NB + 2] int64 out: bins relative to the row's R, F_b(tok), R - R_b(tok)
    stride_t, stride_q, rows_t, n_valid, vocab_start, width, chunk, num_splits, ne, rank, div_t, div_q, k_tok,
    G: tl.constexpr, NB: tl.constexpr, SPLITS: tl.constexpr, HAS_TOK: tl.constexpr,
):
    row = tl.num_programs(0) - 1 - tl.program_id(0)  # backwards: start on the rows block_keys read last
    split = tl.num_programs(1) - 1 - tl.program_id(1)
    is_t = row < rows_t
    rq = tl.maximum(row - rows_t, 0)
    b = tl.where(is_t, row // div_t, rq // div_q)
    kk = tl.where(is_t, row % div_t, rq % div_q)
    t_row = t_ptr + tl.minimum(row, rows_t - 1).to(tl.int64) * stride_t
    q_row = q_ptr + rq.to(tl.int64) * stride_q
    c = weight_scale(tl.load(temp_ptr + b))
    _, r_row, _ = row_grid(keys_ptr, row, num_splits, c, SPLITS)
    e_first, e_end = row_edges(edges_ptr, row, num_splits, ne, rank, SPLITS)
    first_blk = vocab_start // G
    end_blk = (vocab_start + width) // G
    col_tok = tl.full([], -1, tl.int64)
    if HAS_TOK:
        if kk < k_tok:
            col_tok = tl.load(tok_ptr + b.to(tl.int64) * k_tok + kk) - vocab_start
    lanes = tl.arange(0, G)
    nb = tl.arange(0, NB)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    # tiles are global blocks; a block belongs to the chunk that holds its first column on this shard (it may read
    # on into the next chunk's columns: one program weighs a whole block)
    t0 = ((vocab_start + col_begin) // G) * G - vocab_start
    t0 = tl.where(tl.maximum(t0, 0) < col_begin, t0 + G, t0)
    bins = tl.zeros([NB], tl.int64)
    ftok = tl.full([], 0, tl.int64)
    stok = tl.full([], 0, tl.int64)
    for t in range(t0, col_end, G):
        cols = t + lanes
        valid = (cols >= 0) & (cols < n_valid)
        x = load_pair_tile(t_row, q_row, is_t, cols, valid)
        fin = valid & is_finite(x)
        m, live = tile_block_max(x, fin, (vocab_start + t) // G, first_blk, end_blk, e_first, e_end, True)
        rb, g = _block_scale(m, c)
        d = r_row - rb.to(tl.int64)
        ok = live & (d < NB)
        w = _block_weight(x, m, c, g, fin & ok)
        bins += tl.where(nb == d, tl.sum(w, 0), 0)
        if HAS_TOK:
            hit = (cols.to(tl.int64) == col_tok) & fin  # a token that is not finite weighs 0 with no shift
            ftok += tl.sum(tl.where(hit, w, 0), 0)
            stok += tl.where(ok & (tl.sum(hit.to(tl.int32), 0) > 0), d, 0)
    out = out_ptr + (row.to(tl.int64) * num_splits + split) * (NB + 2)
    tl.store(out + nb, bins)
    tl.store(out + NB, ftok)
    tl.store(out + NB + 1, stok)


def block_combine(stats: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor, *, rows_t: int,
                  row_div: int = 1, row_div_q: int = 1, out: torch.Tensor) -> torch.Tensor:
    """The row bins of a one-pass call: each of this rank's ``stats [R, S, STATS_COLS]`` slots shifted from its own
    top ``R_c`` to the row's grid point ``R`` (from the exchanged ``keys``), summed over the slots, with the row
    token's ``F_b`` and ``R - R_b``: ``out [R, 1, BINS_COLS]``, exact under one int64 SUM across ranks. One launch
    of one program per row; CUDA-graph safe."""
    rows, splits = stats.shape[0], stats.shape[1]
    dev = stats.device
    check_tensor("stats", stats, shape=(None, None, STATS_COLS), dtype=torch.int64, contiguous=True)
    check_tensor("keys", keys, shape=(rows, splits, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("out", out, shape=(rows, 1, BINS_COLS), dtype=torch.int64, device=dev, contiguous=True)
    if rows == 0:
        return out
    _block_combine_kernel[(rows,)](stats, keys, temperatures, out, rows_t, splits, row_div, row_div_q, NB=STAT_BINS,
                                   SPLITS=triton.next_power_of_2(splits), num_warps=1)
    return out


def _check_fallback(target, draft, keys_out, edges, num_splits, block_size, vocab_start, vocab_size, rank, tp):
    n_valid, rt, rq = _pair(target, draft, vocab_start, vocab_size)
    check_int("tp", tp, lo=1)
    check_int("rank", rank, lo=0, hi=tp)
    width = target.shape[1]
    if vocab_start != rank * width:
        raise ValueError(f"vocab_start: expected rank * width = {rank * width} (shards of equal width), got "
                         f"{vocab_start}")
    splits, chunk = plan_chunks(width, block_size, num_splits)
    dev = target.device
    check_tensor("keys", keys_out, shape=(rt + rq, splits, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("edges", edges, shape=(rt + rq, splits, tp + 1), dtype=torch.int64, device=dev, contiguous=True)
    return n_valid, rt, rq, splits, chunk, width


def block_keys(target: torch.Tensor, draft: torch.Tensor | None, vocab_start: int, vocab_size: int, *,
               keys_out: torch.Tensor, edges_out: torch.Tensor, rank: int = 0, tp: int = 1, block_size: int = 2048,
               num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of the block weights on any shard (the fallback of the one pass): ``keys_out`` as
    :func:`~tensorrt_llm_ext.kernels.fixed_point_softmax.verify_keys`, and ``edges_out [R, S, tp + 1]``: slot
    ``j`` = this chunk's largest finite key in block ``(j width) // STAT_BLOCK`` (the block at shard boundary
    ``j``), ``EMPTY_KEY`` if none, so after the MAX exchange (with the keys, one round) every slot holds the whole
    block's max. Rank ``r`` owns ids ``[r width, (r + 1) width)``. One launch; CUDA-graph safe."""
    n_valid, rt, rq, splits, chunk, width = _check_fallback(target, draft, keys_out, edges_out, num_splits,
                                                            block_size, vocab_start, vocab_size, rank, tp)
    if rt + rq == 0:
        return keys_out, edges_out
    q = draft if draft is not None and rq else target
    _block_keys_kernel[(rt + rq, splits)](
        target, q, keys_out, edges_out, target.stride(0), q.stride(0), rt, n_valid, vocab_start, width, chunk,
        splits, tp + 1, BLOCK=block_size, G=STAT_BLOCK, NE=triton.next_power_of_2(tp + 1),
        num_warps=num_warps_for(block_size))
    return keys_out, edges_out


def block_bins(target: torch.Tensor, draft: torch.Tensor | None, keys: torch.Tensor, edges: torch.Tensor,
               temperatures: torch.Tensor, vocab_start: int, vocab_size: int, *, tokens: torch.Tensor | None = None,
               row_div: int = 1, row_div_q: int = 1, rank: int = 0, tp: int = 1, out: torch.Tensor,
               block_size: int = 2048, num_splits: int = 1) -> torch.Tensor:
    """Pass 2 of the block weights on any shard: with the row's ``R`` known (exchanged ``keys``) and the blocks
    split between ranks completed by the exchanged ``edges``, per (row, chunk) the bins relative to ``R``, the row
    token's ``F_b`` and ``R - R_b``: ``out [R, S, BINS_COLS]``, the same row sums as the one pass's
    :func:`block_combine` (exact under one int64 SUM). Tiles are global blocks of ``STAT_BLOCK`` ids. One launch;
    CUDA-graph safe."""
    n_valid, rt, rq, splits, chunk, width = _check_fallback(target, draft, keys, edges, num_splits, block_size,
                                                            vocab_start, vocab_size, rank, tp)
    dev = target.device
    check_tensor("temperatures", temperatures, shape=(rt // row_div,), dtype=torch.float32, device=dev,
                 contiguous=True)
    check_tensor("out", out, shape=(rt + rq, splits, BINS_COLS), dtype=torch.int64, device=dev, contiguous=True)
    if rt + rq == 0:
        return out
    q = draft if draft is not None and rq else target
    k_tok = tokens.shape[1] if tokens is not None else 0
    _block_bins_kernel[(rt + rq, splits)](
        target, q, keys, edges, temperatures, tokens if tokens is not None else keys, out, target.stride(0),
        q.stride(0), rt, n_valid, vocab_start, width, chunk, splits, tp + 1, rank, row_div, row_div_q, k_tok,
        G=STAT_BLOCK, NB=STAT_BINS, SPLITS=triton.next_power_of_2(splits), HAS_TOK=k_tok > 0,
        num_warps=num_warps_for(STAT_BLOCK))
    return out


# ----------------------------------------------------------------------------------------------------
# eager twins
# ----------------------------------------------------------------------------------------------------
def _block_scale_torch(m: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = (m.double() * c.double()).clamp(-GRID_CLAMP, GRID_CLAMP)
    t = p.to(torch.int64)
    r = t + (t.double() < p).to(torch.int64)
    return r.to(torch.int32), sfu_exp2_torch((p - r.double()).float())


def _block_weight_torch(x, m, c, g, fin) -> torch.Tensor:
    xs = torch.where(fin, x, m)
    e = sfu_exp2_torch(torch.clamp_min((xs - m) * c, -126.0))
    f = ((e * g) * 1073741824.0).to(torch.int32).to(torch.int64)
    return torch.where(fin, f, torch.zeros_like(f))


def block_stats_reference(target: torch.Tensor, draft: torch.Tensor | None, temperatures: torch.Tensor,
                          vocab_start: int, vocab_size: int, *, tokens: torch.Tensor | None = None, row_div: int = 1,
                          row_div_q: int = 1, keys_out: torch.Tensor, stats_out: torch.Tensor,
                          num_splits: int = 1, block_size: int = STAT_BLOCK,
                          top_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`block_stats` (the same slots)."""
    n_valid, rt, rq, splits, chunk = _check(target, draft, temperatures, tokens, row_div, row_div_q, keys_out,
                                            stats_out, num_splits, vocab_start, vocab_size, block_size, top_p)
    verify_keys_reference(target, draft, vocab_start, vocab_size, out=keys_out, block_size=block_size,
                          num_splits=num_splits)
    dev = target.device
    rows = rt + rq
    if rows == 0:
        return keys_out, stats_out
    G = STAT_BLOCK
    bps = chunk // G  # blocks per chunk
    nblk = splits * bps
    xp = torch.full((rows, nblk * G), float("nan"), dtype=torch.float32, device=dev)
    xp[:, :n_valid] = _rows_f32(target, draft, n_valid)
    x = xp.view(rows, nblk, G)
    fin = torch.isfinite(x)
    mk = torch.where(fin, ordered_i32_torch(x), torch.full_like(x, INT32_MIN, dtype=torch.int32)).amax(-1)
    m = decode_max_key_torch(torch.where(mk == INT32_MIN, torch.full_like(mk, EMPTY_KEY, dtype=torch.int64),
                                         mk.to(torch.int64)))
    bi = torch.cat([torch.arange(rt, device=dev) // row_div, torch.arange(rq, device=dev) // row_div_q])
    kk = torch.cat([torch.arange(rt, device=dev) % row_div, torch.arange(rq, device=dev) % row_div_q])
    c = weight_scale_torch(temperatures[bi])[:, None]
    r, g = _block_scale_torch(m, c)
    w = _block_weight_torch(x, m[..., None], c[..., None], g[..., None], fin)
    r = torch.where(mk == INT32_MIN, torch.full_like(r, INT32_MIN), r)
    z = w.sum(-1)
    rs, zs = r.view(rows, splits, bps), z.view(rows, splits, bps)
    rc = rs.amax(-1)
    d = rc[..., None].to(torch.int64) - rs.to(torch.int64)
    ok = (rs != INT32_MIN) & (d < STAT_BINS)
    bins = torch.zeros((rows, splits, STAT_BINS + 1), dtype=torch.int64, device=dev)
    bins.scatter_add_(2, torch.where(ok, d, torch.full_like(d, STAT_BINS)), torch.where(ok, zs, torch.zeros_like(zs)))
    stats_out.zero_()
    stats_out[:, :, 0] = torch.where(rc == INT32_MIN, torch.full_like(rc, EMPTY_KEY, dtype=torch.int64),
                                     rc.to(torch.int64))
    stats_out[:, :, 1:1 + STAT_BINS] = bins[:, :, :STAT_BINS]
    stats_out[:, :, 2 + STAT_BINS] = EMPTY_KEY
    if tokens is not None and tokens.shape[1] > 0:
        k_tok = tokens.shape[1]
        tok = torch.where(kk < k_tok, tokens[bi, kk.clamp(max=k_tok - 1)], torch.full_like(kk, -1))
        col = tok - vocab_start
        own = (col >= 0) & (col < n_valid)
        colc = torch.where(own, col, torch.zeros_like(col))
        ri = torch.arange(rows, device=dev)
        blk, lane = colc // G, colc % G
        ft = own & torch.isfinite(x[ri, blk, lane])
        slot = colc // chunk  # rows that own no token write slot 0's defaults (0, EMPTY_KEY) again
        stats_out[ri, slot, 1 + STAT_BINS] = torch.where(ft, w[ri, blk, lane], torch.zeros_like(col))
        stats_out[ri, slot, 2 + STAT_BINS] = torch.where(ft, r[ri, blk].to(torch.int64),
                                                         torch.full_like(col, EMPTY_KEY))
    if top_p is not None:  # the rows of requests with top-p in force: an empty chunk's statistics
        skip = top_p_in_force_torch(temperatures[bi], top_p[bi])
        stats_out[skip] = 0
        stats_out[skip, :, 0] = EMPTY_KEY
        stats_out[skip, :, 2 + STAT_BINS] = EMPTY_KEY
    return keys_out, stats_out


def row_bins_reference(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's grid point ``R [rows]`` and bins ``[rows, STAT_BINS]`` from every slot of ``stats [rows, S',
    STATS_COLS]`` (all ranks' slots side by side): each slot's bins shifted by ``R - R_c`` and summed (exact
    int64; the design's ``combine`` launch plus the SUM exchange). ``R = EMPTY_KEY`` for a row without a finite
    logit (bins 0)."""
    rc = stats[:, :, 0]
    live = rc != EMPTY_KEY
    big = torch.where(live, rc, torch.full_like(rc, -(2**62)))
    r = big.amax(1)
    shift = (r[:, None] - big).clamp(max=STAT_BINS)  # [rows, S']
    j = shift[:, :, None] + torch.arange(STAT_BINS, device=stats.device)  # global bin of each slot bin
    vals = torch.where(live[:, :, None] & (j < STAT_BINS), stats[:, :, 1:1 + STAT_BINS], torch.zeros_like(j))
    out = torch.zeros((stats.shape[0], STAT_BINS + 1), dtype=torch.int64, device=stats.device)
    out.scatter_add_(1, j.clamp(max=STAT_BINS).view(stats.shape[0], -1), vals.view(stats.shape[0], -1))
    return torch.where(live.any(1), r, torch.full_like(r, EMPTY_KEY)), out[:, :STAT_BINS]


def row_mass_reference(bins: torch.Tensor) -> torch.Tensor:
    """float64 ``Z = sum_i bins_i 2^-i`` of ``bins [R, STAT_BINS]`` as :func:`mass_from_bins` forms it: two exact
    int64 sums, one rounding each to float64, one exact scaling, one add (the same bits for the same bins)."""
    i = torch.arange(STAT_BINS, dtype=torch.int64, device=bins.device)
    hi = (bins >> i).sum(-1)
    lo = ((bins & ((1 << i) - 1)) << (31 - i)).sum(-1)
    return hi.double() + lo.double() * 2.0 ** -31



def _neg_pow2_f64_torch(d: torch.Tensor) -> torch.Tensor:
    return ((1023 - d) << 52).view(torch.float64)


def _neg_pow2_f32_torch(d: torch.Tensor) -> torch.Tensor:
    return ((127 - d) << 23).to(torch.int32).view(torch.float32)


def row_grid_torch(keys: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`row_grid` for rows ``keys [R, S, 2]`` (``c [R]``): ``(m, R int64, live)``."""
    mk = keys[:, :, 1].amax(1)
    m = decode_max_key_torch(mk)
    r, _ = _block_scale_torch(m, c)
    return m, r.to(torch.int64), mk != EMPTY_KEY


def shard_block_weights_torch(x: torch.Tensor, vocab_start: int, width: int, rank: int, edges: torch.Tensor | None,
                              c: torch.Tensor, r_row: torch.Tensor):
    """Block weights of shard rows ``x [N, n_valid]`` (fp32, this rank's real columns): per block of global ids the
    max over the shard's finite columns, completed by the exchanged ``edges [N, S, tp + 1]`` where the block crosses
    the shard (None: aligned), ``c [N]``, the rows' grid points ``r_row [N]``. Returns ``(w [N, n_valid] int64
    F_b (0 where the block is past the bins or the token not finite), d [N, n_valid] = R - R_b clamped to
    [0, STAT_BINS], z [N, n_blocks] the block masses, db [N, n_blocks], okb [N, n_blocks], first column of each block
    on the shard [n_blocks])``."""
    G = STAT_BLOCK
    n, n_valid = x.shape
    dev = x.device
    b0 = vocab_start // G
    lead = vocab_start - b0 * G
    nblk = (lead + n_valid + G - 1) // G if n_valid else 0
    xp = torch.full((n, nblk * G), float("nan"), dtype=torch.float32, device=dev)
    xp[:, lead:lead + n_valid] = x
    xb = xp.view(n, nblk, G)
    fin = torch.isfinite(xb)
    mk = torch.where(fin, ordered_i32_torch(xb), torch.full_like(xb, INT32_MIN, dtype=torch.int32)).amax(-1)
    mk = torch.where(mk == INT32_MIN, torch.full_like(mk, EMPTY_KEY, dtype=torch.int64), mk.to(torch.int64))
    if edges is not None:
        ids = b0 + torch.arange(nblk, device=dev)[None, :]
        e = edges.amax(1)  # [N, tp + 1]
        none = torch.full_like(mk, EMPTY_KEY)
        mk = torch.maximum(mk, torch.where(ids == b0, e[:, rank:rank + 1], none))
        mk = torch.maximum(mk, torch.where(ids == (vocab_start + width) // G, e[:, rank + 1:rank + 2], none))
    live = mk != EMPTY_KEY
    m = decode_max_key_torch(mk)
    cc = c[:, None].expand_as(m)
    rb, g = _block_scale_torch(m, cc)
    db = r_row[:, None] - rb.to(torch.int64)
    okb = live & (db < STAT_BINS)
    w = _block_weight_torch(xb, m[..., None], cc[..., None], g[..., None], fin & okb[..., None])
    z = w.sum(-1)
    dcol = db.clamp(0, STAT_BINS)[:, :, None].expand(n, nblk, G).reshape(n, nblk * G)[:, lead:lead + n_valid]
    first_col = (torch.arange(nblk, device=dev) * G - lead).clamp_min(0)
    return (w.view(n, nblk * G)[:, lead:lead + n_valid], dcol, z, db, okb, first_col)


def _row_meta(rt, rq, row_div, row_div_q, dev):
    bi = torch.cat([torch.arange(rt, device=dev) // row_div, torch.arange(rq, device=dev) // row_div_q])
    kk = torch.cat([torch.arange(rt, device=dev) % row_div, torch.arange(rq, device=dev) % row_div_q])
    return bi, kk


def block_combine_reference(stats: torch.Tensor, keys: torch.Tensor, temperatures: torch.Tensor, *, rows_t: int,
                            row_div: int = 1, row_div_q: int = 1, out: torch.Tensor) -> torch.Tensor:
    """Eager twin of :func:`block_combine`."""
    rows = stats.shape[0]
    check_tensor("out", out, shape=(rows, 1, BINS_COLS), dtype=torch.int64, device=stats.device, contiguous=True)
    if rows == 0:
        return out
    bi, _ = _row_meta(rows_t, rows - rows_t, row_div, row_div_q, stats.device)
    _, r, _ = row_grid_torch(keys, weight_scale_torch(temperatures[bi]))
    rc = stats[:, :, 0]
    live = rc != EMPTY_KEY
    shift = r[:, None] - torch.where(live, rc, r[:, None])
    j = shift[:, :, None] + torch.arange(STAT_BINS, device=stats.device)
    vals = torch.where(live[:, :, None] & (j < STAT_BINS), stats[:, :, 1:1 + STAT_BINS], torch.zeros_like(j))
    acc = torch.zeros((rows, STAT_BINS + 1), dtype=torch.int64, device=stats.device)
    acc.scatter_add_(1, j.clamp(max=STAT_BINS).view(rows, -1), vals.view(rows, -1))
    rt_ = stats[:, :, 2 + STAT_BINS]
    own = rt_ != EMPTY_KEY
    d = r[:, None] - torch.where(own, rt_, r[:, None])
    keep = own & (d < STAT_BINS)
    out[:, 0, :STAT_BINS] = acc[:, :STAT_BINS]
    out[:, 0, STAT_BINS] = torch.where(keep, stats[:, :, 1 + STAT_BINS], torch.zeros_like(d)).sum(1)
    out[:, 0, STAT_BINS + 1] = torch.where(keep, d, torch.zeros_like(d)).sum(1)
    return out


def block_keys_reference(target: torch.Tensor, draft: torch.Tensor | None, vocab_start: int, vocab_size: int, *,
                         keys_out: torch.Tensor, edges_out: torch.Tensor, rank: int = 0, tp: int = 1,
                         block_size: int = 2048, num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`block_keys`."""
    n_valid, rt, rq, splits, chunk, width = _check_fallback(target, draft, keys_out, edges_out, num_splits,
                                                            block_size, vocab_start, vocab_size, rank, tp)
    verify_keys_reference(target, draft, vocab_start, vocab_size, out=keys_out, block_size=block_size,
                          num_splits=num_splits)
    rows = rt + rq
    if rows == 0:
        return keys_out, edges_out
    dev = target.device
    G = STAT_BLOCK
    x = _rows_f32(target, draft, n_valid)
    o = torch.where(torch.isfinite(x), ordered_i32_torch(x), torch.full_like(x, INT32_MIN, dtype=torch.int32))
    blk = (vocab_start + torch.arange(n_valid, device=dev)) // G
    slot = torch.arange(n_valid, device=dev) // chunk
    first_blk, last_blk = vocab_start // G, (vocab_start + max(n_valid, 1) - 1) // G

    def part(which: int) -> torch.Tensor:
        v = torch.where((blk == which)[None, :], o, torch.full_like(o, INT32_MIN)).to(torch.int64)
        res = torch.full((rows, splits), INT32_MIN, dtype=torch.int64, device=dev)
        res.scatter_reduce_(1, slot[None, :].expand(rows, -1), v, "amax")
        return torch.where(res == INT32_MIN, torch.full_like(res, EMPTY_KEY), res)

    pf, pl = part(first_blk), part(last_blk)
    bj = (torch.arange(tp + 1, device=dev) * width) // G
    none = torch.full((rows, splits, tp + 1), EMPTY_KEY, dtype=torch.int64, device=dev)
    edges_out.copy_(torch.maximum(torch.where(bj == first_blk, pf[..., None], none),
                                  torch.where(bj == last_blk, pl[..., None], none)))
    return keys_out, edges_out


def block_bins_reference(target: torch.Tensor, draft: torch.Tensor | None, keys: torch.Tensor, edges: torch.Tensor,
                         temperatures: torch.Tensor, vocab_start: int, vocab_size: int, *,
                         tokens: torch.Tensor | None = None, row_div: int = 1, row_div_q: int = 1, rank: int = 0,
                         tp: int = 1, out: torch.Tensor, block_size: int = 2048, num_splits: int = 1) -> torch.Tensor:
    """Eager twin of :func:`block_bins`."""
    n_valid, rt, rq, splits, chunk, width = _check_fallback(target, draft, keys, edges, num_splits, block_size,
                                                            vocab_start, vocab_size, rank, tp)
    check_tensor("out", out, shape=(rt + rq, splits, BINS_COLS), dtype=torch.int64, device=target.device,
                 contiguous=True)
    rows = rt + rq
    if rows == 0:
        return out
    dev = target.device
    bi, kk = _row_meta(rt, rq, row_div, row_div_q, dev)
    c = weight_scale_torch(temperatures[bi])
    _, r, _ = row_grid_torch(keys, c)
    x = _rows_f32(target, draft, n_valid)
    w, d, z, db, okb, first_col = shard_block_weights_torch(x, vocab_start, width, rank, edges, c, r)
    bslot = (first_col // chunk)[None, :].expand_as(db)
    idx = bslot * (STAT_BINS + 1) + torch.where(okb, db, torch.full_like(db, STAT_BINS))
    acc = torch.zeros((rows, splits * (STAT_BINS + 1)), dtype=torch.int64, device=dev)
    acc.scatter_add_(1, idx, torch.where(okb, z, torch.zeros_like(z)))
    out.zero_()
    out[:, :, :STAT_BINS] = acc.view(rows, splits, STAT_BINS + 1)[:, :, :STAT_BINS]
    if tokens is not None and tokens.shape[1] > 0 and n_valid > 0:
        k_tok = tokens.shape[1]
        tok = torch.where(kk < k_tok, tokens[bi, kk.clamp(max=k_tok - 1)], torch.full_like(kk, -1))
        col = tok - vocab_start
        own = (col >= 0) & (col < n_valid)
        colc = torch.where(own, col, torch.zeros_like(col))
        ri = torch.arange(rows, device=dev)
        lead = vocab_start % STAT_BLOCK
        blk = (colc + lead) // STAT_BLOCK
        slot = first_col[blk] // chunk  # the chunk that weighs the token's block
        ft = torch.where(own, w[ri, colc], torch.zeros_like(col))
        st = torch.where(own & okb[ri, blk] & torch.isfinite(x[ri, colc]), db[ri, blk], torch.zeros_like(col))
        out[ri, slot, STAT_BINS] += ft
        out[ri, slot, STAT_BINS + 1] += st
    return out


def block_row_mass_torch(bins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`block_row_mass` for rows ``bins [R, S', BINS_COLS]``: ``(Z, F_b(tok), R - R_b(tok))``."""
    tot = bins.sum(1)
    return row_mass_reference(tot[:, :STAT_BINS]), tot[:, STAT_BINS], tot[:, STAT_BINS + 1]
