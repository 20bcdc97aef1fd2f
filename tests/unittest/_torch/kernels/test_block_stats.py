"""The one-pass statistics over 1024-id blocks (kernels/block_stats.py): kernel vs eager twin (bit for bit under the
interpreter, within the SFU's tolerance on a GPU), the combined row bins bitwise the same at TP 1 / 2 / 3 / 4 on
block-aligned shards and across column chunks, the masses against float64, and the alignment check; the combine
launch and the two-pass fallback (block keys with the edge maxima, block bins) on unaligned shards give the TP 1
row bins bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.block_stats import (BINS_COLS, STAT_BINS, STAT_BLOCK, STATS_COLS, block_bins,
                                                  block_bins_reference, block_combine, block_combine_reference,
                                                  block_keys, block_keys_reference, block_row_mass, block_row_mass_rows,
                                                  block_row_mass_torch, block_stats, block_stats_reference,
                                                  row_bins_reference, row_mass_reference)
from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY
from tensorrt_llm_ext.kernels.fixed_point_softmax import plan_chunks, weight_scale_torch
from tensorrt_llm_ext.testing.simulated_tp import shard

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")
# aligned shards of 4096 / 3072 / 2048 ids at TP 2 / 3 / 4: the last holds 7 real ids at TP 3 and 4
VOCAB = 6 * STAT_BLOCK + 7


def _inputs(b: int = 4, k: int = 2, vocab: int = VOCAB, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(b * (k + 1), vocab, generator=g) * 2.0
    draft = torch.randn(b * k, vocab, generator=g) * 2.0
    target[0, 3] = NAN
    target[1] = -INF  # no finite logit
    target[2, STAT_BLOCK - 1: STAT_BLOCK + 1] = 9.0  # a tie on a block (and shard) boundary
    target[3, : vocab // 2] = -INF  # whole blocks empty
    target[3, vocab - 3:] = 12.0  # the max on the last real ids
    target[4] = target[4] * 0.01 - 40.0  # blocks far below ...
    target[4, 5] = 30.0  # ... one heavy token: most blocks fall out of the bins
    draft[0, 2 * STAT_BLOCK] = 25.0
    draft[1, :] = 0.0  # flat
    tokens = torch.randint(0, vocab, (b, k), generator=g)
    tokens[0, 0], tokens[0, 1], tokens[1, 0] = vocab - 1, 3, STAT_BLOCK
    temps = torch.tensor([1.0, 0.0, 2.0, 1e-5][:b])
    return target.to(torch.bfloat16), draft.to(torch.bfloat16), tokens, temps, k


def _run(fn, target, draft, temps, tokens, k, start, vocab, splits):
    rt, rq = target.shape[0], draft.shape[0]
    s, _ = plan_chunks(target.shape[1], STAT_BLOCK, splits)
    keys = torch.full((rt + rq, s, 2), 7, dtype=torch.int64, device=target.device)
    stats = torch.full((rt + rq, s, STATS_COLS), 7, dtype=torch.int64, device=target.device)
    fn(target, draft, temps, start, vocab, tokens=tokens, row_div=k + 1, row_div_q=k, keys_out=keys, stats_out=stats,
       num_splits=splits)
    return keys.cpu(), stats.cpu()


def _aligned(x: torch.Tensor, tp: int, rank: int, pad: float):
    """Rank ``rank``'s block-aligned shard of ``x [R, V]`` (width a multiple of STAT_BLOCK), padded with ``pad``."""
    vocab = x.shape[1]
    width = STAT_BLOCK * -(-(-(-vocab // tp)) // STAT_BLOCK)
    start = rank * width
    out = torch.full((x.shape[0], width), pad, dtype=x.dtype)
    n = max(0, min(width, vocab - start))
    out[:, :n] = x[:, start:start + n]
    return out, start


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_schedules_give_the_same_bits(splits):
    """The schedule knobs (warps, the next tile's early load) change no bit of the keys or the statistics."""
    target, draft, tokens, temps, k = _inputs()
    args = [t.to(DEV) for t in (target, draft, temps, tokens)]
    want = _run(block_stats, args[0], args[1], args[2], args[3], k, 0, VOCAB, splits)
    for num_warps, prefetch in ((4, True), (2, True), (8, False), (2, False)):
        def fn(*a, **kw):
            return block_stats(*a, **kw, num_warps=num_warps, prefetch=prefetch)

        got = _run(fn, args[0], args[1], args[2], args[3], k, 0, VOCAB, splits)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (num_warps, prefetch)


def test_warps_rule_picks_the_measured_winner():
    """stats_num_warps on the 2026-12-08 H100 measurement's grids (V = 200064, K = 7, 132 SMs; rows x chunks of the
    call's column plan): 2 warps where they won, 4 where they lost (B = 1; TP 1 at B = 128)."""
    from tensorrt_llm_ext.kernels.block_stats import stats_num_warps

    cases = {  # (B, TP): (chunks, tiles a chunk) -> the faster warps measured
        (1, 4): (25, 2, 4), (8, 4): (17, 3, 2), (32, 4): (5, 10, 2), (128, 4): (2, 25, 2),
        (1, 1): (28, 7, 4), (8, 1): (18, 11, 2), (32, 1): (5, 40, 2), (128, 1): (2, 98, 4)}
    for (b, tp), (splits, tiles, want) in cases.items():
        assert stats_num_warps(b * 15, splits, tiles * STAT_BLOCK, 132) == want, (b, tp)


def _adversarial(vocab: int, dtype: torch.dtype, seed: int):
    """Rows for the tile loop's branches: a NaN or +inf in a late tile (the masked branch, the argmax moving to it),
    ties of the max across tiles and on a block boundary, a -0.0 / +0.0 block max, bf16's extremes (``x - m``
    overflows), subnormals, all-NaN, all -inf and +inf-only rows, a block of only +inf and NaN; tokens on them."""
    g = torch.Generator().manual_seed(seed)
    b, k = 3, 2
    t = torch.randn(b * (k + 1), vocab, generator=g) * 3.0
    d = torch.randn(b * k, vocab, generator=g) * 3.0
    big = torch.finfo(dtype).max
    t[0, vocab - 2] = NAN  # the first NaN in the last tile: the argmax moves there
    t[0, 5] = 50.0
    t[1, 1500] = INF  # +inf in a later tile, NaN in a later one still
    t[1, 2 * STAT_BLOCK + 3] = NAN
    t[1, 2 * STAT_BLOCK + 4] = -INF
    t[2, :] = -0.0
    t[2, STAT_BLOCK:2 * STAT_BLOCK] = 0.0  # -0.0 and +0.0 block maxima, ties everywhere
    t[2, 7] = 0.0
    t[3, :] = -INF
    # a subnormal max on the last real id (fp32 only: the interpreter flushes bf16 subnormals to 0, both forms alike)
    t[3, vocab - 1] = 1e-40 if dtype == torch.float32 else 1e-30
    t[4, 0], t[4, vocab - 1] = big, -big  # x - m = -inf in fp32
    t[4, STAT_BLOCK - 1] = big  # a tie of the max across blocks
    t[5, :] = NAN
    t[6, :STAT_BLOCK] = INF  # a whole block +inf; the rest finite
    t[7, :] = INF
    t[8, STAT_BLOCK:2 * STAT_BLOCK] = NAN
    t[8, STAT_BLOCK + 1::2] = INF  # a block of only NaN and +inf
    d[0, :] = d[0, :] * 1e-30  # tiny values: weights near 2^30 each
    d[1, 3] = NAN
    d[2, STAT_BLOCK + 2] = INF
    d[3, :] = -INF
    d[4, vocab // 2] = big
    d[5, 2 * STAT_BLOCK - 1] = -0.0
    tokens = torch.tensor([[vocab - 2, 5], [1500, 2 * STAT_BLOCK + 3], [STAT_BLOCK, vocab - 1]])
    temps = torch.tensor([1.0, 1e-5, 0.0])
    return t.to(dtype), d.to(dtype), tokens, temps, k


@pytest.mark.parametrize("vocab,dtype,tp,pad", [(3 * STAT_BLOCK + 5, torch.bfloat16, 1, 0.0),
                                                (6 * STAT_BLOCK + 7, torch.float32, 3, NAN),
                                                (6 * STAT_BLOCK + 7, torch.float16, 4, INF)])
def test_tile_loop_equals_the_twin_on_adversarial_rows(vocab, dtype, tp, pad):
    """The tile loop (per element only the tile max and the weight) against the twin, which keeps the definition's
    per-element form: bit for bit on adversarial rows, every aligned shard of odd vocabularies (the last padded with
    NaN or +inf past its real ids), two column plans, with and without top-p rows, at both warp counts."""
    t, d, tokens, temps, k = _adversarial(vocab, dtype, seed=vocab)
    top_p = torch.tensor([0.9, 1.0, 0.5], device=DEV)
    for rank in range(tp):
        ts, start = _aligned(t, tp, rank, pad)
        ds, _ = _aligned(d, tp, rank, pad)
        args = [x.to(DEV) for x in (ts, ds, temps, tokens)]
        for splits, tp_arg in ((1, None), (3, top_p)):
            runs = [_run(lambda *a, w=w, **kw: block_stats(*a, **kw, num_warps=w, top_p=tp_arg), *args, k, start,
                         vocab, splits) for w in (4, 2)]
            twin = _run(lambda *a, **kw: block_stats_reference(*a, **kw, top_p=tp_arg), *args, k, start, vocab, splits)
            assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), (rank, splits)
            assert torch.equal(runs[0][0], twin[0]), (rank, splits)
            if DEV == "cpu":  # both take numpy's exp2
                assert torch.equal(runs[0][1], twin[1]), (rank, splits)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_kernel_equals_twin(splits):
    target, draft, tokens, temps, k = _inputs()
    args = [t.to(DEV) for t in (target, draft, temps, tokens)]
    keys, stats = _run(block_stats, args[0], args[1], args[2], args[3], k, 0, VOCAB, splits)
    keys_r, stats_r = _run(block_stats_reference, args[0], args[1], args[2], args[3], k, 0, VOCAB, splits)
    assert torch.equal(keys, keys_r)
    if DEV == "cpu":  # both take numpy's exp2
        assert torch.equal(stats, stats_r)
    else:  # grid points exact; masses within the SFU exp2's 2^-22 per token and one truncated unit per token
        assert torch.equal(stats[:, :, 0], stats_r[:, :, 0]) and torch.equal(stats[:, :, -1], stats_r[:, :, -1])
        torch.testing.assert_close(stats[:, :, 1:-1].double(), stats_r[:, :, 1:-1].double(), rtol=2.0**-20,
                                   atol=VOCAB)


@pytest.mark.parametrize("splits", [1, 3])
def test_top_p_rows_read_for_their_keys_only(splits):
    """With ``top_p`` the rows of requests with top-p in force (T > 0, p < 1: they weigh against the row max) write
    an empty chunk's statistics in every slot, and the same keys; every other row -- greedy (T = 0 with p < 1),
    p = 1 -- keeps the bits of the call without ``top_p``; kernel and twin agree."""
    target, draft, tokens, temps, k = _inputs()
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95])  # requests 0 and 3 in force; 1 greedy; 2 at p = 1
    args = [t.to(DEV) for t in (target, draft, temps, tokens)]
    plain = _run(block_stats, *args, k, 0, VOCAB, splits)
    runs = {name: _run(lambda *a, fn=fn, **kw: fn(*a, **kw, top_p=top_p.to(DEV)), *args, k, 0, VOCAB, splits)
            for name, fn in (("kernel", block_stats), ("twin", block_stats_reference))}
    b = temps.shape[0]
    req = torch.cat([torch.arange(b).repeat_interleave(k + 1), torch.arange(b).repeat_interleave(k)])
    skip = ((temps > 0) & (top_p < 1))[req]
    assert int(skip.sum()) == 2 * (2 * k + 1)
    empty = torch.zeros(STATS_COLS, dtype=torch.int64)
    empty[0] = empty[-1] = EMPTY_KEY
    for name, (keys, stats) in runs.items():
        assert torch.equal(keys, plain[0]), name
        assert torch.equal(stats[skip], empty.expand_as(stats[skip])), name
        if DEV == "cpu" or name == "kernel":  # the twin's masses round apart from the SFU's on a GPU
            assert torch.equal(stats[~skip], plain[1][~skip]), name
    with pytest.raises(ValueError, match="top_p"):
        _run(lambda *a, **kw: block_stats(*a, **kw, top_p=top_p[:2].to(DEV)), *args, k, 0, VOCAB, splits)


def test_row_bins_tp_and_chunk_invariant():
    """Kernel vs kernel: the row's grid point, bins and the drafted tokens' (F_b, R_b) from the slots of TP 2 / 3 / 4
    block-aligned shards (the last rank's padding NaN or a value above every logit: never read) equal TP 1's,
    whatever the column chunks. Bitwise on every backend."""
    target, draft, tokens, temps, k = _inputs()
    t, d, tk, tm = (x.to(DEV) for x in (target, draft, tokens, temps))
    _, ref_stats = _run(block_stats, t, d, tm, tk, k, 0, VOCAB, 4)
    ref_r, ref_bins = row_bins_reference(ref_stats)
    ref_tok = ref_stats[:, :, STAT_BINS + 1:].amax(1)  # the one slot that owns the token (others 0 / EMPTY_KEY)
    assert bool((ref_r[[0, 2, 3, 4]] != EMPTY_KEY).all()) and ref_r[1] == EMPTY_KEY and not ref_bins[1].any()
    for tp, splits, pad in ((2, 3, NAN), (3, 1, 1e4), (4, 2, NAN), (4, 8, 1e4)):
        slots = []
        for rank in range(tp):
            ts, start = _aligned(target, tp, rank, pad)
            ds, _ = _aligned(draft, tp, rank, pad)
            slots.append(_run(block_stats, ts.to(DEV), ds.to(DEV), tm, tk, k, start, VOCAB, splits)[1])
        stats = torch.cat(slots, 1)
        r, bins = row_bins_reference(stats)
        assert torch.equal(r, ref_r) and torch.equal(bins, ref_bins), (tp, splits)
        assert torch.equal(stats[:, :, STAT_BINS + 1:].amax(1), ref_tok), (tp, splits)


@triton.jit
def _row_mass_kernel(bins_ptr, z_ptr, f_ptr, s_ptr, rows_ptr, bin_slots, NB: tl.constexpr, SB: tl.constexpr,
                     X: tl.constexpr):
    """block_row_mass of row program_id and block_row_mass_rows of the X rows ``rows_ptr`` (negative: masked)."""
    row = tl.program_id(0)
    z, f, st = block_row_mass(bins_ptr, row, bin_slots, NB, SB)
    tl.store(z_ptr + row, z)
    tl.store(f_ptr + row, f)
    tl.store(s_ptr + row, st)
    xs = tl.arange(0, X)
    rows = tl.load(rows_ptr + xs)
    zr, fr, sr = block_row_mass_rows(bins_ptr, tl.maximum(rows, 0), rows >= 0, bin_slots, NB, SB)
    n = tl.num_programs(0)
    tl.store(z_ptr + n + xs, zr, mask=row == 0)
    tl.store(f_ptr + n + xs, fr, mask=row == 0)
    tl.store(s_ptr + n + xs, sr, mask=row == 0)


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_row_mass_helpers_equal_twin_bitwise(slots):
    """The draw's row masses (one vector load of the bins, two integer sums) are the twin's bits at the bins' edges:
    all zero, the largest bins a 2^32-id vocabulary allows (sum < 2^62), one bin set, random bins; the row form masks
    its padded rows to zero."""
    g = torch.Generator().manual_seed(slots)
    rows = 6
    bins = torch.zeros(rows, slots, BINS_COLS, dtype=torch.int64)
    bins[1, :, :STAT_BINS] = (2**62 - 1) // (STAT_BINS * slots)  # the bound: every bin of every slot near its top
    bins[2, -1, 5] = 3
    bins[3, :, :STAT_BINS] = torch.randint(0, 2**47, (slots, STAT_BINS), generator=g)
    bins[4, :, :STAT_BINS] = torch.randint(0, 2**31, (slots, STAT_BINS), generator=g)
    bins[5, 0, STAT_BINS - 1] = 2**40 + 12345  # only the last bin: its low 31 bits carry the value's tail
    bins[:, :, STAT_BINS] = torch.randint(0, 2**30, (rows, slots), generator=g)
    bins[:, :, STAT_BINS + 1] = torch.randint(0, 40, (rows, slots), generator=g)
    want_z, want_f, want_s = block_row_mass_torch(bins)
    n_rows = torch.tensor([3, 0, 5, -1, 1, -1, 2, 4], dtype=torch.int64)
    d = bins.to(DEV)
    z = torch.empty(rows + 8, dtype=torch.float64, device=DEV)
    f = torch.empty(rows + 8, dtype=torch.int64, device=DEV)
    st = torch.empty(rows + 8, dtype=torch.int64, device=DEV)
    _row_mass_kernel[(rows,)](d, z, f, st, n_rows.to(DEV), slots, NB=STAT_BINS,
                              SB=triton.next_power_of_2(slots), X=8)
    z, f, st = z.cpu(), f.cpu(), st.cpu()
    assert torch.equal(z[:rows].view(torch.int64), want_z.view(torch.int64))
    assert torch.equal(f[:rows], want_f) and torch.equal(st[:rows], want_s)
    live = n_rows >= 0
    pick = n_rows.clamp(min=0)
    assert torch.equal(z[rows:][live].view(torch.int64), want_z[pick][live].view(torch.int64))
    assert (z[rows:][~live] == 0).all() and (f[rows:][~live] == 0).all()
    # the value: the exact sum of bin_i 2^-i, within the one rounding of the high part
    exact = [sum(int(v) * 2.0 ** -i for i, v in enumerate(r)) for r in bins[:, :, :STAT_BINS].sum(1).tolist()]
    torch.testing.assert_close(want_z, torch.tensor(exact, dtype=torch.float64), rtol=2.0**-50, atol=0.0)
    assert want_z[0] == 0.0


def test_masses_match_float64():
    """``Z 2^-30 = sum_i bin_i 2^-(i + 30)`` is the float64 ``sum 2^(x c - R)`` over the tokens that weigh (within
    2^-20), and a token's probability ``F_b 2^-(R - R_b) / Z`` is its float64 softmax (within 2^-20 and one unit of
    ``F_b``)."""
    target, draft, tokens, temps, k = _inputs()
    t, d, tk, tm = (x.to(DEV) for x in (target, draft, tokens, temps))
    _, stats = _run(block_stats, t, d, tm, tk, k, 0, VOCAB, 3)
    r, bins = row_bins_reference(stats)
    z = row_mass_reference(bins)
    x = torch.cat([target, draft]).double()
    # the kernels' fp32 c = div_rn(log2 e, T) is part of the definition (at T = 1e-5 its rounding moves x c by a
    # fraction of a binade, the same for every token of the row)
    c = weight_scale_torch(torch.cat([temps.repeat_interleave(k + 1), temps.repeat_interleave(k)])).double()
    b = tokens.shape[0]
    # each row's drafted token (target row K of a request has none: -1)
    tok = torch.cat([torch.cat([tokens, torch.full((b, 1), -1)], 1).reshape(-1), tokens.reshape(-1)])
    for row in [r for r in range(x.shape[0]) if r != 1]:  # row 1 has no finite logit; T = 1, 0 (as 1), 2, 1e-5
        fin = torch.isfinite(x[row])
        e = torch.exp2(torch.where(fin, x[row] * c[row] - float(r[row]), torch.full_like(x[row], -INF)))
        assert abs(float(z[row]) * 2.0**-30 / float(e.sum()) - 1) < 2.0**-20, row
        f_tok, r_tok = stats[row, :, STAT_BINS + 1].amax(), stats[row, :, STAT_BINS + 2].amax()
        if tok[row] >= 0 and bool(fin[tok[row]]):
            assert r_tok != EMPTY_KEY, row
            p = float(f_tok) * 2.0 ** -(float(r[row]) - float(r_tok)) / float(z[row])
            scores = torch.where(fin, x[row] * c[row], torch.full_like(x[row], -INF))
            soft = torch.softmax(scores * 0.6931471805599453, 0)  # softmax of x c ln 2: base-2 weights
            want = float(soft[tok[row]])
            assert abs(p - want) <= 2.0**-20 * want + 2.0**-28, (row, p, want)  # + one truncated unit of F


def test_unaligned_shard_and_bad_outputs_refused():
    target, draft, tokens, temps, k = _inputs()
    with pytest.raises(ValueError, match="multiple of 1024"):
        _run(block_stats, target[:, :100].contiguous(), draft[:, :100].contiguous(), temps, tokens, k, 5, VOCAB, 1)
    rows = target.shape[0] + draft.shape[0]
    keys = torch.zeros(rows, 1, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="stats_out"):
        block_stats(target, draft, temps, 0, VOCAB, tokens=tokens, row_div=k + 1, row_div_q=k, keys_out=keys,
                    stats_out=torch.zeros(rows, 1, STATS_COLS - 1, dtype=torch.int64))



def _one_pass_bins(fns, t, d, tm, tk, k, tp, splits, pad):
    """The exchanged row bins ``[rows, BINS_COLS]`` of the one pass at TP ``tp`` on aligned shards: block_stats on
    every rank, the keys' MAX, the combine on every rank, the SUM (simulated between the ranks' buffers)."""
    stats_fn, combine_fn = fns
    rt = t.shape[0]
    per_rank = []
    for rank in range(tp):
        ts, start = _aligned(t.cpu(), tp, rank, pad)
        ds, _ = _aligned(d.cpu(), tp, rank, pad)
        per_rank.append(_run(stats_fn, ts.to(DEV), ds.to(DEV), tm, tk, k, start, VOCAB, splits))
    keys = torch.stack([kk for kk, _ in per_rank]).amax(0).to(DEV)
    total = torch.zeros(rt + d.shape[0], BINS_COLS, dtype=torch.int64)
    for _, stats in per_rank:
        out = torch.full((rt + d.shape[0], 1, BINS_COLS), 7, dtype=torch.int64, device=DEV)
        combine_fn(stats.to(DEV), keys, tm, rows_t=rt, row_div=k + 1, row_div_q=k, out=out)
        total += out[:, 0].cpu()
    return total


def _two_pass_bins(fns, t, d, tm, tk, k, tp, splits, block, vocab=VOCAB):
    """The same with the two-pass fallback on today's ``ceil(V / tp)``-column shards: block_keys on every rank, the
    MAX of keys and edges, block_bins on every rank, the SUM over ranks and chunks."""
    keys_fn, bins_fn = fns
    rows = t.shape[0] + d.shape[0]
    ranks = []
    for rank in range(tp):
        ts, start = shard(t, tp, rank, vocab, rule="ceil")
        ds, _ = shard(d, tp, rank, vocab, rule="ceil")
        s, _ = plan_chunks(ts.shape[1], block, splits)
        keys = torch.full((rows, s, 2), 7, dtype=torch.int64, device=DEV)
        edges = torch.full((rows, s, tp + 1), 7, dtype=torch.int64, device=DEV)
        keys_fn(ts, ds, start, vocab, keys_out=keys, edges_out=edges, rank=rank, tp=tp, block_size=block,
                num_splits=splits)
        ranks.append((ts, ds, start, keys, edges, s))
    keys = torch.stack([r[3] for r in ranks]).amax(0)
    edges = torch.stack([r[4] for r in ranks]).amax(0)
    total = torch.zeros(rows, BINS_COLS, dtype=torch.int64)
    for rank, (ts, ds, start, _, _, s) in enumerate(ranks):
        out = torch.full((rows, s, BINS_COLS), 7, dtype=torch.int64, device=DEV)
        bins_fn(ts, ds, keys, edges, tm, start, vocab, tokens=tk, row_div=k + 1, row_div_q=k, rank=rank, tp=tp,
                out=out, block_size=block, num_splits=splits)
        total += out.sum(1).cpu()
    return total


def test_combine_and_fallback_row_bins_equal_tp1():
    """The row bins (bin i = the mass of the blocks i grid points below the row's R), the drafted token's F_b and
    R - R_b that the draw reads, bitwise the same: the one pass (block_stats + combine) at TP 1 / 2 / 4 on aligned
    shards (padding NaN or above every logit), and the two-pass fallback (block_keys + block_bins) at TP 1 / 3 / 4
    on today's ceil(V / tp) shards (blocks split between ranks: edge maxima) and with tiles smaller than a block.
    Every launch equals its eager twin under the interpreter."""
    target, draft, tokens, temps, k = _inputs()
    t, d, tk, tm = (x.to(DEV) for x in (target, draft, tokens, temps))
    fused, eager = (block_stats, block_combine), (block_stats_reference, block_combine_reference)
    ref = _one_pass_bins(fused, t, d, tm, tk, k, 1, 2, NAN)
    assert ref[1].eq(0).all() and bool((ref[[0, 2, 3, 4], 0] > 0).all())  # row 1 has no finite logit
    assert ref[4, 1:STAT_BINS].eq(0).all()  # one heavy token: every other block falls out of the bins
    runs = {"one pass tp 2": _one_pass_bins(fused, t, d, tm, tk, k, 2, 3, 1e4),
            "one pass tp 4": _one_pass_bins(fused, t, d, tm, tk, k, 4, 1, NAN),
            "one pass tp 1, 7 chunks": _one_pass_bins(fused, t, d, tm, tk, k, 1, 7, NAN),
            "two passes tp 1": _two_pass_bins((block_keys, block_bins), t, d, tm, tk, k, 1, 3, 256),
            "two passes tp 3": _two_pass_bins((block_keys, block_bins), t, d, tm, tk, k, 3, 2, 1024),
            "two passes tp 4, tiles of 512": _two_pass_bins((block_keys, block_bins), t, d, tm, tk, k, 4, 2, 512)}
    if DEV == "cpu":  # the eager twins: bit for bit under the interpreter (numpy's exp2 on both sides)
        runs["one pass tp 2, eager"] = _one_pass_bins(eager, t, d, tm, tk, k, 2, 3, 1e4)
        runs["two passes tp 3, eager"] = _two_pass_bins((block_keys_reference, block_bins_reference), t, d, tm, tk,
                                                        k, 3, 2, 1024)
    for name, got in runs.items():
        assert torch.equal(got, ref), (name, (got - ref).abs().amax(0))


def test_fallback_edges_on_shards_narrower_than_a_block():
    """Shards of 100 ids (TP 4 over 397 ids): every block spans several ranks, each rank's edge slots carry its part
    of every block at a shard boundary, and the fallback's bins equal TP 1's."""
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(3, 397, generator=g) * 3).to(torch.bfloat16)
    d = (torch.randn(2, 397, generator=g) * 3).to(torch.bfloat16)
    t[0, 99:101] = 20.0  # the row max tied across a shard boundary
    t[0, 396] = 19.5  # the drafted token, near the max
    tk = torch.tensor([[396, 100]])
    tm = torch.tensor([0.9])
    t, d, tm, tk = (x.to(DEV) for x in (t, d, tm, tk))  # the launchers' device (the GPU in l0_h200)
    ref = _two_pass_bins((block_keys, block_bins), t, d, tm, tk, 2, 1, 1, 1024, vocab=397)
    assert ref[0, 0] > 0 and ref[0, STAT_BINS] > 0  # the drafted token 396 weighs something
    for tp in (2, 4):
        assert torch.equal(_two_pass_bins((block_keys, block_bins), t, d, tm, tk, 2, tp, 1, 32, vocab=397), ref), tp
