"""Kernels fail closed: strided out= buffers are written through their strides or refused, token ids
never wrap, K = 0 / empty shards give a defined result or a ValueError, slot ids are range-checked
outside capture, and an aborted Markov chain leaves its workspace clean (both modes)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import MarkovHeadWeights
from tensorrt_llm_ext.kernels.block_table import decode_block_table, decode_block_table_reference
from tensorrt_llm_ext.kernels.paged_latent import PagedLatentStep, paged_latent_step, paged_latent_step_reference
from tensorrt_llm_ext.kernels.rms_norm import rms_norm, rms_norm_reference
from tensorrt_llm_ext.kernels.shard_select import shard_select_keys
from tensorrt_llm_ext.kernels.strict_accept import strict_accept, strict_accept_reference
from tensorrt_llm_ext.speculative.markov_chain import (MarkovChain, MarkovWorkspace, markov_chain_logits,
                                                       markov_chain_logits_reference)
from tensorrt_llm_ext.speculative.vocab_parallel import gumbel_sample, vocab_parallel_argmax

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DIRTY_KEY = (0x7F7FFFFF << 32) | (0xFFFFFFFF - 5)  # the key of a finite max logit, naming token 5


def _accept_inputs():
    target = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], device=DEV)
    draft = target[:, :2].clone()
    draft[0, 0] = 0  # row 0 rejects at once: num_accepted = [1, 3, 3]
    return draft, target


# -- strided out= -------------------------------------------------------------------------------------
def test_strict_accept_strided_outputs():
    draft, target = _accept_inputs()
    want_acc, want_n = strict_accept_reference(draft, target)
    assert want_n.tolist() == [1, 3, 3]
    wide = torch.full((3, 7), -5, dtype=torch.int64, device=DEV)
    acc, n = strict_accept(draft, target, out=(wide[:, 2:5], torch.empty(3, dtype=torch.int32, device=DEV)))
    assert torch.equal(acc, want_acc) and torch.equal(n, want_n)  # strided rows: written through the stride
    assert torch.equal(wide[:, :2], torch.full((3, 2), -5, device=DEV)) and torch.equal(wide[:, 5:], wide[:, :2])
    buf = torch.full((6,), 99, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="num_accepted.*contiguous"):
        strict_accept(draft, target, out=(torch.empty(3, 3, dtype=torch.int64, device=DEV), buf[::2]))
    assert buf.tolist() == [99] * 6
    cols = torch.empty(3, 6, dtype=torch.int64, device=DEV)[:, ::2]  # strided last dimension
    with pytest.raises(ValueError, match="accepted_tokens.*unit stride"):
        strict_accept(draft, target, out=(cols, torch.empty(3, dtype=torch.int32, device=DEV)))


def test_strict_accept_default_output_keeps_ids_above_2_31():
    draft, target = _accept_inputs()
    target[2, 0] = 3_000_000_000
    target[1, 1] = 2**32 - 2  # the largest id selection can return (V = 2^32 - 1)
    acc, n = strict_accept(draft, target)
    ref_acc, ref_n = strict_accept_reference(draft, target)
    assert acc.dtype == torch.int64 and ref_acc.dtype == torch.int64
    assert acc[2, 0].item() == 3_000_000_000 and acc[1, 1].item() == 2**32 - 2
    assert torch.equal(acc, ref_acc) and torch.equal(n, ref_n)


def test_decode_block_table_strided_outputs():
    enc = torch.tensor([[0, 6, -1], [6, 12, 18], [-1, -1, -1]], dtype=torch.int32, device=DEV)
    want_t, want_n = decode_block_table_reference(enc, 6)
    wide = torch.full((3, 5), 77, dtype=torch.int32, device=DEV)
    table, nb = decode_block_table(enc, 6, out=wide[:, 1:4], num_blocks_out=torch.empty(3, dtype=torch.int32,
                                                                                          device=DEV))
    assert torch.equal(table, want_t) and torch.equal(nb, want_n) and nb.tolist() == [2, 3, 0]
    assert wide[:, 0].tolist() == [77] * 3 and wide[:, 4].tolist() == [77] * 3
    buf = torch.full((6,), 77, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="num_blocks_out.*contiguous"):
        decode_block_table(enc, 6, out=torch.empty_like(enc), num_blocks_out=buf[::2])
    assert buf.tolist() == [77] * 6


def _paged_inputs(slot: int = 2):
    b, k = 3, 3
    acc = torch.arange(b * (k + 1), dtype=torch.int64, device=DEV).view(b, k + 1)
    n = torch.tensor([1, 2, 4], dtype=torch.int32, device=DEV)
    sid = torch.tensor([0, 1, slot], dtype=torch.int32, device=DEV)
    dm = torch.zeros(b, dtype=torch.bool, device=DEV)
    cl = torch.tensor([0, 5, 9, 0], dtype=torch.int32, device=DEV)
    bt = torch.arange(16, dtype=torch.int32, device=DEV).view(4, 4).clone()
    return (acc, n, sid, dm, cl, bt), dict(num_contexts=0, page_size=4, draft_len=k, max_ctx_len=100, mask_token_id=7)


def test_paged_latent_step_refuses_strided_out():
    args, kw = _paged_inputs()
    out = PagedLatentStep.allocate(3, 3, DEV)
    strided = torch.zeros(6, dtype=torch.int32, device=DEV)[::2]
    bad = PagedLatentStep(strided, out.block_input_ids, out.latent_pages, out.latent_offsets, out.latent_write_mask,
                          out.placement)
    with pytest.raises(ValueError, match="out.bonus_tokens.*contiguous"):
        paged_latent_step(*args, **kw, out=bad)


def test_shard_select_keys_refuses_strided_out():
    x = torch.randn(4, 37, device=DEV)
    with pytest.raises(ValueError, match="out.*contiguous"):
        shard_select_keys(x, 0, 37, out=torch.empty(8, dtype=torch.int64, device=DEV)[::2])


@pytest.mark.parametrize("mode", ["exact", "fused"])
def test_markov_chain_strided_out_rows(mode):
    g = torch.Generator().manual_seed(3)
    B, K, V, r = 3, 2, 41, 6
    base, w1, w2 = torch.randn(B, K, V, generator=g), torch.randn(V, r, generator=g), torch.randn(V, r, generator=g)
    base, w1, w2 = base.to(DEV), w1.to(DEV), w2.to(DEV)
    anchors = torch.tensor([3, 40, 0], device=DEV)
    want_b, want_t = markov_chain_logits(base, anchors, w1, w2, mode=mode)
    wide = torch.full((B, K, V + 9), -7.0, device=DEV)
    got_b, got_t = markov_chain_logits(base, anchors, w1, w2, mode=mode, out=wide[:, :, 4:4 + V])
    assert torch.equal(got_b, want_b) and torch.equal(got_t, want_t)
    assert bool((wide[:, :, :4] == -7).all()) and bool((wide[:, :, 4 + V:] == -7).all())


def test_rms_norm_outputs_checked():
    x = torch.randn(5, 24, device=DEV)
    w = torch.randn(24, device=DEV)
    want, _ = rms_norm_reference(x, w, 1e-6)
    wide = torch.zeros(5, 40, device=DEV)
    got, _ = rms_norm(x, w, 1e-6, out=wide[:, 8:32])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # rows through their stride
    assert bool((wide[:, :8] == 0).all()) and bool((wide[:, 32:] == 0).all())
    with pytest.raises(ValueError, match="out.*unit stride"):
        rms_norm(x, w, 1e-6, out=torch.zeros(5, 48, device=DEV)[:, ::2])
    with pytest.raises(ValueError, match="residual_out.*shape"):
        rms_norm(x, w, 1e-6, residual=x.clone(), residual_out=torch.zeros(5, 23, device=DEV))


# -- K = 0, empty shards, slot ranges -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "fused"])
def test_markov_chain_k0_is_empty(mode):
    w1, w2 = torch.randn(40, 6, device=DEV), torch.randn(40, 6, device=DEV)
    anchors = torch.tensor([1, 2, 3, 4], device=DEV)
    biased, toks = markov_chain_logits(torch.empty(4, 0, 40, device=DEV), anchors, w1, w2, mode=mode)
    assert tuple(biased.shape) == (4, 0, 40) and tuple(toks.shape) == (4, 0) and toks.dtype == torch.int64
    rb, rt = markov_chain_logits_reference(torch.empty(4, 0, 40, device=DEV), anchors, w1, w2)
    assert tuple(rb.shape) == (4, 0, 40) and tuple(rt.shape) == (4, 0)


def test_empty_shards_refused():
    w1 = torch.randn(40, 6, device=DEV)
    with pytest.raises(ValueError, match="no vocabulary columns"):
        markov_chain_logits(torch.empty(2, 3, 0, device=DEV), torch.tensor([1, 2], device=DEV), w1,
                            torch.empty(0, 6, device=DEV), vocab_size=40)
    x = torch.empty(3, 0, device=DEV)
    with pytest.raises(ValueError, match="no vocabulary columns"):
        vocab_parallel_argmax(x, 0, 40)
    z = torch.zeros(3, device=DEV)
    with pytest.raises(ValueError, match="no vocabulary columns"):
        gumbel_sample(x, z, z.long(), z.long(), 0, 40)


@pytest.mark.parametrize("slot", [100000, 4, -1])
def test_paged_latent_step_slot_out_of_range(slot):
    args, kw = _paged_inputs(slot)
    ctx_before = args[4].clone()
    with pytest.raises(ValueError, match=r"slot_ids: expected ids in \[0, 4\)"):
        paged_latent_step(*args, **kw)
    with pytest.raises(ValueError, match="slot_ids"):
        paged_latent_step_reference(*args, **kw)
    assert torch.equal(args[4], ctx_before)  # nothing was written
    args, kw = _paged_inputs(3)  # the last slot is in range
    paged_latent_step(*args, **kw)


# -- aborted Markov chains ----------------------------------------------------------------------------
class _TimedOut:
    def __init__(self, after: int = 0):
        self.after = after

    def exchange_(self, keys):
        if self.after == 0:
            raise RuntimeError("simulated collective timeout")
        self.after -= 1
        return keys


@pytest.mark.parametrize("mode", ["exact", "fused"])
@pytest.mark.parametrize("abort_after", [0, 1])
def test_aborted_chain_leaves_workspace_clean(mode, abort_after):
    g = torch.Generator().manual_seed(0)
    B, K, V, r = 4, 3, 40, 6
    w1, w2, base = torch.randn(V, r, generator=g), torch.randn(V, r, generator=g), torch.randn(B, K, V, generator=g)
    w1, w2, base = w1.to(DEV), w2.to(DEV), base.to(DEV)
    anchors = torch.tensor([3, 17, 0, 39], device=DEV)
    want = markov_chain_logits(base, anchors, w1, w2, mode=mode)[1].clone()  # a fresh workspace
    ws = MarkovWorkspace.allocate(B, K, w2, mode)
    with pytest.raises(RuntimeError, match="simulated"):
        markov_chain_logits(base.flip(2).contiguous(), anchors.flip(0).contiguous(), w1, w2, mode=mode,
                            workspace=ws, exchange=_TimedOut(abort_after))
    got = markov_chain_logits(base, anchors, w1, w2, mode=mode, workspace=ws)[1]
    assert torch.equal(got, want)


def test_markov_chain_component_reset():
    g = torch.Generator().manual_seed(1)
    V, r = 40, 6
    w = MarkovHeadWeights(markov_w1=torch.randn(V, r, generator=g).to(DEV), markov_w2=torch.randn(V, r, generator=g).to(DEV),
                          vocab_start=0, vocab_size=V)
    base = torch.randn(4, 3, V, generator=g).to(DEV)
    anchors = torch.tensor([1, 2, 3, 4], device=DEV)
    want = markov_chain_logits(base, anchors, w.markov_w1, w.markov_w2, mode="fused")[1].clone()
    chain = MarkovChain(w, max_batch_size=4, draft_len=3, logits_dtype=torch.float32, mode="fused")
    chain.workspace.keys.fill_(DIRTY_KEY)  # as a chain killed between launches would leave it
    assert not torch.equal(chain(base, anchors)[1], want)  # a dirty ring gives wrong tokens, silently
    chain.workspace.keys.fill_(DIRTY_KEY)
    chain.reset()
    assert torch.equal(chain(base, anchors)[1], want)
