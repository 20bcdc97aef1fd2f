"""The exact Markov mode with the next step's resolve folded into the select launch (no exchange):
bitwise the eager chain, the launch structure it promises, a clean workspace after every chain (finished,
aborted, or followed by another mode), and on GPU the large shape and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import MarkovHeadWeights
from tensorrt_llm_ext.kernels import markov_exact_step
from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY
from tensorrt_llm_ext.speculative import markov_chain as mc
from tensorrt_llm_ext.speculative.markov_chain import (
    MarkovChain,
    MarkovChainStepper,
    MarkovWorkspace,
    markov_chain_logits,
    markov_chain_logits_reference,
)
from tensorrt_llm_ext.testing.markov import bits_equal, markov_inputs, sampling_inputs
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled kernels, graphs, large sizes)")


def _make(B, K, V, r, wdt, ldt, seed=0, scale=0.3):
    return markov_inputs(B, K, V, r, wdt, ldt, seed=seed, scale=scale, device=DEV)


def _sampling(B, seed=7):
    return sampling_inputs(B, seed=seed, device=DEV)


def _adversarial(base: torch.Tensor, block: int) -> torch.Tensor:
    """NaN, -inf rows and exact ties straddling the select kernel's column-program boundaries (needs
    V > block + 2; positions past the row are dropped)."""
    base = base.clone()
    B, K, V = base.shape
    assert V > block + 2, "the ties must cross at least one program boundary"

    def cols(*c):
        return [x for x in c if x < V]

    base[0, 0, :] = 0.0  # all-equal row: the bias decides
    base[0, K - 1, cols(block + 1, V - 2)] = float("nan")  # NaN only past the first program: first NaN wins
    if B > 1:
        base[1, 0, :] = float("-inf")  # -inf + finite bias stays -inf: ties across every program -> id 0
        base[1, K - 1, cols(block - 1, block, 2 * block, V - 1)] = 3e4  # bf16: ties across boundaries
    if B > 2:
        base[2, 0, cols(2 * block, block)] = float("nan")
    return base


class _Identity:
    """An exchange that changes nothing: forces the exchanged (unfolded) path on one process."""

    def exchange_(self, keys):
        return keys


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _clean(ws: MarkovWorkspace, rows: int) -> bool:
    return bool((ws.keys[:, :rows] == EMPTY_KEY).all()) and bool((ws.counts[:rows] == 0).all())


# ------------------------------------------------------------------------------------------------------
# folded exact == eager, bit for bit
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wdt,ldt", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                     (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("B,K", [(1, 1), (4, 3)])
def test_folded_matches_eager(wdt, ldt, B, K):
    """Default select block (two column programs per row at V = 2999): ties and NaN across the boundary,
    an invalid anchor; the exchanged path on the same inputs agrees too."""
    V, r = 2999, 24
    base, anchors, w1, w2 = _make(B, K, V, r, wdt, ldt, seed=B * 10 + K)
    base = _adversarial(base, markov_exact_step.SELECT_BLOCK) if B > 1 else base
    anchors[-1] = -1 if B > 1 else anchors[-1]
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="exact")
    assert torch.equal(t, rt) and bits_equal(o, ro)
    xo, xt = markov_chain_logits(base, anchors, w1, w2, mode="exact", exchange=_Identity())
    assert torch.equal(xt, rt) and bits_equal(xo, ro)
    if B > 1:
        assert t[0, K - 1].item() == markov_exact_step.SELECT_BLOCK + 1  # the first NaN, in the second program
        assert t[1, 0].item() == 0  # an all -inf row ties to id 0


@pytest.mark.parametrize("sample", [False, True])
def test_folded_many_programs_per_row(monkeypatch, sample):
    """A small select block: 8 column programs per row and B = 9 rows (more rows than programs per row),
    so the last-program count and the per-row counters are exercised across many programs."""
    block = 64
    monkeypatch.setattr(markov_exact_step, "SELECT_BLOCK", block)
    B, K, V, r = 9, 2, 509, 16
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=3)
    base = _adversarial(base, block)
    anchors[5], anchors[6] = -3, V  # invalid anchors: zero bias
    samp = _sampling(B) if sample else (None, None, None)
    kw = dict(temperatures=samp[0], seeds=samp[1], offsets=samp[2])
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2, **kw)
    ws = MarkovWorkspace.allocate(B, K, w2, "exact")
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="exact", workspace=ws, **kw)
    assert torch.equal(t, rt) and bits_equal(o, ro)
    assert _clean(ws, B)
    if not sample:
        assert t[1, K - 1].item() == block - 1  # exact tie across a program boundary: the lowest id
        assert t[2, 0].item() == block  # the first NaN of the row, in program 1 (program 2 also has one)
        assert torch.equal(o[5:7, 0], base[5:7, 0])  # invalid anchors: zero bias
    else:
        greedy = samp[0] == 0
        assert not torch.equal(t[~greedy], torch.argmax(o[~greedy], dim=2))  # the noise took part


def test_launches_per_chain(monkeypatch):
    """Folded: one resolve launch per chain (the start) and K selects; exchanged: K + 1 resolves."""
    B, K, V, r = 3, 4, 2999, 16
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=5)
    resolve = _Counting(mc.markov_resolve)
    select = _Counting(mc.markov_select)
    monkeypatch.setattr(mc, "markov_resolve", resolve)
    monkeypatch.setattr(mc, "markov_select", select)
    markov_chain_logits(base, anchors, w1, w2, mode="exact")
    assert (resolve.calls, select.calls) == (1, K)
    resolve.calls = select.calls = 0
    markov_chain_logits(base, anchors, w1, w2, mode="exact", exchange=_Identity())
    assert (resolve.calls, select.calls) == (K + 1, K)


# ------------------------------------------------------------------------------------------------------
# workspace: reuse across B and modes, abort, dirty counters
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 4])  # (K - 1) % 3 == 0: the last step's slot is slot 0, which fused reads
def test_workspace_reuse_across_batches_and_modes(K):
    """One workspace: folded exact chains of different B, an exchanged one, then fused chains (which start
    on ring slot 0 without clearing it) -- every result equals a fresh workspace's."""
    V, r, max_B = 613, 16, 6
    base, anchors, w1, w2 = _make(max_B, K, V, r, torch.bfloat16, torch.bfloat16, seed=11)
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
    fo, ft = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    fo, ft = fo.clone(), ft.clone()
    ws = MarkovWorkspace.allocate(max_B, K, w2, "exact")
    for B, mode, ex in ((5, "exact", None), (6, "exact", _Identity()), (6, "fused", None), (2, "exact", None),
                        (3, "fused", None)):
        o, t = markov_chain_logits(base[:B], anchors[:B], w1, w2, mode=mode, exchange=ex, workspace=ws)
        if mode == "exact":
            assert torch.equal(t, rt[:B]) and bits_equal(o, ro[:B]), (B, ex)
        else:
            assert torch.equal(t, ft[:B]) and bits_equal(o, fo[:B]), B
        # An exact chain leaves its rows' whole ring and counters clean; any chain leaves slot 0 clean.
        assert (ws.keys[0, :max_B] == EMPTY_KEY).all() and (mode == "fused" or _clean(ws, B)), (B, mode)


