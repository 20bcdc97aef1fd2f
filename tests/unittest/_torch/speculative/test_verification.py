"""Single-rank tests of rejection-sampling verification and exact top-p: kernels equal their eager twins bit
for bit under the interpreter and within the weights' stated tolerance on a GPU; kernel vs kernel bitwise at
TP 1-4 (simulated shards) and across tilings; the integer weights match float64; top-p matches a float64
reference; greedy rows equal today's strict-acceptance path; the emitted token is distributed as the target's p
(chi-square); huge and tiny top-p sets; bf16 / fp16 (fewer radix rounds) equal fp32; the launches per call (no
memset, copy or host check besides the kernels); bad input raises ValueError naming the argument. Multi-rank TP
invariance and exchange rounds over MPI: multi_gpu/test_verification_tp.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from tensorrt_llm_ext.bench.verify import capture_graph
from tensorrt_llm_ext.kernels import fixed_point_softmax as fps
from tensorrt_llm_ext.kernels.fixed_point_softmax import fixed_point_weight_torch, weight_scale_torch
from tensorrt_llm_ext.kernels.rejection_sample import neg_log2_uniform_torch
from tensorrt_llm_ext.kernels.strict_accept import strict_accept
from tensorrt_llm_ext.mapping import vocab_shards
from tensorrt_llm_ext.speculative import value_checks, verification
from tensorrt_llm_ext.speculative.verification import (VerificationWorkspace, call_shape, rejection_sample,
                                                        rejection_sample_reference, top_p_keep, top_p_keep_reference)
from tensorrt_llm_ext.speculative.vocab_parallel import vocab_parallel_argmax
from tensorrt_llm_ext.testing.simulated_tp import simulated_rejection_sample, simulated_top_p_keep
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")


def _chi2_upper(df: int, z: float = 5.0) -> float:
    """Upper quantile of chi^2(df) by Wilson-Hilferty; z = 5 sigma (p ~ 3e-7)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def adversarial_rows(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random rows plus: a NaN, -inf columns, a row with no finite logit, a huge tie group, a flat row,
    a one-hot row, ties straddling shard boundaries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows, 8), vocab, generator=g) * 2.0
    x[0, 3] = NAN
    x[0, vocab // 2:] = -INF
    x[1] = -INF
    x[2] = x[2] * 0.05 - 5.0
    x[2, : vocab // 3] = 1.5  # big tie group holding the boundary of top-p
    x[3] = 0.0  # flat
    x[4] = -30.0
    x[4, vocab - 2] = 30.0  # mass in one token
    x[5, [0, vocab // 2, vocab - 1]] = 9.0  # ties across shards
    x[6] = torch.randint(-3, 3, (vocab,), generator=g).float()  # many ties
    return x[:rows].contiguous()


def assert_tokens_match_twin(got, ref) -> None:
    """Kernel vs eager twin, tokens: bit for bit under the interpreter (both take numpy's exp2 / log2); on a GPU
    the weights are within the stated tolerance, so a token can differ only where a decision falls inside it:
    at most one request of a call here."""
    acc, n = (t.cpu() for t in got)
    acc_r, n_r = (t.cpu() for t in ref)
    if DEV == "cpu":
        assert torch.equal(acc, acc_r) and torch.equal(n, n_r)
        return
    rows_differ = int(((acc != acc_r).any(1) | (n != n_r)).sum())
    assert rows_differ <= 1, (acc, acc_r)


def assert_mask_matches_twin(m, m_ref, x, t=None) -> None:
    """Kernel vs eager twin, top-p sets: equal under the interpreter; on a GPU both are prefixes of the same
    (logit desc, id asc) order, so one contains the other, and their float64 masses differ by at most the
    weights' tolerance (2^-18 of the row mass here, plus one token)."""
    m, m_ref = m.cpu(), m_ref.cpu()
    if DEV == "cpu":
        assert torch.equal(m, m_ref)
        return
    xf = x.cpu().double()
    tt = torch.ones(xf.shape[0], dtype=torch.float64) if t is None else t.cpu().double().clamp_min(1e-5)
    w = torch.exp((xf - torch.where(torch.isfinite(xf), xf, torch.full_like(xf, -INF)).amax(1, keepdim=True))
                  / tt[:, None]).nan_to_num(0.0)
    for r in range(m.shape[0]):
        small, big = (m[r], m_ref[r]) if m[r].sum() <= m_ref[r].sum() else (m_ref[r], m[r])
        assert bool((big | ~small).all()), r  # nested
        diff = (w[r] * (big & ~small)).sum()
        extra = w[r][big & ~small]
        assert diff <= 2.0**-18 * w[r].sum() + (extra.max() if extra.numel() else 0.0), r


# ----------------------------------------------------------------------------------------------------
# integer weights
# ----------------------------------------------------------------------------------------------------
def test_fixed_point_weight_matches_float64():
    """F = trunc(exp2((x - m) * c) * 2^30) is within the stated tolerance of float64 (on CPU numpy's exp2,
    on CUDA torch's: the twin's), exactly 2^30 at the max, 0 past 30 binades, monotone in x."""
    g = torch.Generator().manual_seed(1)
    x = (-torch.rand(200_000, generator=g) * 22.0).to(DEV)
    x[:3] = torch.tensor([0.0, -1e-30, -20.79])
    c = weight_scale_torch(torch.tensor([1.0], device=DEV))
    f = fixed_point_weight_torch(x, torch.zeros((), device=DEV), c, torch.ones_like(x, dtype=torch.bool)).cpu()
    z = ((x - 0.0) * c).cpu().double()
    exact = torch.exp2(30.0 + z)
    assert f[0].item() == 2**30
    assert bool(((f.double() - exact).abs() <= 2.0**-21 * exact + 1.0).all())
    assert bool((f[exact < 1.0] == 0).all())
    assert bool((f[:-1][x[:-1].cpu() >= x[1:].cpu()] >= f[1:][x[:-1].cpu() >= x[1:].cpu()]).all())  # monotone
    # the clamp keeps a tiny temperature finite (the API refuses it outside capture)
    assert bool(torch.isfinite(weight_scale_torch(torch.tensor([1e-45, 0.0, -1.0]))).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_weights_within_tolerance_of_twin(dtype):
    """verify_sums (kernel) vs its eager twin: every Z, F(token) within |dF| <= 2^-21 F + 1 per token summed
    over the row; under the interpreter (CPU) both take numpy's exp2, so they agree bit for bit."""
    rows, vocab = 9, 1031
    x = adversarial_rows(rows, vocab, seed=4).to(dtype).to(DEV)
    temps = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.3, 2.0, 0.5, 1.0, 1e-5], device=DEV)
    keys = torch.empty(rows, 3, 2, dtype=torch.int64, device=DEV)
    fps.verify_keys(x, None, 0, vocab, out=keys, block_size=128, num_splits=3)
    tokens = torch.randint(0, vocab, (rows, 1), device=DEV)
    size = fps.sums_layout(rows, 0, 3, True)[1]
    got, ref = (torch.empty(size, dtype=torch.int64, device=DEV) for _ in range(2))
    kw = dict(tokens=tokens, hist=True, block_size=128, num_splits=3)
    fps.verify_sums(x, None, keys, temps, 0, vocab, out=got, **kw)
    fps.verify_sums_reference(x, None, keys, temps, 0, vocab, out=ref, **kw)
    got, ref = got.view(rows, 3, -1).cpu(), ref.view(rows, 3, -1).cpu()
    if DEV == "cpu":
        assert torch.equal(got, ref)
    z, zr = got[:, :, 0].sum(1).double(), ref[:, :, 0].sum(1).double()
    assert bool(((z - zr).abs() <= 2.0**-21 * zr + vocab).all())
    ft, ftr = got[:, :, 1].sum(1).double(), ref[:, :, 1].sum(1).double()
    assert bool(((ft - ftr).abs() <= 2.0**-21 * ftr + 1).all())
    assert torch.equal(got[:, :, 2], ref[:, :, 2])  # radix keys: no transcendental


# ----------------------------------------------------------------------------------------------------
# exact top-p
# ----------------------------------------------------------------------------------------------------
def _top_p_float64(x: torch.Tensor, p: torch.Tensor, t: torch.Tensor):
    """(kept, cumulative mass before each kept token) in (logit desc, id asc) order, float64."""
    rows, vocab = x.shape
    kept = torch.zeros_like(x, dtype=torch.bool)
    margin = torch.full((rows,), INF, dtype=torch.float64)
    for r in range(rows):
        xr = x[r].double()
        fin = torch.isfinite(xr)
        if not fin.any():
            continue
        ids = torch.arange(vocab)[fin]
        vals = xr[fin]
        order = sorted(range(len(ids)), key=lambda i: (-vals[i].item(), ids[i].item()))
        ids, vals = ids[order], vals[order]
        w = torch.exp((vals - vals.max()) / t[r].double())
        cum = torch.cumsum(w / w.sum(), 0)
        n = int((cum < p[r].double()).sum().item()) + 1
        n = min(n, len(ids))
        kept[r, ids[:n]] = True
        margin[r] = (cum - p[r].double()).abs().min()
    return kept, margin


@pytest.mark.parametrize("vocab,splits,block", [(1031, 3, 256), (4099, 2, 1024)])
def test_top_p_kernel_equals_twin_and_float64(vocab, splits, block):
    x = adversarial_rows(9, vocab, seed=vocab)
    p = torch.tensor([0.9, 0.5, 0.4, 0.3, 0.99, 0.7, 0.6, 1.0, 1e-7])
    t = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.3, 1.0, 0.9, 1.0, 1.0])
    ws = VerificationWorkspace(9, 0, 0, vocab, block_size=block, num_splits=splits, device=DEV)
    xd, pd, td = x.to(DEV), p.to(DEV), t.to(DEV)
    m = top_p_keep(xd, pd, temperatures=td, workspace=ws).cpu()
    m_ref = top_p_keep_reference(xd, pd, temperatures=td).cpu()
    assert_mask_matches_twin(m, m_ref, x, t)
    assert torch.equal(m, top_p_keep(xd, pd, temperatures=td, workspace=ws).cpu())  # two runs, same mask
    ref, margin = _top_p_float64(x, p, t)
    for r in range(9):
        if margin[r] > 1e-6:
            assert torch.equal(m[r], ref[r]), (r, m[r].sum(), ref[r].sum())
    fin = torch.isfinite(x)
    assert torch.equal(m[7], fin[7])  # p = 1 keeps every finite token
    assert m[8].sum() == 1 and m[8, int(torch.argmax(x[8]))]  # tiny p keeps the (first) max only
    assert m[1].sum() == 0  # no finite logit, nothing kept
    assert not m[0, 3]  # NaN never kept
    # tie group: the kept ones are the lowest ids of the boundary value
    row2 = m[2, : vocab // 3]
    n = int(row2.sum())
    assert 0 < n < vocab // 3 and bool(row2[:n].all()) and m[2].sum() == n


def test_top_p_greedy_rows_and_padding():
    vocab = 1031  # two shards of 516: the second has 1 padded column (NaN, never read)
    x = adversarial_rows(6, vocab, seed=5).to(DEV)
    p = torch.full((6,), 0.9, device=DEV)
    t = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0], device=DEV)
    m = simulated_top_p_keep(x, p, temperatures=t, tp=2, vocab=vocab).cpu()
    assert m.shape == (6, vocab)
    assert m[0].sum() == 1 and m[3].sum() == 1  # T = 0 keeps the first maximum
    assert torch.equal(m, top_p_keep(x, p, temperatures=t).cpu())
    # a shard mostly padding (7 real ids of 64; the second column chunk is all padding): every padded column of
    # the mask is written False, whatever the out buffer held
    xs = torch.where(torch.arange(64, device=DEV) < 7, x[:, :64], torch.full_like(x[:, :64], 100.0))
    ws = VerificationWorkspace(6, 0, 0, 64, block_size=16, num_splits=3, device=DEV)
    out = torch.ones(6, 64, dtype=torch.bool, device=DEV)
    m = top_p_keep(xs, p, temperatures=t, vocab_size=7, workspace=ws, out=out).cpu()
    assert not m[:, 7:].any() and torch.equal(m[:, :7], top_p_keep(xs[:, :7].contiguous(), p, temperatures=t).cpu())


