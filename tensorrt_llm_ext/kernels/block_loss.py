"""The distillation loss's per-row passes over the vocabulary (train-drafter): TV, CE, KL, top-1 agreement and the
gradient of their weighted sum with respect to the draft logits, one row (block position) per program.

Cost (SmolLM2, V = 49,152): three streaming passes per row over bf16 draft and teacher logits and one gradient
write, ~14 bytes per element against ~160 for the torch ops of :func:`block_loss_rows_reference` (its eager twin,
fp32 over ``[c, V]``). Tolerance, not bitwise: both compute in fp32, the kernel's sums run in another order
(tests/integration/test_drafter_data.py). The trainer times it against the torch ops at its first step and keeps
the faster (``training.fused_loss``).

With ``t_index`` (the loss's ``"dedup"`` layout) a row reads the teacher row of its position, shared with the
other block rows of that position, and the teacher's log-sum-exp / argmax come from :func:`teacher_stats` (one
pass per position): the first pass reads z alone, ~8 bytes per element plus the shared teacher row (sm_90: 40-48
registers against 80, no spills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lse_update(m, s, i, x, cols):
    """One block of an online log-sum-exp and first argmax: per-lane running max ``m``, sum ``s`` (relative to
    ``m``) and argmax column ``i``, updated with the values ``x`` at columns ``cols`` (-inf past the row)."""
    nm = tl.maximum(m, x)
    # lanes still at -inf (past V) keep a zero sum (exp(-inf - -inf) would be NaN)
    s = tl.where(nm > float("-inf"), s * tl.exp(m - nm) + tl.exp(x - nm), 0.0)
    i = tl.where(x > m, cols, i)  # strictly greater: a lane keeps its first maximum
    return nm, s, i


@triton.jit
def _lse_finish(m, s, i, V):
    """The row's log-sum-exp and first argmax (as torch.argmax) from the lanes' running state."""
    m_r = tl.max(m, 0)
    lse = m_r + tl.log(tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - m_r), 0.0), 0))
    return lse, tl.min(tl.where(m == m_r, i, V), 0)


@triton.jit
def _lse_argmax_pair(zr, tr, V, BLOCK: tl.constexpr):
    """:func:`_lse_argmax` of a draft row and a teacher row in one pass (both loads in one loop)."""
    offs = tl.arange(0, BLOCK)
    ninf = float("-inf")
    mz = tl.full([BLOCK], ninf, tl.float32)
    mt = tl.full([BLOCK], ninf, tl.float32)
    sz = tl.zeros([BLOCK], tl.float32)
    st = tl.zeros([BLOCK], tl.float32)
    iz = tl.zeros([BLOCK], tl.int32)
    it = tl.zeros([BLOCK], tl.int32)
    for off in range(0, V, BLOCK):
        cols = off + offs
        mask = cols < V
        mz, sz, iz = _lse_update(mz, sz, iz, tl.load(zr + cols, mask=mask, other=ninf).to(tl.float32), cols)
        mt, st, it = _lse_update(mt, st, it, tl.load(tr + cols, mask=mask, other=ninf).to(tl.float32), cols)
    lse_z, arg_z = _lse_finish(mz, sz, iz, V)
    lse_t, arg_t = _lse_finish(mt, st, it, V)
    return lse_z, arg_z, lse_t, arg_t


@triton.jit
def _lse_argmax(r_ptr, V, BLOCK: tl.constexpr):
    """One streaming pass over a row of logits: its log-sum-exp and first argmax (fp32 math)."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    i = tl.zeros([BLOCK], tl.int32)
    for off in range(0, V, BLOCK):
        cols = off + offs
        m, s, i = _lse_update(m, s, i, tl.load(r_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32),
                              cols)
    return _lse_finish(m, s, i, V)


@triton.jit
def _teacher_stats_kernel(t_ptr, lse_ptr, arg_ptr, V, stride_t, BLOCK: tl.constexpr):
    """Per teacher row (once per position, not once per block row): log-sum-exp and argmax."""
    row = tl.program_id(0).to(tl.int64)
    lse, arg = _lse_argmax(t_ptr + row * stride_t, V, BLOCK)
    tl.store(lse_ptr + row, lse)
    tl.store(arg_ptr + row, arg)


