"""Fused spec-tail kernels: strict acceptance, block-table decode, paged-latent drafter bookkeeping.

Around the target's verification and the drafter's forward, a one-model worker runs chains of small
eager ops every step. Each op here replaces one such chain with one launch and the same values. Every
fused op sits beside its eager twin (``x_reference``), written as the torch chain a stock worker runs;
the pair agree bit for bit (tests hold them to it).

Shape letters: B rows of the step (``num_contexts`` context requests first, then G generation
requests), K draft length, L drafter layers, d_c latent width.

CUDA graphs: every launcher takes ``out=`` buffers; given them it allocates nothing, reads no device
value on the host and branches only on shapes and host ints, so it may be captured. Without ``out=``
while a graph is capturing it raises ``ValueError``. Per-step ints are ``do_not_specialize``.

Paged-latent semantics follow :mod:`tensorrt_llm_ext.speculative.contract` (module docstring); the
choices that docstring leaves open are fixed in :func:`paged_latent_step`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.common import is_capturing
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.speculative.contract import DraftBlockPlacement

_INT_DTYPES = (torch.int32, torch.int64)


def _need_out(name: str) -> None:
    if is_capturing():
        raise ValueError(f"{name}: pass out= buffers while a CUDA graph is capturing (no allocation there)")


def _check_int(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes=_INT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def _check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (shape {list(t.shape)}, stride {list(t.stride())})")


# ====================================================================================================
# 1. Strict acceptance
# ====================================================================================================
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
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [G, K], got {getattr(draft_tokens, 'shape', draft_tokens)}")
    if draft_tokens.dtype not in _INT_DTYPES or target_tokens.dtype not in _INT_DTYPES:
        raise ValueError(f"draft/target tokens must have dtype int32 or int64, got {draft_tokens.dtype}, {target_tokens.dtype}")
    if not isinstance(num_contexts, int) or num_contexts < 0:
        raise ValueError(f"num_contexts must be an int >= 0, got {num_contexts!r}")
    g, k = draft_tokens.shape
    b = num_contexts + g
    if target_tokens.dim() == 2:
        if tuple(target_tokens.shape) != (b, k + 1):
            raise ValueError(f"target_tokens must be [num_contexts + G, K+1] = [{b}, {k + 1}], "
                             f"got {list(target_tokens.shape)}")
        flat = False
    elif target_tokens.dim() == 1:
        flat = True
    else:
        raise ValueError(f"target_tokens must be [B, K+1] or flat, got {list(target_tokens.shape)}")
    _check_device(draft_tokens.device, target_tokens=target_tokens)
    return b, k, flat


def _force_arg(forced_num_accepted, b: int, device):
    if forced_num_accepted is None:
        return None
    if isinstance(forced_num_accepted, bool) or not isinstance(forced_num_accepted, (int, torch.Tensor)):
        raise ValueError(f"forced_num_accepted must be an int or a [B] tensor, got {type(forced_num_accepted).__name__}")
    if isinstance(forced_num_accepted, int):
        if forced_num_accepted < 1:
            raise ValueError(f"forced_num_accepted counts accepted tokens (>= 1), got {forced_num_accepted}")
        return forced_num_accepted
    _check_int("forced_num_accepted", forced_num_accepted, (b,))
    _check_device(device, forced_num_accepted=forced_num_accepted)
    _check_contiguous(forced_num_accepted=forced_num_accepted)
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
        out: optional ``(accepted_tokens [B, K+1] int32/int64, num_accepted [B] int32)``.

    Returns:
        ``accepted_tokens [B, K+1]``: a generation row's verified target tokens (the first
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
        _need_out("strict_accept")
        out = (torch.empty((b, k + 1), dtype=torch.int32, device=device),
               torch.empty((b,), dtype=torch.int32, device=device))
    accepted, num_acc = out
    _check_int("accepted_tokens (out)", accepted, (b, k + 1))
    _check_int("num_accepted (out)", num_acc, (b,), (torch.int32,))
    _check_device(device, accepted_tokens=accepted, num_accepted=num_acc)
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
        accepted = torch.zeros((b, k + 1), dtype=torch.int32, device=device)
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
    _check_int("verify_lens", verify_lens, (b,))
    _check_device(device, verify_lens=verify_lens)
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
    accepted = torch.where(valid, gathered, torch.zeros_like(gathered)).to(torch.int32)
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
    if target_tokens.shape[0] != num_contexts + g * (k + 1):
        raise ValueError(f"flat target_tokens must be [num_contexts + G*(K+1)] = [{num_contexts + g * (k + 1)}], "
                         f"got {list(target_tokens.shape)}")


# ====================================================================================================
# 2. Block-table decode
# ====================================================================================================
@triton.jit(do_not_specialize=["divisor"])
def _decode_block_table_kernel(
    src_ptr, dst_ptr, count_ptr, max_blocks, divisor, stride_s, stride_d, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, max_blocks, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < max_blocks
        # Load then store the same elements in one program: safe when dst aliases src.
        o = tl.load(src_ptr + row * stride_s + cols, mask=m, other=-1)
        count += (o >= 0).to(tl.int32)
        tl.store(dst_ptr + row * stride_d + cols, tl.maximum(o, 0) // divisor, mask=m)
    tl.store(count_ptr + row, tl.sum(count, axis=0))


def _decode_checks(encoded_offsets, divisor):
    if isinstance(divisor, bool) or not isinstance(divisor, int):
        raise ValueError(f"divisor must be a Python int, got {type(divisor).__name__}")
    if divisor <= 0 or divisor >= 2**31:
        raise ValueError(f"divisor must lie in [1, 2^31), got {divisor}")
    if not isinstance(encoded_offsets, torch.Tensor) or encoded_offsets.dim() != 2:
        raise ValueError(f"encoded_offsets must be [B, max_blocks], got {getattr(encoded_offsets, 'shape', None)}")
    if encoded_offsets.dtype != torch.int32:
        raise ValueError(f"encoded_offsets must be int32, got {encoded_offsets.dtype}")


def decode_block_table(
    encoded_offsets: torch.Tensor,
    divisor: int,
    out: torch.Tensor | None = None,
    *,
    num_blocks_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the KV manager's encoded block offsets into page ids, in one launch.

    ``table = max(o, 0) // divisor``; ``num_blocks[b] = count(o[b, :] >= 0)``. A negative entry means
    "unallocated" (it decodes to 0, a valid-looking id, so consumers must bound reads by
    ``num_blocks``). The count does not assume allocation is a prefix: it counts every non-negative
    entry (the KV manager allocates prefixes, where the count is the prefix length).

    Args:
        encoded_offsets: ``[B, max_blocks]`` int32, last dim contiguous.
        divisor: int >= 1 (offset units per block); otherwise ``ValueError``.
        out: optional ``[B, max_blocks]`` int32; may be ``encoded_offsets`` itself (in place).
        num_blocks_out: optional ``[B]`` int32.

    Returns:
        ``(table [B, max_blocks] int32, num_blocks [B] int32)``. CUDA-graph safe with both outputs given.
    """
    _decode_checks(encoded_offsets, divisor)
    b, max_blocks = encoded_offsets.shape
    device = encoded_offsets.device
    if out is None or num_blocks_out is None:
        _need_out("decode_block_table")
    if out is None:
        out = torch.empty_like(encoded_offsets)
    if num_blocks_out is None:
        num_blocks_out = torch.empty((b,), dtype=torch.int32, device=device)
    _check_int("out", out, (b, max_blocks), (torch.int32,))
    _check_int("num_blocks_out", num_blocks_out, (b,), (torch.int32,))
    _check_device(device, out=out, num_blocks_out=num_blocks_out)
    if encoded_offsets.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("decode_block_table expects a contiguous last dimension")
    if b == 0:
        return out, num_blocks_out
    block = max(16, min(1024, triton.next_power_of_2(max(max_blocks, 1))))
    _decode_block_table_kernel[(b,)](
        encoded_offsets, out, num_blocks_out, max_blocks, divisor,
        encoded_offsets.stride(0), out.stride(0), BLOCK=block, num_warps=max(1, min(8, block // 256)),
    )
    return out, num_blocks_out


def decode_block_table_reference(
    encoded_offsets: torch.Tensor, divisor: int, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`decode_block_table` (the count is taken before an in-place decode)."""
    _decode_checks(encoded_offsets, divisor)
    num_blocks = (encoded_offsets >= 0).sum(-1, dtype=torch.int32)
    decoded = torch.div(encoded_offsets.clamp(min=0), divisor, rounding_mode="floor")
    if out is None:
        return decoded.to(torch.int32), num_blocks
    out.copy_(decoded)
    return out, num_blocks


# ====================================================================================================
# 3. Paged single-latent drafter bookkeeping + context-latent store
# ====================================================================================================
@dataclass(frozen=True)
class PagedLatentStep:
    """Outputs of :func:`paged_latent_step` for the G generation requests of a step (preallocated).

    ``placement.positions`` are the block's query and RoPE positions; ``placement.ctx_lens`` is the
    advertised context length, ``placement.seq_lens`` its ``+ K`` (0 for a dummy slot).
    """

    bonus_tokens: torch.Tensor  # [G] int32, last accepted token = next anchor
    block_input_ids: torch.Tensor  # [G, K] int64, [anchor, MASK, ..., MASK]
    latent_pages: torch.Tensor  # [G, K+1] int32, physical page of accepted latent j (-1 where not written)
    latent_offsets: torch.Tensor  # [G, K+1] int32, slot in that page ((ctx_len + j) % page_size)
    latent_write_mask: torch.Tensor  # [G, K+1] bool, latent j is stored
    placement: DraftBlockPlacement  # [G, K] / [G] tensors: the block's own positions

    @property
    def positions(self) -> torch.Tensor:
        return self.placement.positions

    @property
    def advertised_ctx_lens(self) -> torch.Tensor:
        return self.placement.ctx_lens

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.placement.seq_lens

    @staticmethod
    def allocate(num_gen: int, draft_len: int, device: torch.device | str) -> "PagedLatentStep":
        """Preallocate (outside capture) the buffers for ``num_gen`` generation rows."""
        if num_gen < 0 or draft_len < 1:
            raise ValueError(f"need num_gen >= 0 and draft_len >= 1, got {num_gen}, {draft_len}")
        g, k = num_gen, draft_len

        def i32(*shape):
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return PagedLatentStep(
            bonus_tokens=i32(g),
            block_input_ids=torch.zeros((g, k), dtype=torch.int64, device=device),
            latent_pages=i32(g, k + 1),
            latent_offsets=i32(g, k + 1),
            latent_write_mask=torch.zeros((g, k + 1), dtype=torch.bool, device=device),
            placement=DraftBlockPlacement(positions=i32(g, k), page_ids=i32(g, k), page_offsets=i32(g, k),
                                          ctx_lens=i32(g), seq_lens=i32(g)),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        p = self.placement
        return dict(bonus_tokens=self.bonus_tokens, block_input_ids=self.block_input_ids,
                    latent_pages=self.latent_pages, latent_offsets=self.latent_offsets,
                    latent_write_mask=self.latent_write_mask, positions=p.positions, page_ids=p.page_ids,
                    page_offsets=p.page_offsets, ctx_lens=p.ctx_lens, seq_lens=p.seq_lens)


@triton.jit(do_not_specialize=["num_contexts", "max_ctx_len", "mask_token_id"])
def _paged_latent_step_kernel(
    accepted_ptr, num_acc_ptr, slot_ptr, dummy_ptr, ctx_lens_ptr, block_table_ptr,
    bonus_ptr, input_ids_ptr, positions_ptr, place_page_ptr, place_off_ptr, adv_ptr, seq_lens_ptr,
    lat_page_ptr, lat_off_ptr, lat_mask_ptr,
    num_contexts, page_size, max_ctx_len, mask_token_id, max_pages, stride_acc, stride_bt,
    K: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    row = g + num_contexts
    n = tl.load(num_acc_ptr + row).to(tl.int32)
    n = tl.minimum(tl.maximum(n, 1), K + 1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    dummy = tl.load(dummy_ptr + row) != 0
    # A dummy (CUDA-graph padding) row is computed as an empty request without pages.
    old = tl.where(dummy, 0, tl.maximum(tl.load(ctx_lens_ptr + slot), 0))
    new = tl.where(dummy, 0, old + n)
    tl.store(ctx_lens_ptr + slot, new)

    bt_row = block_table_ptr + slot * stride_bt
    count = tl.zeros([BLOCK_P], dtype=tl.int32)
    for start in range(0, max_pages, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        e = tl.load(bt_row + p, mask=(p < max_pages) & ~dummy, other=-1)
        count += (e >= 0).to(tl.int32)
    allocated = tl.sum(count, axis=0)
    adv = tl.minimum(tl.minimum(new, allocated * page_size - K), max_ctx_len)
    adv = tl.where(dummy, 0, tl.maximum(adv, 0))
    tl.store(adv_ptr + g, adv)
    tl.store(seq_lens_ptr + g, tl.where(dummy, 0, adv + K))
    bonus = tl.load(accepted_ptr + row * stride_acc + (n - 1))
    tl.store(bonus_ptr + g, bonus.to(tl.int32))

    j = tl.arange(0, BLOCK_J)
    # The draft block: RoPE positions continue the true context; its latents sit right after the
    # advertised context (equal unless capped), so [0, seq_len) is contiguous in the pages.
    km = j < K
    tl.store(positions_ptr + g * K + j, new + j, mask=km)
    ids = tl.where(j == 0, bonus.to(tl.int64), mask_token_id.to(tl.int64))
    tl.store(input_ids_ptr + g * K + j, ids, mask=km)
    spos = adv + j
    sidx = spos // page_size
    sok = km & ~dummy & (sidx < max_pages)
    spage = tl.load(bt_row + sidx, mask=sok, other=-1)
    spage = tl.where(sok & (spage >= 0), spage, -1)
    tl.store(place_page_ptr + g * K + j, spage, mask=km)
    tl.store(place_off_ptr + g * K + j, spos % page_size, mask=km)

    # Newly accepted context latents: latent j < n lives at position old + j.
    jm = j < K + 1
    lpos = old + j
    lidx = lpos // page_size
    lok = jm & (j < n) & ~dummy & (lidx < max_pages)
    lpage = tl.load(bt_row + lidx, mask=lok, other=-1)
    lok = lok & (lpage >= 0)
    tl.store(lat_page_ptr + g * (K + 1) + j, tl.where(lok, lpage, -1), mask=jm)
    tl.store(lat_off_ptr + g * (K + 1) + j, lpos % page_size, mask=jm)
    tl.store(lat_mask_ptr + g * (K + 1) + j, lok, mask=jm)


def _paged_checks(accepted_tokens, num_accepted, slot_ids, is_dummy, ctx_lens, block_table,
                  num_contexts, page_size, draft_len, max_ctx_len, mask_token_id):
    for name, v in dict(num_contexts=num_contexts, page_size=page_size, draft_len=draft_len,
                        max_ctx_len=max_ctx_len, mask_token_id=mask_token_id).items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be a Python int, got {type(v).__name__}")
    if draft_len < 1:
        raise ValueError(f"draft_len (K) must be >= 1, got {draft_len}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if num_contexts < 0 or max_ctx_len < 0 or mask_token_id < 0:
        raise ValueError(f"num_contexts, max_ctx_len and mask_token_id must be >= 0, "
                         f"got {num_contexts}, {max_ctx_len}, {mask_token_id}")
    if max_ctx_len >= 2**31 - 2 * draft_len:
        raise ValueError(f"max_ctx_len must be below 2^31 - 2K, got {max_ctx_len}")
    if not isinstance(accepted_tokens, torch.Tensor) or accepted_tokens.dim() != 2:
        raise ValueError(f"accepted_tokens must be [B, K+1], got {getattr(accepted_tokens, 'shape', None)}")
    b = accepted_tokens.shape[0]
    _check_int("accepted_tokens", accepted_tokens, (b, draft_len + 1))
    if num_contexts > b:
        raise ValueError(f"num_contexts ({num_contexts}) exceeds the step's rows ({b})")
    _check_int("num_accepted", num_accepted, (b,))
    _check_int("slot_ids", slot_ids, (b,))
    _check_int("is_dummy", is_dummy, (b,), (torch.bool,))
    if ctx_lens.dim() != 1:
        raise ValueError(f"ctx_lens must be [num_slots], got {list(ctx_lens.shape)}")
    _check_int("ctx_lens", ctx_lens, tuple(ctx_lens.shape), (torch.int32,))
    if block_table.dim() != 2 or block_table.shape[0] != ctx_lens.shape[0]:
        raise ValueError(f"block_table must be [num_slots={ctx_lens.shape[0]}, max_pages], got {list(block_table.shape)}")
    _check_int("block_table", block_table, tuple(block_table.shape), (torch.int32,))
    if block_table.shape[1] < 1:
        raise ValueError("block_table needs at least one page column")
    _check_device(accepted_tokens.device, num_accepted=num_accepted, slot_ids=slot_ids, is_dummy=is_dummy,
                  ctx_lens=ctx_lens, block_table=block_table)
    _check_contiguous(accepted_tokens=accepted_tokens, num_accepted=num_accepted, slot_ids=slot_ids,
                      is_dummy=is_dummy, ctx_lens=ctx_lens)
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must have a contiguous last dimension")
    return b - num_contexts


def paged_latent_step(
    accepted_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    slot_ids: torch.Tensor,
    is_dummy: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_contexts: int,
    page_size: int,
    draft_len: int,
    max_ctx_len: int,
    mask_token_id: int,
    out: PagedLatentStep | None = None,
) -> PagedLatentStep:
    """Per-request bookkeeping of a paged single-latent drafter for the generation rows, one launch.

    Rows ``num_contexts .. B-1`` of the step are generation requests (row ``g`` of every output is
    step row ``num_contexts + g``); context rows are skipped. For generation row with slot ``s``,
    ``n = clamp(num_accepted, 1, K+1)``, ``c = max(ctx_lens[s], 0)``:

    * latent ``j`` (``j = 0..K``): position ``c + j``; ``latent_offsets = (c + j) % page_size``;
      written iff ``j < n`` and page ``(c + j) // page_size`` is allocated (inside the table and its
      entry ``>= 0``), then ``latent_pages`` is that entry, else ``-1`` and the mask is False.
      A latent whose page is unallocated is never written (the context outran its pages).
    * ``ctx_lens[s] = c + n`` (in place): the true anchor position, never capped.
    * ``bonus_tokens = accepted_tokens[row, n-1]``; ``block_input_ids = [bonus, mask_token_id * (K-1)]``.
    * advertised ``A = max(0, min(c + n, P * page_size - K, max_ctx_len))`` where ``P`` counts the
      slot's block-table entries ``>= 0`` (allocation is a prefix in practice; holes are still never
      written): the context the block may attend, leaving room for the block's K latents in the
      allocated pages. ``seq_lens = A + K``.
    * placement: ``positions = c + n + k`` (query and RoPE positions, ``k = 0..K-1``); the block's own
      latents go to storage slot ``A + k``: ``page_offsets = (A + k) % page_size``, ``page_ids`` the
      table entry of page ``(A + k) // page_size`` or ``-1`` if unallocated (consumers skip ``-1``).
    * a dummy row (``is_dummy``, CUDA-graph padding): ``ctx_lens[s] = 0`` (emptied, never advanced),
      computed as ``c = 0`` with no pages: nothing to write (mask False, pages ``-1``), ``A = 0``,
      ``seq_lens = 0``, positions ``0..K-1``.

    Preconditions (not checkable without a device sync): slot ids lie in ``[0, num_slots)``; a real
    row's slot is used by no other row of the step (dummies may share one slot). Values are written
    only to ``ctx_lens`` at the step's slots and to ``out``.

    Args:
        accepted_tokens: ``[B, K+1]`` int32/int64 (from :func:`strict_accept`).
        num_accepted: ``[B]`` int32/int64. slot_ids: ``[B]`` int32/int64. is_dummy: ``[B]`` bool.
        ctx_lens: ``[num_slots]`` int32, advanced in place. block_table: ``[num_slots, max_pages]``
            int32 physical page ids, ``< 0`` where unallocated.
        out: a :class:`PagedLatentStep` for G rows (from ``PagedLatentStep.allocate``).

    CUDA-graph safe with ``out=``.
    """
    g = _paged_checks(accepted_tokens, num_accepted, slot_ids, is_dummy, ctx_lens, block_table,
                      num_contexts, page_size, draft_len, max_ctx_len, mask_token_id)
    k = draft_len
    device = accepted_tokens.device
    if out is None:
        _need_out("paged_latent_step")
        out = PagedLatentStep.allocate(g, k, device)
    _check_step_out(out, g, k, device)
    if g == 0:
        return out
    p = out.placement
    max_pages = block_table.shape[1]
    _paged_latent_step_kernel[(g,)](
        accepted_tokens, num_accepted, slot_ids, is_dummy, ctx_lens, block_table,
        out.bonus_tokens, out.block_input_ids, p.positions, p.page_ids, p.page_offsets, p.ctx_lens, p.seq_lens,
        out.latent_pages, out.latent_offsets, out.latent_write_mask,
        num_contexts, page_size, max_ctx_len, mask_token_id, max_pages,
        accepted_tokens.stride(0), block_table.stride(0),
        K=k, BLOCK_J=triton.next_power_of_2(k + 1), BLOCK_P=max(16, min(1024, triton.next_power_of_2(max_pages))),
        num_warps=1,  # a few dozen scalars per request: latency, not width
    )
    return out


def _check_step_out(out: PagedLatentStep, g: int, k: int, device) -> None:
    if not isinstance(out, PagedLatentStep):
        raise ValueError(f"out must be a PagedLatentStep, got {type(out).__name__}")
    expect = dict(bonus_tokens=((g,), torch.int32), block_input_ids=((g, k), torch.int64),
                  latent_pages=((g, k + 1), torch.int32), latent_offsets=((g, k + 1), torch.int32),
                  latent_write_mask=((g, k + 1), torch.bool), positions=((g, k), torch.int32),
                  page_ids=((g, k), torch.int32), page_offsets=((g, k), torch.int32),
                  ctx_lens=((g,), torch.int32), seq_lens=((g,), torch.int32))
    for name, t in out.tensors().items():
        shape, dtype = expect[name]
        _check_int(f"out.{name}", t, shape, (dtype,))
        _check_device(device, **{f"out.{name}": t})
        _check_contiguous(**{f"out.{name}": t})


def _page_lookup(block_table, slots, pos, page_size, valid):
    """Physical page of ``pos`` in each slot's table (-1 where invalid or unallocated)."""
    max_pages = block_table.shape[1]
    pidx = torch.div(pos, page_size, rounding_mode="floor")
    ok = valid & (pidx < max_pages)
    page = block_table[slots[:, None], pidx.clamp(max=max_pages - 1)]
    ok = ok & (page >= 0)
    return torch.where(ok, page, torch.full_like(page, -1)), (pos % page_size).to(torch.int32), ok


def paged_latent_step_reference(
    accepted_tokens, num_accepted, slot_ids, is_dummy, ctx_lens, block_table, *,
    num_contexts: int, page_size: int, draft_len: int, max_ctx_len: int, mask_token_id: int,
) -> PagedLatentStep:
    """Eager twin of :func:`paged_latent_step` (advances ``ctx_lens`` in place the same way)."""
    g = _paged_checks(accepted_tokens, num_accepted, slot_ids, is_dummy, ctx_lens, block_table,
                      num_contexts, page_size, draft_len, max_ctx_len, mask_token_id)
    k = draft_len
    device = accepted_tokens.device
    acc = accepted_tokens[num_contexts:]
    n = num_accepted[num_contexts:].to(torch.int64).clamp(1, k + 1)
    slots = slot_ids[num_contexts:].to(torch.int64)
    dummy = is_dummy[num_contexts:]
    zero = torch.zeros((g,), dtype=torch.int64, device=device)
    old = torch.where(dummy, zero, ctx_lens[slots].to(torch.int64).clamp(min=0))
    new = torch.where(dummy, zero, old + n)
    ctx_lens[slots] = new.to(torch.int32)
    allocated = (block_table[slots] >= 0).sum(-1)
    adv = torch.minimum(torch.minimum(new, allocated * page_size - k), torch.full_like(new, max_ctx_len))
    adv = torch.where(dummy, zero, adv.clamp(min=0))
    seq = torch.where(dummy, zero, adv + k)
    bonus = acc.gather(1, (n - 1)[:, None]).squeeze(1)
    ks = torch.arange(k, device=device)
    ids = torch.full((g, k), mask_token_id, dtype=torch.int64, device=device)
    ids[:, 0] = bonus
    live = ~dummy[:, None]
    sp, so, _ = _page_lookup(block_table, slots, adv[:, None] + ks, page_size, live)
    js = torch.arange(k + 1, device=device)
    lp, lo, lm = _page_lookup(block_table, slots, old[:, None] + js, page_size, live & (js[None, :] < n[:, None]))
    placement = DraftBlockPlacement(positions=(new[:, None] + ks).to(torch.int32), page_ids=sp.to(torch.int32),
                                    page_offsets=so, ctx_lens=adv.to(torch.int32), seq_lens=seq.to(torch.int32))
    return PagedLatentStep(bonus_tokens=bonus.to(torch.int32), block_input_ids=ids, latent_pages=lp.to(torch.int32),
                           latent_offsets=lo, latent_write_mask=lm, placement=placement)


@triton.jit
def _store_context_latents_kernel(
    lat_ptr, page_ptr, off_ptr, mask_ptr, pool_ptr,
    num_pages, page_size, d_c, stride_ln, stride_ll, stride_pl, stride_pp, stride_ps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    page = tl.load(page_ptr + row).to(tl.int64)
    off = tl.load(off_ptr + row).to(tl.int64)
    ok = (tl.load(mask_ptr + row) != 0) & (page >= 0) & (page < num_pages) & (off >= 0) & (off < page_size)
    m = (cols < d_c) & ok
    x = tl.load(lat_ptr + row * stride_ln + layer * stride_ll + cols, mask=m)
    tl.store(pool_ptr + layer * stride_pl + page * stride_pp + off * stride_ps + cols, x, mask=m)


def _store_checks(latents, dest_pages, dest_offsets, write_mask, pool):
    if not isinstance(latents, torch.Tensor) or latents.dim() != 3:
        raise ValueError(f"latents must be [N, L, d_c], got {getattr(latents, 'shape', None)}")
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
        raise ValueError(f"pool must be [L, num_pages, page_size, d_c], got {getattr(pool, 'shape', None)}")
    n, layers, d_c = latents.shape
    if pool.shape[0] != layers or pool.shape[3] != d_c:
        raise ValueError(f"pool must be [L={layers}, num_pages, page_size, d_c={d_c}], got {list(pool.shape)}")
    if pool.dtype != latents.dtype:
        raise ValueError(f"pool dtype {pool.dtype} must equal latents dtype {latents.dtype}")
    _check_int("dest_pages", dest_pages, (n,))
    _check_int("dest_offsets", dest_offsets, (n,))
    _check_int("write_mask", write_mask, (n,), (torch.bool,))
    _check_device(latents.device, dest_pages=dest_pages, dest_offsets=dest_offsets, write_mask=write_mask, pool=pool)
    if latents.stride(-1) != 1 or pool.stride(-1) != 1:
        raise ValueError("latents and pool need a contiguous last dimension")
    _check_contiguous(dest_pages=dest_pages, dest_offsets=dest_offsets, write_mask=write_mask)


def store_context_latents(
    latents: torch.Tensor,
    dest_pages: torch.Tensor,
    dest_offsets: torch.Tensor,
    write_mask: torch.Tensor,
    pool: torch.Tensor,
) -> torch.Tensor:
    """Store every drafter layer's context latent into the paged pool, one launch.

    ``pool[l, dest_pages[i], dest_offsets[i], :] = latents[i, l, :]`` for every layer ``l`` and every
    row ``i`` with ``write_mask[i]`` and an in-range destination (``0 <= page < num_pages``,
    ``0 <= offset < page_size``; out-of-range or ``-1`` destinations are skipped, never a fault).
    Nothing else in ``pool`` is written. Destinations of written rows must be distinct.

    Args:
        latents: ``[N, L, d_c]`` (N flattened rows: ``[G*(K+1)]`` of a generation step from
            ``PagedLatentStep.latent_*.view(-1)``, or a prefill's tokens with their own destinations).
        dest_pages, dest_offsets: ``[N]`` int32/int64. write_mask: ``[N]`` bool.
        pool: ``[L, num_pages, page_size, d_c]``, same dtype, written in place.

    Returns ``pool``. CUDA-graph safe.
    """
    _store_checks(latents, dest_pages, dest_offsets, write_mask, pool)
    n, layers, d_c = latents.shape
    if n == 0 or layers == 0 or d_c == 0:
        return pool
    block_d = min(1024, triton.next_power_of_2(d_c))
    _store_context_latents_kernel[(n, layers, triton.cdiv(d_c, block_d))](
        latents, dest_pages, dest_offsets, write_mask, pool,
        pool.shape[1], pool.shape[2], d_c, latents.stride(0), latents.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), BLOCK_D=block_d, num_warps=max(1, min(4, block_d // 128)),
    )
    return pool


def store_context_latents_reference(latents, dest_pages, dest_offsets, write_mask, pool) -> torch.Tensor:
    """Eager twin of :func:`store_context_latents` (boolean selection: syncs, not capturable)."""
    _store_checks(latents, dest_pages, dest_offsets, write_mask, pool)
    ok = (write_mask & (dest_pages >= 0) & (dest_pages < pool.shape[1])
          & (dest_offsets >= 0) & (dest_offsets < pool.shape[2]))
    rows = ok.nonzero().squeeze(1)
    pool[:, dest_pages[rows].long(), dest_offsets[rows].long()] = latents[rows].transpose(0, 1)
    return pool
