"""Single-rank tests of vocab-parallel selection: the shard-select kernel (CPU interpreter and GPU),
the functional layer, the LM head and the selection decision.

A TP exchange is simulated in one process by reducing each shard to its key and taking the max, which
is exactly what the all-reduce MAX of :class:`PairExchange` does.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.contract import BuildRefusal
from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY, LOG2E_F32, key_to_id_torch, one_minus_uniform, one_plus_top
from tensorrt_llm_ext.kernels.shard_select import (DRAFT_SALT, TARGET_SALT, _bf16_words, _bound_lift, _bound_sum,
                                                   make_shard_select_scratch, shard_select_keys,
                                                   shard_select_keys_reference)
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.modules.lm_head import LMHead
from tensorrt_llm_ext.modules.linear import TensorParallelMode
from tensorrt_llm_ext.modules.logits_processor import LogitsProcessor
from tensorrt_llm_ext.speculative.selection_decision import (VocabParallelSelection, local_draft_failures,
                                                             local_target_failures)
from tensorrt_llm_ext.speculative.token_selector import SelectionParams
from tensorrt_llm_ext.speculative.vocab_parallel import (VocabShardedLogits, gathered_argmax, gumbel_sample,
                                                         vocab_parallel_argmax)
from tensorrt_llm_ext.speculative.worker_base import VocabParallelSelectionMixin
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]  # CPU tensors need the interpreter
NAN, INF = float("nan"), float("inf")


def _adversarial(rows_v: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Rows that break naive argmaxes: NaN (several), ties (across shard boundaries), -inf, all-NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows_v, 8), vocab, generator=g)
    x[0, 5] = NAN
    x[0, vocab - 3] = NAN
    x[0, 1] = 100.0  # a larger value before the first NaN must still lose
    x[1] = -INF
    x[2] = NAN
    x[3, :] = 1.0  # all tied: lowest index
    x[4, vocab // 3] = 50.0
    x[4, vocab // 2] = 50.0
    x[4, vocab - 1] = 50.0
    x[5] = -INF
    x[5, vocab - 1] = -6e4  # the only finite value (fp16-representable) sits at the very end
    x[6, vocab - 2] = 0.0
    x[6, 3] = -0.0  # -0.0 and +0.0 tie: lowest index, if nothing else is positive
    x[6] = torch.where(x[6] > 0, -x[6], x[6])
    x[6, 3], x[6, vocab - 2] = -0.0, 0.0
    return x[:rows_v].to(dtype).to(device)


def _simulated_tp_keys(x: torch.Tensor, tp: int, vocab: int, **kw) -> torch.Tensor:
    """Split ``[R, V]`` like a COLUMN LMHead (zero-padded last shard), select per shard, take the max key."""
    width = -(-vocab // tp)
    pad = width * tp - vocab
    xp = torch.cat([x, torch.zeros(x.shape[0], pad, dtype=x.dtype, device=x.device)], dim=1)
    keys = torch.stack([shard_select_keys(xp[:, r * width:(r + 1) * width], r * width, vocab, **kw)
                        for r in range(tp)])
    return keys.max(dim=0).values


def _simulated_tp(x: torch.Tensor, tp: int, vocab: int, **kw) -> torch.Tensor:
    """:func:`_simulated_tp_keys` -> the winners' global ids."""
    return key_to_id_torch(_simulated_tp_keys(x, tp, vocab, **kw))


