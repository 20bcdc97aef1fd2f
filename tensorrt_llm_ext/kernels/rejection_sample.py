"""Rejection-sampling decisions and the exact residual / bonus draw on vocabulary shards.

Per request ``b`` with drafts ``d_0..d_{K-1}``, target rows ``k = 0..K`` and draft rows ``k = 0..K-1``, given
the exchanged integer masses (``Z_p``, ``F_p(d_k)`` from ``top_p_finalize``; ``Z_q``, ``F_q(d_k)`` from
``weight_sums``; see :mod:`~tensorrt_llm_ext.kernels.fixed_point_softmax`):

* accept ``d_k`` iff ``u_k * (F_q(d_k) / Z_q) < F_p(d_k) / Z_p`` in float64 (``F_q / Z_q := 0`` when
  ``Z_q = 0``); ``u_k`` is a 52-bit uniform from Philox keyed by (seed, offset + k, ``ACCEPT_SALT``). A target
  row without a finite logit (``Z_p = 0``) is the point mass on its argmax: accept iff ``d_k`` equals it.
* ``k*`` = the first rejection (``K`` if none). Emit, at row ``k*``: a sample of ``norm(max(p - q, 0))``
  (residual; weights ``trunc(max(F_p/Z_p - F_q/Z_q, 0) * 2^52)`` as int64) or, when all were accepted, of
  ``p_K`` (bonus; weights ``F_p``); the argmax when ``Z_p = 0`` at ``k*``; if the residual weights sum to 0
  (p and q equal up to rounding) the draw falls back to ``p_{k*}``.
* The draw is an inverse CDF in global id order: ``target = min(floor(u * total), total - 1)`` with ``u``
  keyed by (seed, offset + k*, ``RESIDUAL_SALT`` / ``BONUS_SALT``); per-chunk partial sums, per-rank
  totals (all-gathered ``[tp, B, 2]``), and the one program that holds ``target`` scans its chunk.

Everything is integer or one IEEE float64 operation at a time (no add after a multiply), so the kernels,
their eager twins and every TP size agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import check_int, check_tensor, num_warps_for
from tensorrt_llm_ext.kernels.fixed_point_softmax import (_check_logits, decode_max_key, decode_max_key_torch,
                                                          exp2_table, fixed_point_weight, fixed_point_weight_torch,
                                                          is_finite, plan_chunks, radix_key, radix_key_torch)
from tensorrt_llm_ext.kernels.ordered_key import _philox_4x32_10_torch, key_to_id, key_to_id_torch
from tensorrt_llm_ext.kernels.top_p import FINAL_COLS, kept_in_tile, kept_torch

__all__ = [
    "ACCEPT_SALT", "BONUS_SALT", "MODE_ARGMAX", "MODE_BONUS", "MODE_GREEDY", "MODE_RESIDUAL", "RESIDUAL_SALT",
    "rejection_assemble", "rejection_assemble_reference", "rejection_partials", "rejection_partials_reference",
    "rejection_pick", "rejection_pick_reference", "uniform52_torch",
]

# Philox counter word c3 of verification's draws (distinct from the target, draft and Markov salts).
ACCEPT_SALT = 0xACCE97
RESIDUAL_SALT = 0x4E5D1
BONUS_SALT = 0xB0705
# dec[b, 1]: how row b ends
MODE_GREEDY, MODE_RESIDUAL, MODE_BONUS, MODE_ARGMAX = 0, 1, 2, 3
_TWO52 = 4503599627370496.0
_ACCEPT: tl.constexpr = tl.constexpr(ACCEPT_SALT)
_RESIDUAL: tl.constexpr = tl.constexpr(RESIDUAL_SALT)
_BONUS: tl.constexpr = tl.constexpr(BONUS_SALT)


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
    r0, r1, _, _ = _philox_4x32_10_torch(seed.to(torch.int64) + c0, c0, c1, c2, c3)
    v = (r0 << 20) | (r1 >> 12)
    return (v.to(torch.float64) + 0.5) * 2.220446049250313e-16


@triton.jit
def _tile_weights(t_row_ptr, q_row_ptr, cols, valid, m_p, m_q, t, zp, zq, bstar, n_keep, run, mode, exp2_ptr,
                  HAS_P: tl.constexpr):
    """(main, alt, run): residual (mode 1) or bonus (mode 2) weights of one tile, and the p weights."""
    xp = tl.load(t_row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    fin = valid & is_finite(xp)
    if HAS_P:
        kept, run = kept_in_tile(radix_key(xp), fin, bstar, n_keep, run)
    else:
        kept = fin
    fp = fixed_point_weight(xp, m_p, t, kept, exp2_ptr)
    main = fp
    if mode == 1:
        xq = tl.load(q_row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        fq = fixed_point_weight(xq, m_q, t, valid & is_finite(xq), exp2_ptr)
        pv = fp.to(tl.float64) / tl.maximum(zp, 1).to(tl.float64)
        qv = fq.to(tl.float64) / tl.maximum(zq, 1).to(tl.float64)
        qv = tl.where(zq > 0, qv, 0.0)
        main = (tl.maximum(pv - qv, 0.0) * 4503599627370496.0).to(tl.int64)
    return main, fp, run


@triton.jit
def _decide(tok_ptr, temp_ptr, seed_ptr, off_ptr, keys_t_ptr, sums_q_ptr, final_t_ptr, b, sums_q_stride, K,
            BLOCK_K: tl.constexpr):
    """(k*, mode) of request b (scalar, identical in every program and on every rank)."""
    temp = tl.load(temp_ptr + b)
    seed = tl.load(seed_ptr + b).to(tl.int64)
    off = tl.load(off_ptr + b)
    ks = tl.arange(0, BLOCK_K)
    kv = ks < K
    b64 = b.to(tl.int64)
    row_t = b64 * (K + 1) + ks
    row_q = b64 * K + ks
    zp = tl.load(final_t_ptr + row_t * 5, mask=kv, other=1)
    fp = tl.load(final_t_ptr + row_t * 5 + 1, mask=kv, other=0)
    targ = key_to_id(tl.load(keys_t_ptr + row_t * 2, mask=kv, other=0))
    d = tl.load(tok_ptr + row_q, mask=kv, other=-1)
    zq = tl.load(sums_q_ptr + row_q * sums_q_stride, mask=kv, other=0)
    fq = tl.load(sums_q_ptr + row_q * sums_q_stride + 1, mask=kv, other=0)
    u = uniform52(seed, off + ks, (ks * 0 + _ACCEPT).to(tl.uint32))
    pv = fp.to(tl.float64) / tl.maximum(zp, 1).to(tl.float64)
    qv = tl.where(zq > 0, fq.to(tl.float64) / tl.maximum(zq, 1).to(tl.float64), 0.0)
    acc = tl.where(zp == 0, d == targ, u * qv < pv)
    kstar = tl.min(tl.where(kv & ~acc, ks, K), 0)
    zps = tl.load(final_t_ptr + (b64 * (K + 1) + kstar) * 5)
    sampled = temp > 0.0
    mode = tl.where(sampled, tl.where(zps == 0, 3, tl.where(kstar == K, 2, 1)), 0)
    return kstar, mode, temp, seed, off


@triton.jit
def _row_params(keys_t_ptr, keys_q_ptr, sums_q_ptr, final_t_ptr, chunk_ties_ptr, b, kstar, sums_q_stride, K,
                ties_stride, split, HAS_P: tl.constexpr):
    b64 = b.to(tl.int64)
    row_s = b64 * (K + 1) + kstar
    row_qs = b64 * K + tl.minimum(kstar, K - 1)
    m_p = decode_max_key(tl.load(keys_t_ptr + row_s * 2 + 1))
    m_q = decode_max_key(tl.load(keys_q_ptr + row_qs * 2 + 1))
    zp = tl.load(final_t_ptr + row_s * 5)
    zq = tl.load(sums_q_ptr + row_qs * sums_q_stride)
    n_keep = tl.load(final_t_ptr + row_s * 5 + 2)
    run = tl.load(final_t_ptr + row_s * 5 + 3)
    bstar = tl.load(final_t_ptr + row_s * 5 + 4)
    if HAS_P:
        for s in range(split):
            run += tl.load(chunk_ties_ptr + row_s * ties_stride + s)
    return row_s, row_qs, m_p, m_q, zp, zq, n_keep, run, bstar


@triton.jit
def _rejection_partials_kernel(
    t_ptr, q_ptr,  # [B*(K+1), V_local], [B*K, V_local] logits
    tok_ptr, temp_ptr, seed_ptr, off_ptr,  # [B, K] int64, [B] fp32, [B] int64, [B] int64
    keys_t_ptr, keys_q_ptr,  # [rows, 2] int64 exchanged keys
    sums_q_ptr,  # [B*K, sums_q_stride] int64 exchanged (Z_q, F_q(d), ...)
    final_t_ptr,  # [B*(K+1), 5] int64 (top_p_finalize)
    chunk_ties_ptr,  # [B*(K+1), num_splits] int64 (HAS_P)
    dec_ptr,  # [B, 2] int64 out: (k*, mode)
    partial_ptr,  # [B, num_splits, 2] int64 out: (main, alt) per chunk
    tot_ptr,  # [B, 2] int64, zero on entry: this rank's totals
    exp2_ptr,
    stride_t, stride_q, sums_q_stride, n_valid, chunk, num_splits, ties_stride, K,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_P: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    kstar, mode, temp, seed, off = _decide(tok_ptr, temp_ptr, seed_ptr, off_ptr, keys_t_ptr, sums_q_ptr,
                                           final_t_ptr, b, sums_q_stride, K, BLOCK_K)
    if split == 0:
        tl.store(dec_ptr + b * 2, kstar.to(tl.int64))
        tl.store(dec_ptr + b * 2 + 1, mode.to(tl.int64))
    acc_main = tl.zeros([BLOCK], tl.int64)
    acc_alt = tl.zeros([BLOCK], tl.int64)
    if (mode == 1) | (mode == 2):
        row_s, row_qs, m_p, m_q, zp, zq, n_keep, run, bstar = _row_params(
            keys_t_ptr, keys_q_ptr, sums_q_ptr, final_t_ptr, chunk_ties_ptr, b, kstar, sums_q_stride, K,
            ties_stride, split, HAS_P)
        lanes = tl.arange(0, BLOCK)
        col_begin = split * chunk
        col_end = tl.minimum(col_begin + chunk, n_valid)
        for start in range(col_begin, col_end, BLOCK):
            cols = start + lanes
            main, alt, run = _tile_weights(t_ptr + row_s * stride_t, q_ptr + row_qs * stride_q, cols,
                                           cols < col_end, m_p, m_q, temp, zp, zq, bstar, n_keep, run, mode,
                                           exp2_ptr, HAS_P)
            acc_main += main
            acc_alt += alt
    s_main = tl.sum(acc_main, 0)
    s_alt = tl.sum(acc_alt, 0)
    pbase = partial_ptr + (b.to(tl.int64) * num_splits + split) * 2
    tl.store(pbase, s_main)
    tl.store(pbase + 1, s_alt)
    tl.atomic_add(tot_ptr + b * 2, s_main)
    tl.atomic_add(tot_ptr + b * 2 + 1, s_alt)


@triton.jit
def _rejection_pick_kernel(
    t_ptr, q_ptr, tok_ptr, temp_ptr, seed_ptr, off_ptr, keys_t_ptr, keys_q_ptr, sums_q_ptr, final_t_ptr,
    chunk_ties_ptr,
    dec_ptr,  # [B, 2] int64
    partial_ptr,  # [B, num_splits, 2] int64 (this rank's)
    tot_all_ptr,  # [tp, B, 2] int64 gathered totals
    pick_ptr,  # [B] int64, zero on entry: the drawn global id (only the owning program writes)
    exp2_ptr,
    stride_t, stride_q, sums_q_stride, n_valid, vocab_start, chunk, num_splits, ties_stride, K, batch, rank, tp,
    BLOCK: tl.constexpr, HAS_P: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    b64 = b.to(tl.int64)
    kstar = tl.load(dec_ptr + b * 2)
    mode = tl.load(dec_ptr + b * 2 + 1)
    if (mode == 1) | (mode == 2):
        tm = tl.load(tot_all_ptr + b64 * 2) * 0
        ta = tm
        for q in range(tp):
            tm += tl.load(tot_all_ptr + (q * batch + b64) * 2)
            ta += tl.load(tot_all_ptr + (q * batch + b64) * 2 + 1)
        use_main = tm > 0
        col = tl.where(use_main, 0, 1)
        total = tl.where(use_main, tm, ta)
        seed = tl.load(seed_ptr + b).to(tl.int64)
        off = tl.load(off_ptr + b)
        lanes = tl.arange(0, BLOCK)
        salt = tl.where(mode == 1, lanes * 0 + _RESIDUAL, lanes * 0 + _BONUS).to(tl.uint32)
        uv = uniform52(seed, off + kstar + lanes * 0, salt)
        u = tl.max(uv, 0)  # every lane holds the same draw
        target = tl.minimum(tl.math.floor(u * total.to(tl.float64)).to(tl.int64), total - 1)
        base = total * 0
        for q in range(tp):
            base += tl.where(q < rank, tl.load(tot_all_ptr + (q * batch + b64) * 2 + col), 0)
        for s in range(split):
            base += tl.load(partial_ptr + (b64 * num_splits + s) * 2 + col)
        mine = tl.load(partial_ptr + (b64 * num_splits + split) * 2 + col)
        if (target >= base) & (target < base + mine):
            temp = tl.load(temp_ptr + b)
            row_s, row_qs, m_p, m_q, zp, zq, n_keep, run, bstar = _row_params(
                keys_t_ptr, keys_q_ptr, sums_q_ptr, final_t_ptr, chunk_ties_ptr, b, kstar, sums_q_stride, K,
                ties_stride, split, HAS_P)
            col_begin = split * chunk
            col_end = tl.minimum(col_begin + chunk, n_valid)
            found = tl.full([], -1, tl.int64)  # int64 from the start: the loop assigns an int64 id
            cum = base
            for start in range(col_begin, col_end, BLOCK):
                cols = start + lanes
                main, alt, run = _tile_weights(t_ptr + row_s * stride_t, q_ptr + row_qs * stride_q, cols,
                                               cols < col_end, m_p, m_q, temp, zp, zq, bstar, n_keep, run, mode,
                                               exp2_ptr, HAS_P)
                w = tl.where(use_main, main, alt)
                c = cum + tl.cumsum(w, 0)
                idx = tl.min(tl.where(c > target, lanes, BLOCK), 0)
                hit = (found < 0) & (idx < BLOCK)
                found = tl.where(hit, (start + idx).to(tl.int64) + vocab_start, found)
                cum += tl.sum(w, 0)
            tl.store(pick_ptr + b, found)


@triton.jit
def _rejection_assemble_kernel(
    tok_ptr, keys_t_ptr, dec_ptr, pick_ptr,
    acc_ptr,  # [B, K+1] int64 out
    num_ptr,  # [B] int32 out
    K,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    kv1 = ks < K + 1
    kv = ks < K
    targ = key_to_id(tl.load(keys_t_ptr + (b64 * (K + 1) + ks) * 2, mask=kv1, other=0))
    d = tl.load(tok_ptr + b64 * K + ks, mask=kv, other=-1)
    kstar = tl.load(dec_ptr + b * 2)
    mode = tl.load(dec_ptr + b * 2 + 1)
    miss = kv & (d != targ)
    n_greedy = 1 + tl.min(tl.where(miss, ks, K), 0)
    emitted = tl.where(mode == 3, tl.sum(tl.where(ks == kstar, targ, 0), 0), tl.load(pick_ptr + b))
    sampled_row = tl.where(ks < kstar, d, tl.where(ks == kstar, emitted, -1))
    greedy = mode == 0
    tl.store(acc_ptr + b64 * (K + 1) + ks, tl.where(greedy, targ, sampled_row), mask=kv1)
    tl.store(num_ptr + b, tl.where(greedy, n_greedy, kstar + 1).to(tl.int32))


# ----------------------------------------------------------------------------------------------------
# Launchers and eager twins
# ----------------------------------------------------------------------------------------------------
def _check(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t, chunk_ties,
           vocab_start, vocab_size):
    n_valid = _check_logits("target_logits", target, vocab_start, vocab_size)
    _check_logits("draft_logits", draft, vocab_start, vocab_size)
    check_tensor("draft_tokens", tokens, shape=(None, None), dtype=torch.int64, contiguous=True)
    b, k = tokens.shape
    dev = target.device
    if target.shape[0] != b * (k + 1) or draft.shape[0] != b * k or draft.shape[1] != target.shape[1]:
        raise ValueError(f"target/draft rows: expected [B*(K+1)={b * (k + 1)}, V] and [B*K={b * k}, V], got "
                         f"{list(target.shape)} and {list(draft.shape)}")
    check_tensor("temperatures", temperatures, shape=(b,), dtype=torch.float32, device=dev, contiguous=True)
    check_tensor("seeds", seeds, shape=(b,), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("offsets", offsets, shape=(b,), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("keys_t", keys_t, shape=(b * (k + 1), 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("keys_q", keys_q, shape=(b * k, 2), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("sums_q", sums_q, shape=(b * k, None), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("final_t", final_t, shape=(b * (k + 1), FINAL_COLS), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("chunk_ties", chunk_ties, shape=(b * (k + 1), None), dtype=torch.int64, device=dev,
                 contiguous=True)
    return n_valid, b, k


def rejection_partials(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t,
                       chunk_ties, dec, partial, tot, vocab_start: int, vocab_size: int, *, has_top_p: bool,
                       block_size: int = 2048, num_splits: int = 1) -> None:
    """Decide every request (``dec [B, 2]`` = (k*, mode)) and sum its draw weights per column chunk.

    ``partial [B, >= splits, 2]`` (main, alt) per chunk; ``tot [B, 2]`` (zeroed by the caller) this rank's
    totals, all-gathered next. CUDA-graph safe.
    """
    n_valid, b, k = _check(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t,
                           chunk_ties, vocab_start, vocab_size)
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    if b == 0:
        return
    _rejection_partials_kernel[(b, splits)](
        target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t, chunk_ties, dec,
        partial, tot, exp2_table(target.device), target.stride(0), draft.stride(0), sums_q.stride(0), n_valid,
        chunk, splits, chunk_ties.shape[1], k, BLOCK=block_size,
        BLOCK_K=triton.next_power_of_2(max(k, 1)), HAS_P=has_top_p, num_warps=num_warps_for(block_size))


def rejection_pick(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t,
                   chunk_ties, dec, partial, tot_all, pick, vocab_start: int, vocab_size: int, *, has_top_p: bool,
                   rank: int = 0, block_size: int = 2048, num_splits: int = 1) -> None:
    """The residual / bonus draw: the program holding the target writes its global id into ``pick [B]``
    (zeroed by the caller; SUM-exchanged next). CUDA-graph safe."""
    n_valid, b, k = _check(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t,
                           chunk_ties, vocab_start, vocab_size)
    tp = tot_all.shape[0]
    check_int("rank", rank, lo=0, hi=tp)
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    if b == 0:
        return
    _rejection_pick_kernel[(b, splits)](
        target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t, chunk_ties, dec,
        partial, tot_all, pick, exp2_table(target.device), target.stride(0), draft.stride(0), sums_q.stride(0),
        n_valid, vocab_start, chunk, splits, chunk_ties.shape[1], k, b, rank, tp, BLOCK=block_size,
        HAS_P=has_top_p, num_warps=num_warps_for(block_size))


def rejection_assemble(tokens, keys_t, dec, pick, accepted, num_accepted) -> None:
    """Write ``accepted [B, K+1]`` int64 and ``num_accepted [B]`` int32. CUDA-graph safe."""
    b, k = tokens.shape
    if b == 0:
        return
    _rejection_assemble_kernel[(b,)](tokens, keys_t, dec, pick, accepted, num_accepted, k,
                                     BLOCK_K=triton.next_power_of_2(k + 1), num_warps=1)


def _decide_torch(tokens, temperatures, seeds, offsets, keys_t, sums_q, final_t):
    b, k = tokens.shape
    dev = tokens.device
    ks = torch.arange(k, device=dev)
    zp = final_t[:, 0].view(b, k + 1)
    fp = final_t[:, 1].view(b, k + 1)[:, :k]
    targ = key_to_id_torch(keys_t[:, 0]).view(b, k + 1)
    zq = sums_q[:, 0].view(b, k)
    fq = sums_q[:, 1].view(b, k)
    u = uniform52_torch(seeds[:, None], offsets[:, None] + ks[None, :], ACCEPT_SALT)
    pv = fp.double() / zp[:, :k].clamp_min(1).double()
    qv = torch.where(zq > 0, fq.double() / zq.clamp_min(1).double(), torch.zeros_like(pv))
    acc = torch.where(zp[:, :k] == 0, tokens == targ[:, :k], u * qv < pv)
    kstar = torch.where(~acc, ks[None, :], torch.full_like(tokens, k)).min(dim=1).values if k else \
        torch.zeros(b, dtype=torch.int64, device=dev)
    zps = zp.gather(1, kstar[:, None])[:, 0]
    sampled = temperatures > 0
    mode = torch.where(sampled, torch.where(zps == 0, MODE_ARGMAX, torch.where(kstar == k, MODE_BONUS, MODE_RESIDUAL)),
                       torch.full_like(kstar, MODE_GREEDY))
    return kstar, mode


def _weights_torch(target, draft, n_valid, tokens, temperatures, keys_t, keys_q, sums_q, final_t, kstar, mode,
                   has_top_p):
    """[B, n_valid] (main, alt) int64 draw weights of every request's row k* (zeros for other modes)."""
    b, k = tokens.shape
    dev = target.device
    bi = torch.arange(b, device=dev)
    row_s = bi * (k + 1) + kstar
    row_qs = bi * k + kstar.clamp(max=max(k - 1, 0))
    xp = target[row_s, :n_valid].float()
    fin = torch.isfinite(xp)
    fs = final_t[row_s]
    kept = kept_torch(radix_key_torch(xp), fin, fs[:, 4], fs[:, 2], fs[:, 3]) if has_top_p else fin
    t = temperatures[:, None]
    m_p = decode_max_key_torch(keys_t[row_s, 1])[:, None]
    fpw = fixed_point_weight_torch(xp, m_p, t, kept)
    zp = fs[:, 0:1]
    if k:
        xq = draft[row_qs, :n_valid].float()
        m_q = decode_max_key_torch(keys_q[row_qs, 1])[:, None]
        fqw = fixed_point_weight_torch(xq, m_q, t, torch.isfinite(xq))
        zq = sums_q[row_qs, 0:1]
        pv = fpw.double() / zp.clamp_min(1).double()
        qv = torch.where(zq > 0, fqw.double() / zq.clamp_min(1).double(), torch.zeros_like(pv))
        res = (torch.clamp_min(pv - qv, 0.0) * _TWO52).to(torch.int64)
    else:
        res = fpw
    main = torch.where((mode == MODE_RESIDUAL)[:, None], res, fpw)
    live = ((mode == MODE_RESIDUAL) | (mode == MODE_BONUS))[:, None]
    zero = torch.zeros_like(main)
    return torch.where(live, main, zero), torch.where(live, fpw, zero)


