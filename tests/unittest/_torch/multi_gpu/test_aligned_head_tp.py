"""The block-aligned LM head over MPI (gloo on CPU, NCCL on GPU): V = 5000 splits into whole 1024-id blocks at TP 2
(3072 rows per rank; ceil(V / tp) would be 2500) and TP 3 (2048; ceil 1667), the last rank padded with zero rows.
Each rank's own head shard plus the real exchanges give TP 1's tokens and values: greedy and sampled selection,
logprobs with top-p, and rejection-sampling verification, which reads the logits once on every rank (observed).
Adversarial: every real logit is about -1e4 and every padded one is 0, so a padded column that is not masked wins.
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.mapping import vocab_shards
from tensorrt_llm_ext.testing.mpi import run_on_ranks

V, H, ROWS, B, K, TOP = 5000, 8, 6, 2, 2, 5


def _weight_and_hidden():
    """Identical on every rank: real logits -1e4 + N(0, ~7); row 1 ties its max on ids 0, 3072, 4096 and V - 1."""
    g = torch.Generator().manual_seed(17)
    w = torch.randn(V, H, generator=g)
    w[:, 0] = 1.0
    h = torch.randn(ROWS + B * (2 * K + 1), H, generator=g)
    h[:, 0] = -1e4
    top = (h[1] @ w.t()).argmax()
    for col in (0, 3072, 4096, V - 1):
        w[col] = w[top]
    return w, h


def _rank(fused: bool):
    import dataclasses

    import torch

    from tensorrt_llm_ext.distributed import PairExchange, comm_device, init_from_mpi
    from tensorrt_llm_ext.mapping import Mapping
    from tensorrt_llm_ext.modules.linear import TensorParallelMode
    from tensorrt_llm_ext.modules.lm_head import LMHead
    from tensorrt_llm_ext.speculative import verification as vf
    from tensorrt_llm_ext.speculative.logprobs import token_logprobs
    from tensorrt_llm_ext.speculative.vocab_parallel import VocabParallelHead, gumbel_sample, vocab_parallel_argmax

    mapping = init_from_mpi()
    dev = comm_device()
    exchange = PairExchange(mapping)
    w, h = _weight_and_hidden()
    h = h.to(dev)
    head = LMHead(V, H, torch.float32, dev, mapping, TensorParallelMode.COLUMN, gather_output=True)
    head.load_weights(w)
    single = LMHead(V, H, torch.float32, dev, Mapping(), None)
    single.load_weights(w)
    vph = VocabParallelHead(head, exchange)
    start = head.vocab_start
    x, full = head.shard_forward(h), single(h)
    sel_x, sel_full = x[:ROWS].contiguous(), full[:ROWS].contiguous()
    out = {"layout": (head.shard_width, start, head.num_valid_rows),
           "padded_logits_zero": not bool(x[:, head.num_valid_rows:].any()),
           "real_logits_max": float(full.max())}
    temps = torch.tensor([1.0, 1.0, 0.0, 2.0, 0.5, 0.7], device=dev)
    seeds = torch.arange(ROWS, dtype=torch.int64, device=dev) * 7919 + 5
    offsets = torch.arange(ROWS, dtype=torch.int64, device=dev) + 40
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95, 0.3], device=dev)
    out["greedy"] = (vocab_parallel_argmax(sel_x, start, V, exchange).cpu(),
                     vocab_parallel_argmax(sel_full, 0, V).cpu())
    out["sample"] = (gumbel_sample(sel_x, temps, seeds, offsets, start, V, exchange).cpu(),
                     gumbel_sample(sel_full, temps, seeds, offsets, 0, V).cpu())
    keep = vf.top_p_keep if fused else vf.top_p_keep_reference
    tokens = out["sample"][1].to(dev)
    lp = token_logprobs(sel_x, tokens, temps, top_p, TOP, head=vph, top_p_keep=keep)
    lp1 = token_logprobs(sel_full, tokens, temps, top_p, TOP, top_p_keep=keep)
    out["logprobs"] = ((lp.chosen.cpu(), lp.top_values.cpu(), lp.top_ids.cpu()),
                       (lp1.chosen.cpu(), lp1.top_values.cpu(), lp1.top_ids.cpu()))
    # verification: target rows [B, K+1], draft rows [B, K] from the same head
    tgt_x = x[ROWS:ROWS + B * (K + 1)].reshape(B, K + 1, -1).contiguous()
    drf_x = x[ROWS + B * (K + 1):].reshape(B, K, -1).contiguous()
    tgt_f = full[ROWS:ROWS + B * (K + 1)].reshape(B, K + 1, -1).contiguous()
    drf_f = full[ROWS + B * (K + 1):].reshape(B, K, -1).contiguous()
    drafts = torch.stack([drf_f[0].argmax(-1), torch.tensor([V - 1, 3072], device=dev)])
    kw = dict(temperatures=torch.tensor([1.0, 0.0], device=dev),
              seeds=torch.tensor([11, 2**40 + 1], dtype=torch.int64, device=dev),
              offsets=torch.tensor([3, 9], dtype=torch.int64, device=dev))
    table = "_FUSED_KERNELS" if fused else "_EAGER_KERNELS"
    ops = getattr(vf, table)
    seen = []

    def spy(name, fn):
        def run(*a, **k):
            seen.append(name)
            return fn(*a, **k)
        return run

    rs = vf.rejection_sample if fused else vf.rejection_sample_reference
    setattr(vf, table, dataclasses.replace(ops, stats=spy("one", ops.stats), block_keys=spy("two", ops.block_keys)))
    try:
        ws = vf.VerificationWorkspace.for_verification(B, K, head.shard_width, tp=mapping.tp_size, device=dev,
                                                       num_splits=2)
        res = {}
        for name, p in (("none", None), ("top_p", torch.tensor([0.8, 1.0], device=dev))):
            acc, n = rs(tgt_x, drf_x, drafts, top_p=p, vocab_start=start, vocab_size=V, exchange=exchange,
                        workspace=ws, **kw)
            acc1, n1 = rs(tgt_f, drf_f, drafts, top_p=p, **kw)
            res[name] = ((acc.cpu(), n.cpu()), (acc1.cpu(), n1.cpu()))
        out["verify"], out["passes"] = res, seen
    finally:
        setattr(vf, table, ops)
    return out


@pytest.mark.parametrize("fused", [True, False])  # the kernels, and the eager twins (the same exchanges)
@pytest.mark.parametrize("mpi_pool_executor", [2, 3], indirect=True)
def test_aligned_head_equals_tp1(mpi_pool_executor, fused):
    results = run_on_ranks(mpi_pool_executor, _rank, fused)
    tp = len(results)
    s = vocab_shards(V, tp)
    assert s.rule == "aligned" and s.width > -(-V // tp)
    for rank, res in enumerate(results):
        assert res["layout"] == (s.width, rank * s.width, s.num_valid(rank))
        assert res["padded_logits_zero"] and res["real_logits_max"] < -9000  # padding far above every real logit
        for key in ("greedy", "sample"):
            got, want = res[key]
            assert torch.equal(got, want) and bool((got < V).all()), key
        assert int(res["greedy"][0][1]) == 0  # the tie across ranks: the lowest id
        (chosen, vals, ids), (chosen1, vals1, ids1) = res["logprobs"]
        torch.testing.assert_close(chosen, chosen1, atol=1e-5, rtol=0)
        torch.testing.assert_close(vals, vals1, atol=1e-5, rtol=0)
        assert torch.equal(ids, ids1) and bool((ids < V).all())
        assert bool(torch.isfinite(chosen[[0, 2]]).all())  # rows without top-p: every drawn token has mass
        for name, ((acc, n), (acc1, n1)) in res["verify"].items():
            assert torch.equal(acc, acc1) and torch.equal(n, n1), name
            assert bool((acc < V).all()), name
        assert res["passes"] == ["one", "one", "one", "one"], res["passes"]  # sharded and TP 1 calls, both
    for other in results[1:]:
        assert torch.equal(other["sample"][0], results[0]["sample"][0])
        assert all(torch.equal(other["verify"][k][0][0], results[0]["verify"][k][0][0]) for k in ("none", "top_p"))
