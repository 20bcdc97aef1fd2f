"""The Markov chain's sampled path draws its keyed Gumbel noise from one Philox block per four consecutive
ids (``gumbel2_noise_grouped``): bit for bit the per-element ``gumbel2_noise`` it replaced and the torch
twin, at every first id (shards starting off a multiple of 4), and the chain on such shards equals its eager
twin in both modes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tensorrt_llm_ext.kernels.markov_fused_step import FusedConfig
from tensorrt_llm_ext.kernels.ordered_key import gumbel2_noise, gumbel2_noise_grouped, gumbel2_noise_torch
from tensorrt_llm_ext.speculative.markov_chain import markov_chain_logits, markov_chain_logits_reference
from tensorrt_llm_ext.testing.markov import bits_equal, sampling_inputs

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SALT = 0x5EED


@triton.jit
def _grouped_and_per_element_kernel(seeds_ptr, offsets_ptr, grouped_ptr, per_element_ptr, gid0,
                                    R: tl.constexpr, G: tl.constexpr, ALIGNED: tl.constexpr, SALT: tl.constexpr,
                                    JOIN: tl.constexpr):
    """Rows ``R`` x ids ``gid0 + [0, 4G)``: the grouped noise and the per-element noise, side by side."""
    rows = tl.arange(0, R)
    runs = tl.zeros([R, G], tl.int64)
    seed = tl.load(seeds_ptr + rows)[:, None] + runs
    off = tl.load(offsets_ptr + rows)[:, None] + runs
    first = gid0 + 4 * tl.arange(0, G).to(tl.int64)[None, :] + runs
    cols = tl.arange(0, 4 * G)
    at = rows[:, None] * (4 * G) + cols[None, :]
    tl.store(grouped_ptr + at, gumbel2_noise_grouped(seed, off, first, ALIGNED, SALT, JOIN))
    elems = tl.zeros([R, 4 * G], tl.int64)
    gid = gid0 + cols.to(tl.int64)[None, :] + elems
    per_element = gumbel2_noise(tl.load(seeds_ptr + rows)[:, None] + elems,
                                tl.load(offsets_ptr + rows)[:, None] + elems, gid, SALT)
    tl.store(per_element_ptr + at, per_element)


@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize("gid0", [0, 1, 2, 3, 4, 4097, 128255, 2**31 + 3, 2**32 - 70])
def test_grouped_noise_equals_per_element_and_twin(gid0, join):
    """Every first id mod 4 (the unaligned form), ids past any vocabulary, ids above 2^31 (int64 args), both
    expansions of the runs' words (JOIN: interleave; else broadcast and pick)."""
    R, G = 4, 16
    g = torch.Generator().manual_seed(gid0 % 1000)
    seeds = torch.randint(0, 2**62, (R,), generator=g).to(DEV)
    offsets = torch.randint(0, 2**40, (R,), generator=g).to(DEV)
    offsets[0] = 2**32 - 1  # the offset's high word changes within a chain
    ids = torch.arange(4 * G, dtype=torch.int64, device=DEV)[None, :] + gid0
    twin = gumbel2_noise_torch(seeds[:, None], offsets[:, None], ids, SALT)
    for aligned in ((True, False) if gid0 % 4 == 0 else (False,)):
        grouped = torch.empty(R, 4 * G, dtype=torch.float32, device=DEV)
        per_element = torch.empty_like(grouped)
        _grouped_and_per_element_kernel[(1,)](seeds, offsets, grouped, per_element, gid0, R=R, G=G, ALIGNED=aligned,
                                              SALT=SALT, JOIN=join)
        assert bits_equal(grouped, per_element), (gid0, aligned, join)
        if not CUDA:  # numpy's log2 under the interpreter and in the twin (GPU: the SFU's, see ordered_key)
            assert bits_equal(grouped, twin), (gid0, aligned, join)
    assert torch.isfinite(grouped).all()


def _integer_weights(V, width, r, dtype, g):
    """Small-integer weights: every bias is exact in any sum order, so the fused mode's dot equals F.linear."""
    w1 = torch.randint(-2, 3, (V, r), generator=g).to(dtype)
    w2 = (torch.randint(-2, 3, (width, r), generator=g) * 0.125).to(dtype)
    return w1, w2


@pytest.mark.parametrize("mode", ["exact", "fused", "fused64"])
@pytest.mark.parametrize("vocab_start", [2, 3, 4097, 4])
def test_chain_on_unaligned_shards_matches_eager(mode, vocab_start):
    """A 1031-column shard (ragged last block) starting at ``vocab_start``, with columns past an odd
    vocabulary (padding that never wins); mixed greedy / sampled rows, two seed draws, bf16 and fp32:
    biased logits and tokens bitwise the eager twin's (keyed_gumbel_scores_torch). ``fused64``: the fused
    mode's 64-row tile (its noise takes the broadcast expansion, the 16-row tile's the join)."""
    config = None
    if mode == "fused64":
        mode, config = "fused", FusedConfig(block_n=64, num_warps=4, num_stages=1, programs=3, block_b=64)
    B, K, width, r = 5, 3, 1031, 16
    V = vocab_start + width - 7  # odd or even by start; the shard's last 7 columns lie past the vocabulary
    for dtype, draw in ((torch.bfloat16, 3), (torch.float32, 41)):
        g = torch.Generator().manual_seed(draw + vocab_start)
        base = torch.randn(B, K, width, generator=g).to(dtype)
        base[:, :, width - 7:] = 3e4  # padded columns hold huge logits: they must never win
        w1, w2 = _integer_weights(V, width, r, dtype, g)
        anchors = torch.randint(0, V, (B,), generator=g)
        anchors[1] = vocab_start + 1  # an anchor inside the shard
        temps, seeds, offsets = sampling_inputs(B, seed=draw)
        args = [t.to(DEV) for t in (base, anchors, w1, w2)]
        samp = dict(temperatures=temps.to(DEV), seeds=seeds.to(DEV), offsets=offsets.to(DEV))
        out, toks = markov_chain_logits(*args, vocab_start=vocab_start, vocab_size=V, mode=mode, config=config,
                                        **samp)
        ref_out, ref_toks = markov_chain_logits_reference(*args, vocab_start=vocab_start, vocab_size=V, **samp)
        assert torch.equal(toks, ref_toks), (dtype, draw)
        assert bits_equal(out, ref_out), (dtype, draw)
        assert (toks < V).all() and (toks >= vocab_start).all()
        # Greedy rows keep their plain argmax; the sampled rows' noise moved some token off it.
        greedy = temps == 0
        local = (toks - vocab_start).cpu()
        assert torch.equal(local[greedy], torch.argmax(out.cpu()[greedy][:, :, : V - vocab_start].float(), dim=2))
        assert not torch.equal(local[~greedy], torch.argmax(out.cpu()[~greedy][:, :, : V - vocab_start].float(),
                                                             dim=2))
