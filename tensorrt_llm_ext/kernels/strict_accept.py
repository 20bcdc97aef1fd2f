"""Strict (greedy-match) acceptance of a step's drafts: one launch, beside its eager twin.

Semantics: a generation request with drafts ``d[0..K-1]`` and target tokens ``t[0..K]`` accepts
``1 + (leading k with d[k] == t[k])`` tokens, ``t[0..n-1]``; a context request accepts its one sampled
token. A forced acceptance override never exceeds the request's verify length. The eager twin is the
chain a stock one-model worker runs. CUDA-graph safe with ``out=`` and uniform width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import (
    INT_DTYPES,
    check_contiguous,
    check_devices,
    check_int,
    check_tensor,
    is_capturing,
    refuse_allocation_while_capturing,
)
from tensorrt_llm_ext.logger import info_once


@triton.jit(do_not_specialize=["num_rows", "num_contexts", "force_value"])
def _strict_accept_kernel(
    draft_ptr, target_ptr, force_ptr, accepted_ptr, num_acc_ptr,
    num_rows, num_contexts, force_value, stride_d, stride_t, stride_a,
    K: tl.constexpr, FLAT_TARGET: tl.constexpr, FORCE_MODE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    is_ctx = rows < num_contexts
    rows64 = rows.to(tl.int64)
    gen64 = rows64 - num_contexts  # negative (and never dereferenced) for context rows
    r2 = rows64[:, None]
    g2 = gen64[:, None]
    c2 = cols[None, :]
    ctx2 = is_ctx[:, None]
    # A context row verified one token (its sampled token, column 0); a generation row K+1.
    t_mask = row_ok[:, None] & (c2 < K + 1) & ((c2 == 0) | ~ctx2)
    if FLAT_TARGET:
        t_off = tl.where(ctx2, r2, num_contexts + g2 * (K + 1) + c2)
    else:
        t_off = r2 * stride_t + c2
    t = tl.load(target_ptr + t_off, mask=t_mask, other=0).to(tl.int64)
    d_mask = row_ok[:, None] & ~ctx2 & (c2 < K)
    d = tl.load(draft_ptr + g2 * stride_d + c2, mask=d_mask, other=0).to(tl.int64)
    # 1 + number of leading matches == 1 + index of the first mismatch (K when all match).
    first_miss = tl.min(tl.where(d_mask & (d != t), c2, K), axis=1)
    n = first_miss + 1
    if FORCE_MODE == 1:
        n = tl.zeros_like(n) + tl.minimum(tl.maximum(force_value, 1), K + 1)
    elif FORCE_MODE == 2:
        f = tl.load(force_ptr + rows64, mask=row_ok, other=1).to(tl.int32)
        n = tl.minimum(tl.maximum(f, 1), K + 1)
    n = tl.where(is_ctx, 1, n)
    a_mask = row_ok[:, None] & (c2 < K + 1)
    tl.store(accepted_ptr + r2 * stride_a + c2, t.to(accepted_ptr.dtype.element_ty), mask=a_mask)
    tl.store(num_acc_ptr + rows64, n.to(tl.int32), mask=row_ok)


def _strict_accept_shapes(draft_tokens, target_tokens, num_contexts):
    check_tensor("draft_tokens", draft_tokens, shape=(None, None), dtype=INT_DTYPES)
    check_tensor("target_tokens", target_tokens, dtype=INT_DTYPES)
    check_int("num_contexts", num_contexts, lo=0)
    g, k = draft_tokens.shape
    b = num_contexts + g
    if target_tokens.dim() == 2:
        check_tensor("target_tokens [num_contexts + G, K+1]", target_tokens, shape=(b, k + 1))
        flat = False
    elif target_tokens.dim() == 1:
        flat = True
    else:
        raise ValueError(f"target_tokens: expected [B, K+1] or flat, got shape {list(target_tokens.shape)}")
    check_devices(draft_tokens.device, target_tokens=target_tokens)
    return b, k, flat


def _force_arg(forced_num_accepted, b: int, device):
    if forced_num_accepted is None:
        return None
    if not isinstance(forced_num_accepted, torch.Tensor):
        # an int counts accepted tokens (>= 1); anything else (a bool too) is refused by check_int
        return check_int("forced_num_accepted (an int or a [B] tensor)", forced_num_accepted, lo=1)
    check_tensor("forced_num_accepted", forced_num_accepted, shape=(b,), dtype=INT_DTYPES)
    check_devices(device, forced_num_accepted=forced_num_accepted)
    check_contiguous(forced_num_accepted=forced_num_accepted)
    return forced_num_accepted


def strict_accept(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    num_contexts: int,
    *,
    forced_num_accepted: int | torch.Tensor | None = None,
    verify_lens: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict (greedy-match) acceptance of a step's drafts, one launch for uniform width.

    Args:
        draft_tokens: ``[G, K]`` int32/int64, drafts of the G generation requests.
        target_tokens: the target's tokens at the verified positions, either ``[B, K+1]`` (B =
            ``num_contexts + G``; a context row's sampled token is column 0, its other columns are
            ignored) or flat ``[num_contexts + G*(K+1)]`` (one token per context, then K+1 per
            generation request). With ``verify_lens`` the flat layout is ``[sum(verify)]``.
        num_contexts: context requests occupy the first rows.
        forced_num_accepted: optional override of the accepted count of every generation request
            (an int >= 1 or a ``[B]`` int tensor whose context entries are ignored); it never exceeds
            the request's verify length (K+1, or ``verify_lens``); tensor values below 1 count as 1.
        verify_lens: optional ``[B]`` int, tokens verified per request (ragged drafts: request i drafted
            ``verify_lens[i] - 1 <= K`` tokens, ``draft_tokens[i, :verify_lens[i]-1]``); context
            entries are ignored (a context verifies one). Ragged verification runs the eager chain.
        out: optional ``(accepted_tokens [B, K+1] int32/int64 with unit last stride (rows may be
            strided), num_accepted [B] int32 contiguous)``; int32 ``accepted_tokens`` holds ids below 2^31
            only.

    Returns:
        ``accepted_tokens [B, K+1]`` (int64 unless ``out`` says otherwise): a generation row's verified target tokens (the first
        ``num_accepted`` are the accepted ones), a context row ``[t, 0, ..., 0]``, zeros past a ragged
        row's verify length; ``num_accepted [B]`` int32: 1 for a context, otherwise
        ``1 + (leading k with d[k] == t[k])`` or the capped forced count.

    CUDA-graph safe with ``out=`` and uniform width (the ragged path is eager, with host checks).
    """
    b, k, flat = _strict_accept_shapes(draft_tokens, target_tokens, num_contexts)
    device = draft_tokens.device
    if flat and verify_lens is None:
        _check_flat_len(target_tokens, num_contexts, b - num_contexts, k)
    force = _force_arg(forced_num_accepted, b, device)
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
    if verify_lens is not None:
        info_once("strict_accept: ragged verification (verify_lens given) runs the eager chain",
                  key="strict_accept_ragged")
        ref_acc, ref_n = strict_accept_reference(draft_tokens, target_tokens, num_contexts,
                                                 forced_num_accepted=force, verify_lens=verify_lens)
        accepted.copy_(ref_acc)
        num_acc.copy_(ref_n)
        return accepted, num_acc
    if b == 0:
        return accepted, num_acc
    if draft_tokens.stride(-1) != 1 or target_tokens.stride(-1) != 1 or accepted.stride(-1) != 1:
        raise ValueError("strict_accept expects a contiguous last dimension on draft/target/accepted")
    if isinstance(force, torch.Tensor):
        mode, force_ptr, force_value = 2, force, 0
    elif isinstance(force, int):
        mode, force_ptr, force_value = 1, num_acc, min(force, k + 1)
    else:
        mode, force_ptr, force_value = 0, num_acc, 0
    block_k = triton.next_power_of_2(k + 1)
    block_b = max(1, min(64, 4096 // block_k))
    _strict_accept_kernel[(triton.cdiv(b, block_b),)](
        draft_tokens, target_tokens, force_ptr, accepted, num_acc,
        b, num_contexts, force_value, draft_tokens.stride(0), target_tokens.stride(0), accepted.stride(0),
        K=k, FLAT_TARGET=flat, FORCE_MODE=mode, BLOCK_B=block_b, BLOCK_K=block_k,
    )
    return accepted, num_acc


def strict_accept_reference(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    num_contexts: int,
    *,
    forced_num_accepted: int | torch.Tensor | None = None,
    verify_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`strict_accept` (also its ragged path); same arguments and results.

    The uniform-width branch is the chain a stock one-model worker runs (capturable); the ragged
    branch checks ``verify_lens`` values on the host (it syncs unless capturing).
    """
    b, k, flat = _strict_accept_shapes(draft_tokens, target_tokens, num_contexts)
    g = b - num_contexts
    device = draft_tokens.device
    force = _force_arg(forced_num_accepted, b, device)
    if verify_lens is None:
        if flat:
            _check_flat_len(target_tokens, num_contexts, g, k)
            ctx_t, gen_t = target_tokens[:num_contexts], target_tokens[num_contexts:].view(g, k + 1)
        else:
            ctx_t, gen_t = target_tokens[:num_contexts, 0], target_tokens[num_contexts:]
        accepted = torch.zeros((b, k + 1), dtype=torch.int64, device=device)
        accepted[:num_contexts, 0] = ctx_t
        accepted[num_contexts:] = gen_t
        num_acc = torch.ones((b,), dtype=torch.int32, device=device)
        num_acc[num_contexts:] += torch.cumprod((draft_tokens == gen_t[:, :k]).int(), dim=-1).sum(-1).int()
        if isinstance(force, int):
            num_acc[num_contexts:] = min(force, k + 1)
        elif force is not None:
            num_acc[num_contexts:] = force[num_contexts:].clamp(1, k + 1)
        return accepted, num_acc

    cols = torch.arange(k + 1, device=device)
    check_tensor("verify_lens", verify_lens, shape=(b,), dtype=INT_DTYPES)
    check_devices(device, verify_lens=verify_lens)
    verify = verify_lens.to(torch.int64).clone()
    verify[:num_contexts] = 1
    if not is_capturing():
        if g > 0 and bool(((verify[num_contexts:] < 1) | (verify[num_contexts:] > k + 1)).any()):
            raise ValueError(f"verify_lens of generation requests must lie in [1, K+1] = [1, {k + 1}], "
                             f"got {verify[num_contexts:].tolist()}")
        if flat and target_tokens.shape[0] != int(verify.sum()):
            raise ValueError(f"flat target_tokens must hold sum(verify_lens) = {int(verify.sum())} tokens "
                             f"(one per context), got {target_tokens.shape[0]}")
    valid = cols[None, :] < verify[:, None]
    if flat:
        starts = torch.cumsum(verify, 0) - verify
        idx = (starts[:, None] + cols[None, :]).clamp(max=max(target_tokens.shape[0] - 1, 0))
        gathered = target_tokens[idx] if target_tokens.shape[0] else torch.zeros_like(idx)
    else:
        gathered = target_tokens
    accepted = torch.where(valid, gathered, torch.zeros_like(gathered)).to(torch.int64)
    gen_t = gathered[num_contexts:, :k]
    match = (draft_tokens == gen_t) & valid[num_contexts:, 1:]
    num_acc = torch.ones((b,), dtype=torch.int32, device=device)
    num_acc[num_contexts:] += torch.cumprod(match.int(), dim=-1).sum(-1).int()
    if isinstance(force, int):
        num_acc[num_contexts:] = verify[num_contexts:].clamp(max=force).int()
    elif force is not None:
        num_acc[num_contexts:] = torch.minimum(force[num_contexts:].to(torch.int64).clamp(min=1),
                                               verify[num_contexts:]).int()
    return accepted, num_acc


def _check_flat_len(target_tokens, num_contexts, g, k):
    check_tensor("flat target_tokens [num_contexts + G*(K+1)]", target_tokens, shape=(num_contexts + g * (k + 1),))

