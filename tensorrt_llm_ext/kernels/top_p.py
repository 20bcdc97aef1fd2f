"""Exact top-p on vocabulary shards: a mass-weighted MSB-first radix select over the logit order.

The kept set of a row is the smallest prefix, in (logit descending, global id ascending) order, whose
fixed-point mass (see :mod:`~tensorrt_llm_ext.kernels.fixed_point_softmax`) reaches
``tau = max(ceil(p * Z), 1)`` (float64 product of the fp32 ``p`` and the int64 row mass ``Z``: one IEEE
multiply and a ceil, the same on every rank). Rows with ``p >= 1`` (or NaN) keep every finite token; rows
with ``T <= 0`` keep exactly their first maximum (``tau = 1``); a row without a finite logit keeps nothing.

The boundary is the radix key ``u`` (the fp32 ordered key made unsigned: larger logit, larger ``u``) of
the token where the prefix mass crosses ``tau``. **The window first**: ``verify_sums`` counts, per row and
column chunk, the finite tokens at each of the 256 values of the logits' dtype at and below the row max (the
values' keys are one apart after dropping the ``key_shift`` bits that the dtype leaves constant). Every token of
such a bin has one value, so the bin's exact mass is its count times that value's weight; where the cumulative
mass of the 256 bins reaches ``tau`` (:func:`window_resolve`: on bf16 rows of a real or a random-weight model at
T = 1 the top-p 0.95 boundary lies ~100 values below the max), that bin is the boundary. Only the few tokens near
the max add into the window, spread over up to 256 bins, where a radix round 0 adds every weighted token into
the few buckets of a factor of 4 in ``|x|``: contended atomics were most of the top-p time on the H200.

**The radix rounds** find the boundary of the other rows (below the window) a byte at a time, most significant
first: round ``r`` adds, per row and column chunk, the mass of every token whose top ``8r`` bits equal the
prefix found so far into 256 buckets of the next byte. Each program owns its 256 buckets (no global
atomics shared between programs, no memset: the program writes its own slot; the logits' last round counts in
registers and multiplies by each bucket's one weight, earlier rounds add atomically); after one int64 SUM across
ranks every rank sums the chunks' buckets and scans them from the top for the first whose cumulative
mass (plus the mass above the prefix) reaches ``tau``. The resolve of round ``r`` runs at the start of the kernel
of round ``r + 1`` (every program of a row resolves the same, the program of chunk 0 stores it); rows the window
resolved (:func:`top_p_window`: one program per row, before round 0, its result read by every later program)
histogram nothing (their programs skip the pass). The logits' dtype decides how many rounds there are
(:func:`radix_rounds`); after the last the boundary value ``b*`` and the mass strictly above it are exact, and
the same as the window's where both apply (the same definition).

Tokens with key ``b*`` all weigh the same ``F*``; the first ``n_keep = ceil((tau - mass_above) / F*)`` of
them in global id order are kept. Each program counts its ties (and those with a global id below the
row's drafted token), one all-gather of the counts ``[tp, R, S, 2]`` gives every rank the ties that
precede each of its chunks, and a token's tie rank is that base plus a prefix count inside the chunk. The
kept mass comes out for free: ``Z_p = mass_above + n_keep * F*``. :func:`final_rows` (a ``@triton.jit``
helper, used by the mask kernel and by the draw) derives all of it where it is needed, so there is no
separate finalize launch.

Launches of :func:`~tensorrt_llm_ext.speculative.verification.top_p_keep`: ``verify_keys``,
``verify_sums`` (the window's counts), ``top_p_window``, rounds 0..n (n = 1 bf16, 2 fp16, 3 fp32), ties, mask: bf16
7 launches, 5 exchanges (MAX, SUM, 2 x SUM, gather).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_int, check_tensor, num_warps_for
from tensorrt_llm_ext.kernels.ordered_key import ordered_i32
from tensorrt_llm_ext.kernels.fixed_point_softmax import (HIST_BUCKETS, SUMS_COLS, check_logits, decode_max_key,
                                                          decode_max_key_torch, fixed_point_weight, hist_add,
                                                          fixed_point_weight_torch, is_finite, key_shift, plan_chunks,
                                                          radix_key, radix_key_torch, radix_to_f32,
                                                          radix_to_f32_torch, row_max_from_keys, subchunk_index_torch,
                                                          subchunk_width,
                                                          row_max_from_keys_rows, split_reduce, split_reduce_rows,
                                                          weight_scale,
                                                          weight_scale_torch)

__all__ = [
    "bucket_key", "final_rows", "final_rows_torch", "kept_in_tile", "kept_torch", "radix_rounds", "row_tau", "top_p_mask",
    "top_p_mask_reference", "window_key", "window_resolve", "window_resolve_torch",
    "check_sub", "top_p_round", "top_p_round_reference", "top_p_ties", "top_p_ties_reference", "top_p_window",
    "top_p_window_reference",
]


# ----------------------------------------------------------------------------------------------------
# Triton helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def row_tau(p, z, temp, HAS_P: tl.constexpr):
    """Mass threshold of a row (int64): -1 = keep every finite token (p >= 1 or NaN, no top-p, Z = 0)."""
    greedy = ~(temp > 0.0)
    if HAS_P:
        lim = p < 1.0
        tau_p = tl.maximum(tl.math.ceil(p.to(tl.float64) * z.to(tl.float64)).to(tl.int64), 1)
    else:
        lim = greedy & False
        tau_p = z * 0 + 1
    tau = tl.where(greedy, z * 0 + 1, tl.where(lim, tau_p, z * 0 - 1))
    return tl.where(z == 0, z * 0 - 1, tau)


@triton.jit
def _resolve(hist_ptr, num_splits, split_stride, prefix, mass, tau, SPLITS: tl.constexpr):
    """One radix digit: the first bucket from the top whose cumulative mass reaches ``tau``."""
    j = tl.arange(0, 256)
    g = split_reduce_rows(hist_ptr + 255 - j, num_splits, split_stride, j < 256, SPLITS, False)
    c = tl.cumsum(g, 0)
    hit = (mass + c) >= tau
    jstar = tl.min(tl.where(hit, j, 255), 0)
    before = tl.sum(tl.where(j == jstar, c - g, 0), 0)
    keep_all = tau < 0
    new_prefix = tl.where(keep_all, 0, (prefix << 8) | (255 - jstar).to(tl.int64))
    new_mass = tl.where(keep_all, 0, mass + before)
    return new_prefix, new_mass


@triton.jit
def kept_in_tile(u, fin, bstar, n_keep, run):
    """Kept mask of one tile in global id order, and the tie count carried to the next tile."""
    tie = fin & (u == bstar)
    ti = tie.to(tl.int64)
    rank = run + tl.cumsum(ti, 0) - 1
    kept = fin & ((u > bstar) | (tie & (rank < n_keep)))
    return kept, run + tl.sum(ti, 0)


@triton.jit
def bucket_key(prefix, digit, low_bits):
    """The full radix key of bucket ``digit`` under ``prefix`` when the ``low_bits`` below it are constant given
    the sign (the dtype's last round, :func:`radix_rounds`): 0 for a positive logit, all ones for a negative one
    (the ordered key of a negative float inverts its bits). int64 in, int64 out."""
    key = ((prefix << 8) | digit) << low_bits
    low = ((digit * 0 + 1) << low_bits) - 1
    return tl.where(key < 2147483648, key | low, key)


@triton.jit
def window_key(wtop, j, SHIFT: tl.constexpr):
    """The full radix key of top-p window bin ``j`` (int64): the dtype value ``j`` steps below the row max, whose
    key is ``wtop = radix_key(m) >> SHIFT`` in units of ``2^SHIFT``; the ``SHIFT`` low bits follow from the sign
    (0 for a positive logit, all ones for a negative one), as in :func:`bucket_key`."""
    key = (wtop - j) << SHIFT
    return tl.where(key < 2147483648, key | ((1 << SHIFT) - 1), key)


@triton.jit
def window_resolve(win_ptr, num_splits, stride, m, c, tau, SHIFT: tl.constexpr, SPLITS: tl.constexpr):
    """``(resolved, b*, mass above b*)`` of a row from its exchanged window counts (``win_ptr [S, 256]`` at chunk
    stride ``stride``, :func:`~tensorrt_llm_ext.kernels.fixed_point_softmax.verify_sums`).

    Every token of bin ``j`` has the one value of :func:`window_key`, so the bin's mass is its count times that
    value's weight: the exact masses of the 256 largest values of the row. ``resolved``: ``tau >= 0`` and their
    cumulative mass from the top reaches ``tau`` -- then ``b*`` is that bin's key and the mass above it the bins'
    sum before it, the same boundary the radix rounds find (the first value, logit descending, where the prefix
    mass reaches ``tau``). Otherwise the boundary lies below the window and the rounds find it."""
    j = tl.arange(0, 256)
    g = split_reduce_rows(win_ptr + j, num_splits, stride, j < 256, SPLITS, False)
    key = window_key(radix_key(m) >> SHIFT, j.to(tl.int64), SHIFT)
    mass = g * fixed_point_weight(radix_to_f32(key), m, c, g > 0)
    hit = tl.cumsum(mass, 0) >= tau
    jstar = tl.min(tl.where(hit, j, 256), 0)
    above = tl.sum(tl.where(j < jstar, mass, 0), 0)
    bstar = tl.sum(tl.where(j == jstar, key, 0), 0)
    return (tau >= 0) & (jstar < 256), bstar, above


@triton.jit
def final_rows(keys_ptr, sums_ptr, state_ptr, ties_all_ptr, temp, p, r, ok, cols_t, num_splits, rows,
               rank, tp, slot, n_slots, HAS_P: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr,
               TPS: tl.constexpr):
    """Per target row ``r`` (a scalar, or a block with ``ROWS``): ``(Z_p, F_p(tok) if kept else 0, n_keep, tie
    base, b*)``.

    The tie base counts the ties of ``b*`` before tie slot ``slot`` of rank ``rank`` in global id order
    (``ties_all [tp, rows, n_slots, 2]``: a slot is a column chunk, or a sub-chunk of the draw). ``sums`` is
    the exchanged target part ``[rows, S, cols_t]``; without ``HAS_P`` the kept set is
    every finite token (``Z_p = Z``). Identical on every rank but the tie base. Reductions over the chunks
    (``SPLITS``) and over (rank, chunk) (``TPS``, next power of two >= tp * S) are single vector loads.
    """
    r64 = r.to(tl.int64)
    srow = sums_ptr + r64 * num_splits * cols_t
    if ROWS:
        z = split_reduce_rows(srow, num_splits, cols_t, ok, SPLITS, False)
        ftok = split_reduce_rows(srow + 1, num_splits, cols_t, ok, SPLITS, False)
    else:
        z = split_reduce(srow, num_splits, cols_t, ok, SPLITS, False)
        ftok = split_reduce(srow + 1, num_splits, cols_t, ok, SPLITS, False)
    zp = z
    fp_tok = ftok
    n_keep = z * 0
    run = z * 0
    bstar = z * 0
    if HAS_P:
        j = tl.arange(0, TPS)
        q = j // n_slots
        s = j % n_slots
        jv = j < tp * n_slots
        before = (q < rank) | ((q == rank) & (s < slot))
        if ROWS:
            utok = split_reduce_rows(srow + 2, num_splits, cols_t, ok, SPLITS, False)
            m = decode_max_key(row_max_from_keys_rows(keys_ptr, r, num_splits, ok, SPLITS))
            base = ties_all_ptr + ((q[None, :] * rows + r64[:, None]) * n_slots + s[None, :]) * 2
            lm = jv[None, :] & ok[:, None]
            c0 = tl.load(base, mask=lm, other=0)
            run = tl.sum(tl.where(before[None, :], c0, 0), 1)
            tok_rank = tl.sum(tl.load(base + 1, mask=lm, other=0), 1)
        else:
            utok = split_reduce(srow + 2, num_splits, cols_t, ok, SPLITS, False)
            m = decode_max_key(row_max_from_keys(keys_ptr, r, num_splits, SPLITS))
            base = ties_all_ptr + ((q * rows + r64) * n_slots + s) * 2
            c0 = tl.load(base, mask=jv & ok, other=0)
            run = tl.sum(tl.where(before, c0, 0), 0)
            tok_rank = tl.sum(tl.load(base + 1, mask=jv & ok, other=0), 0)
        c = weight_scale(temp)
        tau = row_tau(p, z, temp, True)
        keep_all = tau < 0
        bstar = tl.load(state_ptr + r64 * 2, mask=ok, other=0)
        mass = tl.load(state_ptr + r64 * 2 + 1, mask=ok, other=0)
        fstar = fixed_point_weight(radix_to_f32(bstar), m, c, ok & ~keep_all)
        fs = tl.maximum(fstar, 1)
        n_keep = tl.where(keep_all, 0, (tau - mass + fs - 1) // fs)
        zp = tl.where(keep_all, z, mass + n_keep * fs)
        kept_tok = keep_all | (utok > bstar) | ((utok == bstar) & (tok_rank < n_keep))
        fp_tok = tl.where(kept_tok, ftok, 0)
    return zp, fp_tok, n_keep, run, bstar


@triton.jit
def _top_p_round_kernel(
    x_ptr,  # [R, V_local] target logits
    keys_ptr,  # [>= R, S, 2] int64 exchanged keys
    temp_ptr, top_p_ptr,  # [R // row_div] fp32
    sums_ptr,  # [R, S, cols_t] int64 exchanged (Z in column 0)
    prev_ptr,  # the previous round's exchanged histogram, [R, S, 256] at strides (prev_rs, prev_ss)
    window_ptr,  # [R, 2] int64 (b* or -1, mass above b*): the window's resolution (top_p_window)
    state_prev_ptr,  # [R, 2] int64 (prefix, mass above) before this round's digit
    state_out_ptr,  # [R, 2] int64 written by the program of chunk 0
    out_ptr,  # [R, S, 256] int64 histogram (rounds) or [R, S * n_sub, 2] tie counts (TIES), every slot written
    tok_ptr,  # [R // row_div, k_tok] int64 (TIES and HAS_TOK)
    stride_row, cols_t, prev_rs, prev_ss, n_valid, vocab_start, chunk, num_splits, row_div, k_tok, n_sub, sub,
    rnd,  # 0..3: which digit this kernel histograms; with TIES: the low key bits no round resolved (0, 8, 16)
    BLOCK: tl.constexpr, TIES: tl.constexpr, HAS_TOK: tl.constexpr, SPLITS: tl.constexpr,
    COUNT: tl.constexpr = False,  # the dtype's last round: every bucket is one logit value (counts x its weight)
    SHIFT: tl.constexpr = 0,  # key_shift of the logits' dtype (the window's unit)
):
    # the order of the rows alternates between consecutive passes (sums backwards, rounds forwards, the tie
    # count backwards), so each pass starts on the rows the previous one read last (still in L2)
    row = tl.program_id(0)
    split = tl.program_id(1)
    if TIES:
        row = tl.num_programs(0) - 1 - row
        split = tl.num_programs(1) - 1 - split
    r64 = row.to(tl.int64)
    b = row // row_div
    temp = tl.load(temp_ptr + b)
    c = weight_scale(temp)
    m = decode_max_key(row_max_from_keys(keys_ptr, row, num_splits, SPLITS))
    srow = sums_ptr + r64 * num_splits * cols_t
    z = split_reduce(srow, num_splits, cols_t, row >= 0, SPLITS, False)
    tau = row_tau(tl.load(top_p_ptr + b), z, temp, True)
    # a row whose boundary lies among its 256 largest values is resolved by verify_sums' window (top_p_window,
    # once per row; the counts from sums column 3 = SUMS_COLS): no round histograms it, and the tie count takes its
    # boundary from the window
    wkey = tl.load(window_ptr + r64 * 2)
    wmass = tl.load(window_ptr + r64 * 2 + 1)
    wres = wkey >= 0
    pv = tl.load(state_prev_ptr + r64 * 2)
    mv = tl.load(state_prev_ptr + r64 * 2 + 1)
    # a row the window resolved skips the scan of its S x 256 buckets (its histogram is zero: its round state
    # stays (0, 0), the scan's result on it), and the tie count takes the window's boundary
    if TIES:
        prefix = wkey
        mass = wmass
        if wkey < 0:
            prefix, mass = _resolve(prev_ptr + r64 * prev_rs, num_splits, prev_ss, pv, mv, tau, SPLITS)
            # bits the logits' dtype leaves constant (bf16: 16, fp16: 8 of the radix key) follow from the sign
            full = prefix << rnd
            low = ((prefix * 0 + 1) << rnd) - 1
            prefix = tl.where(tau < 0, prefix, tl.where(full < 2147483648, full | low, full))
    else:
        # rounds 0 and 1 start from the empty prefix (no memset of a state buffer needed); round 0 has no digit
        # to resolve (its prev_ptr is any buffer of the right shape, never read)
        prefix = tl.where(rnd <= 1, 0, pv)
        mass = tl.where(rnd <= 1, 0, mv)
        if (rnd > 0) & (wkey < 0):
            prefix, mass = _resolve(prev_ptr + r64 * prev_rs, num_splits, prev_ss, prefix, mass, tau, SPLITS)
    if split == 0:
        tl.store(state_out_ptr + r64 * 2, prefix)
        tl.store(state_out_ptr + r64 * 2 + 1, mass)
    row_ptr = x_ptr + r64 * stride_row
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    if TIES:
        tok = tl.full([], -1, tl.int64)  # the branch below assigns an int64 id
        if HAS_TOK:
            kk = row % row_div
            if kk < k_tok:
                tok = tl.load(tok_ptr + b.to(tl.int64) * k_tok + kk)
        # one (count, before-token count) slot per sub-chunk: the draw's programs need their own tie base
        for si in range(n_sub):
            sub_begin = col_begin + si * sub
            sub_end = tl.minimum(sub_begin + sub, col_end)
            # int32 in the loop (counts of one sub-chunk, column ids of one shard): the radix key compared as its
            # ordered int32 key, the token as a column of this shard (-1: none here or before)
            cnt = tl.zeros([BLOCK], tl.int32)
            before = tl.zeros([BLOCK], tl.int32)
            if tau >= 0:
                okey = (prefix - 2147483648).to(tl.int32)
                tok_col = tl.minimum(tl.maximum(tok - vocab_start, -1), 2147483647).to(tl.int32)
                for start in range(sub_begin, sub_end, BLOCK):
                    cols = start + lanes
                    valid = cols < sub_end
                    x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
                    tie = (valid & is_finite(x) & (ordered_i32(x) == okey)).to(tl.int32)
                    cnt += tie
                    before += tl.where(cols < tok_col, tie, 0)
            out = out_ptr + ((r64 * num_splits + split) * n_sub + si) * 2
            tl.store(out, tl.sum(cnt, 0).to(tl.int64))
            tl.store(out + 1, tl.sum(before, 0).to(tl.int64))
    elif COUNT:
        # The last round of the logits' dtype: the key bits below this digit are constant given the sign
        # (radix_rounds), so every token of a bucket has the same fp32 value and the same weight. The bucket's
        # mass is its count times that weight: a register histogram of counts (tl.histogram), no atomics.
        sh_match = 32 - 8 * rnd
        sh_digit = 24 - 8 * rnd
        cnt = tl.zeros([256], tl.int32)
        if (tau >= 0) & ~wres:
            for start in range(col_begin, col_end, BLOCK):
                cols = start + lanes
                valid = cols < col_end
                x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
                u = radix_key(x)
                hit = valid & is_finite(x) & ((u >> sh_match) == prefix)
                cnt += tl.histogram(((u >> sh_digit) & 255).to(tl.int32), 256, mask=hit)
        j = tl.arange(0, 256)
        value = radix_to_f32(bucket_key(prefix, j.to(tl.int64), sh_digit))
        w = fixed_point_weight(value, m, c, cnt > 0)
        tl.store(out_ptr + (r64 * num_splits + split) * 256 + j, cnt.to(tl.int64) * w)
    else:
        out = out_ptr + (r64 * num_splits + split) * 256
        tl.store(out + tl.arange(0, 256), tl.zeros([256], tl.int64))  # this program's own buckets
        tl.debug_barrier()
        if (tau >= 0) & ~wres:
            sh_match = 32 - 8 * rnd
            sh_digit = 24 - 8 * rnd
            for start in range(col_begin, col_end, BLOCK):
                cols = start + lanes
                valid = cols < col_end
                x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
                u = radix_key(x)
                hit = valid & is_finite(x) & ((u >> sh_match) == prefix)
                w = fixed_point_weight(x, m, c, hit)
                hist_add(out, ((u >> sh_digit) & 255).to(tl.int32), w)


@triton.jit
def _top_p_window_kernel(
    keys_ptr, temp_ptr, top_p_ptr,  # as in _top_p_round_kernel
    sums_ptr,  # [R, S, cols_t] int64 exchanged (Z in column 0, the window's counts from column 3)
    out_ptr,  # [R, 2] int64: (b*, mass above b*) where the window resolves the row, else (-1, 0)
    cols_t, num_splits, row_div, SPLITS: tl.constexpr, SHIFT: tl.constexpr,
):
    # one program per row: the window's boundary, read by every program of the rounds and the tie count (each
    # had resolved the row's whole window itself: rows x chunks x 3 scans of S x 256 counts)
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    b = row // row_div
    temp = tl.load(temp_ptr + b)
    m = decode_max_key(row_max_from_keys(keys_ptr, row, num_splits, SPLITS))
    srow = sums_ptr + r64 * num_splits * cols_t
    tau = row_tau(tl.load(top_p_ptr + b), split_reduce(srow, num_splits, cols_t, row >= 0, SPLITS, False), temp, True)
    wres, wkey, wmass = window_resolve(srow + 3, num_splits, cols_t, m, weight_scale(temp), tau, SHIFT, SPLITS)
    tl.store(out_ptr + r64 * 2, tl.where(wres, wkey, -1))
    tl.store(out_ptr + r64 * 2 + 1, tl.where(wres, wmass, 0))


@triton.jit(do_not_specialize=["rows"])  # a row count: one build for every batch
def _top_p_mask_kernel(
    x_ptr, keys_ptr, temp_ptr, top_p_ptr, sums_ptr,
    state_ptr,  # [R, 2] int64: (b*, mass above b*)
    ties_all_ptr,  # [tp, R, S, 2] int64 gathered tie counts
    mask_ptr,  # [R, width] uint8 (a bool tensor's bytes), every column written
    stride_row, width, cols_t, n_valid, chunk, num_splits, rows, row_div, rank, tp,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, TPS: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    r64 = row.to(tl.int64)
    b = row // row_div
    _, _, n_keep, run, bstar = final_rows(keys_ptr, sums_ptr, state_ptr, ties_all_ptr, tl.load(temp_ptr + b),
                                          tl.load(top_p_ptr + b), row, row >= 0, cols_t, num_splits,
                                          rows, rank, tp, split, num_splits, True, False, SPLITS, TPS)
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    # every chunk also clears its padded columns (>= n_valid): the chunks cover the whole width
    col_stop = tl.minimum(col_begin + chunk, width)
    for start in range(col_begin, col_stop, BLOCK):
        cols = start + lanes
        valid = cols < col_end
        x = tl.load(x_ptr + r64 * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
        kept, run = kept_in_tile(radix_key(x), valid & is_finite(x), bstar, n_keep, run)
        tl.store(mask_ptr + r64 * width + cols, kept.to(tl.uint8), mask=cols < col_stop)


# ----------------------------------------------------------------------------------------------------
# torch twins of the helpers
# ----------------------------------------------------------------------------------------------------
def row_tau_torch(p: torch.Tensor | None, z: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    one = torch.ones_like(z)
    greedy = ~(temp > 0)
    if p is not None:
        lim = p < 1.0
        tau_p = torch.clamp_min(torch.ceil(p.double() * z.double()).to(torch.int64), 1)
    else:
        lim = torch.zeros_like(greedy)
        tau_p = one
    tau = torch.where(greedy, one, torch.where(lim, tau_p, -one))
    return torch.where(z == 0, -one, tau)


def _resolve_torch(hist: torch.Tensor, prefix: torch.Tensor, mass: torch.Tensor, tau: torch.Tensor):
    """``hist [R, S, 256]`` (summed over the chunks here)."""
    g = hist.sum(1).flip(1)
    c = torch.cumsum(g, 1)
    j = torch.arange(256, device=hist.device)
    hit = (mass[:, None] + c) >= tau[:, None]
    jstar = torch.where(hit, j, torch.full_like(j, 255)).min(dim=1).values
    before = (c - g).gather(1, jstar[:, None])[:, 0]
    keep_all = tau < 0
    zero = torch.zeros_like(prefix)
    return (torch.where(keep_all, zero, (prefix << 8) | (255 - jstar)),
            torch.where(keep_all, zero, mass + before))


def window_resolve_torch(win: torch.Tensor, m: torch.Tensor, c: torch.Tensor, tau: torch.Tensor, shift: int):
    """Torch twin of :func:`window_resolve` for rows ``[R]`` (``win [R, S, 256]`` window counts)."""
    g = win.sum(1)
    j = torch.arange(HIST_BUCKETS, device=win.device)
    key = (radix_key_torch(m)[:, None] >> shift) - j[None, :]
    key = key << shift
    key = torch.where(key < 2**31, key | ((1 << shift) - 1), key)
    mass = g * fixed_point_weight_torch(radix_to_f32_torch(key), m[:, None], c[:, None], g > 0)
    hit = torch.cumsum(mass, 1) >= tau[:, None]
    jstar = torch.where(hit, j[None, :], torch.full_like(hit, HIST_BUCKETS, dtype=torch.int64)).min(1).values
    above = torch.where(j[None, :] < jstar[:, None], mass, torch.zeros_like(mass)).sum(1)
    bstar = key.gather(1, jstar.clamp(max=HIST_BUCKETS - 1)[:, None])[:, 0]
    return (tau >= 0) & (jstar < HIST_BUCKETS), bstar, above


def _row_setup_torch(keys, temperatures, top_p, sums, row_div):
    rows = sums.shape[0]
    temp = temperatures.repeat_interleave(row_div)
    c = weight_scale_torch(temp)
    m = decode_max_key_torch(keys[:rows, :, 1].max(1).values)
    p = top_p.repeat_interleave(row_div) if top_p is not None else None
    return c, m, row_tau_torch(p, sums[:, :, 0].sum(1), temp)


def kept_torch(u, fin, bstar, n_keep, tie_base):
    tie = fin & (u == bstar[:, None])
    rank = tie_base[:, None] + torch.cumsum(tie.to(torch.int64), 1) - 1
    return fin & ((u > bstar[:, None]) | (tie & (rank < n_keep[:, None])))


def final_rows_torch(keys, sums, state, ties_all, temp, p, rank: int):
    """Torch twin of :func:`final_rows` for rows ``[R]`` (``temp``/``p`` per row; ``p`` None = no top-p).

    Returns ``(Z_p, F_p(tok), n_keep, tie base [R, S], b*)``: the tie base of every chunk of ``rank``.
    """
    z, ftok, utok = sums[:, :, 0].sum(1), sums[:, :, 1].sum(1), sums[:, :, 2].sum(1)
    zero = torch.zeros_like(z)
    splits = sums.shape[1]
    if p is None:
        return z, ftok, zero, torch.zeros((z.shape[0], splits), dtype=torch.int64, device=z.device), zero
    c = weight_scale_torch(temp)
    tau = row_tau_torch(p, z, temp)
    keep_all = tau < 0
    m = decode_max_key_torch(keys[: z.shape[0], :, 1].max(1).values)
    bstar, mass = state[:, 0], state[:, 1]
    fstar = fixed_point_weight_torch(radix_to_f32_torch(bstar), m, c, ~keep_all)
    fs = torch.clamp_min(fstar, 1)
    n_keep = torch.where(keep_all, zero, (tau - mass + fs - 1) // fs)
    zp = torch.where(keep_all, z, mass + n_keep * fs)
    counts = ties_all[..., 0]  # [tp, R, S]
    run = counts[:rank].sum((0, 2))[:, None] + torch.cumsum(counts[rank], 1) - counts[rank]
    tok_rank = ties_all[..., 1].sum((0, 2))
    kept_tok = keep_all | (utok > bstar) | ((utok == bstar) & (tok_rank < n_keep))
    return zp, torch.where(kept_tok, ftok, zero), n_keep, run, bstar


def _chunk_index(n_valid: int, chunk: int, device) -> torch.Tensor:
    return torch.arange(n_valid, device=device) // chunk


# ----------------------------------------------------------------------------------------------------
# Launchers and eager twins
# ----------------------------------------------------------------------------------------------------
def _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, row_div, block_size,
                 num_splits, vocab_start, vocab_size):
    n_valid = check_logits("logits", logits, vocab_start, vocab_size)
    splits, chunk = plan_chunks(logits.shape[1], block_size, num_splits)
    rows = logits.shape[0]
    dev = logits.device
    check_int("row_div", row_div, lo=1)
    check_tensor("keys", keys, shape=(None, splits, 2), dtype=torch.int64, device=dev, contiguous=True)
    if keys.shape[0] < rows:
        raise ValueError(f"keys: expected >= {rows} rows, got {keys.shape[0]}")
    check_tensor("temperatures", temperatures, shape=(rows // row_div,), dtype=torch.float32, device=dev,
                 contiguous=True)
    check_tensor("top_p", top_p, shape=(rows // row_div,), dtype=torch.float32, device=dev, contiguous=True)
    check_tensor("sums", sums, shape=(rows, splits, None), dtype=torch.int64, device=dev, contiguous=True)
    if prev_hist is not None:
        check_tensor("prev_hist", prev_hist, shape=(rows, splits, HIST_BUCKETS), dtype=torch.int64, device=dev,
                     unit_last_stride=True)
    for name, t in (("state_prev", state_prev), ("state_out", state_out)):
        if t is not None:
            check_tensor(name, t, shape=(rows, 2), dtype=torch.int64, device=dev, contiguous=True)
    return n_valid, splits, chunk


def _window_state(window, rows: int, device) -> torch.Tensor:
    """``window [R, 2]`` int64 (:func:`top_p_window`'s output), checked; returned."""
    check_tensor("window", window, shape=(rows, 2), dtype=torch.int64, device=device, contiguous=True)
    return window


def top_p_window(logits, keys, temperatures, top_p, sums, window, vocab_start: int, vocab_size: int, *,
                 row_div: int = 1, block_size: int = 2048, num_splits: int = 1) -> None:
    """The top-p window's boundary of every row, once: ``window [R, 2]`` int64 = ``(b*, mass above b*)`` where the
    exchanged window counts of ``sums [R, S, cols_t]`` (``verify_sums``) resolve the row (:func:`window_resolve`),
    else ``(-1, 0)`` (the rounds find it). Read by :func:`top_p_round` and :func:`top_p_ties`. One launch, one
    program per row; CUDA-graph safe."""
    _, splits, _ = _check_round(logits, keys, temperatures, top_p, sums, None, None, None, row_div, block_size,
                                num_splits, vocab_start, vocab_size)
    rows = logits.shape[0]
    _window_state(window, rows, logits.device)
    if rows == 0:
        return
    _top_p_window_kernel[(rows,)](keys, temperatures, top_p, sums, window, sums.shape[2], splits, row_div,
                                  SPLITS=triton.next_power_of_2(splits), SHIFT=key_shift(logits.dtype), num_warps=4)


def top_p_window_reference(logits, keys, temperatures, top_p, sums, window, vocab_start: int, vocab_size: int, *,
                           row_div: int = 1, block_size: int = 2048, num_splits: int = 1) -> None:
    """Eager twin of :func:`top_p_window`."""
    _check_round(logits, keys, temperatures, top_p, sums, None, None, None, row_div, block_size, num_splits,
                 vocab_start, vocab_size)
    _window_state(window, logits.shape[0], logits.device)
    c, m, tau = _row_setup_torch(keys, temperatures, top_p, sums, row_div)
    wres, wkey, wmass = window_resolve_torch(sums[:, :, SUMS_COLS:], m, c, tau, key_shift(logits.dtype))
    window[:, 0] = torch.where(wres, wkey, -1)
    window[:, 1] = torch.where(wres, wmass, 0)


def top_p_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, hist_out,
                vocab_start: int, vocab_size: int, rnd: int, *, window: torch.Tensor, row_div: int = 1,
                block_size: int = 2048, num_splits: int = 1) -> None:
    """Radix round ``rnd`` (0..3): resolve the previous digit into ``state_out`` and histogram the next.

    ``sums [R, S, cols_t]`` (the exchanged target part of ``verify_sums``, with its top-p window),
    ``prev_hist [R, S, 256]`` (the exchanged histogram of round ``rnd - 1``; None for round 0),
    ``state_prev``/``state_out`` ``[R, 2]`` (prefix, mass above; rounds 0 and 1 start from the empty prefix and
    ignore ``state_prev``, which may be None), ``hist_out [R, S, 256]`` int64, every slot written (SUM-exchanged
    next). Rows that the window resolves (``window``, :func:`top_p_window`) histogram nothing (zeros). One launch; CUDA-graph
    safe. The logits' last round (:func:`radix_rounds`) histograms counts in registers and multiplies each bucket's
    count by its one value's weight (no atomics; the same int64 masses as the weighted adds); the others add each
    token's weight atomically into the program's own buckets.
    """
    n_valid, splits, chunk = _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out,
                                          row_div, block_size, num_splits, vocab_start, vocab_size)
    check_int("rnd", rnd, lo=0, hi=4)
    rows = logits.shape[0]
    check_tensor("hist_out", hist_out, shape=(rows, splits, HIST_BUCKETS), dtype=torch.int64, device=logits.device,
                 contiguous=True)
    if rnd > 0 and prev_hist is None:
        raise ValueError(f"prev_hist: round {rnd} needs the previous round's histogram, got None")
    if rows == 0:
        return
    prev = hist_out if rnd == 0 else prev_hist  # round 0 reads no digit (any buffer of the shape)
    st_prev = state_out if state_prev is None else state_prev
    _top_p_round_kernel[(rows, splits)](
        logits, keys, temperatures, top_p, sums, prev, _window_state(window, rows, logits.device), st_prev,
        state_out, hist_out, keys,
        logits.stride(0), sums.shape[2], prev.stride(0), prev.stride(1),
        n_valid, vocab_start, chunk, splits, row_div, 0, 1, chunk, rnd, BLOCK=block_size, TIES=False, HAS_TOK=False,
        SPLITS=triton.next_power_of_2(splits), COUNT=rnd == radix_rounds(logits.dtype), SHIFT=key_shift(logits.dtype),
        num_warps=num_warps_for(block_size))