def test_shard_without_exchange_is_refused():
    """One rank without an exchange must own the whole vocabulary (issue 29): a shard's vocab_start > 0 or a
    vocab_size past its width would silently drop the other ids, so it is a ValueError."""
    x = torch.randn(2, 64, device=DEV)
    p = torch.full((2,), 0.9, device=DEV)
    with pytest.raises(ValueError, match="vocab_start / vocab_size"):
        top_p_keep(x, p, vocab_start=64, vocab_size=128)
    with pytest.raises(ValueError, match="vocab_start / vocab_size"):
        top_p_keep(x, p, vocab_size=100)
    assert top_p_keep(x, p, vocab_size=60).shape == (2, 64)  # padded columns past vocab_size are fine


# ----------------------------------------------------------------------------------------------------
# rejection_sample
# ----------------------------------------------------------------------------------------------------
def _verify_inputs(b: int, k: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(b, k + 1, vocab, generator=g) * 1.5
    draft = target[:, :k] + 0.5 * torch.randn(b, k, vocab, generator=g)
    tokens = torch.randint(0, vocab, (b, k), generator=g)
    tokens[:, 0] = target[:, 0].argmax(-1)  # likely accepted: exercises acceptance runs
    adv = adversarial_rows(8, vocab, seed)
    target[0, 1] = adv[0]
    target[1, 0] = adv[1]  # no finite logit: point mass on the argmax
    draft[1, 1] = adv[1]  # q = 0 everywhere
    target[2, 2] = adv[2]
    target[3 % b, k] = adv[4]
    draft[2, 0] = adv[5]
    temps = torch.tensor([1.0, 0.8, 0.0, 1.0, 1.2, 0.0, 0.7, 1.0])[:b].contiguous()
    seeds = torch.arange(b, dtype=torch.int64) * 7919 + 2**33
    offsets = torch.arange(b, dtype=torch.int64) * 3 + 11
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.9, 0.8, 0.6])[:b].contiguous()
    return target, draft, tokens, temps, seeds, offsets, top_p


@pytest.mark.parametrize("use_top_p,vocab,splits,b,k,block", [
    (False, 1031, 1, 8, 3, 512), (True, 1031, 2, 8, 2, 512), (True, 4099, 2, 4, 2, 1024)])
def test_rejection_sample_equals_twin(use_top_p, vocab, splits, b, k, block):
    target, draft, tokens, temps, seeds, offsets, top_p = (t.to(DEV) for t in _verify_inputs(b, k, vocab, vocab))
    tp = top_p if use_top_p else None
    ws = VerificationWorkspace.for_verification(b, k, vocab, block_size=block, num_splits=splits, device=DEV)
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=tp)
    acc, n = rejection_sample(target, draft, tokens, **kw, workspace=ws)
    acc_r, n_r = rejection_sample_reference(target, draft, tokens, **kw)
    assert_tokens_match_twin((acc, n), (acc_r, n_r))
    assert n.dtype == torch.int32 and bool(((n >= 1) & (n <= k + 1)).all())
    # out= buffers written in place, and a second run gives the same
    out = (torch.full_like(acc, 7), torch.zeros_like(n))
    res = rejection_sample(target, draft, tokens, **kw, workspace=ws, out=out)
    assert res[0] is out[0] and torch.equal(out[0], acc) and torch.equal(out[1], n)
    # emitted tokens are real vocabulary ids; the rest of a sampled row is -1
    for r in range(b):
        row = acc[r].cpu()
        assert bool(((row[: n[r]] >= 0) & (row[: n[r]] < vocab)).all())
        if temps[r] > 0:
            assert bool((row[n[r]:] == -1).all())
            assert torch.equal(row[: n[r] - 1], tokens[r, : n[r] - 1].cpu())  # accepted drafts first
    # a row with no finite target logit (request 1, position 0) emits the target argmax there if the draft
    # differs from it
    if tokens[1, 0] != target[1, 0].argmax():
        assert n[1] == 1 and acc[1, 0] == target[1, 0].argmax()


