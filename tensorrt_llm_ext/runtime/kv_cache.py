"""Caches sized at start: the target KV cache, the drafter's paged latent pool, slots and pages.

* Slots ``0 .. max_batch_size-1`` belong to requests; slot ``max_batch_size`` is the DUMMY slot that
  CUDA-graph padding rows use (its state is scratch, emptied by every step).
* The drafter's latent pool has ``num_pages + 1`` pages; the last one is a SCRATCH page never handed
  out: a placement entry of ``-1`` (a dummy row, or nothing allocated) used as an index reaches it, so a
  read or write through an unallocated placement can never touch a request's page.
* Pages are handed out per request at admission (enough for its prompt, its ``max_new_tokens`` and the
  overshoot of a speculative step) and recorded as ENCODED block offsets (``page * divisor``, ``-1`` =
  unallocated), the way a KV-cache manager reports them; the step decodes them with
  :func:`~tensorrt_llm_ext.speculative.spec_tail_kernels.decode_block_table`.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.contract import DSparkState


class SlotPool:
    """Free list of request slots; the lowest free slot is handed out first (deterministic reuse)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("SlotPool: no free slot")
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"SlotPool: slot {slot} released twice or out of range")
        self._free.append(slot)

    def release_all(self) -> int:
        """Free every slot; returns how many were held."""
        held = self.num_slots - len(self._free)
        self._free = list(range(self.num_slots))
        return held


class PageAllocator:
    """Pages of the drafter's latent pool, with the encoded block-offset table of every slot."""

    def __init__(self, num_pages: int, num_slots: int, max_pages_per_slot: int, divisor: int, device):
        self.num_pages = num_pages
        self.max_pages_per_slot = max_pages_per_slot
        self.divisor = divisor
        self._free = list(range(num_pages))
        self._owned: dict[int, list[int]] = {}
        # [num_slots, max_pages] int32 encoded offsets, -1 = unallocated (device; copied on change only).
        self.encoded_offsets = torch.full((num_slots, max_pages_per_slot), -1, dtype=torch.int32, device=device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, slot: int, num_pages: int) -> list[int]:
        if slot in self._owned:
            raise RuntimeError(f"PageAllocator: slot {slot} already holds pages")
        if num_pages > self.max_pages_per_slot:
            raise RuntimeError(f"PageAllocator: {num_pages} pages exceed {self.max_pages_per_slot} per slot")
        if num_pages > len(self._free):
            raise RuntimeError(f"PageAllocator: {num_pages} pages requested, {len(self._free)} free")
        self._free.sort()
        pages, self._free = self._free[:num_pages], self._free[num_pages:]
        self._owned[slot] = pages
        row = torch.full((self.max_pages_per_slot,), -1, dtype=torch.int32)
        row[:num_pages] = torch.tensor(pages, dtype=torch.int32) * self.divisor
        self.encoded_offsets[slot].copy_(row)
        return pages

    def free(self, slot: int) -> None:
        pages = self._owned.pop(slot, [])
        self._free.extend(pages)
        self.encoded_offsets[slot].fill_(-1)

    def free_all(self) -> None:
        """Free the pages of every slot (the table returns to all ``-1``)."""
        self._owned.clear()
        self._free = list(range(self.num_pages))
        self.encoded_offsets.fill_(-1)


def pages_needed(num_tokens: int, draft_len: int, page_size: int) -> int:
    """Pages for a request of ``num_tokens`` (prompt + max_new_tokens): its context can run ``K`` past the
    last kept token (a step accepts up to K+1), and the draft block needs K more latent slots after it."""
    return -(-(num_tokens + 2 * draft_len + 1) // page_size)


def build_state(target, drafter, *, max_batch_size: int, max_seq_len: int, draft_len: int, page_size: int,
                device) -> tuple[DSparkState, SlotPool, PageAllocator]:
    """Allocate every cache once: ``max_batch_size`` request slots plus the dummy slot."""
    num_slots = max_batch_size + 1
    dummy = max_batch_size
    k = draft_len
    # Positions a step may write: the longest request + the verification block + padding columns.
    max_positions = max_seq_len + 2 * k + 2
    kv = target.make_kv_cache(num_slots, max_positions, device=device)
    max_pages = pages_needed(max_seq_len, k, page_size)
    num_pages = max_batch_size * max_pages
    divisor = 2 * drafter.num_latent_layers  # offsets count per-layer K/V-style units, as a KV manager's do
    pages = PageAllocator(num_pages, num_slots, max_pages, divisor, device)
    pool = torch.zeros(drafter.latent_pool_shape(num_pages + 1, page_size), dtype=drafter.dtype, device=device)
    state = DSparkState(
        kv_cache=kv,
        latent_pool=pool,
        encoded_offsets=pages.encoded_offsets,
        block_table=torch.full_like(pages.encoded_offsets, -1),
        ctx_lens=torch.zeros(num_slots, dtype=torch.int32, device=device),
        ref_lens=torch.zeros(num_slots, dtype=torch.int32, device=device),
        slot_tokens=torch.zeros(num_slots, k + 1, dtype=torch.int64, device=device),
        slot_temps=torch.zeros(num_slots, dtype=torch.float32, device=device),
        slot_seeds=torch.zeros(num_slots, dtype=torch.int64, device=device),
        slot_top_p=torch.ones(num_slots, dtype=torch.float32, device=device),
        page_size=page_size,
        page_divisor=divisor,
        dummy_slot=dummy,
        max_ctx_len=max_positions,
    )
    return state, SlotPool(max_batch_size), pages