@pytest.mark.parametrize("steps_done", [0, 1, 2])
def test_aborted_folded_chain_leaves_workspace_clean(monkeypatch, steps_done):
    """A folded chain whose select launch raises part way (no exchange to time out here) resets its rows:
    the next chain on the workspace equals a fresh one's, and the ring and counters are clean."""
    B, K, V, r = 4, 3, 2999, 8
    base, anchors, w1, w2 = _make(B, K, V, r, torch.float32, torch.float32, seed=13)
    want = markov_chain_logits(base, anchors, w1, w2, mode="exact")[1].clone()  # a fresh workspace
    real = mc.markov_select
    calls = {"n": 0}

    def failing(*args, **kwargs):
        if calls["n"] == steps_done:
            raise RuntimeError("simulated launch failure")
        calls["n"] += 1
        return real(*args, **kwargs)

    ws = MarkovWorkspace.allocate(B, K, w2, "exact")
    monkeypatch.setattr(mc, "markov_select", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        markov_chain_logits(base.flip(2).contiguous(), anchors.flip(0).contiguous(), w1, w2, mode="exact",
                            workspace=ws)
    monkeypatch.setattr(mc, "markov_select", real)
    assert _clean(ws, B)
    assert torch.equal(markov_chain_logits(base, anchors, w1, w2, mode="exact", workspace=ws)[1], want)


def test_stepper_abort_between_folded_steps():
    """Driven by hand: after two of three folded steps the ring holds live keys; abort() cleans it."""
    B, K, V, r = 3, 3, 2999, 8
    base, anchors, w1, w2 = _make(B, K, V, r, torch.float32, torch.float32, seed=17)
    ws = MarkovWorkspace.allocate(B, K, w2, "exact")
    st = MarkovChainStepper(base, anchors, w1, w2, mode="exact", workspace=ws, fold_resolve=True)
    st.step(0)
    keys = st.step(1).clone()
    assert (keys != EMPTY_KEY).all() and (ws.counts[:B] == 0).all()  # step 1's finished keys, counters zeroed
    st.abort()
    assert _clean(ws, B)


def test_dirty_counters_do_not_leak_into_the_next_chain():
    """Counters a crashed process left behind are zeroed by the chain start (and by reset())."""
    B, K, V, r = 3, 2, 2999, 8
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=19)
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
    chain = MarkovChain(MarkovHeadWeights(w1, w2, 0, V), max_batch_size=4, draft_len=K, mode="exact")
    chain.workspace.counts.fill_(5)
    chain.workspace.keys.fill_(1 << 40)
    o, t = chain(base, anchors)
    assert torch.equal(t, rt) and bits_equal(o, ro)
    chain.workspace.counts.fill_(5)
    chain.reset()
    assert _clean(chain.workspace, 4)