def test_greedy_rows_equal_strict_accept_path():
    b, k, vocab = 8, 3, 523
    target, draft, tokens, _, seeds, offsets, top_p = (t.to(DEV) for t in _verify_inputs(b, k, vocab, 3))
    temps = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.9, 0.0, 1.0, 0.0], device=DEV)
    # make some greedy drafts match the target argmax for a few leading positions
    t_ids = vocab_parallel_argmax(target.view(-1, vocab), 0, vocab).view(b, k + 1)
    tokens[2] = t_ids[2, :k]
    tokens[3, :2] = t_ids[3, :2]
    for tp in (None, top_p):
        acc, n = rejection_sample(target, draft, tokens, temperatures=temps, seeds=seeds, offsets=offsets, top_p=tp)
        ref_acc, ref_n = strict_accept(tokens, t_ids)
        greedy = temps == 0
        assert torch.equal(acc[greedy], ref_acc.to(torch.int64)[greedy])
        assert torch.equal(n[greedy], ref_n[greedy])
        assert n[2] == k + 1 and n[3] == 3


def _tp_invariance_inputs(b: int, k: int, vocab: int, dtype, seed: int):
    """Verification inputs with ties, NaN, -inf rows and maxima on the shard boundaries of TP 2, 3 and 4."""
    target, draft, tokens, temps, seeds, offsets, top_p = _verify_inputs(b, k, vocab, seed)
    bounds = sorted({r * -(-vocab // tp) for tp in (2, 3, 4) for r in range(1, tp)})
    for col in bounds:  # a tie group straddling each boundary, at the row max
        target[0, 0, col - 1: col + 1] = 6.0
        draft[0, 0, col - 1: col + 1] = 5.0
    target[1, 1, bounds] = 4.0
    return (target.to(dtype), draft.to(dtype), tokens, temps, seeds, offsets, top_p)


@pytest.mark.parametrize("use_top_p,dtype", [
    (False, torch.bfloat16), (True, torch.bfloat16),
    pytest.param(True, torch.float32, marks=pytest.mark.skipif(DEV == "cpu", reason="3 radix rounds: GPU only"))])
def test_kernel_tp_invariant_simulated_shards(use_top_p, dtype):
    """Kernel vs kernel: the same tokens at TP 1, 2, 3 and 4 (ranks simulated in one process on padded
    ceil(V / tp) shards, exchanges applied between them) and across column tilings. Bitwise on every
    backend: under the interpreter here, on the GPU in l0_h200."""
    b, k, vocab = 3, 2, 263  # tiny: the interpreter runs every simulated rank's programs one by one
    target, draft, tokens, temps, seeds, offsets, top_p = (
        t.to(DEV) for t in _tp_invariance_inputs(b, k, vocab, dtype, seed=21))
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p if use_top_p else None)
    ref_acc, ref_n = rejection_sample(target, draft, tokens, **kw)
    for tp, block, splits in ((1, 32, 3), (2, 64, 2), (3, 32, 2), (4, 64, 1)):
        for acc, n in simulated_rejection_sample(target, draft, tokens, tp=tp, vocab=vocab, block_size=block,
                                                 num_splits=splits, **kw):
            assert torch.equal(acc, ref_acc) and torch.equal(n, ref_n), (tp, block, splits)
    if use_top_p:
        rows = target.view(-1, vocab)
        p_rows, t_rows = top_p.repeat_interleave(k + 1), temps.repeat_interleave(k + 1)
        ref = top_p_keep(rows, p_rows, temperatures=t_rows)
        sim = simulated_top_p_keep(rows, p_rows, temperatures=t_rows, tp=3, vocab=vocab, block_size=32)
        assert torch.equal(sim, ref)


def _aligned_width(vocab: int, tp: int, align: int) -> int:
    """A shard of whole ``align``-column blocks: ``align * ceil(ceil(V / tp) / align)`` (docs/rejection_sampling.md,
    "One pass over block-aligned shards"; 1024 there, a small block here)."""
    return align * -(-(-(-vocab // tp)) // align)


@pytest.mark.parametrize("use_top_p,pad", [(False, NAN), (True, 6.0)])
def test_kernel_tp_invariant_block_aligned_shards(use_top_p, pad):
    """Shards padded to whole blocks (rank r owns ids [r W, (r + 1) W), W a multiple of the block; every id >= V
    is padding on the last rank) give the TP 1 tokens at TP 2 / 3 / 4 and across tilings, fused and eager.
    V = 199 with 16-column blocks: the last shard holds 7 real ids of 64 at TP 4 and 39 of 80 at TP 3.
    Adversarial: a tie group at the row max straddling every aligned shard boundary, a tie group at the max on
    the last real ids with the padding equal to it (pad 6.0: reading a padded column would add mass to the tie
    group and change top-p) or NaN (a padded NaN would win the argmax), drafted tokens on the last real id and
    on a boundary, NaN on a boundary, rows without a finite logit (``_verify_inputs``)."""
    b, k, vocab, align = 3, 2, 199, 16
    target, draft, tokens, temps, seeds, offsets, top_p = _verify_inputs(b, k, vocab, seed=5)
    widths = {tp: _aligned_width(vocab, tp, align) for tp in (2, 3, 4)}
    assert all((tp - 1) * w < vocab for tp, w in widths.items())  # every rank owns real ids
    bounds = sorted({r * w for tp, w in widths.items() for r in range(1, tp)})
    for col in bounds:
        target[0, 0, col - 1: col + 1] = 6.0
        draft[0, 0, col - 1: col + 1] = 5.0
    target[0, 0, vocab - 2:] = 6.0  # the tie group reaches the padding boundary
    target[2, 1, vocab - 3:] = 7.0
    draft[0, 1, vocab - 1] = 8.0  # a draft row's max on the last real id
    target[2, 0, bounds[0]] = NAN
    tokens[0, 0], tokens[0, 1], tokens[2, 1] = vocab - 1, bounds[-1], vocab - 2
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    target, draft, tokens, temps, seeds, offsets, top_p = (
        t.to(DEV) for t in (target, draft, tokens, temps, seeds, offsets, top_p))
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p if use_top_p else None)
    ref_acc, ref_n = rejection_sample(target, draft, tokens, **kw)
    # (tp, tile, chunks, fused); with top-p fewer kernel runs (the interpreter's time), the eager twin at TP 2 / 3
    configs = ((3, 32, 1, True), (4, 16, 3, True), (2, 16, 2, False), (3, 16, 2, False))
    if not use_top_p:
        configs += ((2, 16, 2, True),)
    for tp, block, splits, fused in configs:
        for acc, n in simulated_rejection_sample(target, draft, tokens, tp=tp, vocab=vocab, block_size=block,
                                                 num_splits=splits, width=widths[tp], pad_value=pad, fused=fused,
                                                 **kw):
            if fused:  # kernel vs kernel: bitwise on every backend
                assert torch.equal(acc, ref_acc) and torch.equal(n, ref_n), (tp, block, splits)
            else:  # the eager twin's pipeline on the same shards against the kernel at TP 1
                assert_tokens_match_twin((acc, n), (ref_acc, ref_n))
    if use_top_p:
        rows = target.view(-1, vocab)
        p_rows, t_rows = top_p.repeat_interleave(k + 1), temps.repeat_interleave(k + 1)
        ref = top_p_keep(rows, p_rows, temperatures=t_rows)
        sim = simulated_top_p_keep(rows, p_rows, temperatures=t_rows, tp=4, vocab=vocab, block_size=16,
                                   width=widths[4], pad_value=pad)
        assert torch.equal(sim, ref)


# ----------------------------------------------------------------------------------------------------
# one read of the logits on block-aligned shards (block weights) and the two-pass fallback
# ----------------------------------------------------------------------------------------------------
G = 1024  # kernels/block_stats.STAT_BLOCK
ONE_PASS_VOCAB = 6 * G + 7  # aligned shards of 3072 / 2048 / 2048 at TP 2 / 3 / 4: the last holds 7 real ids at TP 4


def _block_adversarial(b: int, k: int, vocab: int, seed: int):
    """Verification inputs with the row max tied across block and shard boundaries, NaN on a boundary, rows without
    a finite logit, a whole block far below the row max, drafted tokens on the last real id and on boundaries."""
    target, draft, tokens, temps, seeds, offsets, top_p = _verify_inputs(max(b, 4), k, vocab, seed)
    target, draft, tokens = target[:b].clone(), draft[:b].clone(), tokens[:b].clone()
    temps, seeds, offsets, top_p = temps[:b].clone(), seeds[:b].clone(), offsets[:b].clone(), top_p[:b].clone()
    bounds = [c for c in range(G, vocab, G)]
    for col in bounds:  # a tie at the row max straddling every block (and aligned shard) boundary
        target[0, 0, col - 1: col + 1] = 9.0
        draft[0, 0, col - 1: col + 1] = 8.0
    target[0, 0, vocab - 2:] = 9.0  # ... reaching the last real ids
    if b > 1:
        target[1, 1, :G] = -60.0  # a block ~30 binades below the row max at T = 0.8: outside the bins
        target[1, 1, bounds[0]] = NAN
        draft[1, 0, vocab - 1] = 20.0  # a draft row's max on the last real id
    tokens[0, 0], tokens[0, k - 1] = vocab - 1, bounds[-1]
    return target, draft, tokens, temps, seeds, offsets, top_p


@pytest.mark.parametrize("use_top_p,b", [(False, 1), (True, 1), (False, 4), (True, 4)])
def test_one_pass_equals_two_passes_and_twin(use_top_p, b):
    """On a block-aligned call (TP 1, tiles of whole blocks) the one-pass path (block_stats, combine, draw), the
    forced two-pass path (block_keys, block_bins, draw) and both eager twins give the same tokens, bit for bit under
    the interpreter; batch 1 and a batch mixing greedy, p = 1 and top-p requests; an odd vocabulary."""
    k, vocab = 2, 2 * G + 37
    target, draft, tokens, temps, seeds, offsets, top_p = (
        t.to(DEV) for t in _block_adversarial(b, k, vocab, seed=31))
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p if use_top_p else None)
    ws = VerificationWorkspace.for_verification(b, k, vocab, block_size=G, num_splits=3, device=DEV)
    ws_small = VerificationWorkspace.for_verification(b, k, vocab, block_size=256, num_splits=2, device=DEV)
    ref = rejection_sample(target, draft, tokens, **kw, workspace=ws)
    runs = {"two passes": rejection_sample(target, draft, tokens, **kw, workspace=ws, passes="two"),
            "tiles of 256": rejection_sample(target, draft, tokens, **kw, workspace=ws_small)}
    for name, got in runs.items():
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), name
    for passes in ("one", "two"):
        assert_tokens_match_twin(ref, rejection_sample_reference(target, draft, tokens, **kw, workspace=ws,
                                                                 passes=passes))


@pytest.mark.parametrize("use_top_p,pad", [(False, NAN), (True, 50.0)])
def test_one_pass_tp_invariant_aligned_shards(use_top_p, pad):
    """Kernel vs kernel on shards of whole 1024-id blocks, each rank reading its logits once: the TP 1 tokens at
    TP 2 / 3 / 4 and across column chunks. The last shard at TP 4 holds 7 real ids of 2048; its padding is NaN
    (a padded NaN would win the argmax) or 50, above every logit (reading it would move every block weight)."""
    b, k, vocab = 2, 2, ONE_PASS_VOCAB
    target, draft, tokens, temps, seeds, offsets, top_p = (
        t.to(DEV) for t in _block_adversarial(b, k, vocab, seed=13))
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p if use_top_p else None)
    ref_acc, ref_n = rejection_sample(target, draft, tokens, **kw)
    for tp, splits, fused in ((2, 2, True), (3, 1, False), (4, 3, True)):
        width = vocab_shards(vocab, tp).width  # the LM head's split: whole blocks
        assert width % G == 0
        for acc, n in simulated_rejection_sample(target, draft, tokens, tp=tp, vocab=vocab, block_size=G,
                                                 num_splits=splits, width=width, pad_value=pad, fused=fused, **kw):
            if fused:
                assert torch.equal(acc, ref_acc) and torch.equal(n, ref_n), (tp, splits)
            else:
                assert_tokens_match_twin((acc, n), (ref_acc, ref_n))


def test_one_pass_and_fallback_exchange_the_same_bins(monkeypatch):
    """The same aligned TP 2 shards on the one-pass and the forced two-pass path: equal tokens, and a path that is
    not aligned (today's ceil(V / tp) shards) takes the two passes with the TP 1 tokens."""
    b, k, vocab = 2, 2, ONE_PASS_VOCAB
    target, draft, tokens, temps, seeds, offsets, top_p = (
        t.to(DEV) for t in _block_adversarial(b, k, vocab, seed=7))
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=None)
    ref = rejection_sample(target, draft, tokens, **kw)
    width = vocab_shards(vocab, 2).width
    assert width % G == 0
    monkeypatch.setattr(verification, "DEFAULT_PASSES", "two")
    for w in (width, vocab_shards(vocab, 2, "ceil").width):  # aligned but forced onto two passes; ceil(V / tp)
        for acc, n in simulated_rejection_sample(target, draft, tokens, tp=2, vocab=vocab, block_size=G,
                                                 num_splits=2, width=w, **kw):
            assert torch.equal(acc, ref[0]) and torch.equal(n, ref[1]), w


