"""The distillation loss over the vocabulary, chunked: the LM head, the Markov bias, the teacher's logits, the
total variation / cross-entropy / KL and their gradients computed a few thousand block positions at a time.

The eager objective (:func:`eager_block_loss`, what :func:`~tensorrt_llm_ext.training.trainer.distillation_loss`
computed before) materialises ``[N, V]`` draft and teacher logits in fp32 for every block position of a step, and
autograd keeps about six such tensors for the backward (SmolLM2: 16 x 128 x 7 positions x 49,152 columns = 2.8
GB each). :class:`FusedBlockLoss` computes the same loss, the per-row values the metrics and the confidence label
read, and the gradients of the loss with respect to the block hidden states, the Markov rows ``W1[prev]`` and
``W2`` chunk by chunk inside the forward (the loss is linear in the per-row terms, with the coefficients known
before), so a step holds one chunk's ``[rows, V]`` temporaries instead of the whole step's: the batch can grow.

Per row (block position) with draft logits ``z = h Wᵀ + W2 W1[prev]`` and teacher logits ``t = h_t Wᵀ``,
``q = softmax(z)``, ``p = softmax(t)``:

* TV = ½‖q - p‖₁, ∂TV/∂z = ½ q ⊙ (s - ⟨s, q⟩), ``s = sign(q - p)`` (``sign(0) = 0``, as autograd's
  ``abs``);
* CE = -log q_y, ∂CE/∂z = q - onehot(y);
* KL(p ‖ q) = Σ p (log p - log q), ∂KL/∂z = q - p.

The matrix products run in ``compute_dtype`` (bfloat16 under CUDA autocast, as the eager path's ``F.linear``),
the softmax and the loss terms in fp32.

Layouts (``layout``; :data:`LAYOUTS`):

* ``"rows"`` (the first one): one teacher row per block row (``t = h_t[row] Wᵀ``), ``z = addmm(h Wᵀ, W1[prev],
  W2ᵀ)`` (two GEMMs, the first writes a ``[rows, V]`` intermediate the second re-reads) and three gradient GEMMs.
* ``"joint"``: ``z = [h | W1[prev]] [W | W2]ᵀ`` and ``[∂h | ∂W1[prev]] = g [W | W2]`` -- one GEMM each way
  (inner size H + r). One rounding of z in ``compute_dtype`` instead of two (``addmm`` rounds ``h Wᵀ`` first):
  in bf16 the logits differ in the last bit; in fp32 the tests hold both to the eager objective at 2e-5.
* ``"dedup"`` (the trainer's default once the H200 measures it faster; ``"rows"`` until then): ``"joint"`` plus the
  teacher's logits once per teacher position, not once per block row. The caller passes the unique teacher hidden rows
  ``[U, H]`` and ``teacher_index [N]`` (row -> unique row): it knows the rows' positions (sequence, anchor + k) and
  gathers U rows instead of N, where the loss would have to deduplicate hidden vectors. The loss sorts its rows by
  ``teacher_index`` so a chunk's rows need one contiguous range of unique rows, computes their logits and log-sum-exp
  / argmax (:func:`~tensorrt_llm_ext.kernels.block_loss.teacher_stats`) once, and writes the per-row outputs and
  gradients back in the caller's order (the loss is a sum: the order changes only its rounding). The range bounds are
  read on the host once per call (one device sync). With ``teacher_groups`` (the trainer's form) nothing is sorted
  or read: each sequence's rows read a grid of its own ``W`` answer positions (``max_candidates + K - 1``, known on
  the host), chunks are whole sequences, and their teacher ranges follow from the shapes; the grid computes the
  teacher logits of answer positions no anchor reached too (``W`` per sequence instead of the distinct positions).

Cost of the vocabulary-wide part of one step at 64 sequences x 256 anchors x K = 7 (N = 114,688 block rows;
V = 49,152, H = 576, Markov rank r = 256; U <= 64 x (256 + 6) = 16,768 teacher positions: the anchors of a
sequence are distinct and wrap over its answer, so each position is the teacher of up to 7 rows):

======================  ======================================  ==========================================
                        ``"rows"``                              ``"dedup"``
======================  ======================================  ==========================================
draft logits            2NV(H + r) = 9.38 TFLOP                 same FLOP, one GEMM
teacher logits          2NVH = 6.49 TFLOP                       2UVH <= 0.95 TFLOP
gradients               2NV(H + 2r) = 12.27 TFLOP               same FLOP, two GEMMs instead of three
GEMMs                   28.1 TFLOP (~50 ms at ~560 TFLOP/s)     22.6 TFLOP (~40 ms)
``[N, V]`` bf16 passes  14 x 11.3 GB = 158 GB (~38 ms)          7 x 11.3 + ~4 x 1.6 GB = 86 GB (~20 ms)
======================  ======================================  ==========================================

Passes over ``[N, V]`` bf16 (11.3 GB each), ``"rows"``: ``h Wᵀ`` written, read and rewritten by ``addmm`` (3),
t written (1), the row kernel's three passes over z and t (6) and its gradient write (1), the gradient GEMMs'
reads of g (3). ``"dedup"``: z written (1), the row kernel's three passes over z (3) and gradient write (1), g
read by ``g [W | W2]`` and ``gᵀ W1[prev]`` (2); t (``[U, V]``, 1.6 GB) written once, read by its statistics
and by the row kernel's second and third passes (rows sorted by position: a position's rows are neighbouring
programs, so its t row comes from L2 after the first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensorrt_llm_ext.kernels.block_loss import block_loss_rows, block_loss_rows_reference, teacher_stats
from tensorrt_llm_ext.kernels.common import triton_runs_on

# Rows per chunk: about 2**28 fp32 elements of [rows, V] per temporary (1 GiB; SmolLM2: 5,461 rows).
CHUNK_ELEMENTS = 2**28


def chunk_rows(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(vocab, 1))


LAYOUTS = ("rows", "joint", "dedup")


def _region(name: str):
    """A profiler range (scripts/drafter_throughput.py --profile groups kernels by these; ~1 us without one)."""
    return torch.profiler.record_function(name)


class FusedBlockLoss(torch.autograd.Function):
    """``loss = Σ_r coef_tv[r] TV_r + coef_ce[r] CE_r + coef_kl[r] KL_r`` and the per-row ``tv``, ``ce`` and
    top-1 agreement (detached).

    Args (forward):
        hidden: ``[N, H]`` block hidden states (differentiable).
        markov_rows: ``[N, r]`` ``W1[prev]`` (differentiable).
        markov_w2: ``[V, r]`` (differentiable).
        head: ``[V, H]`` the target's LM head (frozen).
        teacher_hidden: ``[N, H]`` the target's final hidden state at each row's teacher position; with
            ``teacher_index``, ``[U, H]`` one row per teacher position.
        next_tokens: ``[N]`` int64, the sequence's next token (CE's label).
        coef_tv, coef_ce, coef_kl: ``[N]`` fp32 (0 on a row that does not count); ``coef_kl`` None: no KL term.
        compute_dtype: the matrix products' dtype.
        rows: rows per chunk.
        kernel: the per-row passes in the Triton kernel (else torch ops).
        teacher_index: ``[N]`` int64 row -> row of ``teacher_hidden``, or None (row r reads row r).
        joint: the draft logits and their gradient as one GEMM each (module docstring).
        teacher_groups: ``(G, W)`` or None: with ``teacher_index``, the rows come in groups of ``G`` whose
            teacher rows lie in the group's own ``W`` (rows ``[g G, (g+1) G)`` read ``[g W, (g+1) W)``): chunks
            are whole groups, so their ranges are known without sorting or reading the index on the host.
    """

    @staticmethod
    def forward(ctx, hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens, coef_tv, coef_ce, coef_kl,
                compute_dtype, rows, kernel, teacher_index, joint, teacher_groups):
        n, h_dim = hidden.shape
        dev = hidden.device
        cd = compute_dtype
        need_grad = any(ctx.needs_input_grad[:3])
        use_kl = coef_kl is not None
        with _region("loss.prepare"):
            head_c, w2_c = head.detach().to(cd), markov_w2.detach().to(cd)
            h_c, m_c, t_c = hidden.detach().to(cd), markov_rows.detach().to(cd), teacher_hidden.detach().to(cd)
            order = t_rows = bounds = None
            if teacher_groups is not None:  # whole groups per chunk: the ranges follow from the shapes
                group, width = teacher_groups
                rows = max(1, rows // group) * group
                t_rows = teacher_index
                bounds = [((lo // group) * width, -(-min(n, lo + rows) // group) * width - 1)
                          for lo in range(0, n, rows)]
            elif teacher_index is not None:
                # a chunk's rows share teacher positions: sort the rows by position, scatter the results back
                order = torch.argsort(teacher_index, stable=True)
                t_rows = teacher_index[order]
                h_c, m_c = h_c[order], m_c[order]
                next_tokens, coef_tv, coef_ce = next_tokens[order], coef_tv[order], coef_ce[order]
                coef_kl = coef_kl[order] if use_kl else None
                starts = torch.arange(0, n, rows, device=dev)
                ends = (starts + rows).clamp(max=n) - 1
                bounds = torch.stack([t_rows[starts], t_rows[ends]], 1).tolist() if n else []  # one host read
            if joint:
                w_cat = torch.cat([head_c, w2_c], 1)  # [V, H + r]
                x_c = torch.cat([h_c, m_c], 1)
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=dev) if need_grad else None
        grad_m = torch.empty(markov_rows.shape, dtype=torch.float32, device=dev) if need_grad else None
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=dev) if need_grad else None
        tv = torch.empty(n, dtype=torch.float32, device=dev)
        ce = torch.empty(n, dtype=torch.float32, device=dev)
        agree = torch.empty(n, dtype=torch.bool, device=dev)
        loss = torch.zeros((), dtype=torch.float32, device=dev)

        def put(dst, lo, hi, val):  # the caller's order (order's indices are distinct: a plain index_put)
            dst[slice(lo, hi) if order is None else order[lo:hi]] = val

        for i, lo in enumerate(range(0, n, rows)):
            hi = min(n, lo + rows)
            y = next_tokens[lo:hi]
            a_tv, a_ce = coef_tv[lo:hi], coef_ce[lo:hi]
            a_kl = coef_kl[lo:hi] if use_kl else None
            with _region("loss.gemm_draft"):
                if joint:
                    z = x_c[lo:hi] @ w_cat.T  # [c, V] in cd: one rounding
                else:
                    z = torch.addmm(h_c[lo:hi] @ head_c.T, m_c[lo:hi], w2_c.T)
            with _region("loss.gemm_teacher"):
                if t_rows is None:
                    t, t_local, stats = t_c[lo:hi] @ head_c.T, None, None
                else:  # the chunk's teacher positions, once each
                    first, last = bounds[i]
                    t = t_c[first:last + 1] @ head_c.T
                    t_local = t_rows[lo:hi] - first
                    stats = None
            if kernel and t_rows is not None:
                with _region("loss.teacher_stats"):
                    stats = teacher_stats(t)
            with _region("loss.rows"):
                if kernel:  # the three streaming passes of block_loss_rows; the gradient lands in z
                    tv_c, ce_c, kl_c, agree_c = block_loss_rows(z, t, y, a_tv, a_ce, a_kl, need_grad,
                                                                t_index=t_local, t_stats=stats)
                    g_c = z
                else:
                    tv_c, ce_c, kl_c, agree_c, g_c = block_loss_rows_reference(
                        z, t if t_local is None else t[t_local], y, a_tv, a_ce, a_kl, need_grad)
                del t
                put(tv, lo, hi, tv_c)
                put(ce, lo, hi, ce_c)
                put(agree, lo, hi, agree_c)
                part = (a_tv * tv_c).sum() + (a_ce * ce_c).sum()
                if use_kl:
                    part = part + (a_kl * kl_c).sum()
                loss += part
            if not need_grad:
                continue
            with _region("loss.gemm_grad"):
                g_c = g_c.to(cd)
                if joint:
                    gx = (g_c @ w_cat).float()
                    put(grad_h, lo, hi, gx[:, :h_dim])
                    put(grad_m, lo, hi, gx[:, h_dim:])
                    del gx
                else:
                    put(grad_h, lo, hi, g_c @ head_c)
                    put(grad_m, lo, hi, g_c @ w2_c)
                grad_w2 += (g_c.T @ m_c[lo:hi]).float()
                del g_c, z
        ctx.save_for_backward(grad_h, grad_m, grad_w2)
        ctx.input_dtypes = (hidden.dtype, markov_rows.dtype, markov_w2.dtype)
        ctx.mark_non_differentiable(tv, ce, agree)
        return loss, tv, ce, agree

    @staticmethod
    def backward(ctx, g_loss, _g_tv, _g_ce, _g_agree):
        grad_h, grad_m, grad_w2 = ctx.saved_tensors
        dh, dm, dw = ctx.input_dtypes
        out_h = (grad_h * g_loss).to(dh) if ctx.needs_input_grad[0] else None
        out_m = (grad_m * g_loss).to(dm) if ctx.needs_input_grad[1] else None
        out_w = (grad_w2 * g_loss).to(dw) if ctx.needs_input_grad[2] else None
        return out_h, out_m, out_w, None, None, None, None, None, None, None, None, None, None, None, None


def fused_block_loss(hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens, coef_tv, coef_ce,
                     coef_kl=None, compute_dtype=None, rows=None, kernel=None, teacher_index=None, joint=None,
                     teacher_groups=None):
    """:class:`FusedBlockLoss` (``compute_dtype`` default: the autocast dtype where autocast is on for the
    device, else the head's dtype; ``rows`` default: :func:`chunk_rows`; ``kernel``: the per-row passes in the
    Triton kernel :func:`block_loss_rows` or in torch ops -- default: the kernel on CUDA; ``teacher_index``:
    ``teacher_hidden`` holds one row per teacher position and row r reads row ``teacher_index[r]``; ``joint``:
    one GEMM each way for the draft logits, default: with ``teacher_index`` -- the module docstring's
    layouts; ``teacher_groups``: :class:`FusedBlockLoss`'s)."""
    if kernel is None:
        kernel = hidden.is_cuda
    if kernel and not triton_runs_on(hidden):
        raise ValueError("fused_block_loss: kernel=True needs CUDA or TRITON_INTERPRET=1")
    if teacher_index is not None and teacher_index.shape != (hidden.shape[0],):
        raise ValueError(f"fused_block_loss: teacher_index must be [{hidden.shape[0]}], got "
                         f"{tuple(teacher_index.shape)}")
    if teacher_groups is not None:
        if teacher_index is None or len(teacher_groups) != 2 or min(teacher_groups) < 1 \
                or hidden.shape[0] % teacher_groups[0]:
            raise ValueError(f"fused_block_loss: teacher_groups (G, W) needs teacher_index and rows in whole groups "
                             f"of G, got {teacher_groups} for {hidden.shape[0]} rows")
        teacher_groups = (int(teacher_groups[0]), int(teacher_groups[1]))
    if teacher_index is None and teacher_hidden.shape[0] != hidden.shape[0]:
        raise ValueError("fused_block_loss: teacher_hidden has a row per block row unless teacher_index is given")
    if joint is None:
        joint = teacher_index is not None
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else head.dtype)
    rows = rows or chunk_rows(head.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        return FusedBlockLoss.apply(hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens,
                                    coef_tv.float(), coef_ce.float(),
                                    None if coef_kl is None else coef_kl.float(), compute_dtype, rows,
                                    bool(kernel), None if teacher_index is None else teacher_index.long(),
                                    bool(joint), teacher_groups)


def eager_block_loss(hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens, coef_tv, coef_ce,
                     coef_kl=None, teacher_index=None):
    """The eager twin of :func:`fused_block_loss` (autograd through full ``[N, V]`` tensors): the objective as
    the trainer computed it before."""
    if teacher_index is not None:
        teacher_hidden = teacher_hidden[teacher_index]
    logits = (F.linear(hidden, head) + F.linear(markov_rows, markov_w2)).float()
    teacher = F.linear(teacher_hidden.to(head.dtype), head).float()
    p_log = torch.log_softmax(teacher, -1)
    q_log = torch.log_softmax(logits, -1)
    p, q = p_log.exp(), q_log.exp()
    tv = 0.5 * (q - p).abs().sum(-1)
    ce = -q_log.gather(-1, next_tokens[:, None]).squeeze(-1)
    loss = (coef_tv * tv).sum() + (coef_ce * ce).sum()
    if coef_kl is not None:
        loss = loss + (coef_kl * (p * (p_log - q_log)).sum(-1)).sum()
    agree = logits.argmax(-1) == teacher.argmax(-1)
    return loss, tv.detach(), ce.detach(), agree
