"""Exact top-p on vocabulary shards: a mass-weighted MSB-first radix select over the logit order.

The kept set of a row is the smallest prefix, in (logit descending, global id ascending) order, whose
fixed-point mass (see :mod:`~tensorrt_llm_ext.kernels.fixed_point_softmax`) reaches
``tau = max(ceil(p * Z), 1)`` (float64 product of the fp32 ``p`` and the int64 row mass ``Z``: one IEEE
multiply and a ceil, the same on every rank). Rows with ``p >= 1`` (or NaN) keep every finite token; rows
with ``T <= 0`` keep exactly their first maximum (``tau = 1``); a row without a finite logit keeps nothing.

The boundary is the radix key ``u`` (the fp32 ordered key made unsigned: larger logit, larger ``u``) of
the token where the prefix mass crosses ``tau``. Four rounds find it a byte at a time, most significant
first: round ``r`` adds, per row, the mass of every token whose top ``8r`` bits equal the prefix found so
far into 256 buckets of the next byte (int64 atomics: exact in any order); after one int64 SUM across
ranks every rank scans the 256 buckets from the top and takes the first whose cumulative mass (plus the
mass above the prefix) reaches ``tau``. Round 0 is fused into ``weight_sums``; the resolve of round ``r``
runs at the start of the kernel of round ``r + 1`` (every program of a row resolves the same, program 0
stores it). After round 3 the boundary value ``b*`` and the mass strictly above it are exact.

Tokens with key ``b*`` all weigh the same ``F*``; the first ``n_keep = ceil((tau - mass_above) / F*)`` of
them in global id order are kept. Each rank counts its ties per column chunk, one all-gather of the
per-rank counts ``[tp, R, 2]`` gives every rank the ties that precede its shard, and a token's tie rank is
that base plus a prefix count inside the shard. The kept mass comes out for free:
``Z_p = mass_above + n_keep * F*``. Rounds: the max exchange, the sums (round 0), rounds 1..3, the tie
counts: six small collectives, none of them proportional to the vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_int, check_tensor, num_warps_for
from tensorrt_llm_ext.kernels.fixed_point_softmax import (HIST_BUCKETS, SUMS_COLS, _check_logits, decode_max_key,
                                                          decode_max_key_torch, exp2_table, fixed_point_weight,
                                                          fixed_point_weight_torch, is_finite, plan_chunks,
                                                          radix_key, radix_key_torch, radix_to_f32,
                                                          radix_to_f32_torch)

__all__ = [
    "FINAL_COLS", "kept_in_tile", "top_p_finalize", "top_p_finalize_reference", "top_p_mask", "top_p_mask_reference",
    "top_p_round", "top_p_round_reference", "top_p_ties", "top_p_ties_reference",
]

# top_p_finalize columns: kept mass Z_p, F(token) if kept else 0, n_keep, ties before this shard, b*
FINAL_COLS = 5


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
def _resolve(hist_ptr, prefix, mass, tau):
    """One radix digit: the first bucket from the top whose cumulative mass reaches ``tau``."""
    j = tl.arange(0, 256)
    g = tl.load(hist_ptr + 255 - j)
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
def _row_setup(keys_ptr, temp_ptr, top_p_ptr, sums_ptr, row, b, sums_stride, HAS_P: tl.constexpr):
    temp = tl.load(temp_ptr + b)
    t = tl.where(temp > 0.0, temp, 1.0)
    m = decode_max_key(tl.load(keys_ptr + row * 2 + 1))
    z = tl.load(sums_ptr + row.to(tl.int64) * sums_stride)
    p = 1.0
    if HAS_P:
        p = tl.load(top_p_ptr + b)
    tau = row_tau(p, z, temp, HAS_P)
    return t, m, tau


@triton.jit
def _top_p_round_kernel(
    x_ptr, keys_ptr, temp_ptr, top_p_ptr, sums_ptr,
    prev_hist_ptr,  # [R, prev_stride] int64: the previous round's exchanged histogram (at column hist_col)
    state_prev_ptr,  # [R, 2] int64 (prefix, mass above) before this round's digit
    state_out_ptr,  # [R, 2] int64 written by program 0 of each row
    hist_out_ptr,  # [R, 256] int64, zero on entry (or None-like when TIES)
    chunk_ties_ptr,  # [R, num_splits] int64 (TIES)
    ties_ptr,  # [R, 2] int64, zero on entry (TIES): ties on this shard, ties before the row's token
    tok_ptr,  # [R // row_div, k_tok] int64 (TIES and HAS_TOK)
    exp2_ptr,
    stride_row, sums_stride, prev_stride, hist_col, n_valid, vocab_start, chunk, num_splits, row_div, k_tok,
    rnd,  # 1..3: which digit this kernel histograms; 4 with TIES
    BLOCK: tl.constexpr,
    TIES: tl.constexpr,
    HAS_TOK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // row_div
    t, m, tau = _row_setup(keys_ptr, temp_ptr, top_p_ptr, sums_ptr, row, b, sums_stride, True)
    prefix = tl.load(state_prev_ptr + row * 2)
    mass = tl.load(state_prev_ptr + row * 2 + 1)
    prefix, mass = _resolve(prev_hist_ptr + row.to(tl.int64) * prev_stride + hist_col, prefix, mass, tau)
    if split == 0:
        tl.store(state_out_ptr + row * 2, prefix)
        tl.store(state_out_ptr + row * 2 + 1, mass)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    if TIES:
        tok = tl.full([], -1, tl.int64)  # the branch below assigns an int64 id
        if HAS_TOK:
            kk = row % row_div
            if kk < k_tok:
                tok = tl.load(tok_ptr + b.to(tl.int64) * k_tok + kk)
        cnt = tl.zeros([BLOCK], tl.int64)
        before = tl.zeros([BLOCK], tl.int64)
        if tau >= 0:
            for start in range(col_begin, col_end, BLOCK):
                cols = start + lanes
                valid = cols < col_end
                x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
                tie = (valid & is_finite(x) & (radix_key(x) == prefix)).to(tl.int64)
                cnt += tie
                before += tl.where(cols.to(tl.int64) + vocab_start < tok, tie, 0)
        c = tl.sum(cnt, 0)
        tl.store(chunk_ties_ptr + row.to(tl.int64) * num_splits + split, c)
        tl.atomic_add(ties_ptr + row * 2, c)
        tl.atomic_add(ties_ptr + row * 2 + 1, tl.sum(before, 0))
    else:
        if tau >= 0:
            sh_match = 32 - 8 * rnd
            sh_digit = 24 - 8 * rnd
            out_ptr = hist_out_ptr + row.to(tl.int64) * 256
            for start in range(col_begin, col_end, BLOCK):
                cols = start + lanes
                valid = cols < col_end
                x = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
                u = radix_key(x)
                hit = valid & is_finite(x) & ((u >> sh_match) == prefix)
                w = fixed_point_weight(x, m, t, hit, exp2_ptr)
                tl.atomic_add(out_ptr + ((u >> sh_digit) & 255), w, mask=w > 0)


@triton.jit
def _top_p_finalize_kernel(
    keys_ptr, temp_ptr, top_p_ptr, sums_ptr,
    state_ptr,  # [R, 2] int64: (b*, mass above b*) (HAS_P)
    ties_all_ptr,  # [tp, R, 2] int64 gathered tie counts (HAS_P)
    final_ptr,  # [R, FINAL_COLS] int64 out
    exp2_ptr,
    rows, sums_stride, rank, tp, row_div,
    BLOCK_R: tl.constexpr,
    HAS_P: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    r64 = r.to(tl.int64)
    b = r // row_div
    z = tl.load(sums_ptr + r64 * sums_stride, mask=ok, other=0)
    ftok = tl.load(sums_ptr + r64 * sums_stride + 1, mask=ok, other=0)
    utok = tl.load(sums_ptr + r64 * sums_stride + 2, mask=ok, other=0)
    zp = z
    fp_tok = ftok
    n_keep = z * 0
    tie_base = z * 0
    bstar = z * 0
    if HAS_P:
        temp = tl.load(temp_ptr + b, mask=ok, other=1.0)
        t = tl.where(temp > 0.0, temp, 1.0)
        p = tl.load(top_p_ptr + b, mask=ok, other=1.0)
        tau = row_tau(p, z, temp, True)
        keep_all = tau < 0
        m = decode_max_key(tl.load(keys_ptr + r64 * 2 + 1, mask=ok, other=0))
        bstar = tl.load(state_ptr + r64 * 2, mask=ok, other=0)
        mass = tl.load(state_ptr + r64 * 2 + 1, mask=ok, other=0)
        fstar = fixed_point_weight(radix_to_f32(bstar), m, t, ok & ~keep_all, exp2_ptr)
        fs = tl.maximum(fstar, 1)
        n_keep = tl.where(keep_all, 0, (tau - mass + fs - 1) // fs)
        zp = tl.where(keep_all, z, mass + n_keep * fs)
        tok_rank = z * 0
        for q in range(tp):
            base = ties_all_ptr + (q * rows + r64) * 2
            c0 = tl.load(base, mask=ok, other=0)
            tie_base += tl.where(q < rank, c0, 0)
            tok_rank += tl.load(base + 1, mask=ok, other=0)
        kept_tok = keep_all | (utok > bstar) | ((utok == bstar) & (tok_rank < n_keep))
        fp_tok = tl.where(kept_tok, ftok, 0)
    out = final_ptr + r64 * 5
    tl.store(out, zp, mask=ok)
    tl.store(out + 1, fp_tok, mask=ok)
    tl.store(out + 2, n_keep, mask=ok)
    tl.store(out + 3, tie_base, mask=ok)
    tl.store(out + 4, bstar, mask=ok)


@triton.jit
def _top_p_mask_kernel(
    x_ptr, final_ptr, chunk_ties_ptr,
    mask_ptr,  # [R, mask_stride] uint8 (a bool tensor's bytes), zero on entry
    stride_row, mask_stride, n_valid, chunk, num_splits,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    r64 = row.to(tl.int64)
    n_keep = tl.load(final_ptr + r64 * 5 + 2)
    run = tl.load(final_ptr + r64 * 5 + 3)
    bstar = tl.load(final_ptr + r64 * 5 + 4)
    for s in range(split):
        run += tl.load(chunk_ties_ptr + r64 * num_splits + s)
    lanes = tl.arange(0, BLOCK)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    for start in range(col_begin, col_end, BLOCK):
        cols = start + lanes
        valid = cols < col_end
        x = tl.load(x_ptr + r64 * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
        kept, run = kept_in_tile(radix_key(x), valid & is_finite(x), bstar, n_keep, run)
        tl.store(mask_ptr + r64 * mask_stride + cols, kept.to(tl.uint8), mask=valid)


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
    g = hist.flip(1)
    c = torch.cumsum(g, 1)
    j = torch.arange(256, device=hist.device)
    hit = (mass[:, None] + c) >= tau[:, None]
    jstar = torch.where(hit, j, torch.full_like(j, 255)).min(dim=1).values
    before = (c - g).gather(1, jstar[:, None])[:, 0]
    keep_all = tau < 0
    zero = torch.zeros_like(prefix)
    return (torch.where(keep_all, zero, (prefix << 8) | (255 - jstar)),
            torch.where(keep_all, zero, mass + before))


def _row_setup_torch(keys, temperatures, top_p, sums, row_div):
    temp = temperatures.repeat_interleave(row_div)
    t = torch.where(temp > 0, temp, torch.ones_like(temp))
    m = decode_max_key_torch(keys[:, 1])
    p = top_p.repeat_interleave(row_div) if top_p is not None else None
    return t, m, row_tau_torch(p, sums[:, 0], temp)


def kept_torch(u, fin, bstar, n_keep, tie_base):
    tie = fin & (u == bstar[:, None])
    rank = tie_base[:, None] + torch.cumsum(tie.to(torch.int64), 1) - 1
    return fin & ((u > bstar[:, None]) | (tie & (rank < n_keep[:, None])))


# ----------------------------------------------------------------------------------------------------
# Launchers and eager twins
# ----------------------------------------------------------------------------------------------------
def _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, row_div):
    rows = logits.shape[0]
    dev = logits.device
    check_int("row_div", row_div, lo=1)
    check_tensor("keys", keys, shape=(rows, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("temperatures", temperatures, shape=(rows // row_div,), dtype=torch.float32, device=dev,
                 contiguous=True)
    check_tensor("top_p", top_p, shape=(rows // row_div,), dtype=torch.float32, device=dev, contiguous=True)
    check_tensor("sums", sums, shape=(rows, None), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("prev_hist", prev_hist, shape=(rows, HIST_BUCKETS), dtype=torch.int64, device=dev,
                 unit_last_stride=True)
    for name, t in (("state_prev", state_prev), ("state_out", state_out)):
        check_tensor(name, t, shape=(rows, 2), dtype=torch.int64, device=dev, contiguous=True)


def top_p_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, hist_out,
                vocab_start: int, vocab_size: int, rnd: int, *, row_div: int = 1, block_size: int = 2048,
                num_splits: int = 1) -> None:
    """Radix round ``rnd`` (1..3): resolve the previous digit into ``state_out`` and histogram the next.

    ``prev_hist`` ``[R, 256]`` (the exchanged previous histogram: ``sums[:, 3:]`` for round 1),
    ``state_prev``/``state_out`` ``[R, 2]`` (prefix, mass above), ``hist_out`` ``[R, 256]`` int64 zeroed by
    the caller (SUM-exchanged next). Writes only ``state_out`` and ``hist_out``; CUDA-graph safe.
    """
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, row_div)
    check_int("rnd", rnd, lo=1, hi=4)
    rows = logits.shape[0]
    check_tensor("hist_out", hist_out, shape=(rows, HIST_BUCKETS), dtype=torch.int64, device=logits.device,
                 contiguous=True)
    if rows == 0:
        return
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    _top_p_round_kernel[(rows, splits)](
        logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, hist_out, hist_out, hist_out,
        keys, exp2_table(logits.device), logits.stride(0), sums.stride(0), prev_hist.stride(0), 0, n_valid,
        vocab_start, chunk, splits, row_div, 0, rnd, BLOCK=block_size, TIES=False, HAS_TOK=False,
        num_warps=num_warps_for(block_size))


def top_p_round_reference(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, hist_out,
                          vocab_start: int, vocab_size: int, rnd: int, *, row_div: int = 1,
                          block_size: int = 2048, num_splits: int = 1) -> None:
    """Eager twin of :func:`top_p_round` (same buffers written)."""
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, row_div)
    t, m, tau = _row_setup_torch(keys, temperatures, top_p, sums, row_div)
    prefix, mass = _resolve_torch(prev_hist, state_prev[:, 0], state_prev[:, 1], tau)
    state_out[:, 0] = prefix
    state_out[:, 1] = mass
    x = logits[:, :n_valid].float()
    u = radix_key_torch(x)
    hit = torch.isfinite(x) & ((u >> (32 - 8 * rnd)) == prefix[:, None]) & (tau >= 0)[:, None]
    w = fixed_point_weight_torch(x, m[:, None], t[:, None], hit)
    hist_out.zero_()
    hist_out.scatter_add_(1, (u >> (24 - 8 * rnd)) & 255, w)


def _check_ties(logits, chunk_ties, ties, splits):
    rows = logits.shape[0]
    check_tensor("chunk_ties", chunk_ties, shape=(rows, None), dtype=torch.int64, device=logits.device,
                 contiguous=True)
    if chunk_ties.shape[1] < splits:
        raise ValueError(f"chunk_ties: expected >= {splits} columns (one per column chunk), got {chunk_ties.shape[1]}")
    check_tensor("ties", ties, shape=(rows, 2), dtype=torch.int64, device=logits.device, contiguous=True)


def top_p_ties(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, chunk_ties, ties,
               vocab_start: int, vocab_size: int, *, tokens: torch.Tensor | None = None, row_div: int = 1,
               block_size: int = 2048, num_splits: int = 1) -> None:
    """Resolve the last digit (``state_out`` = (b*, mass above b*)) and count this shard's ties.

    ``chunk_ties [R, >= splits]``: ties per column chunk (the tie rank base of later kernels);
    ``ties [R, 2]`` (zeroed by the caller): ties on this shard and ties with a global id below the row's
    token (``tokens[r // row_div, r % row_div]``); gather it across ranks next. CUDA-graph safe.
    """
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, row_div)
    rows = logits.shape[0]
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    _check_ties(logits, chunk_ties, ties, splits)
    if rows == 0:
        return
    k_tok = tokens.shape[1] if tokens is not None else 0
    _top_p_round_kernel[(rows, splits)](
        logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, ties, chunk_ties, ties,
        tokens if tokens is not None else keys, exp2_table(logits.device), logits.stride(0), sums.stride(0),
        prev_hist.stride(0), 0, n_valid, vocab_start, chunk, chunk_ties.shape[1], row_div, k_tok, 4,
        BLOCK=block_size, TIES=True, HAS_TOK=k_tok > 0, num_warps=num_warps_for(block_size))


def top_p_ties_reference(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, chunk_ties,
                         ties, vocab_start: int, vocab_size: int, *, tokens: torch.Tensor | None = None,
                         row_div: int = 1, block_size: int = 2048, num_splits: int = 1) -> None:
    """Eager twin of :func:`top_p_ties` (same buffers written; ``chunk_ties`` per the same column plan)."""
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    _check_round(logits, keys, temperatures, top_p, sums, prev_hist, state_prev, state_out, row_div)
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    _check_ties(logits, chunk_ties, ties, splits)
    rows = logits.shape[0]
    _, _, tau = _row_setup_torch(keys, temperatures, top_p, sums, row_div)
    bstar, mass = _resolve_torch(prev_hist, state_prev[:, 0], state_prev[:, 1], tau)
    state_out[:, 0] = bstar
    state_out[:, 1] = mass
    x = logits[:, :n_valid].float()
    tie = (torch.isfinite(x) & (radix_key_torch(x) == bstar[:, None]) & (tau >= 0)[:, None]).to(torch.int64)
    per_chunk = torch.zeros((rows, splits * chunk), dtype=torch.int64, device=x.device)
    per_chunk[:, :n_valid] = tie
    chunk_ties[:, :splits] = per_chunk.view(rows, splits, chunk).sum(-1)
    ties[:, 0] = tie.sum(1)
    if tokens is not None and tokens.shape[1] > 0:
        k_tok = tokens.shape[1]
        kk = torch.arange(rows, device=x.device) % row_div
        tok = tokens.repeat_interleave(row_div, dim=0).gather(1, kk.clamp(max=k_tok - 1)[:, None])[:, 0]
        tok = torch.where(kk < k_tok, tok, torch.full_like(tok, -1))
        gid = torch.arange(vocab_start, vocab_start + n_valid, device=x.device)
        ties[:, 1] = (tie * (gid[None, :] < tok[:, None])).sum(1)
    else:
        ties[:, 1] = 0


def _check_finalize(keys, temperatures, top_p, sums, state, ties_all, final, row_div, tp):
    rows = keys.shape[0]
    dev = keys.device
    check_tensor("keys", keys, shape=(rows, 2), dtype=torch.int64, contiguous=True)
    check_tensor("temperatures", temperatures, shape=(rows // row_div,), dtype=torch.float32, device=dev,
                 contiguous=True)
    check_tensor("sums", sums, shape=(rows, None), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("final", final, shape=(rows, FINAL_COLS), dtype=torch.int64, device=dev, contiguous=True)
    if top_p is not None:
        check_tensor("top_p", top_p, shape=(rows // row_div,), dtype=torch.float32, device=dev, contiguous=True)
        check_tensor("state", state, shape=(rows, 2), dtype=torch.int64, device=dev, contiguous=True)
        check_tensor("ties_all", ties_all, shape=(tp, rows, 2), dtype=torch.int64, device=dev, contiguous=True)


def top_p_finalize(keys, temperatures, top_p, sums, state, ties_all, final, *, rank: int = 0, tp: int = 1,
                   row_div: int = 1) -> torch.Tensor:
    """Per row: ``final [R, 5]`` = (kept mass Z_p, F(token) if kept else 0, n_keep, ties before this shard, b*).

    ``top_p=None``: every finite token is kept (``Z_p = Z``; ``state``/``ties_all`` unused). Same on every
    rank except column 3. CUDA-graph safe.
    """
    check_int("tp", tp, lo=1)
    check_int("rank", rank, lo=0, hi=tp)
    _check_finalize(keys, temperatures, top_p, sums, state, ties_all, final, row_div, tp)
    rows = keys.shape[0]
    if rows == 0:
        return final
    block_r = 64
    has_p = top_p is not None
    _top_p_finalize_kernel[(triton.cdiv(rows, block_r),)](
        keys, temperatures, top_p if has_p else temperatures, sums, state if has_p else keys,
        ties_all if has_p else keys, final, exp2_table(keys.device), rows, sums.stride(0), rank, tp, row_div,
        BLOCK_R=block_r, HAS_P=has_p, num_warps=1)
    return final


def top_p_finalize_reference(keys, temperatures, top_p, sums, state, ties_all, final, *, rank: int = 0, tp: int = 1,
                             row_div: int = 1) -> torch.Tensor:
    """Eager twin of :func:`top_p_finalize`."""
    check_int("tp", tp, lo=1)
    check_int("rank", rank, lo=0, hi=tp)
    _check_finalize(keys, temperatures, top_p, sums, state, ties_all, final, row_div, tp)
    z, ftok, utok = sums[:, 0], sums[:, 1], sums[:, 2]
    zero = torch.zeros_like(z)
    if top_p is None:
        final.copy_(torch.stack([z, ftok, zero, zero, zero], dim=1))
        return final
    t, m, tau = _row_setup_torch(keys, temperatures, top_p, sums, row_div)
    keep_all = tau < 0
    bstar, mass = state[:, 0], state[:, 1]
    fstar = fixed_point_weight_torch(radix_to_f32_torch(bstar), m, t, ~keep_all)
    fs = torch.clamp_min(fstar, 1)
    n_keep = torch.where(keep_all, zero, (tau - mass + fs - 1) // fs)
    zp = torch.where(keep_all, z, mass + n_keep * fs)
    tie_base = ties_all[:rank, :, 0].sum(0) if rank > 0 else zero
    tok_rank = ties_all[:, :, 1].sum(0)
    kept_tok = keep_all | (utok > bstar) | ((utok == bstar) & (tok_rank < n_keep))
    final.copy_(torch.stack([zp, torch.where(kept_tok, ftok, zero), n_keep, tie_base, bstar], dim=1))
    return final


def top_p_mask(logits, final, chunk_ties, vocab_start: int, vocab_size: int, *, out: torch.Tensor,
               block_size: int = 2048, num_splits: int = 1) -> torch.Tensor:
    """The kept set as ``out [R, V_local]`` bool (padded and non-finite columns False). CUDA-graph safe."""
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    rows, width = logits.shape
    check_tensor("final", final, shape=(rows, FINAL_COLS), dtype=torch.int64, device=logits.device, contiguous=True)
    check_tensor("out", out, shape=(rows, width), dtype=torch.bool, device=logits.device, contiguous=True)
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    check_tensor("chunk_ties", chunk_ties, shape=(rows, None), dtype=torch.int64, device=logits.device,
                 contiguous=True)
    if chunk_ties.shape[1] < splits:
        raise ValueError(f"chunk_ties: expected >= {splits} columns, got {chunk_ties.shape[1]}")
    out.zero_()
    if rows == 0 or n_valid == 0:
        return out
    _top_p_mask_kernel[(rows, splits)](
        logits, final, chunk_ties, out.view(torch.uint8), logits.stride(0), width, n_valid, chunk,
        chunk_ties.shape[1], BLOCK=block_size, num_warps=num_warps_for(block_size))
    return out


def top_p_mask_reference(logits, final, chunk_ties, vocab_start: int, vocab_size: int, *, out: torch.Tensor,
                         block_size: int = 2048, num_splits: int = 1) -> torch.Tensor:
    """Eager twin of :func:`top_p_mask`."""
    n_valid = _check_logits("logits", logits, vocab_start, vocab_size)
    x = logits[:, :n_valid].float()
    out.zero_()
    out[:, :n_valid] = kept_torch(radix_key_torch(x), torch.isfinite(x), final[:, 4], final[:, 2], final[:, 3])
    return out