# Tokens of main 81108f1 (the previous definition: every row weighed against its row max) on
# _verify_inputs(8, 3, 1031, 17) in bf16 with top-p: the requests with top-p in force (T > 0, p < 1) and the greedy
# ones must keep these bits; request 1 (p = 1) uses block weights.
_TODAY_ACC = [[323, 323, -1, -1], [0, -1, -1, -1], [559, 872, 0, 770], [693, 465, -1, -1], [996, 369, -1, -1],
              [477, 1017, 999, 337], [600, 691, -1, -1], [393, 372, -1, -1]]
_TODAY_N = [2, 1, 2, 2, 2, 2, 2, 2]


@pytest.mark.skipif(DEV != "cpu", reason="pinned interpreter bits (numpy's exp2); the GPU's SFU rounds differently")
@pytest.mark.parametrize("block", [G, 256])
def test_top_p_requests_keep_todays_bits(block):
    """Top-p requests mixed with p = 1 and greedy requests in one batch: the top-p and greedy requests return the
    previous definition's tokens (pinned), on the one-pass (tiles of 1024) and the two-pass path (tiles of 256)."""
    b, k, vocab = 8, 3, 1031
    target, draft, tokens, temps, seeds, offsets, top_p = (t.to(DEV) for t in _verify_inputs(b, k, vocab, 17))
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    ws = VerificationWorkspace.for_verification(b, k, vocab, block_size=block, num_splits=2, device=DEV)
    acc, n = rejection_sample(target, draft, tokens, temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p,
                              workspace=ws)
    kept_today = ((temps > 0) & (top_p < 1)) | (temps == 0)
    assert int(kept_today.sum()) == 7
    want_acc = torch.tensor(_TODAY_ACC, device=DEV)
    want_n = torch.tensor(_TODAY_N, dtype=torch.int32, device=DEV)
    assert torch.equal(acc[kept_today], want_acc[kept_today]) and torch.equal(n[kept_today], want_n[kept_today])


