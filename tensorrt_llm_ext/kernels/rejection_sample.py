"""Rejection-sampling decisions and the residual / bonus draw on vocabulary shards: two launches.

Per request ``b`` with drafts ``d_0..d_{K-1}``, target rows ``k = 0..K`` and draft rows ``k = 0..K-1``. A request
with top-p in force (``T > 0``, ``p < 1``) uses the exchanged per-chunk integer masses of ``verify_sums`` (``Z``,
``F(d_k)``, the exact kept mass ``Z_p`` and ``F_p(d_k)`` from :func:`~tensorrt_llm_ext.kernels.top_p.final_rows`);
every other request uses block weights (``kernels/block_stats.py``): ``Z = sum_i bin_i 2^-i`` (float64) from the
exchanged bins, ``F(d) = F_b(d) 2^-(R - R_b(d))``, and in the draw a token's weight ``F_b(x) 2^-(R - R_b)`` with
``m_b`` from the tile that holds its block (tiles are global blocks; on a shard that is not block-aligned the
exchanged edge maxima complete the blocks split between ranks). With those:

* accept ``d_k`` iff ``u_k * (F_q(d_k) / Z_q) < F_p(d_k) / Z_p`` in float64 (block weights: the per-token powers
  of two applied first) (``F_q / Z_q := 0`` when
  ``Z_q = 0``); ``u_k`` is a 52-bit uniform from Philox keyed by (seed, offset + k, ``ACCEPT_SALT``). A target
  row without a finite logit (``Z_p = 0``) is the point mass on its argmax: accept iff ``d_k`` equals it.
* ``k*`` = the first rejection (``K`` if none). Emit, at row ``k*``: a sample of ``norm(max(p - q, 0))``
  (residual; fp32 weights ``max(F_p * (1 / Z_p) - F_q * (1 / Z_q), 0)``, with block weights per block
  ``F_b * fp32(2^-(R - R_b) / Z)``) or, when all were accepted, of
  ``p_K`` (bonus; weights ``F_p``); the argmax when ``Z_p = 0`` at ``k*``; if every residual weight is 0
  (p and q equal up to rounding) the draw falls back to ``p_{k*}``.
* The draw is an exponential race, so it needs no totals and no prefix across ranks: token ``j`` with
  weight ``w_j > 0`` gets the fp32 key ``E_j / w_j``, ``E_j = -log2(u_j)`` (the SFU ``log2``; a series near
  ``u = 1``, so ``E_j > 0``), ``u_j`` a 24-bit uniform from the Philox word of global id ``j`` keyed by (seed,
  offset + k*, ``j // 4``, ``RESIDUAL_SALT`` / ``BONUS_SALT``) -- one Philox call serves four consecutive
  ids, word ``j % 4``. The smallest key wins, ties to the lowest id (key bits and id packed in one int64,
  one min). ``argmin_j E_j / w_j`` with ``E_j`` exponential is a sample of ``w / sum(w)``, up to the 24-bit
  uniform and fp32 rounding of the key. Every program keeps its chunk's best packed key for the residual
  and for the fallback weights; one all-gather ``[tp, B, S, 2]`` and :func:`rejection_assemble` pick the
  winner.

Launches: :func:`rejection_draw` (decide + race over the chunks of row k*) and
:func:`rejection_assemble` (reduce the race, write the outputs). A kernel gives the same bits at every
TP size and tiling (the same instruction sequence per element and order-independent min / sum); its
eager twin agrees bit for bit under the interpreter and within the SFU's tolerance on a GPU (see
``fixed_point_softmax``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.block_stats import (BINS_COLS, STAT_BINS, STAT_BLOCK, _block_scale, _block_weight,
                                                  _neg_pow2_f32_torch, _neg_pow2_f64_torch, block_row_mass,
                                                  block_row_mass_rows, block_row_mass_torch, pow2_neg_f32, pow2_neg_f64,
                                                  row_edges, row_grid, row_grid_torch, shard_block_weights_torch,
                                                  tile_block_max)
from tensorrt_llm_ext.kernels.common import check_int, check_tensor, num_warps_for
from tensorrt_llm_ext.kernels.fixed_point_softmax import (check_logits, fixed_point_weight_torch, is_finite, plan_chunks,
                                                          radix_key, radix_key_torch, split_reduce, split_reduce_rows,
                                                          subchunk_index_torch, sfu_log2, sfu_log2_torch,
                                                          top_p_in_force, top_p_in_force_torch, weight_scale,
                                                          weight_scale_torch)
from tensorrt_llm_ext.kernels.ordered_key import key_to_id, key_to_id_torch, philox_4x32_10_torch, uniform_from_word
from tensorrt_llm_ext.kernels.top_p import check_sub, final_rows, final_rows_torch, kept_in_tile

__all__ = [
    "ACCEPT_SALT", "BONUS_SALT", "MODE_ARGMAX", "MODE_BONUS", "MODE_GREEDY", "MODE_RESIDUAL", "NO_CANDIDATE",
    "RACE_COLS", "RESIDUAL_SALT", "neg_log2_uniform", "neg_log2_uniform_torch", "race_words_torch",
    "rejection_assemble", "rejection_assemble_reference", "rejection_draw", "rejection_draw_reference", "uniform52",
    "uniform52_torch",
]

# Philox counter word c3 of verification's draws (distinct from the target, draft and Markov salts).
ACCEPT_SALT = 0xACCE97
RESIDUAL_SALT = 0x4E5D1
BONUS_SALT = 0xB0705
# dec[b, 1]: how row b ends
MODE_GREEDY, MODE_RESIDUAL, MODE_BONUS, MODE_ARGMAX = 0, 1, 2, 3
RACE_COLS = 2  # per (request, chunk): the packed best (key bits << 32 | id) of the residual and of the fallback
# "no candidate": +inf key bits with the id 2^32 - 1 (no vocabulary id: MAX_VOCAB = 2^32 - 1), above every
# real candidate's packed key
NO_CANDIDATE = (0x7F800000 << 32) | 0xFFFFFFFF
_ACCEPT: tl.constexpr = tl.constexpr(ACCEPT_SALT)
_RESIDUAL: tl.constexpr = tl.constexpr(RESIDUAL_SALT)
_BONUS: tl.constexpr = tl.constexpr(BONUS_SALT)
_NONE: tl.constexpr = tl.constexpr(NO_CANDIDATE)


@triton.jit
def uniform52(seed, pos, salt):
    """float64 uniform in (0, 1) with 52 random bits, keyed by (seed, position, salt); ``salt`` uint32 like pos."""
    p = pos.to(tl.int64)
    c1 = (p & 4294967295).to(tl.uint32)
    c2 = ((p >> 32) & 4294967295).to(tl.uint32)
    c0 = c1 * 0
    r0, r1, _, _ = tl.philox(seed, c0, c1, c2, salt)
    v = (r0.to(tl.int64) << 20) | (r1.to(tl.int64) >> 12)
    return (v.to(tl.float64) + 0.5) * 2.220446049250313e-16


def uniform52_torch(seed: torch.Tensor, pos: torch.Tensor, salt) -> torch.Tensor:
    """Torch twin of :func:`uniform52` (int64 tensors; ``salt`` an int or int64 tensor)."""
    p = pos.to(torch.int64)
    c1 = p & 0xFFFFFFFF
    c2 = (p >> 32) & 0xFFFFFFFF
    c0 = torch.zeros_like(c1)
    c3 = (torch.zeros_like(c1) + salt) & 0xFFFFFFFF
    r0, r1, _, _ = philox_4x32_10_torch(seed.to(torch.int64) + c0, c0, c1, c2, c3)
    v = (r0 << 20) | (r1 >> 12)
    return (v.to(torch.float64) + 0.5) * 2.220446049250313e-16


@triton.jit
def neg_log2_uniform(r):
    """uint32 Philox word -> ``E = -log2(u) > 0`` (fp32), ``u = uniform_from_word(r)`` in (0, 1).

    Near ``u = 1`` (``t = 1 - u < 2^-6``, exact) the series ``log2(e) * (t + t^2/2 + t^3/3 + t^4/4)``, since
    the SFU log2's absolute error there could reach 0 (a certain winner); elsewhere ``E >= 0.0227``."""
    u = uniform_from_word(r)
    t = 1.0 - u
    series = t * (1.0 + t * (0.5 + t * (0.3333333432674408 + t * 0.25))) * 1.4426950216293335
    return tl.where(t < 0.015625, series, -sfu_log2(u))