@triton.jit
def _block_loss_rows_kernel(z_ptr, t_ptr, y_ptr, atv_ptr, ace_ptr, akl_ptr, tv_ptr, ce_ptr, kl_ptr, agree_ptr,
                            tidx_ptr, tlse_ptr, targ_ptr, V, stride_z, stride_t, HAS_KL: tl.constexpr,
                            WRITE_GRAD: tl.constexpr, T_STATS: tl.constexpr, BLOCK: tl.constexpr):
    """One row (block position) per program, three streaming passes over the vocabulary: (1) max, sum-exp and
    argmax of the draft logits z and the teacher logits t; (2) TV, <sign(q - p), q> and KL; (3) the gradient of
    the row's weighted loss with respect to z, written over z (bfloat16 reads, fp32 math). ``T_STATS``: the
    row's teacher logits are row ``tidx[row]`` of t (shared by the block rows of one position) and their
    log-sum-exp / argmax come precomputed (:func:`teacher_stats`), so pass (1) reads z alone."""
    row = tl.program_id(0).to(tl.int64)
    zr = z_ptr + row * stride_z
    if T_STATS:
        trow = tl.load(tidx_ptr + row).to(tl.int64)
    else:
        trow = row
    tr = t_ptr + trow * stride_t
    offs = tl.arange(0, BLOCK)
    ninf = float("-inf")
    if T_STATS:
        lse_z, arg_z = _lse_argmax(zr, V, BLOCK)
        lse_t = tl.load(tlse_ptr + trow)
        arg_t = tl.load(targ_ptr + trow)
    else:
        lse_z, arg_z, lse_t, arg_t = _lse_argmax_pair(zr, tr, V, BLOCK)
    tv = tl.zeros([BLOCK], tl.float32)
    sq = tl.zeros([BLOCK], tl.float32)
    kl = tl.zeros([BLOCK], tl.float32)
    for off in range(0, V, BLOCK):
        cols = off + offs
        mask = cols < V
        zl = tl.load(zr + cols, mask=mask, other=ninf).to(tl.float32) - lse_z
        tlg = tl.load(tr + cols, mask=mask, other=ninf).to(tl.float32) - lse_t
        q = tl.exp(zl)
        p = tl.exp(tlg)
        d = q - p
        tv += tl.abs(d)
        sq += tl.where(d > 0, q, tl.where(d < 0, -q, 0.0))
        if HAS_KL:
            kl += tl.where(mask & (p > 0), p * (tlg - zl), 0.0)
    tv_r = 0.5 * tl.sum(tv, 0)
    sq_r = tl.sum(sq, 0)
    y = tl.load(y_ptr + row)
    ce_r = lse_z - tl.load(zr + y).to(tl.float32)
    tl.store(tv_ptr + row, tv_r)
    tl.store(ce_ptr + row, ce_r)
    tl.store(agree_ptr + row, (arg_z == arg_t).to(tl.int8))
    if HAS_KL:
        tl.store(kl_ptr + row, tl.sum(kl, 0))
    if WRITE_GRAD:
        a_tv = 0.5 * tl.load(atv_ptr + row)
        a_ce = tl.load(ace_ptr + row)
        a_kl = tl.load(akl_ptr + row)  # a stand-in pointer without KL (never used then)
        for off in range(0, V, BLOCK):
            cols = off + offs
            mask = cols < V
            q = tl.exp(tl.load(zr + cols, mask=mask, other=ninf).to(tl.float32) - lse_z)
            p = tl.exp(tl.load(tr + cols, mask=mask, other=ninf).to(tl.float32) - lse_t)
            d = q - p
            s = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
            g = a_tv * q * (s - sq_r) + a_ce * (q - tl.where(cols == y, 1.0, 0.0))
            if HAS_KL:
                g += a_kl * d
            tl.store(zr + cols, g.to(z_ptr.dtype.element_ty), mask=mask)


ROWS_BLOCK = 2048  # columns per iteration of the row kernel (49,152 = 24); 8 warps: ~8 per thread, no spill