def test_passes_choice_is_by_alignment_and_the_fallback_is_logged_once(caplog, monkeypatch):
    from tensorrt_llm_ext import logger as logger_module
    from tensorrt_llm_ext.speculative.verification import choose_passes

    monkeypatch.setattr(logger_module, "_seen_once", set())  # once per process: earlier tests took these paths

    assert choose_passes(None, 4099, 1, 0, G) == "one"  # TP 1 owns every id from 0: aligned at any width
    assert choose_passes("auto", 3 * G, 4, 3 * G, G) == "one"
    with caplog.at_level("INFO"):
        for _ in range(2):
            assert choose_passes(None, 3 * G + 1, 4, 3 * G + 1, G) == "two"  # today's ceil(V / tp) width
        assert choose_passes(None, 3 * G, 2, 3 * G, 512) == "two"  # tiles smaller than a block
    lines = [r.getMessage() for r in caplog.records if "two passes" in r.getMessage()]
    assert len(lines) == 2 and "3073" in lines[0] and "512" in lines[1], lines
    with pytest.raises(ValueError, match="not block-aligned"):
        choose_passes("one", 3 * G + 1, 4, 0, G)
    with pytest.raises(ValueError, match="passes"):
        choose_passes("three", 3 * G, 4, 0, G)


@pytest.mark.parametrize("use_top_p", [False, True])
def test_emitted_token_is_distributed_as_p(use_top_p):
    """Drafts sampled from q (known seeds); the first emitted token must follow p (top-p restricted)."""
    vocab, k, draws, temp = 13, 2, 4000, 0.9
    tl_row = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.25, 3.0, -2.0, 0.75, 1.25, -0.25])
    dl_row = torch.tensor([2.0, 0.0, 1.0, 0.5, -1.0, 1.5, 1.0, -0.5, 1.0, 0.0, 0.25, -0.25, 0.5])
    target = tl_row.expand(draws, k + 1, vocab).contiguous()
    draft = dl_row.expand(draws, k, vocab).contiguous()
    g = torch.Generator().manual_seed(2024)
    q = torch.softmax(dl_row.double() / temp, 0)
    tokens = torch.multinomial(q.expand(draws * k, vocab), 1, replacement=True, generator=g).view(draws, k)
    temps = torch.full((draws,), temp)
    seeds = torch.arange(draws, dtype=torch.int64) * 104729 + 5
    offsets = torch.full((draws,), 40, dtype=torch.int64)
    top_p = torch.full((draws,), 0.8) if use_top_p else None
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p)
    # statistics on the eager twin (the interpreter is slow for thousands of rows); the kernel is checked
    # bitwise on a subset
    acc, n = rejection_sample_reference(target, draft, tokens, **kw)
    sub = slice(0, 8)
    sub_kw = dict(temperatures=temps[sub], seeds=seeds[sub], offsets=offsets[sub],
                  top_p=top_p[sub] if use_top_p else None)
    acc_k, n_k = rejection_sample(target[sub].to(DEV), draft[sub].to(DEV), tokens[sub].to(DEV),
                                  **{a: (v.to(DEV) if v is not None else None) for a, v in sub_kw.items()})
    assert_tokens_match_twin((acc_k, n_k), (acc[sub], n[sub]))
    p = torch.softmax(tl_row.double() / temp, 0)
    if use_top_p:
        kept, _ = _top_p_float64(tl_row[None], torch.tensor([0.8]), torch.tensor([temp]))
        p = torch.where(kept[0], p, torch.zeros_like(p))
        p = p / p.sum()
    counts = torch.bincount(acc[:, 0], minlength=vocab).double()
    live = p > 0
    assert counts[~live].sum() == 0  # never a token outside the top-p set
    expected = p[live] * draws
    stat = ((counts[live] - expected) ** 2 / expected).sum().item()
    assert stat < _chi2_upper(int(live.sum()) - 1), (stat, counts, expected)
    # more than strict acceptance would give: q and p differ but overlap
    assert (n > 1).float().mean() > 0.3


# ----------------------------------------------------------------------------------------------------
# extreme top-p sets: huge (flat rows, p = 0.9999) and tiny (one token holds the mass)
# ----------------------------------------------------------------------------------------------------
def _extreme_rows(rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    x = torch.zeros(rows, vocab)  # even rows flat
    x[1::2] = -30.0
    for r in range(1, rows, 2):  # odd rows: one token holds the mass
        x[r, int(torch.randint(0, vocab, (1,), generator=g))] = 30.0
    return x


def test_top_p_extreme_sets_kernel_equals_twin():
    vocab = 1031
    x = _extreme_rows(4, vocab)
    p = torch.tensor([0.9999, 0.9999, 0.99, 0.5])
    ws = VerificationWorkspace(4, 0, 0, vocab, block_size=256, num_splits=3, device=DEV)
    m = top_p_keep(x.to(DEV), p.to(DEV), workspace=ws).cpu()
    assert_mask_matches_twin(m, top_p_keep_reference(x, p), x)
    # flat: the ceil(p * V) lowest ids (all weights equal); one-hot: only the heavy token
    assert m[0].sum() == vocab and int(m[2].sum()) == math.ceil(0.99 * vocab) and bool(m[2, : m[2].sum()].all())
    for r in (1, 3):
        assert m[r].sum() == 1 and m[r, int(torch.argmax(x[r]))]


def test_rejection_sample_extreme_top_p_rows():
    b, k, vocab = 4, 2, 517
    rows = _extreme_rows(b * (k + 1), vocab).view(b, k + 1, vocab)
    target = rows.contiguous()
    draft = rows[:, :k].flip(0).contiguous()  # flat drafts where the target is one-hot and vice versa
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (b, k), generator=g)
    temps = torch.tensor([1.0, 0.9, 1.0, 1.3])
    seeds = torch.arange(b, dtype=torch.int64) + 17
    offsets = torch.arange(b, dtype=torch.int64) * 5
    top_p = torch.tensor([0.9999, 0.9999, 0.5, 0.9999])
    ws = VerificationWorkspace.for_verification(b, k, vocab, block_size=128, num_splits=3, device=DEV)
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p)
    acc, n = rejection_sample(*(t.to(DEV) for t in (target, draft, tokens)),
                              **{a: v.to(DEV) for a, v in kw.items()}, workspace=ws)
    acc_r, n_r = rejection_sample_reference(target, draft, tokens, **kw)
    assert_tokens_match_twin((acc, n), (acc_r, n_r))
    for r in range(b):
        last = int(n_r[r]) - 1
        row = target[r, last]
        if row.max() == 30.0:  # one-hot target row at the emitted position: the heavy token is emitted
            assert acc_r[r, last] == int(torch.argmax(row))


# ----------------------------------------------------------------------------------------------------
# launches and exchange rounds per call (held to the limits of the issue: 4 / 7 launches, 3 / 5 rounds)
# ----------------------------------------------------------------------------------------------------
_NOT_A_LAUNCH = ("aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.unsqueeze", "aten.as_strided",
                 "aten.alias", "aten.detach", "aten.expand", "aten.t.", "aten.split")


