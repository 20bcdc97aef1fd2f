"""AllReduce fusions, allgather, rank agreement and the pair exchange over MPI (gloo on CPU, NCCL on GPU)."""

import pytest
import torch

from tensorrt_llm_ext.testing.mpi import run_on_ranks


def _allreduce_case(dtype_name: str):
    import torch

    from tensorrt_llm_ext.distributed import (AllReduce, AllReduceFusionOp, AllReduceParams, allgather,
                                              comm_device, init_from_mpi)
    from tensorrt_llm_ext.kernels.rms_norm import rms_norm_reference

    mapping = init_from_mpi()
    dev = comm_device()
    dtype = getattr(torch, dtype_name)
    tp = mapping.tp_size
    g = torch.Generator().manual_seed(7)
    parts = torch.randn(tp, 6, 40, generator=g)  # every rank builds all parts, uses its own
    residual = torch.randn(6, 40, generator=g).to(dtype)
    weight = (torch.rand(40, generator=g) + 0.5).to(dtype)
    mine = parts[mapping.tp_rank].to(dtype).to(dev)
    full = parts.to(dtype).float().sum(0)  # the reduced value in fp32
    ar = AllReduce(mapping)
    red = ar(mine.clone())
    normed = ar(mine.clone(), AllReduceParams(AllReduceFusionOp.RMS_NORM, norm_weight=weight.to(dev), eps=1e-5))
    n2, r2 = ar(mine.clone(), AllReduceParams(AllReduceFusionOp.RESIDUAL_RMS_NORM, residual=residual.to(dev),
                                              norm_weight=weight.to(dev), eps=1e-5))
    ref_n, _ = rms_norm_reference(full.to(dtype), weight, 1e-5)
    ref_n2, ref_r2 = rms_norm_reference(full.to(dtype), weight, 1e-5, residual=residual)
    gathered = allgather(torch.full((2, 3), float(mapping.tp_rank), device=dev), mapping, dim=-1)
    return dict(red=red.cpu(), full=full, normed=normed.cpu(), ref_n=ref_n, n2=n2.cpu(), r2=r2.cpu(),
                ref_n2=ref_n2, ref_r2=ref_r2, gathered=gathered.cpu())


@pytest.mark.parametrize("mpi_pool_executor", [2, 4], indirect=True)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_allreduce_fusions(mpi_pool_executor, dtype_name):
    results = run_on_ranks(mpi_pool_executor, _allreduce_case, dtype_name)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype_name == "float32" else dict(atol=3e-2, rtol=3e-2)
    tp = len(results)
    for r in results:
        torch.testing.assert_close(r["red"].float(), r["full"], **tol)
        torch.testing.assert_close(r["normed"].float(), r["ref_n"].float(), **tol)
        torch.testing.assert_close(r["n2"].float(), r["ref_n2"].float(), **tol)
        torch.testing.assert_close(r["r2"].float(), r["ref_r2"].float(), **tol)
        expect = torch.cat([torch.full((2, 3), float(i)) for i in range(tp)], dim=-1)
        assert torch.equal(r["gathered"], expect)
    # Every rank ends with the same bits.
    for key in ("red", "normed", "n2", "r2"):
        assert all(torch.equal(results[0][key], r[key]) for r in results[1:]), key


def _adversarial_rows(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(12, vocab, generator=g)
    rows[0] = 1.0  # all tied: lowest id
    rows[1, :] = float("-inf")  # all -inf: id 0
    rows[2, vocab - 1] = float("nan"); rows[2, vocab // 2] = float("nan")  # first NaN wins
    rows[3, :] = float("nan")
    rows[4, :] = -3.0; rows[4, vocab // 2 - 1] = 5.0; rows[4, vocab // 2] = 5.0  # tie across a boundary
    rows[5, :] = 0.0; rows[5, 3] = -0.0  # -0 ties +0
    rows[6, -1] = float("inf"); rows[6, 0] = float("inf")
    rows[7] = rows[7].to(torch.bfloat16).float()  # many exact ties after rounding
    rows[8, :] = float("-inf"); rows[8, vocab - 1] = -1e30
    return rows


def _pair_exchange_case(vocab: int, seed: int):
    from tensorrt_llm_ext.distributed import PairExchange, comm_device, init_from_mpi
    from tensorrt_llm_ext.kernels.ordered_key import shard_argmax_key_reference

    mapping = init_from_mpi()
    rows = _adversarial_rows(vocab, seed)
    shard = -(-vocab // mapping.tp_size)  # padded: the last shard may be short or empty
    start = mapping.tp_rank * shard
    local = torch.zeros(rows.shape[0], shard)  # padded columns hold 0 (zero weight rows), must not win
    width = max(0, min(shard, vocab - start))
    local[:, :width] = rows[:, start:start + width]
    keys = shard_argmax_key_reference(local, start, vocab).to(comm_device())
    ex = PairExchange(mapping)
    return ex.winner_ids(keys).cpu(), torch.argmax(rows, dim=-1)


@pytest.mark.parametrize("mpi_pool_executor", [2, 3, 4], indirect=True)
@pytest.mark.parametrize("vocab", [9, 37, 1000])
def test_pair_exchange_matches_torch_argmax(mpi_pool_executor, vocab):
    results = run_on_ranks(mpi_pool_executor, _pair_exchange_case, vocab, vocab)
    for ids, expect in results:
        assert torch.equal(ids, expect)


def _agree_case():
    from tensorrt_llm_ext.distributed import agree_all, agree_any, init_from_mpi

    mapping = init_from_mpi()
    mine = mapping.tp_rank == 0
    return agree_all(mapping, mine), agree_any(mapping, mine), agree_all(mapping, True)


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_agreement_is_identical_on_every_rank(mpi_pool_executor):
    assert run_on_ranks(mpi_pool_executor, _agree_case) == [(False, True, True)] * 2


def _bad_tp_case():
    from tensorrt_llm_ext.distributed import init_from_mpi

    init_from_mpi(tp_size=3)


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp_size_not_dividing_world_is_rejected(mpi_pool_executor):
    from tensorrt_llm_ext.testing.mpi import RankJobError

    with pytest.raises(RankJobError, match="does not divide"):
        run_on_ranks(mpi_pool_executor, _bad_tp_case)