def top_p_round_reference(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, hist_out,
                          vocab_start: int, vocab_size: int, rnd: int, *, window: torch.Tensor, row_div: int = 1,
                          block_size: int = 2048, num_splits: int = 1) -> None:
    """Eager twin of :func:`top_p_round` (same buffers written)."""
    n_valid, splits, chunk = _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out,
                                          row_div, block_size, num_splits, vocab_start, vocab_size)
    rows = logits.shape[0]
    c, m, tau = _row_setup_torch(keys, temperatures, top_p, sums, row_div)
    wres = _window_state(window, rows, logits.device)[:, 0] >= 0
    zero = torch.zeros_like(tau)
    if rnd == 0:
        prefix, mass = zero, zero
    else:
        start = torch.zeros_like(state_out) if rnd == 1 else state_prev
        prefix, mass = _resolve_torch(prev_hist, start[:, 0], start[:, 1], tau)
    state_out[:, 0] = prefix
    state_out[:, 1] = mass
    x = logits[:, :n_valid].float()
    u = radix_key_torch(x)
    hit = torch.isfinite(x) & ((u >> (32 - 8 * rnd)) == prefix[:, None]) & ((tau >= 0) & ~wres)[:, None]
    w = fixed_point_weight_torch(x, m[:, None], c[:, None], hit)
    h = torch.zeros((rows, splits * HIST_BUCKETS), dtype=torch.int64, device=x.device)
    sc = _chunk_index(n_valid, chunk, x.device)[None, :] * HIST_BUCKETS
    h.scatter_add_(1, sc + ((u >> (24 - 8 * rnd)) & 255), w)
    hist_out.copy_(h.view(rows, splits, HIST_BUCKETS))


