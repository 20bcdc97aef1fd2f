"""Fused spec-tail kernels vs their eager twins, bit for bit (CPU interpreter in CI; compiled + CUDA graph on GPU)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import DraftBlockPlacement
from tensorrt_llm_ext.kernels.common import CaptureAllocationError
from tensorrt_llm_ext.kernels.block_table import decode_block_table, decode_block_table_reference
from tensorrt_llm_ext.kernels.paged_latent import PagedLatentStep, paged_latent_step, paged_latent_step_reference, store_context_latents, store_context_latents_reference, store_prompt_latents, store_prompt_latents_reference
from tensorrt_llm_ext.kernels.strict_accept import strict_accept, strict_accept_reference
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The parity tests run compiled on a GPU machine and under the Triton interpreter on CPU.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _equal_outputs(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x, y)


# ----------------------------------------------------------------------------------------------------
# Strict acceptance
# ----------------------------------------------------------------------------------------------------
def _accept_inputs(num_rows, k, dtype, seed, device="cpu"):
    """Drafts with all-match, no-match and partial rows (plus random ones)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 50, (num_rows, k + 1), generator=g, dtype=dtype)
    draft = target[:, :k].clone()
    for i in range(num_rows):
        kind = i % 4
        if kind == 1:  # no match: the first draft differs
            draft[i, 0] += 1
        elif kind == 2:  # partial: mismatch at a random position, later ones match again
            draft[i, int(torch.randint(0, k, (1,), generator=g))] += 1
        elif kind == 3:  # random tokens from a small alphabet
            draft[i] = torch.randint(0, 2, (k,), generator=g, dtype=dtype)
            target[i, :k] = torch.randint(0, 2, (k,), generator=g, dtype=dtype)
    return draft.to(device), target.to(device)


def _accept_oracle(draft, target):
    draft, target = draft.cpu(), target.cpu()
    n = []
    for r in range(target.shape[0]):
        cnt = 1
        for j in range(draft.shape[1]):
            if int(draft[r, j]) != int(target[r, j]):
                break
            cnt += 1
        n.append(cnt)
    return torch.tensor(n, dtype=torch.int32)