def neg_log2_uniform_torch(r: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`neg_log2_uniform` (int64 tensor of uint32 words -> fp32)."""
    top = (r >> 9).to(torch.float32)
    u = (top + 0.5) * 1.1920928955078125e-07  # exact: 24 significant bits, as uniform_from_word
    t = 1.0 - u
    series = t * (1.0 + t * (0.5 + t * (0.3333333432674408 + t * 0.25))) * 1.4426950216293335
    return torch.where(t < 0.015625, series, -sfu_log2_torch(u))


@triton.jit
def _race_words(seed, pos, gid0, salt, BLOCK: tl.constexpr):
    """The Philox words of global ids ``gid0 + 0..BLOCK-1`` (``gid0`` a multiple of 4) at position ``pos``:
    one Philox call per four ids (counter ``(gid // 4, pos lo, pos hi, salt)``, word ``gid % 4``)."""
    g = (gid0 >> 2) + tl.arange(0, BLOCK // 4).to(tl.int64)
    c0 = (g & 4294967295).to(tl.uint32)
    p = pos.to(tl.int64)
    c1 = (p & 4294967295).to(tl.uint32) + c0 * 0
    c2 = ((p >> 32) & 4294967295).to(tl.uint32) + c0 * 0
    c3 = c0 * 0 + salt.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    return tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))


def race_words_torch(seed: torch.Tensor, pos: torch.Tensor, gid: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """Torch twin of the race's Philox words: ``seed`` / ``pos`` / ``salt`` ``[B, 1]``, ``gid`` ``[1, N]`` int64."""
    g = gid & 0xFFFFFFFF
    c0 = (g >> 2) + 0 * pos
    c1 = (pos & 0xFFFFFFFF) + 0 * g
    c2 = ((pos >> 32) & 0xFFFFFFFF) + 0 * g
    r0, r1, r2, r3 = philox_4x32_10_torch(seed + 0 * c0, c0, c1, c2, (salt & 0xFFFFFFFF) + 0 * c0)
    w = g & 3
    return torch.where(w == 0, r0, torch.where(w == 1, r1, torch.where(w == 2, r2, r3)))


@triton.jit
def _race_tile(w, e, gids, best):
    """Merge one tile's race ``E / w`` (fp32 ``w > 0`` only) into the per-lane running packed best
    ``key bits << 32 | id`` (elementwise: one reduction across lanes at the end, not one per tile)."""
    key = tl.where(w > 0.0, e / tl.where(w > 0.0, w, 1.0), float("inf"))
    packed = (key.to(tl.int32, bitcast=True).to(tl.int64) << 32) | gids
    packed = tl.where(w > 0.0, packed, _NONE)
    return tl.minimum(best, packed)


@triton.jit
def _decide(t_keys_ptr, sums_ptr, q_sums_ptr, state_ptr, ties_all_ptr, bins_ptr, tok_ptr, temp_ptr, seed_ptr, off_ptr,
            p_ptr, b, K, cols_t, num_splits, n_sub, rows_t, rank, tp, bin_slots, BLOCK_K: tl.constexpr,
            HAS_P: tl.constexpr, SPLITS: tl.constexpr, TPS: tl.constexpr, NB: tl.constexpr, SB: tl.constexpr):
    """(k*, mode, legacy, ...) of request b (identical in every program and on every rank). ``legacy``: top-p in
    force (``T > 0``, ``p < 1``): the request's rows use today's weights (``sums``); every other request's rows use
    block weights (the exchanged ``bins``)."""
    temp = tl.load(temp_ptr + b)
    seed = tl.load(seed_ptr + b).to(tl.int64)
    off = tl.load(off_ptr + b)
    p = temp * 0.0 + 1.0
    if HAS_P:
        p = tl.load(p_ptr + b)
    legacy = top_p_in_force(temp, p)
    ks = tl.arange(0, BLOCK_K)
    kv = ks < K
    kv1 = ks < K + 1
    b64 = b.to(tl.int64)
    row_t = b64 * (K + 1) + tl.where(kv1, ks, 0)
    row_q = b64 * K + tl.where(kv, ks, 0)
    # target argmax ids (the per-chunk selection keys reduced)
    targ = key_to_id(tl.where(kv1, split_reduce_rows(t_keys_ptr + row_t * num_splits * 2, num_splits, 2, kv1,
                                                     SPLITS, True), 0))
    d = tl.load(tok_ptr + row_q, mask=kv, other=-1)
    # block weights: p(d) = F_b(d) 2^-(R - R_b(d)) / Z in float64
    zt, ft, st = block_row_mass_rows(bins_ptr, row_t, kv1, bin_slots, NB, SB)
    zqb, fqb, sqb = block_row_mass_rows(bins_ptr, rows_t + row_q, kv, bin_slots, NB, SB)
    pv = ft.to(tl.float64) * pow2_neg_f64(tl.minimum(st, NB)) / tl.where(zt > 0.0, zt, 1.0)
    qv = tl.where(zqb > 0.0, fqb.to(tl.float64) * pow2_neg_f64(tl.minimum(sqb, NB)) / tl.where(zqb > 0.0, zqb, 1.0),
                  0.0)
    empty = zt == 0.0
    if HAS_P:  # today's weights for the requests with top-p in force
        zp, fp, _, _, _ = final_rows(t_keys_ptr, sums_ptr, state_ptr, ties_all_ptr, temp, p, row_t, kv1, cols_t,
                                     num_splits, rows_t, rank, tp, 0, num_splits * n_sub, HAS_P, True, SPLITS, TPS)
        qrow = q_sums_ptr + row_q * num_splits * 3
        zq = split_reduce_rows(qrow, num_splits, 3, kv, SPLITS, False)
        fq = split_reduce_rows(qrow + 1, num_splits, 3, kv, SPLITS, False)
        pv = tl.where(legacy, fp.to(tl.float64) / tl.maximum(zp, 1).to(tl.float64), pv)
        qv = tl.where(legacy, tl.where(zq > 0, fq.to(tl.float64) / tl.maximum(zq, 1).to(tl.float64), 0.0), qv)
        empty = tl.where(legacy, zp == 0, empty)
    empty = empty & kv1
    u = uniform52(seed, off + ks, (ks * 0 + _ACCEPT).to(tl.uint32))
    acc = tl.where(empty, d == targ, u * qv < pv)
    kstar = tl.min(tl.where(kv & ~acc, ks, K), 0)
    empty_s = tl.sum(tl.where((ks == kstar) & empty, 1, 0), 0) > 0
    sampled = temp > 0.0
    mode = tl.where(sampled, tl.where(empty_s, 3, tl.where(kstar == K, 2, 1)), 0)
    return kstar, mode, targ, temp, seed, off, p, legacy


@triton.jit
def _rejection_draw_kernel(
    t_ptr, q_ptr,  # [B*(K+1), V_local], [B*K, V_local] logits
    keys_ptr,  # [B*(K+1) + B*K, S, 2] int64 exchanged keys (target rows first)
    sums_ptr,  # [B*(K+1), S, cols_t] int64 exchanged target sums (HAS_P: the top-p requests' rows)
    q_sums_ptr,  # [B*K, S, 3] int64 exchanged draft sums (HAS_P)
    state_ptr, ties_all_ptr,  # top-p: [B*(K+1), 2] (b*, mass above), [tp, B*(K+1), S, 2] (HAS_P)
    bins_ptr,  # [B*(K+1) + B*K, bin_slots, NB + 2] int64 exchanged block bins
    edges_ptr,  # [B*(K+1) + B*K, S, tp + 1] int64 exchanged edge maxima (EDGES)
    tok_ptr, temp_ptr, seed_ptr, off_ptr, p_ptr,  # [B, K] int64, [B] fp32, [B] int64, [B] int64, [B] fp32
    dec_ptr,  # [B, 2] int64 out: (k*, mode), written by the program of chunk 0
    race_ptr,  # [B, S, 2] int64 out, every slot written
    stride_t, stride_q, cols_t, n_valid, vocab_start, width, chunk, num_splits, n_sub, sub, K, rank, tp, bin_slots,
    BLOCK_K: tl.constexpr, HAS_P: tl.constexpr, SPLITS: tl.constexpr, TPS: tl.constexpr, NB: tl.constexpr,
    SB: tl.constexpr, G: tl.constexpr, EDGES: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.program_id(1)  # (column chunk, sub-chunk) = (slot // n_sub, slot % n_sub)
    nb = tl.num_programs(0)
    rows_t = nb * (K + 1)
    kstar, mode, _targ, temp, seed, off, p, legacy = _decide(
        keys_ptr, sums_ptr, q_sums_ptr, state_ptr, ties_all_ptr, bins_ptr, tok_ptr, temp_ptr, seed_ptr, off_ptr,
        p_ptr, b, K, cols_t, num_splits, n_sub, rows_t, rank, tp, bin_slots, BLOCK_K, HAS_P, SPLITS, TPS, NB, SB)
    if slot == 0:
        tl.store(dec_ptr + b * 2, kstar.to(tl.int64))
        tl.store(dec_ptr + b * 2 + 1, mode.to(tl.int64))
    best_m = tl.full([G], _NONE, tl.int64)
    best_a = best_m
    if (mode == 1) | (mode == 2):
        b64 = b.to(tl.int64)
        row_s = b64 * (K + 1) + kstar
        row_qs = b64 * K + tl.minimum(kstar, K - 1)
        c = weight_scale(temp)
        m_p, r_p, _ = row_grid(keys_ptr, row_s, num_splits, c, SPLITS)
        m_q, r_q, _ = row_grid(keys_ptr, rows_t + row_qs, num_splits, c, SPLITS)
        zpb, _, _ = block_row_mass(bins_ptr, row_s, bin_slots, NB, SB)
        zqb, _, _ = block_row_mass(bins_ptr, rows_t + row_qs, bin_slots, NB, SB)
        # block rows: per-block fp32 factors 2^-(R - R_b) / Z (1/Z a float64 division, the power of two exact)
        inv_pb = 1.0 / tl.where(zpb > 0.0, zpb, 1.0)
        inv_qb = tl.where(zqb > 0.0, 1.0 / tl.where(zqb > 0.0, zqb, 1.0), 0.0)
        inv_p = 0.0
        inv_q = 0.0
        n_keep = tl.full([], 0, tl.int64)
        run = n_keep
        bstar = n_keep
        if HAS_P:  # requests with top-p in force: today's weights against the row max, fp32 reciprocals of the masses
            zp, _fp_tok, n_keep, run, bstar = final_rows(keys_ptr, sums_ptr, state_ptr, ties_all_ptr, temp, p, row_s,
                                                         row_s >= 0, cols_t, num_splits, rows_t, rank, tp, slot,
                                                         num_splits * n_sub, HAS_P, False, SPLITS, TPS)
            zq = split_reduce(q_sums_ptr + row_qs * num_splits * 3, num_splits, 3, row_qs >= 0, SPLITS, False)
            inv_p = (1.0 / tl.maximum(zp, 1).to(tl.float64)).to(tl.float32)
            inv_q = tl.where(zq > 0, 1.0 / tl.maximum(zq, 1).to(tl.float64), 0.0).to(tl.float32)
        ep_first = tl.full([], -9223372036854775808, tl.int64)
        ep_end = ep_first
        eq_first = ep_first
        eq_end = ep_first
        if EDGES:
            ep_first, ep_end = row_edges(edges_ptr, row_s, num_splits, tp + 1, rank, SPLITS)
            eq_first, eq_end = row_edges(edges_ptr, rows_t + row_qs, num_splits, tp + 1, rank, SPLITS)
        first_blk = vocab_start // G
        end_blk = (vocab_start + width) // G
        salt = tl.where(mode == 1, _RESIDUAL, _BONUS)
        pos = off + kstar
        t_row = t_ptr + row_s * stride_t
        q_row = q_ptr + row_qs * stride_q
        lanes = tl.arange(0, G)
        chunk_begin = (slot // n_sub) * chunk
        col_begin = chunk_begin + (slot % n_sub) * sub
        col_end = tl.minimum(tl.minimum(col_begin + sub, chunk_begin + chunk), n_valid)
        # tiles are global blocks (their ids start at a multiple of 4: one Philox call per four ids); a tile reads
        # its whole block on this shard for the block max and races only the sub-chunk's columns
        t0 = ((vocab_start + col_begin) // G) * G - vocab_start
        for t in range(t0, col_end, G):
            cols = t + lanes
            in_shard = (cols >= 0) & (cols < n_valid)
            valid = (cols >= col_begin) & (cols < col_end)
            blk = (vocab_start + t) // G
            xp = tl.load(t_row + cols, mask=in_shard, other=0.0).to(tl.float32)
            fin = valid & is_finite(xp)
            mpb, livep = tile_block_max(xp, in_shard & is_finite(xp), blk, first_blk, end_blk, ep_first, ep_end,
                                        EDGES)
            rpb, gpb = _block_scale(mpb, c)
            dp = tl.minimum(tl.maximum(r_p - rpb.to(tl.int64), 0), NB)
            okp = legacy | (livep & (dp < NB))
            kept = fin
            if HAS_P:
                kept_l, run = kept_in_tile(radix_key(xp), fin, bstar, n_keep, run)
                kept = tl.where(legacy, kept_l, fin)
            # g = 1 and the row max for the top-p requests: exactly today's fixed_point_weight
            fpw = _block_weight(xp, tl.where(legacy, m_p, mpb), c, tl.where(legacy, 1.0, gpb),
                                tl.where(okp, kept, False))
            fpw = fpw.to(tl.float32)
            scale_p = tl.where(legacy, 1.0, pow2_neg_f32(dp))
            alt = fpw * scale_p
            main = alt
            if mode == 1:
                xq = tl.load(q_row + cols, mask=in_shard, other=0.0).to(tl.float32)
                mqb, liveq = tile_block_max(xq, in_shard & is_finite(xq), blk, first_blk, end_blk, eq_first, eq_end,
                                            EDGES)
                rqb, gqb = _block_scale(mqb, c)
                dq = tl.minimum(tl.maximum(r_q - rqb.to(tl.int64), 0), NB)
                okq = legacy | (liveq & (dq < NB))
                fqw = _block_weight(xq, tl.where(legacy, m_q, mqb), c, tl.where(legacy, 1.0, gqb),
                                    tl.where(okq, valid & is_finite(xq), False)).to(tl.float32)
                f_p = tl.where(legacy, inv_p, (pow2_neg_f64(dp) * inv_pb).to(tl.float32))
                f_q = tl.where(legacy, inv_q, (pow2_neg_f64(dq) * inv_qb).to(tl.float32))
                main = tl.maximum(fpw * f_p - fqw * f_q, 0.0)
            gid0 = vocab_start + t
            e = neg_log2_uniform(_race_words(seed, pos, gid0.to(tl.int64), salt, G))
            gids = gid0.to(tl.int64) + lanes
            best_m = _race_tile(main, e, gids, best_m)
            best_a = _race_tile(alt, e, gids, best_a)
    out = race_ptr + (b.to(tl.int64) * num_splits * n_sub + slot) * 2
    tl.store(out, tl.min(best_m, 0))
    tl.store(out + 1, tl.min(best_a, 0))


@triton.jit
def _best_of(race_all_ptr, b64, col, batch, n_slots, tp, TPS: tl.constexpr):
    """Min of the packed (key bits, id) at ``col`` over every rank and slot of request b (one vector load)."""
    j = tl.arange(0, TPS)
    q = j // n_slots
    s = j % n_slots
    addr = race_all_ptr + ((q * batch + b64) * n_slots + s) * 2 + col
    return tl.min(tl.load(addr, mask=j < tp * n_slots, other=_NONE), 0)


@triton.jit
def _rejection_assemble_kernel(
    tok_ptr,  # [B, K] int64
    keys_ptr,  # [B*(K+1) + B*K, S, 2] int64 exchanged keys
    dec_ptr,  # [B, 2] int64
    race_all_ptr,  # [tp, B, S, 2] int64 gathered race
    acc_ptr,  # [B, K+1] int64 out
    num_ptr,  # [B] int32 out
    K, num_splits, race_slots, tp,
    BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, TPS: tl.constexpr,
):
    b = tl.program_id(0)
    batch = tl.num_programs(0)
    b64 = b.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    kv1 = ks < K + 1
    kv = ks < K
    kb = keys_ptr + (b64 * (K + 1) + tl.where(kv1, ks, 0)) * num_splits * 2
    targ = key_to_id(tl.where(kv1, split_reduce_rows(kb, num_splits, 2, kv1, SPLITS, True), 0))
    d = tl.load(tok_ptr + b64 * K + ks, mask=kv, other=-1)
    kstar = tl.load(dec_ptr + b * 2)
    mode = tl.load(dec_ptr + b * 2 + 1)
    bm = _best_of(race_all_ptr, b64, 0, batch, race_slots, tp, TPS)
    ba = _best_of(race_all_ptr, b64, 1, batch, race_slots, tp, TPS)
    drawn = tl.where(bm != _NONE, bm, ba) & 4294967295
    miss = kv & (d != targ)
    n_greedy = 1 + tl.min(tl.where(miss, ks, K), 0)
    emitted = tl.where(mode == 3, tl.sum(tl.where(ks == kstar, targ, 0), 0), drawn)
    sampled_row = tl.where(ks < kstar, d, tl.where(ks == kstar, emitted, -1))
    greedy = mode == 0
    tl.store(acc_ptr + b64 * (K + 1) + ks, tl.where(greedy, targ, sampled_row), mask=kv1)
    tl.store(num_ptr + b, tl.where(greedy, n_greedy, kstar + 1).to(tl.int32))


# ----------------------------------------------------------------------------------------------------
# Launchers and eager twins
# ----------------------------------------------------------------------------------------------------
def _check_draw(target, draft, tokens, temperatures, seeds, offsets, top_p, keys, sums, q_sums, state, ties_all, bins,
                edges, vocab_start, vocab_size, block_size, num_splits, n_sub, rank, tp):
    n_valid = check_logits("target_logits", target, vocab_start, vocab_size)
    check_logits("draft_logits", draft, vocab_start, vocab_size)
    check_int("tp", tp, lo=1)
    check_int("rank", rank, lo=0, hi=tp)
    splits, chunk = plan_chunks(target.shape[1], block_size, num_splits)
    sub = check_sub(chunk, block_size, n_sub)
    check_tensor("draft_tokens", tokens, shape=(None, None), dtype=torch.int64, contiguous=True)
    b, k = tokens.shape
    dev = target.device
    rt, rq = b * (k + 1), b * k
    if target.shape[0] != rt or draft.shape[0] != rq or draft.shape[1] != target.shape[1]:
        raise ValueError(f"target/draft rows: expected [B*(K+1)={rt}, V] and [B*K={rq}, V], got "
                         f"{list(target.shape)} and {list(draft.shape)}")
    check_tensor("temperatures", temperatures, shape=(b,), dtype=torch.float32, device=dev, contiguous=True)
    check_tensor("seeds", seeds, shape=(b,), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("offsets", offsets, shape=(b,), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("keys", keys, shape=(rt + rq, splits, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("bins", bins, shape=(rt + rq, None, BINS_COLS), dtype=torch.int64, device=dev, contiguous=True)
    if bins.shape[1] not in (1, splits):
        raise ValueError(f"bins: expected 1 or {splits} slots per row, got {bins.shape[1]}")
    if edges is not None:
        if vocab_start != rank * target.shape[1]:
            raise ValueError(f"vocab_start: expected rank * width = {rank * target.shape[1]}, got {vocab_start}")
        check_tensor("edges", edges, shape=(rt + rq, splits, tp + 1), dtype=torch.int64, device=dev, contiguous=True)
    elif vocab_start % STAT_BLOCK or (tp > 1 and target.shape[1] % STAT_BLOCK):
        raise ValueError(f"edges: required on a shard that is not block-aligned (vocab_start {vocab_start}, width "
                         f"{target.shape[1]}, block {STAT_BLOCK})")
    if top_p is not None:
        check_tensor("top_p", top_p, shape=(b,), dtype=torch.float32, device=dev, contiguous=True)
        check_tensor("sums", sums, shape=(rt, splits, None), dtype=torch.int64, device=dev, contiguous=True)
        check_tensor("q_sums", q_sums, shape=(rq, splits, 3), dtype=torch.int64, device=dev, contiguous=True)
        check_tensor("state", state, shape=(rt, 2), dtype=torch.int64, device=dev, contiguous=True)
        check_tensor("ties_all", ties_all, shape=(None, rt, splits * n_sub, 2), dtype=torch.int64, device=dev,
                     contiguous=True)
    return n_valid, b, k, splits, chunk, sub


def rejection_draw(target, draft, tokens, temperatures, seeds, offsets, top_p, keys, sums, q_sums, state, ties_all,
                   bins, edges, dec, race, vocab_start: int, vocab_size: int, *, rank: int = 0, tp: int = 1,
                   block_size: int = 2048, num_splits: int = 1, n_sub: int = 1) -> None:
    """Decide every request (``dec [B, 2]`` = (k*, mode)) and race its draw over each sub-chunk of row k*.

    ``keys`` exchanged (``block_stats`` / ``block_keys``), ``bins [rows, 1 or S, BINS_COLS]`` the exchanged block
    bins (``block_combine`` / ``block_bins``), ``edges`` the exchanged edge maxima of a shard that is not
    block-aligned (None on an aligned one). With ``top_p`` also ``sums`` / ``q_sums`` (``verify_sums`` of the
    requests with top-p in force), ``state`` (after ``top_p_ties``) and ``ties_all [tp, B*(K+1), S * n_sub, 2]``.
    Each column chunk is split into ``n_sub`` sub-chunks; tiles are global blocks of ``STAT_BLOCK`` ids. ``race
    [B, S * n_sub, 2]`` int64, every slot written (all-gathered next). One launch; CUDA-graph safe.
    """
    n_valid, b, k, splits, chunk, sub = _check_draw(target, draft, tokens, temperatures, seeds, offsets, top_p,
                                                    keys, sums, q_sums, state, ties_all, bins, edges, vocab_start,
                                                    vocab_size, block_size, num_splits, n_sub, rank, tp)
    check_tensor("dec", dec, shape=(b, 2), dtype=torch.int64, device=target.device, contiguous=True)
    check_tensor("race", race, shape=(b, splits * n_sub, RACE_COLS), dtype=torch.int64, device=target.device,
                 contiguous=True)
    if b == 0:
        return
    has_p = top_p is not None
    _rejection_draw_kernel[(b, splits * n_sub)](
        target, draft, keys, sums if has_p else keys, q_sums if has_p else keys, state if has_p else keys,
        ties_all if has_p else keys, bins, edges if edges is not None else keys, tokens, temperatures, seeds, offsets,
        top_p if has_p else temperatures, dec, race,
        target.stride(0), draft.stride(0), sums.shape[2] if has_p else 0, n_valid, vocab_start, target.shape[1],
        chunk, splits, n_sub, sub, k, rank, tp, bins.shape[1], BLOCK_K=triton.next_power_of_2(k + 1), HAS_P=has_p,
        SPLITS=triton.next_power_of_2(splits), TPS=triton.next_power_of_2(splits * n_sub * tp), NB=STAT_BINS,
        SB=triton.next_power_of_2(bins.shape[1]), G=STAT_BLOCK, EDGES=edges is not None,
        num_warps=num_warps_for(STAT_BLOCK))


def _decide_torch(tokens, temperatures, seeds, offsets, top_p, keys, sums, q_sums, state, ties_all, bins, rank):
    b, k = tokens.shape
    dev = tokens.device
    rt = b * (k + 1)
    ks = torch.arange(k, device=dev)
    targ = key_to_id_torch(keys[:rt, :, 0].max(1).values).view(b, k + 1)
    p_req = top_p if top_p is not None else torch.ones_like(temperatures)
    legacy = top_p_in_force_torch(temperatures, p_req)
    z, f, sh = block_row_mass_torch(bins)
    zt, ft, st = z[:rt].view(b, k + 1), f[:rt].view(b, k + 1), sh[:rt].view(b, k + 1)
    zqb, fqb, sqb = z[rt:].view(b, k), f[rt:].view(b, k), sh[rt:].view(b, k)
    one = torch.ones_like(zt)
    pv_all = ft.double() * _neg_pow2_f64_torch(st.clamp(max=STAT_BINS)) / torch.where(zt > 0, zt, one)
    pv = pv_all[:, :k]
    qv = torch.where(zqb > 0, fqb.double() * _neg_pow2_f64_torch(sqb.clamp(max=STAT_BINS))
                     / torch.where(zqb > 0, zqb, torch.ones_like(zqb)), torch.zeros_like(zqb))
    empty = zt == 0
    n_keep = run = bstar = zp = None
    if top_p is not None:
        temp_r = temperatures.repeat_interleave(k + 1)
        p_r = top_p.repeat_interleave(k + 1)
        zp, fp, n_keep, run, bstar = final_rows_torch(keys, sums, state, ties_all, temp_r, p_r, rank)
        zp, fp = zp.view(b, k + 1), fp.view(b, k + 1)[:, :k]
        zq = q_sums[:, :, 0].sum(1).view(b, k)
        fq = q_sums[:, :, 1].sum(1).view(b, k)
        lg = legacy[:, None]
        pv = torch.where(lg, fp.double() / zp[:, :k].clamp_min(1).double(), pv)
        qv = torch.where(lg, torch.where(zq > 0, fq.double() / zq.clamp_min(1).double(), torch.zeros_like(pv)), qv)
        empty = torch.where(lg, zp == 0, empty)
    u = uniform52_torch(seeds[:, None], offsets[:, None] + ks[None, :], ACCEPT_SALT)
    acc = torch.where(empty[:, :k], tokens == targ[:, :k], u * qv < pv)
    kstar = torch.where(~acc, ks[None, :], torch.full_like(tokens, k)).min(dim=1).values
    empty_s = empty.gather(1, kstar[:, None])[:, 0]
    sampled = temperatures > 0
    mode = torch.where(sampled, torch.where(empty_s, MODE_ARGMAX, torch.where(kstar == k, MODE_BONUS, MODE_RESIDUAL)),
                       torch.full_like(kstar, MODE_GREEDY))
    return kstar, mode, targ, legacy, (zp, n_keep, run, bstar), (z, rt)


def _race_torch(w: torch.Tensor, e: torch.Tensor, slot: torch.Tensor, n_slots: int, vocab_start: int):
    """Per slot (``slot [n_valid]`` of each column) the packed best ``key bits << 32 | id`` ``[B, n_slots]`` of
    the race ``E / w`` (fp32 ``w``; NO_CANDIDATE where no weight is positive)."""
    pos = w > 0
    key = torch.where(pos, e / torch.where(pos, w, torch.ones_like(w)), torch.full_like(w, float("inf")))
    gid = torch.arange(vocab_start, vocab_start + w.shape[1], device=w.device)[None, :]
    packed = torch.where(pos, (key.view(torch.int32).to(torch.int64) << 32) | gid,
                         torch.full_like(gid, NO_CANDIDATE))
    out = torch.full((w.shape[0], n_slots), NO_CANDIDATE, dtype=torch.int64, device=w.device)
    return out.scatter_reduce_(1, slot[None, :].expand_as(packed), packed, "amin")


def rejection_draw_reference(target, draft, tokens, temperatures, seeds, offsets, top_p, keys, sums, q_sums, state,
                             ties_all, bins, edges, dec, race, vocab_start: int, vocab_size: int, *, rank: int = 0,
                             tp: int = 1, block_size: int = 2048, num_splits: int = 1, n_sub: int = 1) -> None:
    """Eager twin of :func:`rejection_draw` (same buffers, same column plan)."""
    n_valid, b, k, splits, chunk, sub = _check_draw(target, draft, tokens, temperatures, seeds, offsets, top_p,
                                                    keys, sums, q_sums, state, ties_all, bins, edges, vocab_start,
                                                    vocab_size, block_size, num_splits, n_sub, rank, tp)
    kstar, mode, _, legacy, (zp_all, n_keep, run, bstar), (z_all, rt) = _decide_torch(
        tokens, temperatures, seeds, offsets, top_p, keys, sums, q_sums, state, ties_all, bins, rank)
    dec[:, 0] = kstar
    dec[:, 1] = mode
    dev = target.device
    bi = torch.arange(b, device=dev)
    row_s = bi * (k + 1) + kstar
    row_qs = bi * k + kstar.clamp(max=k - 1)
    width = target.shape[1]
    c1 = weight_scale_torch(temperatures)
    c = c1[:, None]
    lg = legacy[:, None]
    xp = target[row_s, :n_valid].float()
    xq = draft[row_qs, :n_valid].float()
    fin = torch.isfinite(xp)
    fin_q = torch.isfinite(xq)
    e_p = edges[row_s] if edges is not None else None
    e_q = edges[rt + row_qs] if edges is not None else None
    m_p, r_p, _ = row_grid_torch(keys[row_s], c1)
    m_q, r_q, _ = row_grid_torch(keys[rt + row_qs], c1)
    # block weights of the two rows (the kernel's tiles: whole blocks, edges where a block crosses the shard)
    wpb, dp, *_ = shard_block_weights_torch(xp, vocab_start, width, rank, e_p, c1, r_p)
    wqb, dq, *_ = shard_block_weights_torch(xq, vocab_start, width, rank, e_q, c1, r_q)
    zpb, zqb = z_all[row_s][:, None], z_all[rt + row_qs][:, None]
    inv_pb = 1.0 / torch.where(zpb > 0, zpb, torch.ones_like(zpb))
    inv_qb = torch.where(zqb > 0, 1.0 / torch.where(zqb > 0, zqb, torch.ones_like(zqb)), torch.zeros_like(zqb))
    fpw = wpb.to(torch.float32)
    fqw = wqb.to(torch.float32)
    scale_p = _neg_pow2_f32_torch(dp)
    f_p = (_neg_pow2_f64_torch(dp) * inv_pb).float()
    f_q = (_neg_pow2_f64_torch(dq) * inv_qb).float()
    if top_p is not None:  # the requests with top-p in force: today's weights against the row max
        u = radix_key_torch(xp)
        tie = (fin & (u == bstar[row_s][:, None])).to(torch.int64)
        # tie rank in global id order: the ties of the lower ranks (the base of this rank's first slot) plus
        # those before the column on this rank
        within = run[row_s][:, :1] + torch.cumsum(tie, 1) - 1
        kept = fin & ((u > bstar[row_s][:, None]) | ((tie > 0) & (within < n_keep[row_s][:, None])))
        fpw = torch.where(lg, fixed_point_weight_torch(xp, m_p[:, None], c, kept).to(torch.float32), fpw)
        fqw = torch.where(lg, fixed_point_weight_torch(xq, m_q[:, None], c, fin_q).to(torch.float32), fqw)
        zp = zp_all.view(-1)[row_s][:, None]
        zq = q_sums[row_qs, :, 0].sum(1)[:, None]
        inv_p = (1.0 / zp.clamp_min(1).double()).float()
        inv_q = torch.where(zq > 0, 1.0 / zq.clamp_min(1).double(), torch.zeros_like(zq, dtype=torch.float64)).float()
        scale_p = torch.where(lg, torch.ones_like(scale_p), scale_p)
        f_p = torch.where(lg, inv_p, f_p)
        f_q = torch.where(lg, inv_q, f_q)
    alt = fpw * scale_p
    res = torch.clamp_min(fpw * f_p - fqw * f_q, 0.0)
    main = torch.where((mode == MODE_RESIDUAL)[:, None], res, alt)
    live = ((mode == MODE_RESIDUAL) | (mode == MODE_BONUS))[:, None]
    zero = torch.zeros_like(main)
    main, alt = torch.where(live, main, zero), torch.where(live, alt, zero)
    gid = torch.arange(vocab_start, vocab_start + n_valid, device=dev)[None, :]
    salt = torch.where(mode == MODE_RESIDUAL, RESIDUAL_SALT, BONUS_SALT)[:, None]
    e = neg_log2_uniform_torch(race_words_torch(seeds[:, None], (offsets + kstar)[:, None], gid, salt))
    slot = subchunk_index_torch(n_valid, chunk, n_sub, sub, dev)
    race[:, :, 0] = _race_torch(main, e, slot, splits * n_sub, vocab_start)
    race[:, :, 1] = _race_torch(alt, e, slot, splits * n_sub, vocab_start)


def _check_assemble(tokens, keys, dec, race_all, accepted, num_accepted):
    check_tensor("draft_tokens", tokens, shape=(None, None), dtype=torch.int64, contiguous=True)
    b, k = tokens.shape
    dev = tokens.device
    check_tensor("keys", keys, shape=(b * (2 * k + 1), None, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("dec", dec, shape=(b, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("race_all", race_all, shape=(None, b, None, RACE_COLS), dtype=torch.int64, device=dev,
                 contiguous=True)
    check_tensor("accepted_tokens (out)", accepted, shape=(b, k + 1), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("num_accepted (out)", num_accepted, shape=(b,), dtype=torch.int32, device=dev, contiguous=True)
    return b, k


def rejection_assemble(tokens, keys, dec, race_all, accepted, num_accepted) -> None:
    """Pick the race winner of every request over ``race_all [tp, B, S, 4]`` and write ``accepted [B, K+1]``
    int64 and ``num_accepted [B]`` int32. One launch; CUDA-graph safe."""
    b, k = _check_assemble(tokens, keys, dec, race_all, accepted, num_accepted)
    if b == 0:
        return
    _rejection_assemble_kernel[(b,)](tokens, keys, dec, race_all, accepted, num_accepted, k, keys.shape[1],
                                     race_all.shape[2], race_all.shape[0], BLOCK_K=triton.next_power_of_2(k + 1),
                                     SPLITS=triton.next_power_of_2(keys.shape[1]),
                                     TPS=triton.next_power_of_2(race_all.shape[2] * race_all.shape[0]), num_warps=1)


def rejection_assemble_reference(tokens, keys, dec, race_all, accepted, num_accepted) -> None:
    """Eager twin of :func:`rejection_assemble`."""
    b, k = _check_assemble(tokens, keys, dec, race_all, accepted, num_accepted)
    if b == 0:
        return
    dev = tokens.device
    ks = torch.arange(k + 1, device=dev)
    targ = key_to_id_torch(keys[: b * (k + 1), :, 0].max(1).values).view(b, k + 1)
    kstar, mode = dec[:, 0], dec[:, 1]
    bm = race_all[..., 0].permute(1, 0, 2).reshape(b, -1).min(1).values
    ba = race_all[..., 1].permute(1, 0, 2).reshape(b, -1).min(1).values
    drawn = torch.where(bm != NO_CANDIDATE, bm, ba) & 0xFFFFFFFF
    miss = tokens != targ[:, :k]
    n_greedy = 1 + torch.where(miss, ks[None, :k], torch.full_like(tokens, k)).min(1).values
    emitted = torch.where(mode == MODE_ARGMAX, targ.gather(1, kstar[:, None])[:, 0], drawn)
    d = torch.cat([tokens, torch.full((b, 1), -1, dtype=torch.int64, device=dev)], 1)
    row = torch.where(ks[None, :] < kstar[:, None], d,
                      torch.where(ks[None, :] == kstar[:, None], emitted[:, None], torch.full_like(d, -1)))
    greedy = (mode == MODE_GREEDY)[:, None]
    accepted.copy_(torch.where(greedy, targ, row))
    num_accepted.copy_(torch.where(greedy[:, 0], n_greedy, kstar + 1).to(torch.int32))