def radix_rounds(dtype: torch.dtype) -> int:
    """Radix rounds after round 0 that the logits' dtype needs: its fp32 radix key has 32 (fp32), 19 (fp16)
    or 16 (bf16) significant bits, the rest constant given the sign, so bf16 stops after round 1 and fp16
    after round 2 (exact: every finite key of the dtype is still told apart). A static fact of the call."""
    return {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 3)


def _check_skip(skip_bits: int) -> None:
    if skip_bits not in (0, 8, 16):
        raise ValueError(f"skip_bits: expected 0, 8 or 16, got {skip_bits!r}")


def check_sub(chunk: int, block_size: int, n_sub: int) -> int:
    """The sub-chunk width of ``n_sub`` sub-chunks per column chunk (``fixed_point_softmax.subchunk_width``)."""
    check_int("n_sub", n_sub, lo=1)
    return subchunk_width(chunk, block_size, n_sub)


def _check_ties(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, ties, row_div,
                block_size, num_splits, vocab_start, vocab_size, n_sub, skip_bits):
    """The checks of :func:`top_p_ties` and its twin: ``(n_valid, splits, chunk, sub-chunk width)``."""
    n_valid, splits, chunk = _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out,
                                          row_div, block_size, num_splits, vocab_start, vocab_size)
    sub = check_sub(chunk, block_size, n_sub)
    check_tensor("ties", ties, shape=(logits.shape[0], splits * n_sub, 2), dtype=torch.int64, device=logits.device,
                 contiguous=True)
    _check_skip(skip_bits)
    return n_valid, splits, chunk, sub