@pytest.mark.parametrize("num_rows,k", [(9, 7), (8, 3), (0, 4), (5, 1)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("strided_rows", [False, True])
def test_strict_accept_matches_reference(num_rows, k, dtype, strided_rows):
    draft, target = _accept_inputs(num_rows, k, dtype, seed=num_rows * 31 + k, device=DEV)
    if strided_rows:  # as the worker passes them: the drafts are columns 1.. of the verified tokens
        tokens = torch.cat([target[:, :1], draft], dim=1)
        draft = tokens[:, 1:]
    got = strict_accept(draft, target)
    ref = strict_accept_reference(draft, target)
    _equal_outputs(got, ref)
    assert torch.equal(got[1].cpu(), _accept_oracle(draft, target))
    if num_rows:
        # the kinds of rows we built are all present
        assert int(got[1][0]) == k + 1 and int(got[1][min(1, num_rows - 1)]) in (1, k + 1)
    assert torch.equal(got[0], target.to(torch.int64))  # the verified target rows


def test_strict_accept_out_buffers_reused():
    draft, target = _accept_inputs(7, 7, torch.int64, seed=2, device=DEV)
    acc = torch.full((7, 8), -9, dtype=torch.int64, device=DEV)
    n = torch.full((7,), -9, dtype=torch.int32, device=DEV)
    got = strict_accept(draft, target, out=(acc, n))
    assert got[0] is acc and got[1] is n
    ref = strict_accept_reference(draft, target)
    assert torch.equal(acc, ref[0].to(torch.int64)) and torch.equal(n, ref[1])


# ----------------------------------------------------------------------------------------------------
# Block-table decode
# ----------------------------------------------------------------------------------------------------
def _encoded_offsets(b, max_blocks, divisor, seed):
    g = torch.Generator().manual_seed(seed)
    o = torch.randint(1, 40 * divisor, (b, max_blocks), generator=g, dtype=torch.int32)
    o[0] = -1  # all unallocated
    o[1] = 0  # all zero: allocated, block 0
    if b > 2:  # about half negative or zero, deterministically placed
        pick = torch.randint(0, 4, (b - 2, max_blocks), generator=g)
        rest = o[2:]
        rest[pick == 0] = 0
        rest[pick == 1] = torch.randint(-3 * divisor, 0, (int((pick == 1).sum()),), generator=g, dtype=torch.int32)
        o[2:] = rest
    o[-1, -1] = -(2**31)  # the most negative offset still counts as unallocated
    return o


@pytest.mark.parametrize("b,max_blocks,divisor", [(5, 13, 3), (9, 40, 1), (4, 1, 7), (3, 1100, 16)])
def test_decode_block_table(b, max_blocks, divisor):
    o = _encoded_offsets(b, max_blocks, divisor, seed=max_blocks).to(DEV)
    assert (o < 0).any() and (o == 0).any()
    expect_table = torch.tensor([[max(x, 0) // divisor for x in row] for row in o.tolist()], dtype=torch.int32, device=DEV)
    expect_n = torch.tensor([sum(x >= 0 for x in row) for row in o.tolist()], dtype=torch.int32, device=DEV)
    ref = decode_block_table_reference(o, divisor)
    got = decode_block_table(o, divisor)
    _equal_outputs(got, ref)
    assert torch.equal(got[0], expect_table) and torch.equal(got[1], expect_n)
    assert int(got[1][0]) == 0 and int(got[1][1]) == max_blocks and not got[0][:2].any()
    # in place, into the offsets tensor itself
    inplace = o.clone()
    nb = torch.full((b,), -5, dtype=torch.int32, device=DEV)
    t, n = decode_block_table(inplace, divisor, out=inplace, num_blocks_out=nb)
    assert t is inplace and n is nb
    assert torch.equal(inplace, expect_table) and torch.equal(nb, expect_n)
    ref_inplace = o.clone()
    decode_block_table_reference(ref_inplace, divisor, out=ref_inplace)
    assert torch.equal(ref_inplace, expect_table)


# ----------------------------------------------------------------------------------------------------
# Paged single-latent bookkeeping + store
# ----------------------------------------------------------------------------------------------------
def _paged_case(seed, *, num_contexts, num_gen, k, page_size, max_pages, num_dummy, max_ctx_len,
                layers=2, d_c=12, device="cpu", dtype=torch.float32):
    """A step with context rows first, real generation rows on distinct slots, dummies sharing a slot."""
    g = torch.Generator().manual_seed(seed)
    num_real = num_gen - num_dummy
    num_slots = num_contexts + num_real + 2
    dummy_slot = num_slots - 1
    num_pages = num_slots * max_pages + 3
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    table = torch.full((num_slots, max_pages), -1, dtype=torch.int32)
    ctx = torch.zeros(num_slots, dtype=torch.int32)
    for s in range(num_slots):
        alloc = int(torch.randint(0, max_pages + 1, (1,), generator=g))
        if s % 5 == 1:
            alloc = max_pages  # fully allocated
        table[s, :alloc] = perm[s * max_pages: s * max_pages + alloc]
        cap = alloc * page_size
        if s % 4 == 3:  # the context outruns its pages
            ctx[s] = cap + int(torch.randint(0, 3 * page_size, (1,), generator=g))
        else:
            ctx[s] = int(torch.randint(0, max(cap - k, 0) + 1, (1,), generator=g))
    if max_pages > 2:  # a hole: never written, still counted as non-allocated
        table[2, 1] = -1
    table[dummy_slot] = perm[-max_pages:]  # a dummy slot's stale table must not be used
    ctx[dummy_slot] = 7
    b = num_contexts + num_gen
    slot_order = torch.randperm(num_slots - 1, generator=g)[: num_contexts + num_real].to(torch.int32)
    slots = torch.full((b,), dummy_slot, dtype=torch.int32)
    is_dummy = torch.zeros(b, dtype=torch.bool)
    real_rows = list(range(num_contexts)) + [num_contexts + i for i in range(num_gen) if i % 3 != 2 or i // 3 >= num_dummy]
    real_rows = real_rows[: num_contexts + num_real]
    for r, s in zip(real_rows, slot_order.tolist()):
        slots[r] = s
    for r in range(num_contexts, b):
        if r not in real_rows:
            is_dummy[r] = True
    accepted = torch.randint(0, 1000, (b, k + 1), generator=g, dtype=torch.int32)
    num_acc = torch.randint(1, k + 2, (b,), generator=g, dtype=torch.int32)
    num_acc[num_contexts] = k + 1 if num_gen else num_acc[num_contexts - 1]
    pool = torch.randn((layers, num_pages, page_size, d_c), generator=g).to(dtype)  # nonzero everywhere
    latents = torch.randn((num_gen * (k + 1), layers, d_c), generator=g).to(dtype)
    kw = dict(num_contexts=num_contexts, page_size=page_size, draft_len=k, max_ctx_len=max_ctx_len, mask_token_id=123457)
    tensors = [t.to(device) for t in (accepted, num_acc, slots, is_dummy, ctx, table)]
    return tensors, kw, pool.to(device), latents.to(device)


def _paged_oracle(accepted, num_acc, slots, is_dummy, ctx, table, *, num_contexts, page_size, draft_len,
                  max_ctx_len, mask_token_id):
    """Plain-python statement of the documented semantics (independent of both implementations)."""
    k = draft_len
    accepted, num_acc, slots, is_dummy, ctx, table = (t.cpu() for t in (accepted, num_acc, slots, is_dummy, ctx, table))
    out = dict(adv=[], pos=[], lat=[], new_ctx={})
    for r in range(num_contexts, accepted.shape[0]):
        s = int(slots[r])
        row = [int(x) for x in table[s]]
        if bool(is_dummy[r]):
            out["new_ctx"][s] = 0
            out["adv"].append(0)
            out["pos"].append(list(range(k)))
            out["lat"].append([(-1, j % page_size, False) for j in range(k + 1)])
            continue
        n = min(max(int(num_acc[r]), 1), k + 1)
        c = max(int(ctx[s]), 0)
        allocated = sum(x >= 0 for x in row)
        out["new_ctx"][s] = c + n
        out["adv"].append(max(0, min(c + n, allocated * page_size - k, max_ctx_len)))
        out["pos"].append([c + n + i for i in range(k)])
        lat = []
        for j in range(k + 1):
            p = c + j
            page = row[p // page_size] if p // page_size < len(row) else -1
            ok = j < n and page >= 0
            lat.append((page if ok else -1, p % page_size, ok))
        out["lat"].append(lat)
    return out


PAGED_CASES = {
    # name: (seed, num_contexts, num_gen, k, page_size, max_pages, num_dummy, max_ctx_len)
    "gen_only": (1, 0, 7, 7, 16, 4, 0, 10_000),
    "contexts_first_dummies": (2, 3, 9, 3, 4, 6, 2, 10_000),
    "max_ctx_ceiling": (3, 1, 8, 4, 5, 7, 1, 9),
    "odd_page_outrun": (4, 2, 10, 5, 3, 5, 3, 40),
    "k1_page1": (5, 0, 6, 1, 1, 9, 1, 10_000),
}


@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_latent_step_and_store(case):
    seed, nc, ng, k, ps, mp, nd, mcl = PAGED_CASES[case]
    (accepted, num_acc, slots, is_dummy, ctx, table), kw, pool0, latents = _paged_case(
        seed, num_contexts=nc, num_gen=ng, k=k, page_size=ps, max_pages=mp, num_dummy=nd, max_ctx_len=mcl, device=DEV)
    assert int(is_dummy.sum()) == nd and not is_dummy[:nc].any()
    ctx_fused, ctx_ref = ctx.clone(), ctx.clone()
    got = paged_latent_step(accepted, num_acc, slots, is_dummy, ctx_fused, table, **kw)
    ref = paged_latent_step_reference(accepted, num_acc, slots, is_dummy, ctx_ref, table, **kw)
    assert isinstance(got.placement, DraftBlockPlacement)
    for name, t in got.tensors().items():
        r = ref.tensors()[name]
        assert t.dtype == r.dtype and t.shape == r.shape, name
        assert torch.equal(t, r), (name, t, r)
    assert torch.equal(ctx_fused, ctx_ref)

    # the documented semantics, from a plain-python oracle
    oracle = _paged_oracle(accepted, num_acc, slots, is_dummy, ctx, table, **kw)
    assert got.placement.ctx_lens.tolist() == oracle["adv"]
    assert got.seq_lens.tolist() == [0 if bool(d) else a + k for a, d in zip(oracle["adv"], is_dummy[nc:])]
    assert got.positions.tolist() == oracle["pos"]
    lat = [[(int(p), int(o), bool(m)) for p, o, m in zip(*rows)] for rows in
           zip(got.latent_pages, got.latent_offsets, got.latent_write_mask)]
    assert lat == oracle["lat"]
    for s in range(ctx.shape[0]):  # only the step's generation slots move
        assert int(ctx_fused[s]) == oracle["new_ctx"].get(s, int(ctx[s]))
    n_clamped = num_acc[nc:].long().clamp(1, k + 1)
    assert torch.equal(got.bonus_tokens.long(), accepted[nc:].long().gather(1, n_clamped[:, None] - 1).squeeze(1))
    assert torch.equal(got.block_input_ids[:, 0], got.bonus_tokens.long())
    assert (got.block_input_ids[:, 1:] == kw["mask_token_id"]).all()
    if case == "max_ctx_ceiling":
        assert any(a == mcl for a in oracle["adv"])
    if case == "odd_page_outrun":  # some accepted latents of real rows had no page, and A was capped by pages
        accepted_j = torch.arange(k + 1, device=DEV)[None, :] < n_clamped[:, None]
        assert (accepted_j & ~got.latent_write_mask & ~is_dummy[nc:, None]).any()
        assert (got.placement.ctx_lens < ctx_fused[slots[nc:].long()])[~is_dummy[nc:]].any()
    assert not got.latent_write_mask[is_dummy[nc:]].any()
    assert (got.placement.page_ids[is_dummy[nc:]] == -1).all()
    assert (got.seq_lens[is_dummy[nc:]] == 0).all()

    # the store, from a nonzero pool
    pages, offs, mask = got.latent_pages.view(-1), got.latent_offsets.view(-1), got.latent_write_mask.view(-1)
    pool_fused, pool_ref = pool0.clone(), pool0.clone()
    store_context_latents(latents, pages, offs, mask, pool_fused)
    store_context_latents_reference(latents, pages, offs, mask, pool_ref)
    assert torch.equal(pool_fused, pool_ref)
    touched = torch.zeros(pool0.shape[1:3], dtype=torch.bool, device=DEV)
    for i in mask.nonzero().squeeze(1).tolist():
        p, o = int(pages[i]), int(offs[i])
        assert not touched[p, o], "destinations of one step are distinct"
        touched[p, o] = True
        assert torch.equal(pool_fused[:, p, o], latents[i])  # every destination written
    assert int(mask.sum()) > 0
    assert torch.equal(pool_fused[:, ~touched], pool0[:, ~touched])  # nothing else changed


def test_store_context_latents_prefill_and_bad_destinations():
    g = torch.Generator().manual_seed(7)
    layers, num_pages, ps, d_c, n = 3, 6, 4, 1030, 9  # d_c spans two column blocks
    pool0 = torch.randn((layers, num_pages, ps, d_c), generator=g).to(DEV, torch.bfloat16)
    latents = torch.randn((n, layers, d_c), generator=g).to(DEV, torch.bfloat16)
    pages = torch.tensor([0, 5, -1, 6, 2, 3, 3, 1, 4], dtype=torch.int32, device=DEV)
    offs = torch.tensor([0, 3, 1, 0, 4, -1, 2, 1, 0], dtype=torch.int64, device=DEV)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool, device=DEV)
    got, ref = pool0.clone(), pool0.clone()
    store_context_latents(latents, pages, offs, mask, got)
    store_context_latents_reference(latents, pages, offs, mask, ref)
    assert torch.equal(got, ref)
    written = [0, 1, 6, 8]  # -1 page, page >= num_pages, offset >= page_size, negative offset, masked: skipped
    touched = torch.zeros((num_pages, ps), dtype=torch.bool, device=DEV)
    for i in written:
        touched[pages[i], offs[i]] = True
        assert torch.equal(got[:, pages[i], offs[i]], latents[i])
    assert torch.equal(got[:, ~touched], pool0[:, ~touched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_prompt_latents_equals_its_twin_and_the_lookup_it_replaces(dtype):
    """A [R, T] prefill block's latents stored at their prompt positions, the pages looked up in the kernel:
    bitwise the twin (torch destinations + the reference store) and the stores of the destinations the worker
    used to compute itself; rows at or past a prompt's last position (padding), on unallocated pages or past
    the table are not written, nothing else in the pool changes. Starts strided (a column of the positions)."""
    g = torch.Generator().manual_seed(11)
    layers, num_pages, ps, d_c, t = 2, 9, 4, 40, 11
    max_pages = 4  # a table of 16 positions: row 1 runs past it
    table = torch.full((6, max_pages), -1, dtype=torch.int32)
    table[4] = torch.tensor([3, 0, 7, -1], dtype=torch.int32)
    table[1] = torch.tensor([5, 8, 1, 2], dtype=torch.int32)
    table[2] = torch.tensor([6, -1, 4, -1], dtype=torch.int32)  # its 2nd page unallocated
    table[0] = torch.tensor([2, -1, -1, -1], dtype=torch.int32)  # a slot outside the block: never written
    table = table.to(DEV)
    slots = torch.tensor([4, 1, 2], dtype=torch.int32, device=DEV)
    lens = torch.tensor([3, 40, 11], dtype=torch.int64, device=DEV)  # row 0: padding past its prompt's end
    starts_col = torch.tensor([0, 9, 2], dtype=torch.int64, device=DEV)
    positions = starts_col[:, None] + torch.arange(t, device=DEV)  # [R, T]; row 1 reaches position 19 > 15
    starts = positions[:, 0]  # strided view
    assert starts.stride(0) == t
    pool0 = torch.randn((layers, num_pages, ps, d_c), generator=g).to(DEV, dtype)
    latents = torch.randn((3 * t, layers, d_c), generator=g).to(DEV, dtype)
    got, ref, old = pool0.clone(), pool0.clone(), pool0.clone()
    store_prompt_latents(latents, slots, starts, lens, table, got, page_size=ps)
    store_prompt_latents_reference(latents, slots, starts, lens, table, ref, page_size=ps)
    assert torch.equal(got, ref)
    # the destinations as the worker computed them before the kernel looked them up (in-table rows)
    pos = positions.reshape(-1)
    pages = table[slots.long().repeat_interleave(t), (pos // ps).clamp(max=max_pages - 1)]
    keep = (positions < (lens - 1)[:, None]).reshape(-1) & (pos // ps < max_pages)
    store_context_latents_reference(latents, pages, (pos % ps).to(torch.int32), keep, old)
    assert torch.equal(got, old)
    written = 0
    touched = torch.zeros((num_pages, ps), dtype=torch.bool, device=DEV)
    for i in range(3 * t):
        r, p = divmod(i, t)
        p += int(starts_col[r])
        page = int(table[slots[r], p // ps]) if p // ps < max_pages else -1
        if p < int(lens[r]) - 1 and page >= 0:
            assert torch.equal(got[:, page, p % ps], latents[i]), i
            touched[page, p % ps] = True
            written += 1
    # row 0: positions 0-1 (2 is its last, 3-10 padding); row 1: 9-15 (16-19 past its 4-page table); row 2: 2-3 and
    # 8-9 (4-7 on its unallocated page, 10 its last)
    assert written == 2 + 7 + 4
    assert torch.equal(got[:, ~touched], pool0[:, ~touched])


# ----------------------------------------------------------------------------------------------------
# Host-side validation
# ----------------------------------------------------------------------------------------------------
def test_bad_input_raises_value_error():
    draft, target = _accept_inputs(5, 3, torch.int32, seed=0)
    with pytest.raises(ValueError, match="target_tokens"):
        strict_accept(draft, target[:-1])  # mismatched batch
    with pytest.raises(ValueError, match="target_tokens"):
        strict_accept(draft, target.reshape(-1))  # one layout: [B, K+1]
    with pytest.raises(ValueError, match="dtype"):
        strict_accept(draft.float(), target)
    with pytest.raises(ValueError, match="draft_tokens.*unit stride"):
        strict_accept(torch.zeros((5, 6), dtype=torch.int32)[:, ::2], target)
    o = torch.zeros((2, 3), dtype=torch.int32)
    for bad in (0, -4, 2.0):
        with pytest.raises(ValueError, match="divisor"):
            decode_block_table(o, bad)
    with pytest.raises(ValueError, match="int32"):
        decode_block_table(o.long(), 2)
    with pytest.raises(ValueError, match="out"):
        decode_block_table(o, 2, out=torch.zeros((3, 3), dtype=torch.int32))

    (accepted, num_acc, slots, is_dummy, ctx, table), kw, pool, latents = _paged_case(
        0, num_contexts=1, num_gen=4, k=3, page_size=4, max_pages=3, num_dummy=1, max_ctx_len=100)
    for key, bad in (("draft_len", -1), ("draft_len", 0), ("page_size", 0), ("max_ctx_len", -2)):
        with pytest.raises(ValueError, match=key):
            paged_latent_step(accepted, num_acc, slots, is_dummy, ctx, table, **{**kw, key: bad})
    with pytest.raises(ValueError, match="num_accepted"):
        paged_latent_step(accepted, num_acc[:-1], slots, is_dummy, ctx, table, **kw)
    with pytest.raises(ValueError, match="accepted_tokens"):
        paged_latent_step(accepted, num_acc, slots, is_dummy, ctx, table, **{**kw, "draft_len": 4})
    with pytest.raises(ValueError, match="is_dummy"):
        paged_latent_step(accepted, num_acc, slots, is_dummy.int(), ctx, table, **kw)
    with pytest.raises(ValueError, match="block_table"):
        paged_latent_step(accepted, num_acc, slots, is_dummy, ctx, table[:-1], **kw)
    with pytest.raises(ValueError, match="out.bonus_tokens"):
        paged_latent_step(accepted, num_acc, slots, is_dummy, ctx, table, **kw, out=PagedLatentStep.allocate(5, 3, "cpu"))
    with pytest.raises(ValueError, match="draft_len"):
        PagedLatentStep.allocate(4, -1, "cpu")
    with pytest.raises(ValueError, match="dest_pages"):
        store_context_latents(latents, torch.zeros(2, dtype=torch.int32), torch.zeros(latents.shape[0], dtype=torch.int32),
                              torch.ones(latents.shape[0], dtype=torch.bool), pool)
    with pytest.raises(ValueError, match="dtype"):
        store_context_latents(latents.double(), torch.zeros(latents.shape[0], dtype=torch.int32),
                              torch.zeros(latents.shape[0], dtype=torch.int32),
                              torch.ones(latents.shape[0], dtype=torch.bool), pool)


# ----------------------------------------------------------------------------------------------------
# GPU: compiled kernels under CUDA-graph capture and replay
# ----------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("num_gen,num_contexts,max_pages,d_c", [(7, 0, 8, 512), (256, 0, 40, 128), (61, 3, 1030, 32)])
def test_spec_tail_cuda_graph_replay(num_gen, num_contexts, max_pages, d_c):
    dev = "cuda"
    k, ps, layers, divisor = 7, 16, 3, 4
    b = num_contexts + num_gen
    # static inputs
    draft = torch.zeros((b, k), dtype=torch.int64, device=dev)
    target = torch.zeros((b, k + 1), dtype=torch.int64, device=dev)
    offsets = torch.zeros((b, max_pages), dtype=torch.int32, device=dev)
    (acc0, _, slots0, dummy0, ctx0, table0), kw0, pool0, lat0 = _paged_case(
        99, num_contexts=num_contexts, num_gen=num_gen, k=k, page_size=ps, max_pages=max_pages,
        num_dummy=num_gen // 5, max_ctx_len=10_000, layers=layers, d_c=d_c, dtype=torch.bfloat16)
    slots, is_dummy = slots0.to(dev), dummy0.to(dev)
    ctx, table = ctx0.to(dev), table0.to(dev)
    pool, latents = pool0.to(dev), lat0.to(dev)
    kw = {**kw0, "draft_len": k}
    # static outputs
    acc = torch.zeros((b, k + 1), dtype=torch.int32, device=dev)
    num_acc = torch.zeros((b,), dtype=torch.int32, device=dev)
    dec = torch.zeros_like(offsets)
    nblk = torch.zeros((b,), dtype=torch.int32, device=dev)
    step = PagedLatentStep.allocate(num_gen, k, dev)

    def run():
        strict_accept(draft, target, out=(acc, num_acc))
        decode_block_table(offsets, divisor, out=dec, num_blocks_out=nblk)
        paged_latent_step(acc, num_acc, slots, is_dummy, ctx, table, **kw, out=step)
        store_context_latents(latents, step.latent_pages.view(-1), step.latent_offsets.view(-1),
                              step.latent_write_mask.view(-1), pool)

    ctx_init, pool_init = ctx.clone(), pool.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        run()

    for it in range(3):
        d_cpu, t_cpu = _accept_inputs(b, k, torch.int64, seed=100 + it)
        draft.copy_(d_cpu)
        target.copy_(t_cpu)
        offsets.copy_(_encoded_offsets(b, max_pages, divisor, seed=it))
        latents.normal_()
        ctx.copy_(ctx_init)
        pool.copy_(pool_init)
        graph.replay()
        torch.cuda.synchronize()
        ref_acc, ref_n = strict_accept_reference(draft, target)
        assert torch.equal(acc, ref_acc) and torch.equal(num_acc, ref_n)
        ref_dec = decode_block_table_reference(offsets, divisor)
        assert torch.equal(dec, ref_dec[0]) and torch.equal(nblk, ref_dec[1])
        ctx_ref, pool_ref = ctx_init.clone(), pool_init.clone()
        ref = paged_latent_step_reference(ref_acc, ref_n, slots, is_dummy, ctx_ref, table, **kw)
        for name, t in step.tensors().items():
            assert torch.equal(t, ref.tensors()[name]), name
        assert torch.equal(ctx, ctx_ref)
        store_context_latents_reference(latents, ref.latent_pages.view(-1), ref.latent_offsets.view(-1),
                                        ref.latent_write_mask.view(-1), pool_ref)
        assert torch.equal(pool, pool_ref)
        # eager launch (compiled, no graph) equals the graph too
        ctx.copy_(ctx_init)
        eager = paged_latent_step(ref_acc, ref_n, slots, is_dummy, ctx, table, **kw)
        for name, t in eager.tensors().items():
            assert torch.equal(t, ref.tensors()[name]), name


@requires_cuda
def test_capture_without_out_raises():
    draft, target = (t.cuda() for t in _accept_inputs(4, 3, torch.int32, seed=0))
    strict_accept(draft, target)  # compile
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureAllocationError, match="out="):
        with graph_capture(graph):
            strict_accept(draft, target)