class _LaunchCounter(TorchDispatchMode):
    """Counts Triton launches and every torch op outside them that would be a device launch (not a view)."""

    def __init__(self):
        super().__init__()
        self.triton = 0
        self.torch_ops: list[str] = []
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not self.inside and not name.startswith(_NOT_A_LAUNCH):
            self.torch_ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(DEV != "cpu", reason="counts interpreter launches (the GPU twin is in l0_h200)")
@pytest.mark.parametrize("b,splits,dtype,block", [(1, 1, torch.bfloat16, 128), (2, 3, torch.float32, 128),
                                                  (2, 2, torch.bfloat16, 1024)])
def test_launches_and_exchange_rounds_per_call(monkeypatch, b, splits, dtype, block):
    """Tiles of 128: the two-pass path; tiles of 1024 at TP 1: the one read of the logits (the same counts)."""
    from triton.runtime.interpreter import InterpretedFunction

    counter = _LaunchCounter()
    run = InterpretedFunction.run

    def counted(self, *args, **kw):
        counter.triton += 1
        counter.inside = True
        try:
            return run(self, *args, **kw)
        finally:
            counter.inside = False

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    # as in serving (TLLM_EXT_CHECK_VALUES off) or under capture: no value checks, only the call's own launches
    monkeypatch.setattr(value_checks, "ENV", dataclasses.replace(value_checks.ENV, check_values=False))
    k, vocab = 2, 517
    target, draft, tokens, temps, seeds, offsets, top_p = _verify_inputs(max(b, 4), k, vocab, 5)
    target, draft = target[:b].to(dtype).contiguous(), draft[:b].to(dtype).contiguous()
    tokens, temps, seeds, offsets, top_p = (t[:b].contiguous() for t in (tokens, temps, seeds, offsets, top_p))
    ws = VerificationWorkspace.for_verification(b, k, vocab, block_size=block, num_splits=splits)
    out = (torch.empty(b, k + 1, dtype=torch.int64), torch.empty(b, dtype=torch.int32))
    mask = torch.empty(b * (k + 1), vocab, dtype=torch.bool)
    rows, rows_p, rows_t = target.view(-1, vocab), top_p.repeat_interleave(k + 1), temps.repeat_interleave(k + 1)
    calls = {
        ("rejection_sample", False): lambda: rejection_sample(target, draft, tokens, temperatures=temps, seeds=seeds,
                                                              offsets=offsets, out=out, workspace=ws),
        ("rejection_sample", True): lambda: rejection_sample(target, draft, tokens, temperatures=temps, seeds=seeds,
                                                             offsets=offsets, top_p=top_p, out=out, workspace=ws),
        ("top_p_keep", True): lambda: top_p_keep(rows, rows_p, temperatures=rows_t, out=mask, workspace=ws),
    }
    for key, call in calls.items():
        counter.triton, counter.torch_ops = 0, []
        with counter:
            call()
        assert counter.torch_ops == [], (key, counter.torch_ops)  # no memset, copy or host check
        assert counter.triton == call_shape(*key, dtype)[0], (key, counter.triton)
    # the limits (4 / 7 launches, 3 / 5 rounds): met without top-p; with bf16 top-p 9 launches and 6 rounds
    # (round 0 has its own launch and exchange since the window replaced it in verify_sums, and the window's
    # boundary its own one-program-per-row launch; rows the window resolves skip the rounds; the top-p requests'
    # sums pass follows the block statistics and their combine)
    assert call_shape("rejection_sample", False) == (4, 3)
    if dtype == torch.bfloat16:
        assert call_shape("rejection_sample", True, dtype) == (9, 6)
        assert call_shape("top_p_keep", True, dtype) == (7, 5)


def _window_sums(x, q, temps, tokens, vocab, block, splits):
    """verify_sums with the top-p window on target rows ``x`` and draft rows ``q`` (one chunk plan), kernel and twin:
    asserts their window counts equal (exact on any device; every column on the CPU) and returns ``(keys, the twin's
    sums, win)``, ``win(sums)`` the ``[rows, splits, 256]`` window counts."""
    rows_t, rows_q = x.shape[0], q.shape[0]
    kw = dict(block_size=block, num_splits=splits)
    keys = fps.verify_keys_reference(x, q, 0, vocab, out=torch.empty(rows_t + rows_q, splits, 2, dtype=torch.int64,
                                                                      device=DEV), **kw)
    cols_t, size = fps.sums_layout(rows_t, rows_q, splits, True)
    got, ref = (fn(x, q, keys, temps, 0, vocab, tokens=tokens, row_div=1, row_div_q=1, hist=True,
                   out=torch.full((size,), -7, dtype=torch.int64, device=DEV), **kw)
                for fn in (fps.verify_sums, fps.verify_sums_reference))
    win = lambda t: t[: rows_t * splits * cols_t].view(rows_t, splits, cols_t)[:, :, fps.SUMS_COLS:]  # noqa: E731
    assert torch.equal(win(got).cpu(), win(ref).cpu())
    if DEV == "cpu":
        assert torch.equal(got, ref)
    return keys, ref, win


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_window_counts_equal_twin_and_resolve_as_the_rounds(dtype):
    """verify_sums' top-p window (the count of each of the 256 dtype values at and below the row max): kernel ==
    twin, target and draft rows in one launch, on adversarial rows (NaN, -inf rows, ties across chunks) and on
    rows whose values span many binades. Where the window resolves a row, its boundary and mass above equal what
    the radix rounds alone find; rows below the window are left to the rounds."""
    from tensorrt_llm_ext.kernels import top_p as tpk
    rows_t, rows_q, width, vocab, block, splits = 6, 2, 260, 257, 64, 2
    g = torch.Generator().manual_seed(11)
    x = adversarial_rows(rows_t, width, seed=4)
    mag = torch.exp2(torch.rand(2, width, generator=g) * 25 - 20)
    x[3:5] = mag * torch.where(torch.rand(2, width, generator=g) < 0.5, -1.0, 1.0)
    x[:, vocab:] = NAN  # padding, never read
    x = x.to(dtype).to(DEV)
    q = torch.randn(rows_q, width, generator=g).to(dtype).to(DEV)
    temps = torch.tensor([1.0, 0.7, 4.0, 3.0, 1.0, 0.0], device=DEV)
    top_p = torch.tensor([0.9, 0.5, 0.3, 0.999, 0.95, 0.9], device=DEV)
    tokens = torch.tensor([[5], [200], [0], [256], [17], [130]], device=DEV)
    keys, ref, win = _window_sums(x, q, temps, tokens, vocab, block, splits)
    kw = dict(block_size=block, num_splits=splits)
    cols_t, _ = fps.sums_layout(rows_t, rows_q, splits, True)
    # the window's boundary == the rounds' boundary: the rounds run on sums whose window is empty
    sums = ref[: rows_t * splits * cols_t].view(rows_t, splits, cols_t)
    blind = sums.clone()
    blind[:, :, fps.SUMS_COLS:] = 0
    c, m, tau = tpk._row_setup_torch(keys, temps, top_p, sums, 1)
    wres, wkey, wmass = tpk.window_resolve_torch(win(ref), m, c, tau, fps.key_shift(dtype))
    n = tpk.radix_rounds(dtype)
    states = []
    for s_in in (sums, blind):
        window = torch.full((rows_t, 2), -7, dtype=torch.int64, device=DEV)
        tpk.top_p_window(x, keys, temps, top_p, s_in, window, 0, vocab, **kw)  # the kernel: once per row
        want = torch.full_like(window, -7)
        tpk.top_p_window_reference(x, keys, temps, top_p, s_in, want, 0, vocab, **kw)
        assert torch.equal(window, want)
        got = []
        for round_fn, ties_fn in ((tpk.top_p_round, tpk.top_p_ties),  # the kernels: resolved rows skip their scans
                                  (tpk.top_p_round_reference, tpk.top_p_ties_reference)):
            st = torch.full((4, rows_t, 2), -7, dtype=torch.int64, device=DEV)
            h = torch.full((4, rows_t, splits, 256), -7, dtype=torch.int64, device=DEV)
            for rnd in range(n + 1):
                round_fn(x, keys, temps, top_p, s_in, h[rnd - 1] if rnd else None, st[max(rnd - 2, 0)],
                         st[max(rnd - 1, 0)], h[rnd], 0, vocab, rnd, window=window, **kw)
            ties = torch.full((rows_t, splits, 2), -7, dtype=torch.int64, device=DEV)
            ties_fn(x, keys, temps, top_p, s_in, h[n], st[n - 1], st[3], ties, 0, vocab, window=window,
                    skip_bits=8 * (3 - n), **kw)
            got.append((st[: n + 1].clone(), st[3].clone(), h[: n + 1].clone(), ties))
        (st_k, b_k, h_k, ties_k), (st_r, b_r, h_r, ties_r) = got
        assert torch.equal(st_k, st_r) and torch.equal(b_k, b_r) and torch.equal(ties_k, ties_r)
        if DEV == "cpu":
            assert torch.equal(h_k, h_r)
        else:  # weights within the SFU tolerance of the twin's
            assert bool(((h_k - h_r).abs() <= h_r.abs() * 2.0**-20 + 256).all())
        st = got[1]
        states.append((st[1], window))
    assert torch.equal(states[0][0], states[1][0])
    assert bool(wres.any()) and not bool(wres.all())  # both paths taken
    assert torch.equal(states[0][0][wres], torch.stack([wkey, wmass], 1)[wres])
    # the window's state: (b*, mass above) where it resolves the row, (-1, 0) elsewhere; a blind window none
    assert torch.equal(states[0][1], torch.where(wres[:, None], torch.stack([wkey, wmass], 1), torch.tensor([-1, 0],
                                                                                                       device=DEV)))
    assert bool((states[1][1] == torch.tensor([-1, 0], device=DEV)).all())