def rejection_partials_reference(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q,
                                 final_t, chunk_ties, dec, partial, tot, vocab_start: int, vocab_size: int, *,
                                 has_top_p: bool, block_size: int = 2048, num_splits: int = 1) -> None:
    """Eager twin of :func:`rejection_partials` (same buffers, same column plan)."""
    n_valid, b, k = _check(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t,
                           chunk_ties, vocab_start, vocab_size)
    splits, chunk = plan_chunks(n_valid, block_size, num_splits)
    kstar, mode = _decide_torch(tokens, temperatures, seeds, offsets, keys_t, sums_q, final_t)
    dec[:, 0] = kstar
    dec[:, 1] = mode
    main, alt = _weights_torch(target, draft, n_valid, tokens, temperatures, keys_t, keys_q, sums_q, final_t,
                               kstar, mode, has_top_p)
    pad = torch.zeros((b, 2, splits * chunk), dtype=torch.int64, device=target.device)
    pad[:, 0, :n_valid] = main
    pad[:, 1, :n_valid] = alt
    per = pad.view(b, 2, splits, chunk).sum(-1).transpose(1, 2)  # [B, splits, 2]
    partial[:, :splits] = per
    tot.copy_(per.sum(1))


def rejection_pick_reference(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t,
                             chunk_ties, dec, partial, tot_all, pick, vocab_start: int, vocab_size: int, *,
                             has_top_p: bool, rank: int = 0, block_size: int = 2048, num_splits: int = 1) -> None:
    """Eager twin of :func:`rejection_pick` (writes ``pick`` where this rank holds the draw, else leaves 0)."""
    n_valid, b, k = _check(target, draft, tokens, temperatures, seeds, offsets, keys_t, keys_q, sums_q, final_t,
                           chunk_ties, vocab_start, vocab_size)
    kstar, mode = dec[:, 0], dec[:, 1]
    main, alt = _weights_torch(target, draft, n_valid, tokens, temperatures, keys_t, keys_q, sums_q, final_t,
                               kstar, mode, has_top_p)
    tm, ta = tot_all[:, :, 0].sum(0), tot_all[:, :, 1].sum(0)
    use_main = tm > 0
    total = torch.where(use_main, tm, ta)
    w = torch.where(use_main[:, None], main, alt)
    salt = torch.where(mode == MODE_RESIDUAL, RESIDUAL_SALT, BONUS_SALT)
    u = uniform52_torch(seeds, offsets + kstar, salt)
    target_v = torch.minimum(torch.floor(u * total.double()).to(torch.int64), total - 1)
    base = torch.where(use_main, tot_all[:rank, :, 0].sum(0), tot_all[:rank, :, 1].sum(0))
    cum = base[:, None] + torch.cumsum(w, 1)
    hit = cum > target_v[:, None]
    live = (mode == MODE_RESIDUAL) | (mode == MODE_BONUS)
    mine = live & hit.any(1) & (base <= target_v)
    idx = hit.to(torch.uint8).argmax(1)
    pick.copy_(torch.where(mine, idx + vocab_start, torch.zeros_like(idx)))