def top_p_ties(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, ties,
               vocab_start: int, vocab_size: int, *, window: torch.Tensor, tokens: torch.Tensor | None = None,
               row_div: int = 1, skip_bits: int = 0, block_size: int = 2048, num_splits: int = 1,
               n_sub: int = 1) -> None:
    """Resolve the last digit (``state_out`` = (b*, mass above b*)) and count this shard's ties.

    ``skip_bits`` (0, 8 or 16): the low radix-key bits that no round histogrammed because the logits' dtype
    leaves them constant (:func:`radix_rounds`); ``b*`` gets them from its sign.

    ``ties [R, S * n_sub, 2]``, every slot written: per sub-chunk (``n_sub`` per column chunk,
    :func:`check_sub`) the ties of ``b*`` and those with a global id below the row's token (``tokens[r // row_div,
    r % row_div]``); all-gathered next. CUDA-graph safe.
    """
    n_valid, splits, chunk, sub = _check_ties(logits, keys, temperatures, top_p, sums, prev_hist, state_prev,
                                              state_out, ties, row_div, block_size, num_splits, vocab_start,
                                              vocab_size, n_sub, skip_bits)
    rows = logits.shape[0]
    if rows == 0:
        return
    k_tok = tokens.shape[1] if tokens is not None else 0
    _top_p_round_kernel[(rows, splits)](
        logits, keys, temperatures, top_p, sums, prev_hist, _window_state(window, rows, logits.device), state_prev,
        state_out, ties,
        tokens if tokens is not None else keys, logits.stride(0), sums.shape[2],
        prev_hist.stride(0), prev_hist.stride(1), n_valid, vocab_start, chunk, splits, row_div, k_tok, n_sub, sub,
        skip_bits, BLOCK=block_size, TIES=True, HAS_TOK=k_tok > 0, SPLITS=triton.next_power_of_2(splits),
        SHIFT=key_shift(logits.dtype), num_warps=num_warps_for(block_size))