def test_window_counts_a_model_scale_row_in_full():
    """A language model's bf16 rows (N(0, 4^2), the max at 20: the window's 256 values reach down to ~5, about a
    tenth of the row): the per-program count (tl.histogram) equals the twin's, and bin j holds exactly the finite
    tokens whose bf16 bit pattern is the max's minus j (positive values: consecutive patterns are consecutive
    values), across chunk boundaries, with NaN / -inf columns and an all -inf row (no bin counted)."""
    rows_t, rows_q, width, vocab, block, splits = 3, 1, 1100, 1097, 128, 3
    g = torch.Generator().manual_seed(5)
    x = 4.0 * torch.randn(rows_t, width, generator=g)
    x[:2, :4] = 20.0  # the max, tied across the first columns
    x[1, 300:400] = float("-inf")
    x[1, 500] = NAN
    x[2] = float("-inf")
    x[:, vocab:] = NAN  # padding, never read
    x = x.to(torch.bfloat16).to(DEV)
    q = torch.randn(rows_q, width, generator=g).to(torch.bfloat16).to(DEV)
    temps = torch.tensor([1.0, 1.0, 1.0], device=DEV)
    tokens = torch.tensor([[5], [200], [0]], device=DEV)
    _, sums, win = _window_sums(x, q, temps, tokens, vocab, block, splits)
    bins = win(sums).sum(dim=1).cpu()  # [rows, 256]: the chunks' counts added
    assert bins[2].sum() == 0  # no finite token: no bin
    bits = x[:, :vocab].cpu().view(torch.int16).long()
    for r in (0, 1):
        xr = x[r, :vocab].float().cpu()
        fin = torch.isfinite(xr)
        j = bits[r][fin].max() - bits[r]  # the max is positive: j counts bf16 values below it
        hit = fin & (xr > 0) & (j < 256)
        assert torch.equal(bins[r], torch.bincount(j[hit], minlength=256))
        assert 0.05 * vocab < hit.sum() < 0.2 * vocab


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_last_radix_round_counts_equal_weighted_twin(dtype):
    """The dtype's last radix round histograms counts times each bucket's one weight (no atomics): the same
    int64 buckets as the twin's weighted adds on adversarial values (+-0, fp32 subnormals, NaN, +-inf, ties across
    chunk boundaries, the boundary inside a big tie group), at an odd width with padded columns."""
    from tensorrt_llm_ext.kernels import top_p as tpk
    rows, width, vocab, block, splits = 6, 301, 297, 64, 3  # 4 padded columns, 3 chunks of 128
    x = adversarial_rows(rows, width, seed=3)
    x[3, :40] = 0.0
    x[3, 40:80] = -0.0
    if dtype == torch.float32:  # the interpreter flushes bf16 subnormals to zero on conversion (torch does not)
        x[3, 80:90] = 1e-40
        x[3, 90:95] = -1e-40
    x[5, 100:260] = 2.0  # ties across both chunk boundaries, holding the boundary
    x[:, vocab:] = NAN  # padding, never read
    x = x.to(dtype).to(DEV)
    temps = torch.tensor([1.0, 0.7, 1.0, 2.0, 1.0, 0.5], device=DEV)
    top_p = torch.tensor([0.9, 0.5, 0.3, 0.8, 0.99, 0.6], device=DEV)
    n = tpk.radix_rounds(dtype)
    kw = dict(block_size=block, num_splits=splits)
    keys = fps.verify_keys_reference(x, None, 0, vocab, out=torch.empty(rows, splits, 2, dtype=torch.int64,
                                                                         device=DEV), **kw)
    cols_t, size = fps.sums_layout(rows, 0, splits, True)
    sums = fps.verify_sums_reference(x, None, keys, temps, 0, vocab, hist=True,
                                     out=torch.empty(size, dtype=torch.int64, device=DEV), **kw)
    sums = sums.view(rows, splits, cols_t)
    sums[:, :, fps.SUMS_COLS:] = 0  # an empty window: every row is left to the rounds (their subject here)
    unresolved = torch.tensor([[-1, 0]] * rows, dtype=torch.int64, device=DEV)
    prev, state = None, torch.zeros(rows, 2, dtype=torch.int64, device=DEV)
    for rnd in range(n + 1):
        outs = []
        for fn in (tpk.top_p_round, tpk.top_p_round_reference):
            st = torch.full((rows, 2), -7, dtype=torch.int64, device=DEV)
            h = torch.full((rows, splits, 256), -7, dtype=torch.int64, device=DEV)
            fn(x, keys, temps, top_p, sums, prev, state, st, h, 0, vocab, rnd, window=unresolved, **kw)
            outs.append((st, h))
        (st, h), (st_r, h_r) = outs
        assert torch.equal(st.cpu(), st_r.cpu()), rnd
        if DEV == "cpu":
            assert torch.equal(h.cpu(), h_r.cpu()), rnd
        else:  # weights within the SFU tolerance of the twin's
            assert bool(((h - h_r).abs() <= h_r.abs() * 2.0**-20 + 256).all()), rnd
        assert bool((h >= 0).all()) and h.sum() > 0
        prev, state = h_r, st_r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_dtypes_skip_radix_rounds_exactly(dtype):
    """bf16 / fp16 logits run 1 / 2 radix rounds instead of 3: the same kept sets and tokens as the same
    values in fp32 (all rounds), at a tie-heavy vocabulary."""
    b, k, vocab = 3, 2, 523
    target, draft, tokens, temps, seeds, offsets, top_p = _verify_inputs(b, k, vocab, 9)
    target[0, 0, :200] = 1.0  # a tie group at the boundary
    target, draft = target.to(dtype), draft.to(dtype)
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p)
    narrow = rejection_sample(target.to(DEV), draft.to(DEV), tokens.to(DEV), **{a: v.to(DEV) for a, v in kw.items()})
    wide = rejection_sample_reference(target.float(), draft.float(), tokens, **kw)
    assert_tokens_match_twin(narrow, wide)
    rows = target.view(-1, vocab)
    p_rows = torch.tensor([0.9, 0.3, 0.999, 0.5, 0.7, 0.95, 0.2, 0.8, 0.6])
    m = top_p_keep(rows.to(DEV), p_rows.to(DEV)).cpu()
    assert_mask_matches_twin(m, top_p_keep_reference(rows.float(), p_rows), rows)
    assert torch.equal(top_p_keep_reference(rows.float(), p_rows), top_p_keep_reference(rows, p_rows))