def rejection_assemble_reference(tokens, keys_t, dec, pick, accepted, num_accepted) -> None:
    """Eager twin of :func:`rejection_assemble`."""
    b, k = tokens.shape
    if b == 0:
        return
    dev = tokens.device
    ks = torch.arange(k + 1, device=dev)
    targ = key_to_id_torch(keys_t[:, 0]).view(b, k + 1)
    kstar, mode = dec[:, 0], dec[:, 1]
    miss = tokens != targ[:, :k]
    n_greedy = 1 + torch.where(miss, ks[None, :k], torch.full_like(tokens, k)).min(1).values if k else \
        torch.ones(b, dtype=torch.int64, device=dev)
    emitted = torch.where(mode == MODE_ARGMAX, targ.gather(1, kstar[:, None])[:, 0], pick)
    d = torch.cat([tokens, torch.full((b, 1), -1, dtype=torch.int64, device=dev)], 1)
    row = torch.where(ks[None, :] < kstar[:, None], d,
                      torch.where(ks[None, :] == kstar[:, None], emitted[:, None], torch.full_like(d, -1)))
    greedy = (mode == MODE_GREEDY)[:, None]
    accepted.copy_(torch.where(greedy, targ, row))
    num_accepted.copy_(torch.where(greedy[:, 0], n_greedy, kstar + 1).to(torch.int32))
