"""Strict (greedy-match) acceptance of a step's drafts: one launch, beside its eager twin.

Semantics: a generation request with drafts ``d[0..K-1]`` and target tokens ``t[0..K]`` accepts
``1 + (leading k with d[k] == t[k])`` tokens, ``t[0..n-1]``, so it never exceeds the K+1 the target
verified. Every row is a generation request: the engine prefills a context apart, and the prefill's
sampled token is that request's one accepted token. The eager twin is the chain a stock one-model worker
runs. CUDA-graph safe with ``out=``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import INT_DTYPES, check_devices, check_tensor, refuse_allocation_while_capturing


@triton.jit(do_not_specialize=["num_rows"])
def _strict_accept_kernel(
    draft_ptr, target_ptr, accepted_ptr, num_acc_ptr,
    num_rows, stride_d, stride_t, stride_a,
    K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    r2 = rows.to(tl.int64)[:, None]
    c2 = cols[None, :]
    t_mask = row_ok[:, None] & (c2 < K + 1)
    t = tl.load(target_ptr + r2 * stride_t + c2, mask=t_mask, other=0).to(tl.int64)
    d_mask = row_ok[:, None] & (c2 < K)
    d = tl.load(draft_ptr + r2 * stride_d + c2, mask=d_mask, other=0).to(tl.int64)
    # 1 + number of leading matches == 1 + index of the first mismatch (K when all match).
    n = tl.min(tl.where(d_mask & (d != t), c2, K), axis=1) + 1
    tl.store(accepted_ptr + r2 * stride_a + c2, t.to(accepted_ptr.dtype.element_ty), mask=t_mask)
    tl.store(num_acc_ptr + rows.to(tl.int64), n.to(tl.int32), mask=row_ok)


def _strict_accept_shapes(draft_tokens, target_tokens):
    check_tensor("draft_tokens [B, K]", draft_tokens, shape=(None, None), dtype=INT_DTYPES)
    b, k = draft_tokens.shape
    check_tensor("target_tokens [B, K+1]", target_tokens, shape=(b, k + 1), dtype=INT_DTYPES)
    check_devices(draft_tokens.device, target_tokens=target_tokens)
    return b, k


def strict_accept(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict (greedy-match) acceptance of a step's drafts, one launch.

    Args:
        draft_tokens: ``[B, K]`` int32/int64, the drafts of the step's B requests (rows may be strided).
        target_tokens: ``[B, K+1]`` int32/int64, the target's tokens at the verified positions.
        out: optional ``(accepted_tokens [B, K+1] int32/int64 with unit last stride (rows may be
            strided), num_accepted [B] int32 contiguous)``; int32 ``accepted_tokens`` holds ids below 2^31
            only.

    Returns:
        ``accepted_tokens [B, K+1]`` (int64 unless ``out`` says otherwise): the verified target tokens (the
        first ``num_accepted`` are the accepted ones); ``num_accepted [B]`` int32:
        ``1 + (leading k with d[k] == t[k])``.
    """
    b, k = _strict_accept_shapes(draft_tokens, target_tokens)
    # The kernel reads a row's tokens at ptr + column: rows may be strided, columns may not.
    check_tensor("draft_tokens", draft_tokens, unit_last_stride=True)
    check_tensor("target_tokens", target_tokens, unit_last_stride=True)
    device = draft_tokens.device
    if out is None:
        refuse_allocation_while_capturing("strict_accept")
        # int64 ids by default: selection serves vocabularies up to 2^32 - 1, an int32 id would wrap.
        out = (torch.empty((b, k + 1), dtype=torch.int64, device=device),
               torch.empty((b,), dtype=torch.int32, device=device))
    if not isinstance(out, tuple) or len(out) != 2:
        raise ValueError(f"out: expected a tuple (accepted_tokens, num_accepted), got {type(out).__name__}")
    accepted, num_acc = out
    check_tensor("accepted_tokens (out)", accepted, shape=(b, k + 1), dtype=INT_DTYPES, unit_last_stride=True)
    # The kernel writes num_accepted[i] at element i: a strided view would be written as if dense.
    check_tensor("num_accepted (out)", num_acc, shape=(b,), dtype=torch.int32, contiguous=True)
    check_devices(device, accepted_tokens=accepted, num_accepted=num_acc)
    if b == 0:
        return accepted, num_acc
    block_k = triton.next_power_of_2(k + 1)
    block_b = max(1, min(64, 4096 // block_k))
    _strict_accept_kernel[(triton.cdiv(b, block_b),)](
        draft_tokens, target_tokens, accepted, num_acc,
        b, draft_tokens.stride(0), target_tokens.stride(0), accepted.stride(0),
        K=k, BLOCK_B=block_b, BLOCK_K=block_k,
    )
    return accepted, num_acc


def strict_accept_reference(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`strict_accept`, same arguments and results: the compare + cumprod + sum chain
    a stock one-model worker runs (capturable)."""
    b, k = _strict_accept_shapes(draft_tokens, target_tokens)
    device = draft_tokens.device
    accepted = torch.zeros((b, k + 1), dtype=torch.int64, device=device)
    accepted[:] = target_tokens
    num_acc = torch.ones((b,), dtype=torch.int32, device=device)
    num_acc += torch.cumprod((draft_tokens == target_tokens[:, :k]).int(), dim=-1).sum(-1).int()
    return accepted, num_acc