def top_p_ties_reference(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, ties,
                         vocab_start: int, vocab_size: int, *, window: torch.Tensor,
                         tokens: torch.Tensor | None = None, row_div: int = 1, skip_bits: int = 0,
                         block_size: int = 2048, num_splits: int = 1, n_sub: int = 1) -> None:
    """Eager twin of :func:`top_p_ties` (same buffers written, per the same column plan)."""
    n_valid, splits, chunk, sub = _check_ties(logits, keys, temperatures, top_p, sums, prev_hist, state_prev,
                                              state_out, ties, row_div, block_size, num_splits, vocab_start,
                                              vocab_size, n_sub, skip_bits)
    rows = logits.shape[0]
    c, m, tau = _row_setup_torch(keys, temperatures, top_p, sums, row_div)
    bstar, mass = _resolve_torch(prev_hist, state_prev[:, 0], state_prev[:, 1], tau)
    full = bstar << skip_bits
    bstar = torch.where(tau < 0, bstar, torch.where(full < 2**31, full | ((1 << skip_bits) - 1), full))
    wkey, wmass = _window_state(window, rows, logits.device).unbind(1)
    wres = wkey >= 0
    bstar, mass = torch.where(wres, wkey, bstar), torch.where(wres, wmass, mass)
    state_out[:, 0] = bstar
    state_out[:, 1] = mass
    x = logits[:, :n_valid].float()
    tie = (torch.isfinite(x) & (radix_key_torch(x) == bstar[:, None]) & (tau >= 0)[:, None]).to(torch.int64)
    if tokens is not None and tokens.shape[1] > 0:
        k_tok = tokens.shape[1]
        kk = torch.arange(rows, device=x.device) % row_div
        tok = tokens.repeat_interleave(row_div, dim=0).gather(1, kk.clamp(max=k_tok - 1)[:, None])[:, 0]
        tok = torch.where(kk < k_tok, tok, torch.full_like(tok, -1))
        gid = torch.arange(vocab_start, vocab_start + n_valid, device=x.device)
        before = tie * (gid[None, :] < tok[:, None])
    else:
        before = torch.zeros_like(tie)
    slot = subchunk_index_torch(n_valid, chunk, n_sub, sub, x.device)[None, :].expand(rows, n_valid)
    res = torch.zeros((rows, splits * n_sub, 2), dtype=torch.int64, device=x.device)
    res[:, :, 0].scatter_add_(1, slot, tie)
    res[:, :, 1].scatter_add_(1, slot, before)
    ties.copy_(res)


