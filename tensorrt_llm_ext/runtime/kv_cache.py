"""Caches sized at start: the target's paged KV cache, the drafter's paged latent pool, slots and pages.

* ONE page allocator per rank serves both caches: a page id names a page of the target's K/V pool
  (``[L, num_pages + 1, page_size, kv_heads, D]``) and the page of the drafter's latent pool with the same
  id, so a request's pages are taken and returned once for both. The number of pages comes from
  ``kv_cache_config`` (:func:`num_cache_pages`: ``max_tokens``, ``free_gpu_memory_fraction``, else every slot
  at ``max_seq_len``); a request waits for admission until its pages are free (:meth:`PageAllocator.can_allocate`).

* Slots ``0 .. max_batch_size-1`` belong to requests; slot ``max_batch_size`` is the DUMMY slot that
  CUDA-graph padding rows use (its state is scratch, emptied by every step).
* Both pools have ``num_pages + 1`` pages; the last one is a SCRATCH page never handed out: a placement
  entry of ``-1`` (a dummy row, or nothing allocated) used as an index reaches it, and the target's page
  table holds its id where a slot has no page, so a read or write through an unallocated entry can never
  touch a request's page.
* Pages are handed out per request at admission (enough for its prompt, its ``max_new_tokens`` and the
  overshoot of a speculative step) and recorded as ENCODED block offsets (``page * divisor``, ``-1`` =
  unallocated), the way a KV-cache manager reports them; the step decodes them with
  :func:`~tensorrt_llm_ext.speculative.spec_tail_kernels.decode_block_table`.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.contract import BuildRefusal, DSparkState
from tensorrt_llm_ext.kernels.common import copy_from_host_
from tensorrt_llm_ext.logger import info_once


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
    """Pages of the caches, with two per-slot tables kept on the device (rewritten on change only):
    ``encoded_offsets`` (the drafter's encoded block offsets, ``-1`` = unallocated) and ``page_table``
    (the target's page ids, the scratch page id ``num_pages`` = unallocated). Pages are handed out lowest
    first and may be freed in any order.

    **Block reuse** (``enable_block_reuse``; ``kv_cache_config.enable_block_reuse``): a full page of a prompt,
    once prefilled, is registered under its tokens and the chain of pages before it (:meth:`register`), and
    a later request whose prompt starts with the same pages maps them read-only into its own table
    (:meth:`match`, then :meth:`allocate` with ``prefix=``) and prefills the rest only. A page is counted
    per holder; when its last holder leaves, a registered page stays cached (idle, LRU) and an unregistered
    one is free. Idle cached pages count as free: :meth:`allocate` takes truly free pages first (lowest),
    then evicts the least recently released cached pages (the deepest page of a chain first). Keys are exact
    (the page's token ids and a chain id that is never reused), so a match is never a hash collision, and an
    evicted page's descendants become unreachable. A page holds the target's K/V and the drafter's latents
    of its positions; ``root`` separates prefixes whose pages hold different things (a target-only prefill
    stores no latents).

    **Partial reuse** (``enable_partial_reuse``, with block reuse): where the whole pages stop, a cached page whose
    first tokens equal the prompt's next ones (:meth:`match_partial`) is copied into the request's first fresh
    page by the caller, whose prefill then starts after those tokens."""

    def __init__(self, num_pages: int, num_slots: int, max_pages_per_slot: int, divisor: int, device,
                 page_size: int = 0, enable_block_reuse: bool = False, enable_partial_reuse: bool = False):
        if enable_block_reuse and page_size < 1:
            raise ValueError("PageAllocator: block reuse needs the page size")
        self.num_pages = num_pages
        self.max_pages_per_slot = max_pages_per_slot
        self.divisor = divisor
        self.page_size = page_size
        self.enable_block_reuse = enable_block_reuse
        self.enable_partial_reuse = enable_block_reuse and enable_partial_reuse
        self._free = list(range(num_pages))
        self._owned: dict[int, list[int]] = {}
        self._holders: dict[int, int] = {}  # page -> slots holding it (pages of one slot: 1)
        # Block reuse: (parent chain id, page tokens) -> (chain id, page); page -> its key; idle cached pages
        # in release order (the front is evicted first).
        self._cached: dict[tuple, tuple[int, int]] = {}
        self._children: dict[object, set[tuple]] = {}  # parent chain id -> the keys of its cached pages
        self._key_of: dict[int, tuple] = {}
        self._idle: dict[int, None] = {}
        self._next_chain = 1
        self.prefix_queries = 0  # prompt tokens looked up (:meth:`match`)
        self.prefix_hits = 0  # of those, tokens found cached
        # [num_slots, max_pages] int32 encoded offsets, -1 = unallocated (device; copied on change only).
        self.encoded_offsets = torch.full((num_slots, max_pages_per_slot), -1, dtype=torch.int32, device=device)
        # [num_slots, max_pages] int32 page ids, num_pages (the scratch page) = unallocated.
        self.page_table = torch.full((num_slots, max_pages_per_slot), num_pages, dtype=torch.int32, device=device)

    @property
    def num_free(self) -> int:
        """Pages an allocation may take now: the free ones and the idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages held by slots (idle cached pages are not in use)."""
        return self.num_pages - self.num_free

    @property
    def registrations(self) -> int:
        """A count that grows with every page :meth:`register` adds (never reset): an unchanged count means no match
        has grown since."""
        return self._next_chain

    @property
    def num_cached(self) -> int:
        """Registered pages (held or idle)."""
        return len(self._key_of)

    def num_held(self, slot: int) -> int:
        """Pages ``slot`` holds now."""
        return len(self._owned.get(slot, ()))

    def _holds_of(self, slots) -> dict[int, int]:
        """Page -> how many of ``slots`` hold it."""
        holds: dict[int, int] = {}
        for slot in set(slots):
            for page in self._owned.get(slot, ()):
                holds[page] = holds.get(page, 0) + 1
        return holds

    def num_free_after(self, leaving=()) -> int:
        """:attr:`num_free` once the slots ``leaving`` have left: their pages that no other slot holds are free (or
        idle cached) then."""
        return self.num_free + sum(1 for page, n in self._holds_of(leaving).items() if self._holders[page] == n)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether ``num_pages`` are free now (admission waits otherwise)."""
        return num_pages <= self.num_free

    # -- block reuse ---------------------------------------------------------------------------------
    def _page_key(self, parent, token_ids, i: int) -> tuple:
        """The key of page ``i`` of a sequence: its parent's chain id (or the root) and its token ids. ``token_ids``
        is a list or tuple of Python ints (:func:`_token_list`): a slice makes the key at C speed, where a
        per-token ``int()`` took ~1 ms per walk of a 16k-token prompt on the engine's thread."""
        p = self.page_size
        return parent, tuple(token_ids[i * p:(i + 1) * p])

    def _cached_prefix(self, token_ids, max_pages: int, root, with_parent: bool = False):
        """The cached pages that hold the first (at most ``max_pages``) whole pages of ``token_ids``, in order
        (``with_parent``: and the chain id after them)."""
        parent, pages = ("root", root), []
        for i in range(max_pages):
            hit = self._cached.get(self._page_key(parent, token_ids, i))
            if hit is None:
                break
            parent = hit[0]
            pages.append(hit[1])
        return (pages, parent) if with_parent else pages

    def match_partial(self, prompt_ids, root=None) -> tuple[int, int] | None:
        """Where :meth:`match`'s whole pages stop: ``(page, m)`` for the cached page under the same chain whose
        first ``m`` tokens (the most of any, at least one, none past the prompt's second-to-last token) equal the
        prompt's next ones; None without one. Counted in :attr:`prefix_hits`; nothing is taken: the caller copies
        the page's first ``m`` positions into its own fresh page before anything else writes either."""
        if not self.enable_partial_reuse:
            return None
        prompt_ids = _token_list(prompt_ids)
        pages, parent = self._cached_prefix(prompt_ids, (len(prompt_ids) - 1) // self.page_size, root,
                                            with_parent=True)
        return self._best_partial(prompt_ids, len(pages), parent)

    def _best_partial(self, prompt_ids, whole: int, parent) -> tuple[int, int] | None:
        """:meth:`match_partial` after ``whole`` matched pages that end at chain id ``parent``."""
        p, n = self.page_size, len(prompt_ids)
        start = whole * p
        want = tuple(prompt_ids[start:min(start + p, n - 1)])
        best = None
        for key in self._children.get(parent, ()):
            m = 0
            for a, b in zip(key[1], want):
                if a != b:
                    break
                m += 1
            if m and (best is None or m > best[1]):
                best = (self._cached[key][1], m)
        if best is not None:
            self.prefix_hits += best[1]
        return best

    def match_with_partial(self, prompt_ids, root=None) -> tuple[list[int], tuple[int, int] | None]:
        """:meth:`match` and then :meth:`match_partial` from one walk of the prompt's chain: the same results and
        the same counts."""
        if not self.enable_block_reuse:  # nothing is cached without it (and partial reuse is off with it)
            return [], None
        prompt_ids = _token_list(prompt_ids)
        n = len(prompt_ids)
        pages, parent = self._cached_prefix(prompt_ids, (n - 1) // self.page_size, root, with_parent=True)
        self.prefix_queries += n
        self.prefix_hits += len(pages) * self.page_size
        return pages, (self._best_partial(prompt_ids, len(pages), parent) if self.enable_partial_reuse else None)

    def match(self, prompt_ids, root=None) -> list[int]:
        """The cached pages that hold the start of ``prompt_ids`` (whole pages, in order), at most those before
        its last token (a prefill computes at least that one: it gives the first token). Counted in
        :attr:`prefix_queries` / :attr:`prefix_hits`. Nothing is taken: :meth:`allocate` pins them."""
        if not self.enable_block_reuse:
            return []
        prompt_ids = _token_list(prompt_ids)
        n = len(prompt_ids)
        pages = self._cached_prefix(prompt_ids, (n - 1) // self.page_size, root)
        self.prefix_queries += n
        self.prefix_hits += len(pages) * self.page_size
        return pages

    def admission_cost(self, prompt_ids, num_pages: int, root=None, leaving=()) -> int:
        """The free pages that :meth:`allocate` of ``num_pages`` after :meth:`match` of ``prompt_ids`` would take
        now, with the slots ``leaving`` gone first: its fresh pages plus the idle cached pages it pins (nothing is
        counted or taken). Admissions in order may evict one another's matches; an evicted page was idle (a held
        page's chain is held), so it moves from the pinned to the fresh count and the sum stays an upper bound."""
        if not self.enable_block_reuse:
            return num_pages
        prompt_ids = _token_list(prompt_ids)
        gone = self._holds_of(leaving)
        pages = self._cached_prefix(prompt_ids, min((len(prompt_ids) - 1) // self.page_size, num_pages), root)
        idle = sum(1 for page in pages if self._holders.get(page, 0) == gone.get(page, 0))
        return num_pages - len(pages) + idle

    def register(self, slot: int, token_ids, root=None) -> int:
        """Register ``slot``'s whole pages before the last of ``token_ids`` (its sequence from position 0: the
        prompt once its prefill is done, prompt and output at its finish; the caller says their K/V and latents
        are final); a page whose key another page already holds stays private. Returns the pages newly
        registered."""
        if not self.enable_block_reuse:
            return 0
        token_ids = _token_list(token_ids)
        pages = self._owned.get(slot, [])
        added = 0
        parent = ("root", root)
        for i in range(min((len(token_ids) - 1) // self.page_size, len(pages))):
            key = self._page_key(parent, token_ids, i)
            hit = self._cached.get(key)
            if hit is None:
                if pages[i] in self._key_of:  # this page is cached under another key: the chain diverged
                    break
                hit = (self._next_chain, pages[i])
                self._next_chain += 1
                self._cached[key] = hit
                self._key_of[pages[i]] = key
                self._children.setdefault(key[0], set()).add(key)
                added += 1
            parent = hit[0]
        return added

    def rematch(self, slot: int, prompt_ids, root=None) -> int:
        """Map the cached pages that now hold the start of ``prompt_ids`` into ``slot``'s table in place of its
        fresh pages (a request admitted before another one's prefill registered the pages they share); the
        fresh pages it gives back are free. The caller says ``slot`` has written none of its pages past its
        cached prefix. Returns the slot's cached prefix in pages; the new hits count in :attr:`prefix_hits`."""
        pages = self._owned[slot]
        if not self.enable_block_reuse:
            return 0
        prompt_ids = _token_list(prompt_ids)
        n = len(prompt_ids)
        cached = self._cached_prefix(prompt_ids, min((n - 1) // self.page_size, len(pages)), root)
        same = 0
        while same < len(cached) and pages[same] == cached[same]:
            same += 1
        new = 0
        for i in range(same, len(cached)):
            if pages[i] in self._key_of or self._holders[pages[i]] != 1:  # not a fresh page of this slot alone
                break
            page = cached[i]
            self._idle.pop(page, None)
            self._holders[page] = self._holders.get(page, 0) + 1
            self._release([pages[i]])
            pages[i] = page
            new += 1
        if new:
            ids = torch.tensor(pages[same:same + new], dtype=torch.int32)
            copy_from_host_(self.encoded_offsets[slot, same:same + new], ids * self.divisor)
            copy_from_host_(self.page_table[slot, same:same + new], ids)
            self.prefix_hits += new * self.page_size
        return same + new

    def _take_fresh(self, num_pages: int) -> list[int]:
        self._free.sort()
        pages, self._free = self._free[:num_pages], self._free[num_pages:]
        while len(pages) < num_pages:  # evict the idle cached page released longest ago
            page = next(iter(self._idle))
            del self._idle[page]
            key = self._key_of.pop(page)
            del self._cached[key]
            siblings = self._children[key[0]]
            siblings.discard(key)
            if not siblings:
                del self._children[key[0]]
            pages.append(page)
        return pages

    # -- slots ---------------------------------------------------------------------------------------
    def allocate(self, slot: int, num_pages: int, prefix: list[int] = ()) -> list[int]:
        """``num_pages`` pages for ``slot``: the cached ``prefix`` pages (from :meth:`match`) first, then fresh
        ones."""
        if slot in self._owned:
            raise RuntimeError(f"PageAllocator: slot {slot} already holds pages")
        if num_pages > self.max_pages_per_slot:
            raise RuntimeError(f"PageAllocator: {num_pages} pages exceed {self.max_pages_per_slot} per slot")
        prefix = list(prefix)
        if len(prefix) > num_pages or any(page not in self._key_of for page in prefix):
            raise RuntimeError(f"PageAllocator: prefix pages {prefix} are not cached pages within {num_pages}")
        for page in prefix:  # pinned first: taking fresh pages below must not evict them
            self._idle.pop(page, None)
            self._holders[page] = self._holders.get(page, 0) + 1
        fresh, free = num_pages - len(prefix), self.num_free
        if fresh > free:
            self._release(prefix)
            raise RuntimeError(f"PageAllocator: {fresh} pages requested, {free} free")
        pages = prefix + self._take_fresh(fresh)
        for page in pages[len(prefix):]:
            self._holders[page] = 1
        self._owned[slot] = pages
        row = torch.full((self.max_pages_per_slot,), -1, dtype=torch.int32)
        ids = torch.tensor(pages, dtype=torch.int32)
        row[:num_pages] = ids * self.divisor
        copy_from_host_(self.encoded_offsets[slot], row)
        row.fill_(self.num_pages)
        row[:num_pages] = ids
        copy_from_host_(self.page_table[slot], row)
        return pages

    def _release(self, pages: list[int]) -> None:
        # The deepest page of a chain is released last, so it is evicted first (its parent stays matchable).
        for page in reversed(pages):
            left = self._holders[page] - 1
            if left:
                self._holders[page] = left
                continue
            del self._holders[page]
            if page in self._key_of:
                self._idle[page] = None
            else:
                self._free.append(page)

    def free(self, slot: int) -> None:
        self._release(self._owned.pop(slot, []))
        self.encoded_offsets[slot].fill_(-1)
        self.page_table[slot].fill_(self.num_pages)

    def free_all(self) -> None:
        """Free the pages of every slot and forget every cached page (the tables return to unallocated)."""
        self._owned.clear()
        self._holders.clear()
        self._cached.clear()
        self._children.clear()
        self._key_of.clear()
        self._idle.clear()
        self._free = list(range(self.num_pages))
        self.encoded_offsets.fill_(-1)
        self.page_table.fill_(self.num_pages)


def _token_list(token_ids):
    """``token_ids`` as a list or tuple of Python ints: as given when it is one (validated requests' prompts, the
    engine's outputs), else converted once (a tensor's elements would hash by identity in a page key)."""
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    return [int(t) for t in token_ids]


def pages_needed(num_tokens: int, draft_len: int, page_size: int) -> int:
    """Pages for a request of ``num_tokens`` (prompt + max_new_tokens): its context can run ``K`` past the
    last kept token (a step accepts up to K+1), and the draft block needs K more latent slots after it."""
    return -(-(num_tokens + 2 * draft_len + 1) // page_size)


def num_cache_pages(*, max_batch_size: int, max_pages_per_slot: int, page_size: int, bytes_per_page: int,
                    max_tokens: int | None = None, free_gpu_memory_fraction: float | None = None,
                    device=None) -> tuple[int, str]:
    """``(num_pages, why)``: the pool's pages from trtllm-serve's ``kv_cache_config`` names.

    ``max_tokens``: ``ceil(max_tokens / page_size)`` pages; ``free_gpu_memory_fraction`` (CUDA): that fraction of
    the device's free memory now (after the weights) over ``bytes_per_page``; both: the smaller (as
    TensorRT-LLM). Neither (or a fraction on a CPU): every slot at ``max_seq_len``. Never below one request at
    ``max_seq_len`` (a smaller pool could never admit a longest request), never above every slot at it.
    """
    full = max_batch_size * max_pages_per_slot
    caps = []
    if max_tokens is not None:
        caps.append((-(-max_tokens // page_size), f"kv_cache_config.max_tokens={max_tokens}"))
    if free_gpu_memory_fraction is not None:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            free = available_memory_bytes(dev)
            caps.append((int(free * free_gpu_memory_fraction) // bytes_per_page,
                         f"kv_cache_config.free_gpu_memory_fraction={free_gpu_memory_fraction} of "
                         f"{free / 2**30:.1f} GiB free at {bytes_per_page} B per page"))
        else:
            info_once(f"kv cache: free_gpu_memory_fraction={free_gpu_memory_fraction} ignored on {dev.type} "
                      f"(no device memory to measure)")
    if not caps:
        return full, f"every slot at max_seq_len ({max_batch_size} x {max_pages_per_slot} pages)"
    pages, why = min(caps)
    if pages < max_pages_per_slot:
        return max_pages_per_slot, f"{why} raised to one request at max_seq_len ({max_pages_per_slot} pages)"
    if pages > full:
        return full, f"{why} capped at every slot at max_seq_len ({full} pages)"
    return pages, why


def available_memory_bytes(dev: torch.device) -> int | None:
    """Bytes free for the page pool on ``dev`` now: the device's free memory (CUDA), the host's ``MemAvailable``
    (CPU, Linux); None where it cannot be read (no check then)."""
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_pool_fits(pool_bytes: int, device, why: str, *, max_batch_size: int, max_seq_len: int) -> None:
    """Refuse (:class:`~tensorrt_llm_ext.contract.BuildRefusal`, before anything is allocated) a page pool larger
    than the memory free on ``device``: sized as every slot at ``max_seq_len`` (no ``kv_cache_config`` bound) a
    long ``max_seq_len`` asks for terabytes, which the allocator refused with a traceback."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    free = available_memory_bytes(dev)
    if free is None or pool_bytes <= free:
        return
    raise BuildRefusal(
        f"kv cache: the page pool needs {pool_bytes / 2**30:.1f} GiB ({why}) but {free / 2**30:.1f} GiB of "
        f"{dev.type} memory is free: lower max_seq_len "
        f"({max_seq_len}) or max_batch_size ({max_batch_size}), or bound the pool with kv_cache_config.max_tokens "
        f"or kv_cache_config.free_gpu_memory_fraction")


def build_state(target, drafter, *, max_batch_size: int, max_seq_len: int, draft_len: int, page_size: int,
                device, max_tokens: int | None = None, free_gpu_memory_fraction: float | None = None,
                enable_block_reuse: bool = False, enable_partial_reuse: bool = False
                ) -> tuple[DSparkState, SlotPool, PageAllocator]:
    """Allocate every cache once: ``max_batch_size`` request slots plus the dummy slot, one page pool (its size
    from :func:`num_cache_pages`) shared by the target's KV cache and the drafter's latent pool."""
    num_slots = max_batch_size + 1
    dummy = max_batch_size
    k = draft_len
    # Positions a step may write: the longest request + the verification block + padding columns.
    max_positions = max_seq_len + 2 * k + 2
    max_pages = pages_needed(max_seq_len, k, page_size)
    latent_page = drafter.latent_pool_shape(1, page_size)
    bytes_per_page = (page_size * target.kv_bytes_per_token()
                      + latent_page[0] * latent_page[2] * latent_page[3] * drafter.dtype.itemsize)
    num_pages, why = num_cache_pages(max_batch_size=max_batch_size, max_pages_per_slot=max_pages,
                                     page_size=page_size, bytes_per_page=bytes_per_page, max_tokens=max_tokens,
                                     free_gpu_memory_fraction=free_gpu_memory_fraction, device=device)
    # The pool (and the scratch page) plus the page tables, before any of it is allocated.
    check_pool_fits((num_pages + 1) * bytes_per_page + 2 * num_slots * max_pages * 4, device, why,
                    max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    info_once(f"kv cache: {num_pages} pages of {page_size} tokens ({num_pages * page_size} tokens, "
              f"{num_pages * bytes_per_page / 2**20:.1f} MiB with the drafter's latents): {why}; prefix reuse "
              + ("on (kv_cache_config.enable_block_reuse: a prompt's whole pages serve later prompts; partial reuse "
                 + ("on: a page's matching start is copied)" if enable_partial_reuse else "off)")
                 if enable_block_reuse else "off"),
              key=f"kv-cache-pages-{num_pages}-{page_size}-{enable_block_reuse}-{enable_partial_reuse}")
    divisor = 2 * drafter.num_latent_layers  # offsets count per-layer K/V-style units, as a KV manager's do
    pages = PageAllocator(num_pages, num_slots, max_pages, divisor, device, page_size=page_size,
                          enable_block_reuse=enable_block_reuse, enable_partial_reuse=enable_partial_reuse)
    kv = target.make_paged_kv_cache(num_pages, page_size, pages.page_table, device=device)
    pool = torch.zeros(drafter.latent_pool_shape(num_pages + 1, page_size), dtype=drafter.dtype, device=device)
    state = DSparkState(
        kv_cache=kv,
        latent_pool=pool,
        encoded_offsets=pages.encoded_offsets,
        block_table=torch.full_like(pages.encoded_offsets, -1),
        ctx_lens=torch.zeros(num_slots, dtype=torch.int32, device=device),
        ref_lens=torch.zeros(num_slots, dtype=torch.int32, device=device),
        slot_tokens=torch.zeros(num_slots, k + 1, dtype=torch.int64, device=device),
        page_size=page_size,
        page_divisor=divisor,
        dummy_slot=dummy,
        max_ctx_len=max_positions,
    )
    return state, SlotPool(max_batch_size), pages