# ----------------------------------------------------------------------------------------------------
# Argmax
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_order_matches_torch(device, dtype):
    vocab = 1999
    x = _adversarial(8, vocab, dtype, device)
    expected = torch.argmax(x.float(), dim=1)
    for block, splits in ((2048, 1), (256, None), (64, 5)):
        ids = vocab_parallel_argmax(x, 0, vocab)
        assert torch.equal(ids, expected)
        keys = shard_select_keys(x, 0, vocab, block_size=block, num_splits=splits)
        assert torch.equal(keys, shard_select_keys_reference(x, 0, vocab)), (block, splits)
        assert torch.equal(key_to_id_torch(keys), expected)
    # Known winners, stated explicitly.
    assert ids[0].item() == 5 and ids[1].item() == 0 and ids[2].item() == 0 and ids[3].item() == 0
    assert ids[4].item() == vocab // 3 and ids[5].item() == vocab - 1 and ids[6].item() == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_simulated_tp_argmax_with_padded_shard(device, tp):
    vocab = 1001  # uneven at tp 2/3/4 (pad 1/1/3)
    x = _adversarial(8, vocab, torch.bfloat16, device, seed=tp)
    x[7] = -INF  # padded zero columns would beat every real column if they were not masked
    ids = _simulated_tp(x, tp, vocab, block_size=64)
    assert torch.equal(ids, torch.argmax(x.float(), dim=1))
    assert ids[7].item() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_padded_columns_never_win(device):
    vocab, width = 700, 256  # tp 3 shards of 256: the last has 188 real + 68 padded columns
    shard = torch.full((3, width), -INF, device=device)
    shard[:, 188:] = 0.0  # padded columns hold logit 0 (zero weight rows)
    keys = shard_select_keys(shard, 512, vocab, block_size=32, num_splits=4)
    assert torch.equal(key_to_id_torch(keys), torch.full((3,), 512, device=device))
    # A shard made only of padding (a shard past the vocabulary) contributes the empty key.
    keys = shard_select_keys(shard[:, 188:], 700 - 1, vocab)  # one real column
    assert torch.equal(key_to_id_torch(keys), torch.full((3,), 699, device=device))
    empty = shard_select_keys_reference(shard, 512, 512 + 1)
    assert key_to_id_torch(empty)[0].item() == 512
    keys = shard_select_keys(torch.zeros(2, 0, device=device), 0, 5)
    assert torch.equal(keys, torch.full((2,), EMPTY_KEY, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows(device, dtype):
    vocab = 777
    base = _adversarial(6, 1000, dtype, device, seed=3)
    x = base[:, 100:100 + vocab]  # row stride 1000, offset start
    assert not x.is_contiguous()
    assert torch.equal(vocab_parallel_argmax(x, 0, vocab), torch.argmax(x.float(), dim=1))
    every_other = base[::2, :vocab]
    assert torch.equal(vocab_parallel_argmax(every_other, 0, vocab), torch.argmax(every_other.float(), dim=1))


@pytest.mark.parametrize("device", DEVICES)
def test_random_rows_many_shapes(device):
    g = torch.Generator().manual_seed(1)
    for rows, vocab in ((1, 3), (3, 1023), (5, 2049), (2, 4097)):
        x = (torch.randn(rows, vocab, generator=g) * 3).round().to(torch.bfloat16).to(device)  # many ties
        assert torch.equal(vocab_parallel_argmax(x, 0, vocab), torch.argmax(x.float(), dim=1))
        assert torch.equal(_simulated_tp(x, 3, vocab, block_size=128), torch.argmax(x.float(), dim=1))


# ----------------------------------------------------------------------------------------------------
# Gumbel-max
# ----------------------------------------------------------------------------------------------------
def _sampling_inputs(rows, device, temperature=1.0, seed=1234, offset0=0):
    return (torch.full((rows,), temperature, dtype=torch.float32, device=device),
            torch.full((rows,), seed, dtype=torch.int64, device=device),
            torch.arange(offset0, offset0 + rows, dtype=torch.int64, device=device))


def _chi2_upper(df: int, z: float = 5.0) -> float:
    """Upper quantile of chi^2(df) by Wilson-Hilferty; z = 5 sigma (p ~ 3e-7): a conservative bound."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gumbel_matches_softmax_chi_square(device, temperature):
    vocab, draws = 13, 3000
    logits = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.25, 3.0, -2.0, 0.75, 1.25, -0.25]])
    x = logits.expand(draws, vocab).contiguous().to(device)
    temps, seeds, offsets = _sampling_inputs(draws, device, temperature, seed=99)
    if device == "cpu":
        # The interpreter runs one program per row (too slow for thousands of draws): take the
        # statistics on the eager twin and check that the kernel draws bit-identically on a subset.
        ids = shard_select_keys_reference(x, 0, vocab, temps, seeds, offsets, return_ids=True)
        sub = slice(0, 48)
        mismatch = gumbel_sample(x[sub], temps[sub], seeds[sub], offsets[sub], 0, vocab) != ids[sub]
        assert mismatch.sum().item() <= 1  # only an ulp-level near-tie could flip
    else:
        ids = gumbel_sample(x, temps, seeds, offsets, 0, vocab).cpu()
    counts = torch.bincount(ids, minlength=vocab).double()
    expected = torch.softmax(logits[0].double() / temperature, dim=0) * draws
    stat = ((counts - expected) ** 2 / expected).sum().item()
    assert stat < _chi2_upper(vocab - 1), (stat, counts, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_keying(device):
    vocab, rows = 777, 6
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, vocab, generator=g).to(device)
    temps, seeds, offsets = _sampling_inputs(rows, device, 1.0, seed=42, offset0=10)
    seeds[3] = 2**40 + 5  # high seed word
    offsets[4] = 2**33 + 1  # high offset word
    ref = gumbel_sample(x, temps, seeds, offsets, 0, vocab)
    # Kernel vs eager twin: bitwise under the interpreter (the same fp32 ops, numpy's log2 on both sides);
    # on GPU the SFU log2 differs from torch's by ulps, which can only flip a near-tie.
    twin = shard_select_keys_reference(x, 0, vocab, temps, seeds, offsets, return_ids=True)
    if device == "cpu":
        assert torch.equal(twin, ref)
        keys = shard_select_keys(x, 0, vocab, temps, seeds, offsets)
        assert torch.equal(keys, shard_select_keys_reference(x, 0, vocab, temps, seeds, offsets))
    else:
        assert (twin != ref).sum().item() <= 1
    # Same draw at every block size, split count and simulated TP size (noise keyed by global id).
    for block, splits in ((64, 5), (256, None), (2048, 1)):
        keys = shard_select_keys(x, 0, vocab, temps, seeds, offsets, block_size=block, num_splits=splits)
        assert torch.equal(key_to_id_torch(keys), ref)
    for tp in (2, 3):
        assert torch.equal(_simulated_tp(x, tp, vocab, temperatures=temps, seeds=seeds, offsets=offsets), ref)
    # Same (seed, offset) -> same token; rows 0..5 repeat.
    assert torch.equal(gumbel_sample(x, temps, seeds, offsets, 0, vocab), ref)
    # Flat logits make the draw depend on the noise only: distinct keys give distinct draws (w.h.p.:
    # two independent draws over 257 ids collide with probability 1/257).
    n, v = 24, 257
    flat = torch.zeros(n, v, device=device)
    tn, sn, on = _sampling_inputs(n, device, 1.0, seed=42)
    a = gumbel_sample(flat, tn, sn, on, 0, v)
    assert torch.equal(gumbel_sample(flat, tn, sn, on.clone(), 0, v), a)
    assert (gumbel_sample(flat, tn, sn, on + 1000, 0, v) != a).sum() >= n - 4
    assert (gumbel_sample(flat, tn, sn + 1, on, 0, v) != a).sum() >= n - 4
    assert (gumbel_sample(flat, tn, sn, on, 0, v, salt=DRAFT_SALT) != a).sum() >= n - 4
    assert a.unique().numel() >= n - 4  # different offsets in one batch draw different tokens


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_unaligned_shard_starts(device):
    """The noise of id g is word g % 4 of Philox block g // 4; the kernel computes one block per four
    columns of its tile. Shards starting at ids 4n+1, 4n+2, 4n+3 (odd widths) must draw exactly the ids'
    own words: every simulated TP size gives the TP 1 keys bit for bit, at several block sizes and splits
    (flat rows make the draw the argmax of the noise alone, so a shifted word would move it)."""
    vocab, rows = 203, 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, vocab, generator=g)
    x[:2] = 0.0  # flat rows: the winner is the noise's argmax
    x = x.to(torch.bfloat16).to(device)
    temps, seeds, offsets = _sampling_inputs(rows, device, 1.0, seed=2**35 + 3, offset0=2**32 - 2)
    temps[3] = 0.0  # one greedy row among them
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets)
    full = shard_select_keys(x, 0, vocab, **kw)
    # Kernel vs eager twin: the uniforms are exact, the logs (numpy / GPU vs torch) may differ by an ulp,
    # which can only flip a near-tie of the noisy score.
    twin = shard_select_keys_reference(x, 0, vocab, temps, seeds, offsets)
    assert (key_to_id_torch(full) != key_to_id_torch(twin)).sum().item() <= 1
    # tp 2/4/5: widths 102, 51, 41 -> shard starts 102, 51, 102, 153, 41, 82, 123, 164 (every phase mod 4)
    for tp, (block, splits) in ((2, (32, 2)), (4, (16, 2)), (5, (64, None))):
        assert torch.equal(_simulated_tp_keys(x, tp, vocab, block_size=block, num_splits=splits, **kw), full), tp
    # One shard at every phase: its winner among its own ids, as the eager twin draws it.
    for start in (1, 2, 3):
        shard = x[:, start:start + 61]
        keys = shard_select_keys(shard, start, vocab, temps, seeds, offsets, block_size=32, num_splits=1)
        ref = shard_select_keys_reference(shard, start, vocab, temps, seeds, offsets)
        assert (key_to_id_torch(keys) != key_to_id_torch(ref)).sum().item() <= 1, start


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_skip_bound_keeps_the_exact_winner(device):
    """The sampled kernel skips the exact score of a tile when a bound says no element can beat the
    program's best so far. Rows built so that the bound is decisive -- a dominant logit early with a NaN,
    an inf or the real winner late, all -inf, huge magnitudes (the slack scales with them), flat rows (no
    skipping) -- give the eager twin's keys, the same at every tile, split and simulated TP size (shard
    starts at every phase mod 4)."""
    vocab = 263
    g = torch.Generator().manual_seed(23)
    x = torch.randn(15, vocab, generator=g)  # one program per row: the interpreter's cost is the row count
    x[14:] = 0.0  # rows 10..14: random rows and a flat one, where the noise decides among many candidates
    x[0, 1], x[0, vocab - 3] = 60.0, NAN  # NaN after a dominant value: the NaN wins
    x[1, 7], x[1, 200] = INF, INF  # tied +inf scores: the lower id
    x[2] = -INF  # nothing finite: the first id
    x[3] = -INF
    x[3, vocab - 1] = -3.0  # the only finite value, last
    x[4, 2] = 30.0  # dominant at a low temperature, early: every later tile is skipped
    x[5] *= 1e4  # scores near 1e4: the skip slack must scale with |thr|
    x[6] = 0.0  # flat: the noise alone decides
    x[7, vocab - 5] = 6.0  # a late winner beats the best of the earlier tiles
    x[8, 0] = NAN
    x[9, 3], x[9, vocab - 2] = INF, NAN  # NaN after +inf: the NaN wins
    x = x.to(device)
    temps, seeds, offsets = _sampling_inputs(15, device, 1.0, seed=2**33 + 9, offset0=77)
    temps[4] = 0.05
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets)
    keys = shard_select_keys(x, 0, vocab, block_size=16, num_splits=1, wide_mul=False,
                             **kw)  # 17 tiles: the bound decides 16
    ids = key_to_id_torch(keys)
    assert ids[0].item() == vocab - 3 and ids[1].item() == 7 and ids[2].item() == 0
    assert ids[3].item() == vocab - 1 and ids[4].item() == 2 and ids[8].item() == 0 and ids[9].item() == vocab - 2
    twin = shard_select_keys_reference(x, 0, vocab, temps, seeds, offsets)
    if device == "cpu":
        assert torch.equal(keys, twin)
    else:
        assert (key_to_id_torch(twin) != ids).sum().item() <= 1
    # tp 5: shard starts 53, 106, 159, 212 (phases 1, 2, 3, 0), two programs per shard; the wide-multiply
    # Philox (a schedule option, the launcher's default) draws the same words as tl.philox's
    assert torch.equal(_simulated_tp_keys(x, 5, vocab, block_size=16, num_splits=2, wide_mul=True, **kw), keys)
    assert torch.equal(shard_select_keys(x, 0, vocab, block_size=16, num_splits=1, **kw), keys)


@triton.jit
def _bound_probe_kernel(x_ptr, w_ptr, sum_ptr, cmp_ptr, t_ptr, e_ptr, scale, thr, N: tl.constexpr):
    c = tl.arange(0, N)
    x = tl.load(x_ptr + c)
    w = tl.load(w_ptr + c).to(tl.uint32)
    lift = _bound_lift(thr)
    tl.store(sum_ptr + c, _bound_sum(x, scale, lift, one_plus_top(w)))
    t = one_minus_uniform(w)
    e = tl.exp2(x * scale - lift)
    tl.store(cmp_ptr + c, (~(t >= e)).to(tl.int8))  # the earlier per-element test: t < e, or a NaN bound
    tl.store(t_ptr + c, t)
    tl.store(e_ptr + c, e)


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_bound_sum_scores_what_the_compare_scores(device):
    """The skip test as one add per element: ``fl(e + one_plus_top(w)) >= 2`` (or NaN) wherever ``t < e`` (or
    the bound is NaN), and nowhere else but at ``t == e`` -- on NaN / +-inf / huge logits, thresholds -inf,
    +inf, 0 and large, and the extreme words (u at its ends, t = e ties)."""
    n = 256
    g = torch.Generator().manual_seed(41)
    x = torch.randn(n, generator=g) * 8
    x[:8] = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 3e38, -3e38, 1e-30])
    words = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    words[8:16] = torch.tensor([0, 2**32 - 1, 0x1FF, 0xFFFFFE00, 0x200, 2**31, 2**31 - 1, 0x7FFFFE00])
    # Near-ties at scale 1, thr 0: x a few ulps either side of log2(t) + lift, so e = 2^(x - lift) lands
    # within ulps of t on both sides (a sum that rounded the wrong way would skip a t < e element).
    t_host = ((((words[16:80] >> 9) ^ 0x7FFFFF) + 0.5) * 2.0**-23).float()
    lift0 = torch.tensor(0.52876, dtype=torch.float32) - torch.tensor(0.00390625, dtype=torch.float32)
    near = torch.log2(t_host) + lift0
    for k in range(4):
        near[k::8] = torch.nextafter(near[k::8], torch.tensor(INF))
        near[4 + k::8] = torch.nextafter(near[4 + k::8], torch.tensor(-INF))
    x[16:80] = near
    x, words = x.to(device), words.to(device)
    for scale in (1.0, LOG2E_F32, 28.853900817779268, 1e-3):
        for thr in (-INF, INF, 0.0, 17.8, -3.0, 1e4, 60.0):
            out = [torch.empty(n, dtype=dt, device=device) for dt in (torch.float32, torch.int8, torch.float32,
                                                                      torch.float32)]
            _bound_probe_kernel[(1,)](x, words, *out, scale, thr, N=n)
            total, cmp, t, e = (o.cpu() for o in out)
            scored = (total >= 2.0) | torch.isnan(total)
            assert torch.equal(scored, cmp.bool() | (t == e)), (scale, thr)


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_bf16_words_match_element_loads(device):
    """A sampled bf16 launch reads 4-byte aligned rows as 32-bit words (two columns per word); other rows load
    per element. Both give the same keys bit for bit -- adversarial rows (NaN, -inf, all NaN, flat, a greedy
    row whose maxima tie across a TP-3 shard boundary), an odd vocabulary, full tiles and a ragged tail --
    and the eager twin's keys under the interpreter, at TP 1 and simulated TP 3."""
    vocab, rows = 331, 8  # odd: shard starts 111 and 222 (phases 3 and 2), odd widths
    x = _adversarial(rows, vocab, torch.float32, "cpu", seed=31)
    x[4] = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) - 5
    x[4, 110], x[4, 111] = 9.0, 9.0  # greedy row: tied maxima on both sides of the TP-3 boundary at 111
    x[6] = 0.0  # flat: the noise decides
    x = x.to(torch.bfloat16)
    aligned = torch.zeros(rows, vocab + 1, dtype=torch.bfloat16)
    aligned[:, :vocab] = x
    shifted = torch.zeros(rows, vocab + 1, dtype=torch.bfloat16)
    shifted[:, 1:] = x
    aligned, shifted = aligned.to(device)[:, :vocab], shifted.to(device)[:, 1:]  # row stride 332, base +0 / +2 bytes
    assert _bf16_words(aligned) and not _bf16_words(shifted)
    temps, seeds, offsets = _sampling_inputs(rows, device, 1.0, seed=2**33 + 5, offset0=9)
    temps[4] = 0.0
    temps[7] = 0.6
    kw = dict(temperatures=temps, seeds=seeds, offsets=offsets)
    keys = shard_select_keys(aligned, 0, vocab, block_size=64, num_splits=2, **kw)
    assert torch.equal(shard_select_keys(shifted, 0, vocab, block_size=64, num_splits=2, **kw), keys)
    assert torch.equal(shard_select_keys(aligned, 0, vocab, block_size=32, num_splits=1, **kw), keys)
    ids = key_to_id_torch(keys)
    assert ids[1].item() == 0 and ids[2].item() == 0 and ids[4].item() == 110
    twin = shard_select_keys_reference(aligned, 0, vocab, temps, seeds, offsets)
    if device == "cpu":
        assert torch.equal(keys, twin)
    else:
        assert (key_to_id_torch(twin) != ids).sum().item() <= 1
    assert torch.equal(_simulated_tp_keys(aligned, 3, vocab, block_size=32, num_splits=2, **kw), keys)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_and_tile_schedule_invariance(device, dtype):
    """Two tiles per loop iteration with the next two prefetched: programs with 0, 1, 2, 3 and more full
    tiles, with and without a ragged tail, give the same keys (greedy and sampled) as the eager twin."""
    vocab = 300  # 4 tiles of 64 + 44
    x = _adversarial(8, vocab, dtype, device, seed=9)
    x[7, 64 * 2 - 1], x[7, 64 * 2] = 7.0, 7.0  # a tie across a tile boundary: the lower id wins
    greedy_ref = shard_select_keys_reference(x, 0, vocab)
    # Full tiles per program: 4 + tail; 3, 1 + tail; 2, 2, tail; 1, 1, 1, 1, tail; and 16-wide tiles.
    for block, splits in ((64, 1), (64, 2), (64, 3), (64, 5), (128, 2), (16, 3), (512, 1)):
        keys = shard_select_keys(x, 0, vocab, block_size=block, num_splits=splits)
        assert torch.equal(keys, greedy_ref), (block, splits)
    assert key_to_id_torch(greedy_ref)[7].item() == 64 * 2 - 1
    if dtype != torch.bfloat16:
        return  # the sampled schedules once (the interpreter is slow on Philox)
    rows = 4
    temps, seeds, offsets = _sampling_inputs(rows, device, 0.9, seed=11)
    temps[1] = -1.0  # greedy
    xs = x[3:3 + rows]
    sampled_ids = shard_select_keys(xs, 0, vocab, temps, seeds, offsets, block_size=64, num_splits=1,
                                    return_ids=True)
    for block, splits in ((64, 2), (64, 5), (16, 2), (512, 1)):
        ids = shard_select_keys(xs, 0, vocab, temps, seeds, offsets, block_size=block, num_splits=splits,
                                return_ids=True)
        assert torch.equal(ids, sampled_ids), (block, splits)
    twin = shard_select_keys_reference(xs, 0, vocab, temps, seeds, offsets, return_ids=True)
    assert (twin != sampled_ids).sum().item() <= 1  # ulp-level log differences can flip a near-tie only