def _check_mask(logits, keys, temperatures, top_p, sums, state, ties_all, out, row_div, rank, block_size,
                num_splits, vocab_start, vocab_size):
    n_valid, splits, chunk = _check_round(logits, keys, temperatures, top_p, sums, None, state, None, row_div,
                                          block_size, num_splits, vocab_start, vocab_size)
    rows, width = logits.shape
    check_tensor("ties_all", ties_all, shape=(None, rows, splits, 2), dtype=torch.int64, device=logits.device,
                 contiguous=True)
    check_int("rank", rank, lo=0, hi=ties_all.shape[0])
    check_tensor("out", out, shape=(rows, width), dtype=torch.bool, device=logits.device, contiguous=True)
    return n_valid, splits, chunk


def top_p_mask(logits, keys, temperatures, top_p, sums, state, ties_all, vocab_start: int, vocab_size: int, *,
               out: torch.Tensor, rank: int = 0, row_div: int = 1, block_size: int = 2048,
               num_splits: int = 1) -> torch.Tensor:
    """The kept set as ``out [R, V_local]`` bool, every column written (padded and non-finite False).

    Derives ``n_keep`` / ``b*`` / the tie base from the exchanged ``sums``, ``state`` (after
    :func:`top_p_ties`) and ``ties_all [tp, R, S, 2]``. One launch; CUDA-graph safe.
    """
    n_valid, splits, chunk = _check_mask(logits, keys, temperatures, top_p, sums, state, ties_all, out, row_div,
                                         rank, block_size, num_splits, vocab_start, vocab_size)
    rows, width = logits.shape
    if rows == 0:
        return out
    _top_p_mask_kernel[(rows, splits)](
        logits, keys, temperatures, top_p, sums, state, ties_all, out.view(torch.uint8),
        logits.stride(0), width, sums.shape[2], n_valid, chunk, splits, rows, row_div, rank, ties_all.shape[0],
        BLOCK=block_size, SPLITS=triton.next_power_of_2(splits),
        TPS=triton.next_power_of_2(splits * ties_all.shape[0]), num_warps=num_warps_for(block_size))
    return out


