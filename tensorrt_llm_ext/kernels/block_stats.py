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
in any order (:func:`row_bins_reference`), and ``Z = sum_i bin_i 2^-i`` (float64, fixed order) is the same at
every TP size and tiling. Blocks with ``R - R_b >= STAT_BINS`` weigh 0 (tokens ~30 binades below the row's grid
point, as today's weights drop them).

The launch also writes the keys of ``verify_keys`` (argmax key of target rows, finite-max key), so it can replace
pass 1 and pass 2 of a call with one read of the logits. It needs block-aligned chunks: ``vocab_start`` a multiple
of ``G`` (the shards of the zero-padded LM head) and chunks of whole blocks (the launcher plans them). Not wired
into :func:`~tensorrt_llm_ext.speculative.verification.rejection_sample` yet (the consumers, ``combine`` and the
per-row weight choice of the draw, are the rest of the design); ``bench verify --one-pass-stats`` times it against
``verify_keys`` + ``verify_sums`` on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_int, check_tensor, num_warps_for
from tensorrt_llm_ext.kernels.fixed_point_softmax import (_pair, _rows_f32, decode_max_key, decode_max_key_torch,
                                                          is_finite, load_pair_tile, plan_chunks, sfu_exp2,
                                                          sfu_exp2_torch, verify_keys_reference, weight_scale,
                                                          weight_scale_torch)
from tensorrt_llm_ext.kernels.ordered_key import (EMPTY_KEY, INT32_MIN, block_best, ordered_i32, ordered_i32_torch,
                                                  pack_key)

__all__ = ["STAT_BINS", "STAT_BLOCK", "STATS_COLS", "block_stats", "block_stats_reference", "row_bins_reference",
           "row_mass_reference"]

STAT_BLOCK = 1024
STAT_BINS = 32
STATS_COLS = STAT_BINS + 3  # R_c, bins[STAT_BINS], F_b(token), R_b(token)
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
def _block_stats_kernel(
    t_ptr, q_ptr,  # [rows_t, V_local], [rows_q, V_local] logits (q_ptr = t_ptr when rows_q = 0)
    temp_ptr,  # [B] fp32
    tok_ptr,  # [B, k_tok] int64 global ids (read only if HAS_TOK)
    keys_ptr,  # [rows_t + rows_q, S, 2] int64 out: as verify_keys
    stats_ptr,  # [rows_t + rows_q, S, STATS_COLS] int64 out
    stride_t, stride_q, rows_t, n_valid, vocab_start, chunk, num_splits, div_t, div_q, k_tok,
    G: tl.constexpr, MAXB: tl.constexpr, NB: tl.constexpr, HAS_TOK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    is_t = row < rows_t
    rq = tl.maximum(row - rows_t, 0)
    b = tl.where(is_t, row // div_t, rq // div_q)
    kk = tl.where(is_t, row % div_t, rq % div_q)
    t_row = t_ptr + tl.minimum(row, rows_t - 1).to(tl.int64) * stride_t
    q_row = q_ptr + rq.to(tl.int64) * stride_q
    c = weight_scale(tl.load(temp_ptr + b))
    col_tok = tl.full([], -1, tl.int64)
    if HAS_TOK:
        if kk < k_tok:
            col_tok = tl.load(tok_ptr + b.to(tl.int64) * k_tok + kk) - vocab_start
    lanes = tl.arange(0, G)
    col_begin = split * chunk
    col_end = tl.minimum(col_begin + chunk, n_valid)
    best_fin = tl.full([G], -2147483648, tl.int32)
    lane_k = tl.full([G], -2147483648, tl.int32)
    lane_c = tl.full([G], 2147483647, tl.int32)
    idx = tl.arange(0, MAXB)
    rb = tl.full([MAXB], -2147483648, tl.int32)
    zb = tl.zeros([MAXB], tl.int64)
    ftok = tl.full([], 0, tl.int64)
    rtok = tl.full([], -9223372036854775808, tl.int64)
    for i in range(0, tl.cdiv(col_end - col_begin, G)):
        start = col_begin + i * G
        cols = start + lanes
        valid = cols < col_end
        x = load_pair_tile(t_row, q_row, is_t, cols, valid)
        o = ordered_i32(x)
        fin = valid & is_finite(x)
        ofin = tl.where(fin, o, -2147483648)
        best_fin = tl.maximum(best_fin, ofin)
        take = valid & is_t & (o > lane_k)
        lane_k = tl.where(take, o, lane_k)
        lane_c = tl.where(take, cols, lane_c)
        # the block's own max, grid point and weights: one max and one sum across the tile
        mk = tl.max(ofin, 0)
        m = decode_max_key(tl.where(mk == -2147483648, -9223372036854775808, mk.to(tl.int64)))
        r, g = _block_scale(m, c)
        z = tl.sum(_block_weight(x, m, c, g, fin), 0)
        r = tl.where(mk == -2147483648, -2147483648, r)
        rb = tl.where(idx == i, r, rb)
        zb = tl.where(idx == i, z, zb)
        if HAS_TOK:
            if (col_tok >= start) & (col_tok < start + G) & (col_tok < col_end):
                xt = tl.where(is_t, tl.load(t_row + col_tok).to(tl.float32), tl.load(q_row + col_tok).to(tl.float32))
                ft = is_finite(xt)
                ftok = _block_weight(xt, m, c, g, ft)
                rtok = tl.where(ft, r.to(tl.int64), -9223372036854775808)
    arg_k, arg_c = block_best(lane_k, lane_c, lane_c < 2147483647, 0)
    fmax = tl.max(best_fin, 0)
    kout = keys_ptr + (row.to(tl.int64) * num_splits + split) * 2
    tl.store(kout, pack_key(arg_k, arg_c.to(tl.int64) + vocab_start))
    tl.store(kout + 1, tl.where(fmax == -2147483648, -9223372036854775808, fmax.to(tl.int64)))
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
           vocab_size):
    n_valid, rt, rq = _pair(target, draft, vocab_start, vocab_size)
    if vocab_start % STAT_BLOCK:
        raise ValueError(f"vocab_start: expected a multiple of {STAT_BLOCK} (a block-aligned shard), got {vocab_start}")
    check_int("num_splits", num_splits, lo=1)
    splits, chunk = plan_chunks(target.shape[1], STAT_BLOCK, num_splits)
    dev = target.device
    check_int("row_div", div_t, lo=1)
    check_int("row_div_q", div_q, lo=1)
    if rt % div_t or rq % div_q:
        raise ValueError(f"rows: expected row counts divisible by {div_t} / {div_q}, got {rt} / {rq}")
    check_tensor("temperatures", temperatures, shape=(rt // div_t,), dtype=torch.float32, device=dev,
                 contiguous=True)
    if tokens is not None:
        check_tensor("tokens", tokens, shape=(rt // div_t, None), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("keys_out", keys_out, shape=(rt + rq, splits, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("stats_out", stats_out, shape=(rt + rq, splits, STATS_COLS), dtype=torch.int64, device=dev,
                 contiguous=True)
    return n_valid, rt, rq, splits, chunk


def block_stats(target: torch.Tensor, draft: torch.Tensor | None, temperatures: torch.Tensor, vocab_start: int,
                vocab_size: int, *, tokens: torch.Tensor | None = None, row_div: int = 1, row_div_q: int = 1,
                keys_out: torch.Tensor, stats_out: torch.Tensor,
                num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch over the target rows and the draft rows of a block-aligned shard: every slot of ``keys_out
    [R_t + R_q, S, 2]`` (as :func:`~tensorrt_llm_ext.kernels.fixed_point_softmax.verify_keys`) and of
    ``stats_out [R_t + R_q, S, STATS_COLS]`` int64 written: per (row, column chunk of whole blocks) ``R_c``
    (``EMPTY_KEY`` if the chunk has no finite logit), the ``STAT_BINS`` bins, and ``F_b`` and ``R_b`` of the
    row's token where the chunk owns it (0 and ``EMPTY_KEY`` elsewhere). Rows, ``row_div`` / ``row_div_q``,
    ``tokens`` and temperatures as ``verify_sums``. ``S`` = ``plan_chunks(V_local, STAT_BLOCK, num_splits)``.
    CUDA-graph safe (no allocation, no sync).
    """
    n_valid, rt, rq, splits, chunk = _check(target, draft, temperatures, tokens, row_div, row_div_q, keys_out,
                                            stats_out, num_splits, vocab_start, vocab_size)
    if rt + rq == 0:
        return keys_out, stats_out
    if rt == 0:
        raise ValueError("target_logits: expected at least one row")
    q = draft if draft is not None and rq else target
    k_tok = tokens.shape[1] if tokens is not None else 0
    maxb = max(2, triton.next_power_of_2(chunk // STAT_BLOCK))
    _block_stats_kernel[(rt + rq, splits)](
        target, q, temperatures, tokens if tokens is not None else keys_out, keys_out, stats_out,
        target.stride(0), q.stride(0), rt, n_valid, vocab_start, chunk, splits, row_div, row_div_q, k_tok,
        G=STAT_BLOCK, MAXB=maxb, NB=STAT_BINS, HAS_TOK=k_tok > 0, num_warps=num_warps_for(STAT_BLOCK))
    return keys_out, stats_out


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
                          num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`block_stats` (the same slots)."""
    n_valid, rt, rq, splits, chunk = _check(target, draft, temperatures, tokens, row_div, row_div_q, keys_out,
                                            stats_out, num_splits, vocab_start, vocab_size)
    verify_keys_reference(target, draft, vocab_start, vocab_size, out=keys_out, block_size=STAT_BLOCK,
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
    """float64 ``Z = sum_i bins_i 2^-i`` in a fixed order (the same bits for the same bins)."""
    z = torch.zeros(bins.shape[0], dtype=torch.float64, device=bins.device)
    for i in range(STAT_BINS):
        z = z + bins[:, i].double() * 2.0 ** -i
    return z