def test_plan_splits_one_wave_and_covering():
    """The split plan is a schedule: chunks are whole tiles that cover the shard, and the grid fits one
    wave of resident programs (no partial second wave) unless one program per row already exceeds it."""
    from tensorrt_llm_ext.kernels import shard_select as ss

    dev = torch.device("cpu")
    wave = ss._PROGRAMS_PER_SM * ss.sm_count(dev)
    for dtype in (torch.bfloat16, torch.float32):
        for n_valid in (0, 1, 15, 16, 17, 1001, 50016, 200064):
            block = ss.default_block(n_valid, dtype)
            assert block & (block - 1) == 0 and 16 <= block <= ss._TILE_BYTES // (2 if dtype == torch.bfloat16 else 4)
            for rows in (1, 3, 8, 64, 256, 1000):
                splits, chunk = ss.plan_splits(rows, n_valid, dev, block)
                assert chunk % block == 0 and splits >= 1
                assert splits * chunk >= n_valid and (splits - 1) * chunk < max(n_valid, 1)
                assert rows * splits <= max(rows, wave), (rows, n_valid, splits)
    # Few rows split a wide row into many one-tile programs; many rows take one program per row.
    chunk = 4096 * -(-49 // min(wave, 49))  # 49 tiles of 4096 over at most one wave of programs
    assert ss.plan_splits(1, 200064, dev, 4096) == (-(-200064 // chunk), chunk)
    assert ss.plan_splits(1000, 200064, dev, 4096) == (1, 200064 // 4096 * 4096 + 4096)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_sampled_rows(device):
    vocab, rows = 901, 8
    x = _adversarial(rows, vocab, torch.bfloat16, device, seed=11)
    temps = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5, 0.0, 1.0], device=device)
    seeds = torch.arange(rows, dtype=torch.int64, device=device) + 17
    offsets = torch.arange(rows, dtype=torch.int64, device=device) * 3
    ids = gumbel_sample(x, temps, seeds, offsets, 0, vocab)
    greedy = temps == 0
    assert torch.equal(ids[greedy], torch.argmax(x.float(), dim=1)[greedy])
    # A sampled row's draw does not depend on its neighbours being greedy.
    all_sampled = gumbel_sample(x, torch.where(greedy, 1.0, temps), seeds, offsets, 0, vocab)
    assert torch.equal(ids[~greedy], all_sampled[~greedy])
    assert torch.equal(_simulated_tp(x, 4, vocab, temperatures=temps, seeds=seeds, offsets=offsets, block_size=128),
                       ids)


def test_bench_select_smoke_tables():
    """`bench select` prints the goal columns (greedy and Gumbel % of floor, Gumbel/greedy, argmax/greedy)
    for every (tp, rows), and the greedy and sampled schedule sweeps, each marking the launcher's default
    and naming the defaults to paste (CPU: smoke sizes); --tables picks a subset."""
    import argparse

    from tensorrt_llm_ext.bench import harness
    from tensorrt_llm_ext.bench.select import run

    harness.TABLES.clear()
    run(argparse.Namespace(vocab=200064, rows="1,8", tp_sizes="1,2", dtype="bf16", no_sweep=False,
                           tables="main,greedy,sampled"))
    main, greedy, sampled = harness.TABLES[-3:]
    for col in ("greedy % of floor", "gumbel % of floor", "gumbel/greedy", "argmax/greedy"):
        assert col in main["headers"]
    # widths are the LM head's split: 2003 ids at TP 2 are two whole 1024-id blocks (the last padded)
    assert [r[:3] for r in main["rows"]] == [[1, 1, 2003], [1, 3, 2003], [2, 1, 1024], [2, 3, 1024]]
    assert "*" in [r[-1] for r in greedy["rows"]] and {r[2] for r in greedy["rows"]} == {256, 1024}
    assert {r[3] for r in sampled["rows"]} == {2, 4} and "sampled" in sampled["title"]
    assert {r[5] for r in sampled["rows"]} == {"", "yes"}  # the wide-multiply Philox timed too
    assert any("_SAMPLED_TILE_COLUMNS = 256" in n for n in sampled["notes"])
    harness.TABLES.clear()
    run(argparse.Namespace(vocab=200064, rows="1", tp_sizes="1", dtype="bf16", no_sweep=False, tables="sampled"))
    assert len(harness.TABLES) == 1 and "sampled" in harness.TABLES[0]["title"]


# ----------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------
def test_bad_inputs_raise():
    x = torch.randn(4, 100)
    t, s, o = _sampling_inputs(4, "cpu")
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_argmax(x, 300, 300)
    with pytest.raises(ValueError, match="vocab_start"):
        vocab_parallel_argmax(x, -1, 300)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_argmax(x, 0, 0)
    with pytest.raises(ValueError, match=r"temperatures: expected shape \[4\]"):
        gumbel_sample(x, t[:3], s, o, 0, 100)
    with pytest.raises(ValueError, match="offsets: expected dtype int64"):
        gumbel_sample(x, t, s, o.int(), 0, 100)
    with pytest.raises(ValueError, match="seeds: expected dtype"):
        gumbel_sample(x, t, s.float(), o, 0, 100)
    with pytest.raises(ValueError, match="temperatures: expected dtype float32"):
        gumbel_sample(x, t.double(), s, o, 0, 100)
    with pytest.raises(ValueError, match="all three or none"):
        shard_select_keys(x, 0, 100, t, None, None)
    with pytest.raises(ValueError, match="temperatures: expected a contiguous"):
        gumbel_sample(x, t[:1].expand(4), s, o, 0, 100)  # a broadcast view would be misread
    with pytest.raises(ValueError, match="shard_logits: expected unit stride"):
        vocab_parallel_argmax(x.t(), 0, 100)
    with pytest.raises(ValueError, match="dtype"):
        vocab_parallel_argmax(x.double(), 0, 100)
    with pytest.raises(ValueError, match="out"):
        vocab_parallel_argmax(x, 0, 100, out=torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="expected a tensor"):
        vocab_parallel_argmax(torch.randn(5), 0, 5)
    with pytest.raises(ValueError, match="scratch"):
        shard_select_keys(x, 0, 100, block_size=16, num_splits=4, scratch=make_shard_select_scratch(2, "cpu"))
    with pytest.raises(ValueError, match="vocab_start"):
        VocabShardedLogits(x, 100, 100, 100)
    with pytest.raises(ValueError, match="not a shard"):
        VocabShardedLogits(x, 50, 150, 200)
    with pytest.raises(ValueError, match="padded_vocab_size"):
        VocabShardedLogits(x, 0, 150, 150)


def test_outgrown_split_scratch_stays_allocated():
    """A larger eager call (a step above every captured batch size) replaced the cached split scratch and
    freed the old one while captured graphs still point at it (replay on freed memory). Now it is kept."""
    import gc
    import weakref

    from tensorrt_llm_ext.kernels import shard_select as ss

    dev = torch.device("cpu")
    small = ss._scratch(dev, 1)
    cap = small[0].numel()
    refs = [weakref.ref(t) for t in small]
    del small
    big = ss._scratch(dev, cap + 1)
    assert big[0].numel() > cap and ss._scratch(dev, 1)[0] is big[0]
    gc.collect()
    assert all(r() is not None for r in refs)
    assert bool((refs[0]() == EMPTY_KEY).all()) and not refs[1]().any()


def test_caller_scratch_is_restored():
    x = _adversarial(3, 500, torch.float32, DEVICES[0])
    scratch = make_shard_select_scratch(3, DEVICES[0])
    for _ in range(2):
        keys = shard_select_keys(x, 0, 500, block_size=16, num_splits=6, scratch=scratch)
        assert torch.equal(keys, shard_select_keys_reference(x, 0, 500))
        assert torch.all(scratch[0] == EMPTY_KEY) and torch.all(scratch[1] == 0)


# ----------------------------------------------------------------------------------------------------
# LM head, logits processor, decisions
# ----------------------------------------------------------------------------------------------------
def _head(vocab=301, hidden=32, tp=1, rank=0, gather=True, mode=TensorParallelMode.COLUMN, dp=False):
    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp, enable_attention_dp=dp)
    head = LMHead(vocab, hidden, dtype=torch.float32, mapping=mapping, tensor_parallel_mode=mode,
                  gather_output=gather if mode is not None else False)
    return mapping, head


def test_lm_head_shards_and_padding():
    vocab, hidden = 301, 16
    full = torch.randn(vocab, hidden)
    h = torch.randn(5, hidden)
    ref = h @ full.t()
    for tp in (1, 2, 3, 4):
        pieces = []
        for rank in range(tp):
            _, head = _head(vocab, hidden, tp, rank)
            head.load_weights(full)
            assert head.weight.shape == (-(-vocab // tp), hidden)
            assert head.padded_vocab_size == head.weight.shape[0] * tp and head.vocab_size == vocab
            assert head.vocab_start == rank * head.weight.shape[0] and head.quantized is False
            shard = head.shard_forward(h)
            if rank == tp - 1 and head.padding_size:
                assert torch.all(head.weight[head.num_valid_rows:] == 0)
                assert torch.all(shard[:, head.num_valid_rows:] == 0)  # padded logits are 0, not -inf
            pieces.append(shard)
        torch.testing.assert_close(torch.cat(pieces, 1)[:, :vocab], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="too small"):
        _head(vocab=5, tp=4, rank=0)
    _, dp_head = _head(vocab, hidden, tp=2, dp=True)  # attention DP: replicated, as in TensorRT-LLM
    assert dp_head.tp_mode is None and dp_head.weight.shape == (vocab, hidden) and dp_head.vocab_size_padded == vocab
    _, head = _head(tp=1)
    with pytest.raises(ValueError, match="expected full weight"):
        head.load_weights(torch.zeros(300, 32))
    _, head = _head(vocab, hidden, tp=1)
    head.load_weights(full)
    rows = torch.tensor([1, 3])
    assert torch.equal(LogitsProcessor()(h, head, rows), head(h[rows]))


class _CustomProcessor(LogitsProcessor):
    def forward(self, hidden_states, lm_head, row_indices=None):
        return super().forward(hidden_states, lm_head, row_indices) * 2.0


def _first_failure(failures):
    return next((c.value for c, failed in failures.items() if failed), None)


@pytest.mark.parametrize("case, expected", [
    ("eligible", None),
    ("off", "mode='off'"),
    ("tp1", "tp_size == 1"),
    ("attention_dp", "attention DP"),
    ("replicated", "not a COLUMN-parallel"),
    ("no_gather", "not a COLUMN-parallel"),
    ("quantized", "quantized"),
    ("uneven", "unevenly sharded"),
    ("custom_processor", "own logits processor"),
])
def test_selection_decision_reasons(case, expected):
    tp = 1 if case == "tp1" else 2
    kw = {}
    vocab = 301 if case == "uneven" else 300
    mapping, head = _head(vocab=vocab, tp=tp, dp=case == "attention_dp",
                          mode=None if case == "replicated" else TensorParallelMode.COLUMN,
                          gather=case != "no_gather")
    if case == "quantized":
        head.quantized = True
    processor = _CustomProcessor() if case == "custom_processor" else LogitsProcessor()
    if case == "off":
        kw["mode"] = "off"
    target = _first_failure(local_target_failures(mapping, head, processor, **kw))
    if expected is None:
        assert target is None
    else:
        assert target is not None and expected in target
    # Draft side: the drafter drafting through the target head; target-only reasons do not apply.
    draft = _first_failure(local_draft_failures(mapping, head, head, mode=kw.get("mode", "auto")))
    if case in ("custom_processor", "eligible"):
        assert draft is None
    else:
        assert draft is not None and expected in draft
    if expected is None:
        assert "does not draft through" in _first_failure(local_draft_failures(mapping, head, None))


def test_decide_single_rank_and_modes():
    mapping, head = _head(tp=1)
    sel = VocabParallelSelection.decide(mapping, head, LogitsProcessor(), drafter_lm_head=head)
    assert not sel.target_enabled and not sel.draft_enabled and "tp_size == 1" in sel.target_reason
    # a build refusal (one line, exit 2 from generate / serve; was a ValueError traceback, exit 1)
    with pytest.raises(BuildRefusal, match="mode='on'.* not possible: tp_size == 1"):
        VocabParallelSelection.decide(mapping, head, LogitsProcessor(), mode="on")
    with pytest.raises(ValueError):
        VocabParallelSelection.decide(mapping, head, LogitsProcessor(), mode="sometimes")


class _Worker(VocabParallelSelectionMixin):
    def __init__(self, mapping, target, drafter):
        self.mapping, self.target, self.drafter, self.max_exchange_rows = mapping, target, drafter, 0


class _Model:
    """The few attributes post_load reads of a target (head + processor) and of a drafter."""

    def __init__(self, head, processor=None):
        self.lm_head, self.logits_processor = head, processor

    def take_over_lm_head(self, head):
        self.lm_head = head


@pytest.mark.parametrize("processor_cls", [LogitsProcessor, _CustomProcessor])
def test_worker_component_single_rank(processor_cls):
    """tp 1 (and a custom processor) keep the gathered path: logits come from the model's processor."""
    vocab, hidden = 257, 16
    mapping, head = _head(vocab=vocab, hidden=hidden, tp=1)
    head.load_weights(torch.randn(vocab, hidden))
    worker = _Worker(mapping, _Model(head, processor_cls()), _Model(None))
    assert worker.token_selector is None and worker.selection is None
    sel = worker.post_load()
    assert not sel.target_enabled and worker.selection is sel
    assert worker.drafter.lm_head is head  # the drafter took over the target's head
    with pytest.raises(RuntimeError, match="already bound"):
        worker.post_load()
    selector = worker.token_selector
    h = torch.randn(6, hidden)
    logits = selector.target_logits(h, torch.tensor([0, 2, 5]))
    assert isinstance(logits, torch.Tensor) and logits.shape == (3, vocab)
    torch.testing.assert_close(logits, processor_cls()(h[[0, 2, 5]], head), rtol=0, atol=0)
    assert torch.equal(selector.select_tokens(logits), torch.argmax(logits, dim=1))
    temps, seeds, offsets = _sampling_inputs(3, "cpu", 0.0)
    assert torch.equal(selector.select_tokens(logits, SelectionParams(temps, seeds, offsets)),
                       torch.argmax(logits, dim=1))
    assert torch.equal(gathered_argmax(logits, vocab), torch.argmax(logits, dim=1))


# ----------------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_replay_matches_eager():
    vocab, tp = 200064, 4
    width = vocab // tp
    rows = 8
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    temps = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0, 0.0, 0.9], device="cuda")
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 7919
    offsets = torch.arange(rows, dtype=torch.int64, device="cuda")
    out_a = torch.empty(rows, dtype=torch.int64, device="cuda")
    out_s = torch.empty(rows, dtype=torch.int64, device="cuda")
    start = width * 2
    # Eager warm-up (allocates the split scratch, compiles).
    vocab_parallel_argmax(x, start, vocab, out=out_a)
    gumbel_sample(x, temps, seeds, offsets, start, vocab, out=out_s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        vocab_parallel_argmax(x, start, vocab, out=out_a)
        gumbel_sample(x, temps, seeds, offsets, start, vocab, out=out_s)
    for step in range(3):
        x.copy_(torch.randn_like(x))
        x[step, 100] = float("nan")
        offsets.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_a, vocab_parallel_argmax(x, start, vocab))
        assert torch.equal(out_a - start, torch.argmax(x.float(), dim=1))
        assert torch.equal(out_s, gumbel_sample(x, temps, seeds, offsets, start, vocab))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_vocab_matches_torch_argmax(dtype):
    vocab = 200064
    for rows in (1, 7, 64, 257):
        x = torch.randn(rows, vocab, device="cuda").to(dtype)
        x[0, vocab - 1] = x[0].max()  # a tie with the earlier maximum: lowest index wins
        if rows > 2:
            x[1, 12345] = float("nan")
            x[2] = float("-inf")
        assert torch.equal(vocab_parallel_argmax(x, 0, vocab), torch.argmax(x, dim=1))
        for tp in (2, 8):
            assert torch.equal(_simulated_tp(x, tp, vocab), torch.argmax(x, dim=1))
        keys = shard_select_keys(x, 0, vocab)
        assert torch.equal(keys, shard_select_keys_reference(x, 0, vocab))
    # Sampling: the GPU kernel's tl.log may differ from torch's by an ulp, so compare the draws with
    # the eager twin allowing only near-tie disagreements (rare), and across block sizes exactly.
    rows = 64
    x = torch.randn(rows, vocab, device="cuda").to(dtype)
    temps, seeds, offsets = _sampling_inputs(rows, "cuda")
    ids = gumbel_sample(x, temps, seeds, offsets, 0, vocab)
    ref = key_to_id_torch(shard_select_keys_reference(x, 0, vocab, temps, seeds, offsets))
    assert (ids != ref).sum().item() <= 1
    for block, splits in ((1024, 3), (4096, 1)):
        keys = shard_select_keys(x, 0, vocab, temps, seeds, offsets, block_size=block, num_splits=splits)
        assert torch.equal(key_to_id_torch(keys), ids)
    assert TARGET_SALT != DRAFT_SALT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gumbel_unaligned_shards_large_vocab():
    """Compiled kernel, odd vocabulary (200063): TP 2/3/4/8 shard starts at every phase mod 4 draw the TP 1
    keys bit for bit (one Philox block per four ids, taken across the shard boundary), default schedules
    and forced ones; and the draw agrees with the eager twin up to ulp-level near-ties of the log."""
    vocab = 200063
    for rows in (8, 64, 256):
        x = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
        x[: rows // 2] = 0.0  # flat rows: the draw is the noise's argmax
        temps, seeds, offsets = _sampling_inputs(rows, "cuda", 1.0, seed=77 + rows)
        kw = dict(temperatures=temps, seeds=seeds, offsets=offsets)
        full = shard_select_keys(x, 0, vocab, **kw)
        for tp in (2, 3, 4, 8):
            assert torch.equal(_simulated_tp_keys(x, tp, vocab, **kw), full), (rows, tp)
        assert torch.equal(_simulated_tp_keys(x, 3, vocab, block_size=1024, num_splits=5, **kw), full)
        twin = key_to_id_torch(shard_select_keys_reference(x, 0, vocab, temps, seeds, offsets))
        assert (key_to_id_torch(full) != twin).sum().item() <= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gumbel_tail_bound_large_vocab():
    """The 23-bit uniform bounds the noise to about [-2.82, 16.64]: a token more than ~19.5 below the
    row maximum of x / T is never drawn. A noise that turns inf/NaN near u -> 1 (an approximate log
    on the GPU) would break this in ~1% of rows at V = 200064, so every row must pick token 5."""
    vocab, rows = 200064, 4096
    x = torch.zeros(rows, vocab, device="cuda", dtype=torch.bfloat16)
    x[:, 5] = 30.0
    temps, seeds, offsets = _sampling_inputs(rows, "cuda", 1.0, seed=3)
    ids = gumbel_sample(x, temps, seeds, offsets, 0, vocab)
    assert torch.equal(ids, torch.full_like(ids, 5)), ids[ids != 5][:10]
    # Chi-square on the GPU kernel itself with many draws over a small vocabulary.
    small = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.25, 3.0, -2.0, 0.75, 1.25, -0.25]], device="cuda")
    draws = 200000
    t, s, o = _sampling_inputs(draws, "cuda", 1.0, seed=8)
    got = gumbel_sample(small.expand(draws, 13).contiguous(), t, s, o, 0, 13).cpu()
    counts = torch.bincount(got, minlength=13).double()
    expected = torch.softmax(small[0].double().cpu(), 0) * draws
    assert ((counts - expected) ** 2 / expected).sum().item() < _chi2_upper(12)


def test_gumbel_sample_refuses_a_temperature_that_overflows():
    """0 < T < MIN_TEMPERATURE overflowed the scaled logits (every seed drew the lowest id of the +inf tie):
    the selection API refuses it by name; 0 (greedy) and MIN_TEMPERATURE itself are served."""
    from tensorrt_llm_ext.contract import MIN_TEMPERATURE

    x = torch.tensor([[0.5, -1.0, 3.0, 2.0, 0.1, -0.2]])
    seeds, offsets = torch.tensor([3]), torch.tensor([0])
    for t in (1e-30, 1e-45, MIN_TEMPERATURE / 2):
        with pytest.raises(ValueError, match="temperatures: expected 0 \\(greedy\\) or >= 1e-05"):
            gumbel_sample(x, torch.tensor([t]), seeds, offsets, 0, 6)
    for t in (0.0, MIN_TEMPERATURE):
        assert gumbel_sample(x, torch.tensor([t]), seeds, offsets, 0, 6).item() == 2  # the argmax