def top_p_mask_reference(logits, keys, temperatures, top_p, sums, state, ties_all, vocab_start: int,
                         vocab_size: int, *, out: torch.Tensor, rank: int = 0, row_div: int = 1,
                         block_size: int = 2048, num_splits: int = 1) -> torch.Tensor:
    """Eager twin of :func:`top_p_mask`."""
    n_valid, splits, chunk = _check_mask(logits, keys, temperatures, top_p, sums, state, ties_all, out, row_div,
                                         rank, block_size, num_splits, vocab_start, vocab_size)
    x = logits[:, :n_valid].float()
    temp = temperatures.repeat_interleave(row_div)
    p = top_p.repeat_interleave(row_div)
    _, _, n_keep, run, bstar = final_rows_torch(keys, sums, state, ties_all, temp, p, rank)
    u = radix_key_torch(x)
    fin = torch.isfinite(x)
    tie = (fin & (u == bstar[:, None])).to(torch.int64)
    # rank of a tie inside its chunk, plus the chunk's base
    pad = torch.zeros((x.shape[0], splits * chunk), dtype=torch.int64, device=x.device)
    pad[:, :n_valid] = tie
    within = (torch.cumsum(pad.view(-1, splits, chunk), 2) - 1 + run[:, :, None]).view(x.shape[0], -1)[:, :n_valid]
    kept = fin & ((u > bstar[:, None]) | ((tie > 0) & (within < n_keep[:, None])))
    out.zero_()
    out[:, :n_valid] = kept
    return out
