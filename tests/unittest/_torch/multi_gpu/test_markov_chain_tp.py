"""Markov chain on a vocab shard over MPI (gloo on CPU, NCCL on GPU): exact mode equals the eager chain
(gathered over ranks) bit for bit; fused mode equals the TP-1 fused chain bit for bit; keyed sampling
gives the same tokens at every TP size."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.testing.mpi import run_on_ranks

V, R, K, B = 601, 16, 3, 4  # 601 pads the last shard at TP 2/3/4


def _inputs(integer_weights: bool):
    """Identical on every rank (and in the test process)."""
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(B, K, V, generator=g)
    base[0, 0] = -torch.rand(V, generator=g) - 1.0  # all negative: a padded zero column would win
    base[1, 1, [0, V - 1]] = 50.0  # tie between the first and the last shard: lowest id
    base[2, 2, V // 2 + 1] = float("nan")
    if integer_weights:  # every GEMM exact: any shard's bias equals the full one
        w1 = torch.randint(-2, 3, (V, R), generator=g).float()
        w2 = torch.randint(-2, 3, (V, R), generator=g).float() * 0.125
    else:
        w1 = torch.randn(V, R, generator=g) * 0.3
        w2 = torch.randn(V, R, generator=g) * 0.3
    anchors = torch.randint(0, V, (B,), generator=g)
    anchors[3] = -1  # dummy row
    temps = torch.tensor([0.0, 0.7, 1.3, 0.9])
    seeds = torch.tensor([11, 2**40 + 3, 77, 5], dtype=torch.int64)
    offsets = torch.tensor([0, 9, 2**33, 123], dtype=torch.int64)
    return (base.to(torch.bfloat16), w1.to(torch.bfloat16), w2.to(torch.bfloat16), anchors, temps, seeds,
            offsets)


def _rank_chain():
    import torch

    from tensorrt_llm_ext.distributed import PairExchange, comm_device, init_from_mpi
    from tensorrt_llm_ext.contract import MarkovHeadWeights
    from tensorrt_llm_ext.speculative.markov_chain import (MarkovChain, markov_chain_logits,
                                                           markov_chain_logits_reference)

    mapping = init_from_mpi()
    dev = comm_device()
    exchange = PairExchange(mapping)
    width = -(-V // mapping.tp_size)
    start = mapping.tp_rank * width
    stop = min(V, start + width)
    out = {}
    for integer in (False, True):
        base, w1, w2, anchors, temps, seeds, offsets = _inputs(integer)
        bl = torch.zeros(B, K, width, dtype=base.dtype)  # padded columns: logit 0 (zero head rows)
        bl[:, :, : stop - start] = base[:, :, start:stop]
        w2s = torch.zeros(width, R, dtype=w2.dtype)
        w2s[: stop - start] = w2[start:stop]
        bl, w1, w2s, anchors = bl.to(dev), w1.to(dev), w2s.to(dev), anchors.to(dev)
        samp = dict(temperatures=temps.to(dev), seeds=seeds.to(dev), offsets=offsets.to(dev))
        kw = dict(vocab_start=start, vocab_size=V, exchange=exchange)
        res = {"ref": markov_chain_logits_reference(bl, anchors, w1, w2s, **kw)}
        for mode in ("exact", "fused"):
            res[mode] = markov_chain_logits(bl, anchors, w1, w2s, mode=mode, **kw)
            res[mode + "_sample"] = markov_chain_logits(bl, anchors, w1, w2s, mode=mode, **kw, **samp)
        chain = MarkovChain(MarkovHeadWeights(w1, w2s, start, V), max_batch_size=B, draft_len=K,
                            exchange=exchange, mode="fused")
        res["component"] = chain(bl, anchors)
        out[integer] = {name: (o[:, :, : stop - start].cpu(), t.cpu()) for name, (o, t) in res.items()}
    return out


def _bits(x):
    return x.float().nan_to_num(nan=12345.0)


@pytest.mark.parametrize("mpi_pool_executor", [2, 3, 4], indirect=True)
def test_markov_chain_tp(mpi_pool_executor):
    from tensorrt_llm_ext.speculative.markov_chain import markov_chain_logits

    per_rank = run_on_ranks(mpi_pool_executor, _rank_chain)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for integer in (False, True):
        ranks = [r[integer] for r in per_rank]
        gathered = {name: (torch.cat([r[name][0] for r in ranks], dim=2), ranks[0][name][1]) for name in ranks[0]}
        for name in ranks[0]:  # every rank ends with the same tokens
            assert all(torch.equal(r[name][1], ranks[0][name][1]) for r in ranks), name
        # exact == eager chain on the gathered logits, bit for bit
        assert torch.equal(gathered["exact"][1], gathered["ref"][1])
        assert torch.equal(_bits(gathered["exact"][0]), _bits(gathered["ref"][0]))
        # fused == TP-1 fused, bit for bit; the component agrees with the function
        base, w1, w2, anchors, temps, seeds, offsets = _inputs(integer)
        args = (base.to(dev), anchors.to(dev), w1.to(dev), w2.to(dev))
        samp = dict(temperatures=temps.to(dev), seeds=seeds.to(dev), offsets=offsets.to(dev))
        o1, t1 = markov_chain_logits(*args, mode="fused")
        assert torch.equal(gathered["fused"][1], t1.cpu())
        assert torch.equal(_bits(gathered["fused"][0]), _bits(o1.cpu()))
        assert torch.equal(gathered["component"][1], t1.cpu())
        # keyed sampling: same tokens as TP 1 (fused always; exact when the GEMMs are exact)
        fo, ft = markov_chain_logits(*args, mode="fused", **samp)
        assert torch.equal(gathered["fused_sample"][1], ft.cpu())
        if integer:
            eo, et = markov_chain_logits(*args, mode="exact", **samp)
            assert torch.equal(gathered["exact_sample"][1], et.cpu())
            assert torch.equal(et, ft)