def test_race_exponential_is_positive_and_close_to_float64():
    words = torch.cat([torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 2, 2**32 - 1]),
                       torch.randint(0, 2**32, (20000,))])
    e = neg_log2_uniform_torch(words)
    u = ((words >> 9).double() + 0.5) * 2.0**-23
    exact = -torch.log2(u)
    assert bool((e > 0).all())
    assert float(((e.double() - exact).abs() / exact).max()) < 1e-6


# ----------------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------------
def test_bad_input_raises_value_error():
    b, k, vocab = 2, 2, 64
    target = torch.randn(b, k + 1, vocab, device=DEV)
    draft = torch.randn(b, k, vocab, device=DEV)
    tokens = torch.zeros(b, k, dtype=torch.int64, device=DEV)
    temps = torch.ones(b, device=DEV)
    seeds = torch.zeros(b, dtype=torch.int64, device=DEV)
    offs = torch.zeros(b, dtype=torch.int64, device=DEV)
    kw = dict(temperatures=temps, seeds=seeds, offsets=offs)

    def bad(name, **over):
        args = dict(target_logits=target, draft_logits=draft, draft_tokens=tokens, **kw)
        args.update(over)
        with pytest.raises(ValueError, match=name):
            rejection_sample(args.pop("target_logits"), args.pop("draft_logits"), args.pop("draft_tokens"), **args)

    bad("draft_logits", draft_logits=torch.randn(b, k + 1, vocab, device=DEV))
    bad("target_logits", target_logits=torch.randn(b, vocab, device=DEV))
    bad("target_logits", target_logits=target.to(torch.int32))
    bad("draft_tokens", draft_tokens=tokens.to(torch.int32))
    bad("draft_tokens", draft_tokens=torch.full((b, k), vocab, dtype=torch.int64, device=DEV))
    bad("draft_tokens", draft_tokens=torch.full((b, k), -1, dtype=torch.int64, device=DEV))
    bad("temperatures", temperatures=torch.tensor([1.0, -0.5], device=DEV))
    bad("temperatures", temperatures=torch.ones(b + 1, device=DEV))
    bad("temperatures", temperatures=torch.tensor([1e-6, 1.0], device=DEV))  # below contract.MIN_TEMPERATURE
    bad("seeds", seeds=torch.zeros(b, dtype=torch.int32, device=DEV))
    bad("top_p", top_p=torch.tensor([0.5, 1.5], device=DEV))
    bad("top_p", top_p=torch.tensor([0.0, 0.5], device=DEV))
    bad("vocab_size", vocab_size=0)
    bad("vocab_start", vocab_start=vocab, vocab_size=vocab)
    bad("exchange", exchange=object())
    small = VerificationWorkspace.for_verification(1, k, vocab)
    bad("workspace", workspace=small)
    with pytest.raises(ValueError, match="top_p"):
        top_p_keep(target[:, 0], torch.tensor([0.5, 2.0], device=DEV))
    with pytest.raises(ValueError, match="logits"):
        top_p_keep(target, torch.tensor([0.5, 0.5], device=DEV))


# ----------------------------------------------------------------------------------------------------
# GPU: large vocabulary and CUDA-graph replay
# ----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_large_vocab_and_graph_replay(dtype):
    b, k, vocab = 8, 7, 200064
    target, draft, tokens, temps, seeds, offsets, top_p = _verify_inputs(b, k, vocab, 11)
    target, draft = target.to("cuda", dtype), draft.to("cuda", dtype)
    tokens, temps, seeds, offsets, top_p = (t.cuda() for t in (tokens, temps, seeds, offsets, top_p))
    ws = VerificationWorkspace.for_verification(b, k, vocab, device="cuda", num_splits=8)
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=top_p, workspace=ws)
    acc, n = rejection_sample(target, draft, tokens, **kw)
    acc_r, n_r = rejection_sample_reference(target, draft, tokens, temperatures=temps, seeds=seeds,
                                            offsets=offsets, top_p=top_p)
    assert_tokens_match_twin((acc, n), (acc_r, n_r))
    # kernel vs kernel at TP 4 (simulated shards of 50016 columns, the production tiling: the two-pass fallback;
    # and block-aligned shards of 50176: one read of the logits): bitwise
    for width in (None, 50176):
        for acc4, n4 in simulated_rejection_sample(target, draft, tokens, tp=4, vocab=vocab, block_size=1024,
                                                   num_splits=32, width=width, temperatures=temps, seeds=seeds,
                                                   offsets=offsets, top_p=top_p):
            assert torch.equal(acc4, acc) and torch.equal(n4, n), width
    t_rows = temps.repeat_interleave(k + 1).clamp_min(0.5)
    mask = top_p_keep(target.view(-1, vocab), top_p.repeat_interleave(k + 1), temperatures=t_rows)
    mask_r = top_p_keep_reference(target.view(-1, vocab), top_p.repeat_interleave(k + 1), temperatures=t_rows)
    assert_mask_matches_twin(mask, mask_r, target.view(-1, vocab).float(), t_rows)
    out = (torch.empty_like(acc), torch.empty_like(n))
    graph = capture_graph(lambda: rejection_sample(target, draft, tokens, **kw, out=out))
    out[0].fill_(-7)
    offsets.add_(1)  # new draws, same graph
    graph.replay()
    torch.cuda.synchronize()
    acc2, n2 = rejection_sample(target, draft, tokens, **kw)
    assert torch.equal(out[0], acc2) and torch.equal(out[1], n2)
    with pytest.raises(Exception):
        with graph_capture(torch.cuda.CUDAGraph()):
            rejection_sample(target, draft, tokens, temperatures=temps, seeds=seeds, offsets=offsets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_launch_count_and_graph_capture(dtype):
    """One captured call replays exactly call_shape() device launches (kernels, and no memset or copy), and
    the replay equals the eager call, without and with top-p, at V_local = 50016 and 8 column chunks, on the one-pass
    path (TP 1) and the forced two-pass path."""
    from torch.profiler import ProfilerActivity, profile

    b, k, vocab = 8, 7, 50016
    target, draft, tokens, temps, seeds, offsets, top_p = _verify_inputs(b, k, vocab, 13)
    target, draft = target.to("cuda", dtype), draft.to("cuda", dtype)
    tokens, temps, seeds, offsets, top_p = (t.cuda() for t in (tokens, temps, seeds, offsets, top_p))
    ws = VerificationWorkspace.for_verification(b, k, vocab, device="cuda", num_splits=8)
    for tp_arg, passes in ((None, "auto"), (top_p, "auto"), (None, "two"), (top_p, "two")):
        out = (torch.empty(b, k + 1, dtype=torch.int64, device="cuda"),
               torch.empty(b, dtype=torch.int32, device="cuda"))
        kw = dict(temperatures=temps, seeds=seeds, offsets=offsets, top_p=tp_arg, workspace=ws, passes=passes)
        graph = capture_graph(lambda: rejection_sample(target, draft, tokens, **kw, out=out))
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(launches) == call_shape("rejection_sample", tp_arg is not None, dtype)[0], launches
        acc, n = rejection_sample(target, draft, tokens, **kw)
        assert torch.equal(out[0], acc) and torch.equal(out[1], n)
