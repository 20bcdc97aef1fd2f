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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensorrt_llm_ext.kernels.block_loss import block_loss_rows, block_loss_rows_reference
from tensorrt_llm_ext.kernels.common import triton_runs_on

# Rows per chunk: about 2**28 fp32 elements of [rows, V] per temporary (1 GiB; SmolLM2: 5,461 rows).
CHUNK_ELEMENTS = 2**28


def chunk_rows(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, elements // max(vocab, 1))


class FusedBlockLoss(torch.autograd.Function):
    """``loss = Σ_r coef_tv[r] TV_r + coef_ce[r] CE_r + coef_kl[r] KL_r`` and the per-row ``tv``, ``ce`` and
    top-1 agreement (detached).

    Args (forward):
        hidden: ``[N, H]`` block hidden states (differentiable).
        markov_rows: ``[N, r]`` ``W1[prev]`` (differentiable).
        markov_w2: ``[V, r]`` (differentiable).
        head: ``[V, H]`` the target's LM head (frozen).
        teacher_hidden: ``[N, H]`` the target's final hidden state at each row's teacher position.
        next_tokens: ``[N]`` int64, the sequence's next token (CE's label).
        coef_tv, coef_ce, coef_kl: ``[N]`` fp32 (0 on a row that does not count); ``coef_kl`` None: no KL term.
        compute_dtype: the matrix products' dtype.
        rows: rows per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens, coef_tv, coef_ce, coef_kl,
                compute_dtype, rows, kernel):
        n = hidden.shape[0]
        dev = hidden.device
        cd = compute_dtype
        head_c, w2_c = head.detach().to(cd), markov_w2.detach().to(cd)
        h_c, m_c, t_c = hidden.detach().to(cd), markov_rows.detach().to(cd), teacher_hidden.detach().to(cd)
        need_grad = any(ctx.needs_input_grad[:3])
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=dev) if need_grad else None
        grad_m = torch.empty(markov_rows.shape, dtype=torch.float32, device=dev) if need_grad else None
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=dev) if need_grad else None
        tv = torch.empty(n, dtype=torch.float32, device=dev)
        ce = torch.empty(n, dtype=torch.float32, device=dev)
        agree = torch.empty(n, dtype=torch.bool, device=dev)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        use_kl = coef_kl is not None
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            y = next_tokens[lo:hi]
            a_tv, a_ce = coef_tv[lo:hi], coef_ce[lo:hi]
            a_kl = coef_kl[lo:hi] if use_kl else None
            z = torch.addmm(h_c[lo:hi] @ head_c.T, m_c[lo:hi], w2_c.T)  # [c, V] in cd: one rounding of the sum
            t = t_c[lo:hi] @ head_c.T
            if kernel:  # the three streaming passes of block_loss_rows; the gradient lands in z
                tv_c, ce_c, kl_c, agree[lo:hi] = block_loss_rows(z, t, y, a_tv, a_ce, a_kl, need_grad)
                g_c = z
            else:
                tv_c, ce_c, kl_c, agree[lo:hi], g_c = block_loss_rows_reference(z, t, y, a_tv, a_ce, a_kl,
                                                                                 need_grad)
            del t
            tv[lo:hi], ce[lo:hi] = tv_c, ce_c
            part = (a_tv * tv_c).sum() + (a_ce * ce_c).sum()
            if use_kl:
                part = part + (a_kl * kl_c).sum()
            loss += part
            if not need_grad:
                continue
            g_c = g_c.to(cd)
            grad_h[lo:hi] = g_c @ head_c
            grad_m[lo:hi] = g_c @ w2_c
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
        return out_h, out_m, out_w, None, None, None, None, None, None, None, None, None


def fused_block_loss(hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens, coef_tv, coef_ce,
                     coef_kl=None, compute_dtype=None, rows=None, kernel=None):
    """:class:`FusedBlockLoss` (``compute_dtype`` default: the autocast dtype where autocast is on for the
    device, else the head's dtype; ``rows`` default: :func:`chunk_rows`; ``kernel``: the per-row passes in the
    Triton kernel :func:`block_loss_rows` or in torch ops -- default: the kernel on CUDA)."""
    if kernel is None:
        kernel = hidden.is_cuda
    if kernel and not triton_runs_on(hidden):
        raise ValueError("fused_block_loss: kernel=True needs CUDA or TRITON_INTERPRET=1")
    if compute_dtype is None:
        dev = hidden.device.type
        compute_dtype = (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else head.dtype)
    rows = rows or chunk_rows(head.shape[0])
    with torch.autocast(hidden.device.type, enabled=False):
        return FusedBlockLoss.apply(hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens,
                                    coef_tv.float(), coef_ce.float(),
                                    None if coef_kl is None else coef_kl.float(), compute_dtype, rows,
                                    bool(kernel))


def eager_block_loss(hidden, markov_rows, markov_w2, head, teacher_hidden, next_tokens, coef_tv, coef_ce,
                     coef_kl=None):
    """The eager twin of :func:`fused_block_loss` (autograd through full ``[N, V]`` tensors): the objective as
    the trainer computed it before."""
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