# ------------------------------------------------------------------------------------------------------
# GPU only: large shape, graph replay
# ------------------------------------------------------------------------------------------------------
@gpu_only
@pytest.mark.parametrize("B", [1, 37, 128])
@pytest.mark.parametrize("sample", [False, True])
def test_gpu_folded_large_matches_eager(B, sample):
    V, r, K = 200064, 256, 7
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=B, scale=0.05)
    if B > 2:
        base = _adversarial(base, markov_exact_step.SELECT_BLOCK)
    anchors[-1] = -1
    samp = _sampling(B) if sample else (None, None, None)
    kw = dict(temperatures=samp[0], seeds=samp[1], offsets=samp[2])
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2, **kw)
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="exact", **kw)
    xo, xt = markov_chain_logits(base, anchors, w1, w2, mode="exact", exchange=_Identity(), **kw)
    # Sampled rows: GPU tl.log2 may differ from torch.log2 by ulps; the two kernel paths may not.
    assert torch.equal(t, xt) and bits_equal(o, xo)
    if sample:
        assert bits_equal(o[:, 0], ro[:, 0])  # step 0 depends on the anchors only
        agree = (t == rt).float().mean().item()
        assert agree >= 0.99, agree
    else:
        assert torch.equal(t, rt) and bits_equal(o, ro)


@gpu_only
@pytest.mark.parametrize("B", [16, 128])
def test_gpu_folded_graph_replay_matches_eager(B):
    """Captured folded chain replayed many times on fresh inputs: every replay equals the eager chain (a
    memory-ordering slip in the last-program protocol would show as a wrong token on some replay)."""
    V, r, K = 200064, 256, 7
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=43, scale=0.05)
    chain = MarkovChain(MarkovHeadWeights(w1, w2, 0, V), max_batch_size=B, draft_len=K, mode="exact")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(base, anchors)  # warm-up compiles outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        go, gt = chain(base, anchors)
    g = torch.Generator(device=DEV).manual_seed(1)
    for i in range(20):
        base.copy_(torch.randn(base.shape, generator=g, device=DEV).to(base.dtype))
        anchors.copy_(torch.randint(0, V, (B,), generator=g, device=DEV))
        if i % 2:  # every other replay puts each row's winner in its last column program
            base[:, :, V - 3] = 50.0
        graph.replay()
        ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
        torch.cuda.synchronize()
        assert torch.equal(gt, rt) and bits_equal(go, ro), i
    assert _clean(chain.workspace, B)
