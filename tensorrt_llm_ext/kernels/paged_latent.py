"""Paged single-latent drafter bookkeeping and the context-latent store (two launches per step).

Semantics follow :mod:`tensorrt_llm_ext.contract` (module docstring); the choices it leaves open are
fixed in :func:`paged_latent_step`. Every launcher takes ``out=`` buffers; given them it allocates
nothing, reads no device value on the host and branches only on shapes and host ints, so it may be
captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.contract import DraftBlockPlacement
from tensorrt_llm_ext.kernels.common import (
    INT_DTYPES,
    check_contiguous,
    check_devices,
    check_int,
    check_tensor,
    is_capturing,
    num_warps_for,
    refuse_allocation_while_capturing,
)


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
    check_int("draft_len (K)", draft_len, lo=1)
    check_int("page_size", page_size, lo=1)
    check_int("num_contexts", num_contexts, lo=0)
    check_int("mask_token_id", mask_token_id, lo=0)
    check_int("max_ctx_len (below 2^31 - 2K)", max_ctx_len, lo=0, hi=2**31 - 2 * draft_len)
    check_tensor("accepted_tokens [B, K+1]", accepted_tokens, shape=(None, draft_len + 1))
    b = accepted_tokens.shape[0]
    check_tensor("accepted_tokens", accepted_tokens, shape=(b, draft_len + 1), dtype=INT_DTYPES)
    check_int("num_contexts (at most the step's rows)", num_contexts, lo=0, hi=b + 1)
    check_tensor("num_accepted", num_accepted, shape=(b,), dtype=INT_DTYPES)
    check_tensor("slot_ids", slot_ids, shape=(b,), dtype=INT_DTYPES)
    check_tensor("is_dummy", is_dummy, shape=(b,), dtype=torch.bool)
    check_tensor("ctx_lens [num_slots]", ctx_lens, shape=(None,), dtype=torch.int32)
    check_tensor("block_table [num_slots, max_pages]", block_table, shape=(ctx_lens.shape[0], None),
                 dtype=torch.int32, unit_last_stride=True)
    if block_table.shape[1] < 1:
        raise ValueError("block_table: expected at least one page column, got 0")
    check_devices(accepted_tokens.device, num_accepted=num_accepted, slot_ids=slot_ids, is_dummy=is_dummy,
                  ctx_lens=ctx_lens, block_table=block_table)
    check_contiguous(accepted_tokens=accepted_tokens, num_accepted=num_accepted, slot_ids=slot_ids,
                      is_dummy=is_dummy, ctx_lens=ctx_lens)
    if b > num_contexts and not is_capturing(accepted_tokens.device):
        _check_slot_range(slot_ids[num_contexts:], ctx_lens.shape[0])
    return b - num_contexts


def _check_slot_range(slot_ids: torch.Tensor, num_slots: int) -> None:
    """``ValueError`` unless every slot id lies in ``[0, num_slots)``.

    The kernel indexes ``ctx_lens`` and the block table with the slot id and writes ``ctx_lens[slot]``:
    an id out of range reads and writes outside them (heap corruption on CPU, a fault on GPU). One host
    read per call; skipped while a CUDA graph is capturing (no sync there: the worker checks the ids
    where it sets the step's rows up, outside the captured step).
    """
    lo, hi = torch.stack(torch.aminmax(slot_ids)).tolist()
    if lo < 0 or hi >= num_slots:
        bad = slot_ids[(slot_ids < 0) | (slot_ids >= num_slots)][:5].tolist()
        raise ValueError(f"slot_ids: expected ids in [0, {num_slots}) (the rows of ctx_lens / block_table), "
                         f"got {bad}")


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

    Slot ids must lie in ``[0, num_slots)``: checked on the host (one read, ``ValueError``) unless a CUDA
    graph is capturing, where the caller checks them when it sets the rows up (the worker's
    ``set_rows``). Precondition (not checked): a real row's slot is used by no other row of the step
    (dummies may share one slot). Values are written only to ``ctx_lens`` at the step's slots and to
    ``out``. Page ids are copied from ``block_table``, never dereferenced here (the store kernel bounds
    them).

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
        refuse_allocation_while_capturing("paged_latent_step")
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
        raise ValueError(f"out: expected a PagedLatentStep, got {type(out).__name__}")
    expect = dict(bonus_tokens=((g,), torch.int32), block_input_ids=((g, k), torch.int64),
                  latent_pages=((g, k + 1), torch.int32), latent_offsets=((g, k + 1), torch.int32),
                  latent_write_mask=((g, k + 1), torch.bool), positions=((g, k), torch.int32),
                  page_ids=((g, k), torch.int32), page_offsets=((g, k), torch.int32),
                  ctx_lens=((g,), torch.int32), seq_lens=((g,), torch.int32))
    for name, t in out.tensors().items():
        shape, dtype = expect[name]
        check_tensor(f"out.{name}", t, shape=shape, dtype=dtype)
        check_devices(device, **{f"out.{name}": t})
        check_contiguous(**{f"out.{name}": t})


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


@triton.jit(do_not_specialize=["cols_per_row"])  # the block's prompt length: one build for every prompt
def _store_prompt_latents_kernel(
    lat_ptr, slot_ptr, start_ptr, len_ptr, table_ptr, pool_ptr,
    cols_per_row, max_pages, num_pages, page_size, d_c, stride_start, stride_table, stride_ln, stride_ll,
    stride_pl, stride_pp, stride_ps,
    BLOCK_D: tl.constexpr,
):
    # row = r * T + t holds position starts[r] + t of slot slots[r]: its destination is looked up here, not
    # by a chain of torch ops on the host's launch path
    row = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    r = row // cols_per_row
    pos = tl.load(start_ptr + r * stride_start).to(tl.int64) + row % cols_per_row
    n = tl.load(len_ptr + r).to(tl.int64)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    pidx = pos // page_size
    ok = (pos >= 0) & (pos < n - 1) & (pidx < max_pages)
    page = tl.load(table_ptr + slot * stride_table + pidx, mask=ok, other=-1).to(tl.int64)
    ok = ok & (page >= 0) & (page < num_pages)
    off = pos % page_size
    m = (cols < d_c) & ok
    x = tl.load(lat_ptr + row * stride_ln + layer * stride_ll + cols, mask=m)
    tl.store(pool_ptr + layer * stride_pl + page * stride_pp + off * stride_ps + cols, x, mask=m)


def _prompt_checks(latents, slots, starts, lens, block_table, pool, page_size):
    check_tensor("latents [R*T, L, d_c]", latents, shape=(None, None, None), unit_last_stride=True)
    n, layers, d_c = latents.shape
    check_tensor("pool [L, num_pages, page_size, d_c]", pool, shape=(layers, None, page_size, d_c),
                 dtype=latents.dtype, unit_last_stride=True)
    check_tensor("slots [R]", slots, shape=(None,), dtype=INT_DTYPES)
    r = slots.shape[0]
    check_tensor("starts [R]", starts, shape=(r,), dtype=INT_DTYPES)
    check_tensor("lens [R]", lens, shape=(r,), dtype=INT_DTYPES)
    check_tensor("block_table [S, P]", block_table, shape=(None, None), dtype=INT_DTYPES, unit_last_stride=True)
    if r == 0 or n % r:
        raise ValueError(f"store_prompt_latents: latents [R*T, ...] need R >= 1 rows of T positions; got {n} rows "
                         f"for R={r}")
    check_devices(latents.device, slots=slots, starts=starts, lens=lens, block_table=block_table, pool=pool)
    check_contiguous(slots=slots, lens=lens)


def store_prompt_latents(latents: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                         block_table: torch.Tensor, pool: torch.Tensor, *, page_size: int) -> torch.Tensor:
    """Store a prefill block's drafter context latents at their prompt positions, one launch.

    ``latents [R*T, L, d_c]``: row ``r*T + t`` is position ``starts[r] + t`` of slot ``slots[r]`` (a ``[R, T]``
    prefill block, flattened). Every layer's latent of that position goes to
    ``pool[l, block_table[slot, pos // page_size], pos % page_size]`` when ``pos < lens[r] - 1`` (the prompt's
    positions below its last: the last one is stored by the first block's bookkeeping), the position's page
    lies in the table and is allocated (``0 <= page < num_pages``); nothing else is written. What
    :func:`store_context_latents` does with destinations the caller computed (``store_prompt_latents_reference``:
    that computation in torch), without the ~8 host launches that computed them. ``starts`` may be strided
    (a column of the block's positions). Returns ``pool``. CUDA-graph safe.
    """
    check_int("page_size", page_size, lo=1)
    _prompt_checks(latents, slots, starts, lens, block_table, pool, page_size)
    n, layers, d_c = latents.shape
    if layers == 0 or d_c == 0:
        return pool
    block_d = min(1024, triton.next_power_of_2(d_c))
    _store_prompt_latents_kernel[(n, layers, triton.cdiv(d_c, block_d))](
        latents, slots, starts, lens, block_table, pool,
        n // slots.shape[0], block_table.shape[1], pool.shape[1], page_size, d_c, starts.stride(0),
        block_table.stride(0), latents.stride(0), latents.stride(1), pool.stride(0), pool.stride(1), pool.stride(2),
        BLOCK_D=block_d, num_warps=num_warps_for(block_d, elements_per_warp=128, max_warps=4),
    )
    return pool


def prompt_latent_destinations(slots, starts, lens, block_table, cols_per_row: int, page_size: int):
    """``(pages, offsets, write_mask)`` of a ``[R, T]`` prefill block's rows, in torch (what the fused store looks
    up itself): ``-1`` / masked where the position is the prompt's last or past it, or outside the table."""
    t = cols_per_row
    pos = (starts.to(torch.int64)[:, None] + torch.arange(t, device=starts.device)).reshape(-1)
    slot_rows = slots.to(torch.int64).repeat_interleave(t)
    valid = (pos >= 0) & (pos < (lens.to(torch.int64) - 1).repeat_interleave(t))
    pages, offsets, ok = _page_lookup(block_table, slot_rows, pos[:, None], page_size, valid[:, None])
    return pages.view(-1), offsets.view(-1), ok.view(-1)


def store_prompt_latents_reference(latents, slots, starts, lens, block_table, pool, *, page_size: int,
                                   sink_page: int | None = None) -> torch.Tensor:
    """Eager twin of :func:`store_prompt_latents`: the destinations in torch, then
    :func:`store_context_latents_reference` (``sink_page`` as there: the stock table's capturable form)."""
    check_int("page_size", page_size, lo=1)
    _prompt_checks(latents, slots, starts, lens, block_table, pool, page_size)
    pages, offsets, ok = prompt_latent_destinations(slots, starts, lens, block_table,
                                                    latents.shape[0] // slots.shape[0], page_size)
    return store_context_latents_reference(latents, pages, offsets, ok, pool, sink_page=sink_page)


def _store_checks(latents, dest_pages, dest_offsets, write_mask, pool):
    check_tensor("latents [N, L, d_c]", latents, shape=(None, None, None), unit_last_stride=True)
    n, layers, d_c = latents.shape
    check_tensor("pool [L, num_pages, page_size, d_c]", pool, shape=(layers, None, None, d_c), dtype=latents.dtype,
                 unit_last_stride=True)
    check_tensor("dest_pages", dest_pages, shape=(n,), dtype=INT_DTYPES)
    check_tensor("dest_offsets", dest_offsets, shape=(n,), dtype=INT_DTYPES)
    check_tensor("write_mask", write_mask, shape=(n,), dtype=torch.bool)
    check_devices(latents.device, dest_pages=dest_pages, dest_offsets=dest_offsets, write_mask=write_mask, pool=pool)
    check_contiguous(dest_pages=dest_pages, dest_offsets=dest_offsets, write_mask=write_mask)


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
        pool.stride(0), pool.stride(1), pool.stride(2), BLOCK_D=block_d, num_warps=num_warps_for(block_d, elements_per_warp=128, max_warps=4),
    )
    return pool


def store_context_latents_reference(latents, dest_pages, dest_offsets, write_mask, pool, *,
                                    sink_page: int | None = None) -> torch.Tensor:
    """Eager twin of :func:`store_context_latents`: rows that are masked out or whose destination lies
    outside the pool are not written.

    ``sink_page=None``: those rows are skipped by a boolean selection (syncs, not capturable), so nothing
    else in the pool changes, exactly as the kernel. ``sink_page=p`` (the engine's pool keeps a last,
    scratch page): they are written to page ``p`` instead, which needs no sync and is capturable -- the
    upstream eager store the stock op table runs; pages other than ``p`` end equal to the default's, and
    a destination on page ``p`` counts as outside the pool.
    """
    _store_checks(latents, dest_pages, dest_offsets, write_mask, pool)
    num_pages = pool.shape[1] if sink_page is None else sink_page
    ok = (write_mask & (dest_pages >= 0) & (dest_pages < num_pages)
          & (dest_offsets >= 0) & (dest_offsets < pool.shape[2]))
    if sink_page is not None:
        pages = torch.where(ok, dest_pages.long(), torch.full_like(dest_pages, sink_page, dtype=torch.long))
        offsets = torch.where(ok, dest_offsets.long(), torch.zeros_like(dest_offsets, dtype=torch.long))
        pool[:, pages, offsets] = latents.transpose(0, 1).to(pool.dtype)
        return pool
    rows = ok.nonzero().squeeze(1)
    pool[:, dest_pages[rows].long(), dest_offsets[rows].long()] = latents[rows].transpose(0, 1)
    return pool