def teacher_stats(t: torch.Tensor, block: int = ROWS_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of teacher logits ``t [u, V]`` (unit column stride): ``(lse [u] fp32, argmax [u] int32)`` -- the
    row kernel's first pass over t, done once per teacher position instead of once per block row."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"teacher_stats: t must be [u, V] with unit column stride, got {tuple(t.shape)}")
    u, v = t.shape
    lse = torch.empty(u, dtype=torch.float32, device=t.device)
    arg = torch.empty(u, dtype=torch.int32, device=t.device)
    if u:
        _teacher_stats_kernel[(u,)](t, lse, arg, v, t.stride(0), BLOCK=min(block, triton.next_power_of_2(v)),
                                    num_warps=8)
    return lse, arg


def block_loss_rows(z: torch.Tensor, t: torch.Tensor, y: torch.Tensor, a_tv: torch.Tensor, a_ce: torch.Tensor,
                    a_kl: torch.Tensor | None, write_grad: bool, block: int = ROWS_BLOCK,
                    t_index: torch.Tensor | None = None, t_stats: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Per row of draft logits ``z [c, V]`` and teacher logits ``t [c, V]`` (any float dtype, unit column
    stride): ``(tv, ce, kl or None, agree)`` (``[c]`` fp32 / bool) and, with ``write_grad``, the gradient of
    ``a_tv TV + a_ce CE + a_kl KL`` with respect to ``z`` written over ``z``. The Triton twin of the torch chunk
    in :meth:`FusedBlockLoss.forward` (tested equal).

    ``t_index`` (``[c]`` int): row ``r`` reads teacher row ``t[t_index[r]]`` (``t`` then ``[u, V]``, one row per
    teacher position); ``t_stats``: :func:`teacher_stats` of ``t`` (computed here when not given)."""
    c, v = z.shape if z.dim() == 2 else (-1, -1)
    gathered = t_index is not None
    if (z.dim() != 2 or t.dim() != 2 or t.shape[1] != v or (not gathered and t.shape[0] != c) or z.stride(1) != 1
            or t.stride(1) != 1):
        raise ValueError(f"block_loss_rows: z and t must be [c, V] ([u, V] with t_index) with unit column stride, "
                         f"got {tuple(z.shape)} {tuple(z.stride())} and {tuple(t.shape)} {tuple(t.stride())}")
    if any(x is not None and (x.shape != (c,) or x.device != z.device) for x in (y, a_tv, a_ce, a_kl, t_index)):
        raise ValueError(f"block_loss_rows: y, t_index and the coefficients must be [{c}] on {z.device}")
    dev = z.device
    tv = torch.empty(c, dtype=torch.float32, device=dev)
    ce = torch.empty(c, dtype=torch.float32, device=dev)
    kl = torch.empty(c, dtype=torch.float32, device=dev) if a_kl is not None else None
    agree = torch.empty(c, dtype=torch.int8, device=dev)
    if gathered and t_stats is None:
        t_stats = teacher_stats(t, block)
    lse_t, arg_t = t_stats if gathered else (tv, tv)  # stand-in pointers without T_STATS (never read then)
    if c:
        _block_loss_rows_kernel[(c,)](z, t, y, a_tv, a_ce, a_kl if a_kl is not None else a_ce, tv, ce,
                                      kl if kl is not None else tv, agree, t_index if gathered else y, lse_t, arg_t,
                                      v, z.stride(0), t.stride(0), HAS_KL=a_kl is not None, WRITE_GRAD=write_grad,
                                      T_STATS=gathered, BLOCK=min(block, triton.next_power_of_2(v)), num_warps=8)
    return tv, ce, kl, agree.bool()


def block_loss_rows_reference(z, t, y, a_tv, a_ce, a_kl, need_grad):
    """The torch twin of :func:`block_loss_rows` (fp32 over ``[c, V]``): ``(tv, ce, kl, agree, g)``."""
    z, t = z.float(), t.float()
    agree = z.argmax(-1) == t.argmax(-1)
    q_log = torch.log_softmax(z, -1)
    del z
    p_log = torch.log_softmax(t, -1)
    del t
    q, p = q_log.exp(), p_log.exp()
    ce = -q_log.gather(-1, y[:, None]).squeeze(-1)
    kl = (p * (p_log - q_log)).sum(-1) if a_kl is not None else None
    del q_log, p_log
    d = q - p
    tv = 0.5 * d.abs().sum(-1)
    if not need_grad:
        return tv, ce, kl, agree, None
    # g = a_tv ½ q (s - <s, q>) + a_ce (q - onehot) + a_kl (q - p), in place over d's storage
    g_kl = (q - p).mul_(a_kl[:, None]) if a_kl is not None else None
    s = d.sign_()
    sq = (s * q).sum(-1, keepdim=True)
    g = s.sub_(sq).mul_(q).mul_((0.5 * a_tv)[:, None])
    g.add_(q * a_ce[:, None])
    g.scatter_add_(-1, y[:, None], -a_ce[:, None])
    if g_kl is not None:
        g.add_(g_kl)
    return tv, ce, kl, agree, g
