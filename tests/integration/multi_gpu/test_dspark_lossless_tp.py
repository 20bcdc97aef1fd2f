"""Lossless end to end under tensor parallelism, MPI-launched (gloo on CPU, NCCL on GPUs).

At TP 2 and 4: speculative output (vocab-parallel target and draft selection, bound after load) equals
the target's own non-speculative decode at the same TP size and the gathered path, greedy and keyed
sampling in one batch, identical on every rank. An uneven vocabulary falls back to the gathered path
(same reason on every rank) and stays lossless.
"""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.testing.mpi import run_on_ranks
from tensorrt_llm_ext.testing.tiny_models import tiny_model

# fp32: eager steps run at the live batch size, so GEMM shapes differ between the speculative run and the
# reference; fp32 keeps shape-dependent rounding far below any logit gap (bf16 is covered on one GPU).
SMALL = tiny_model(**{"max_seq_len": 40})
PROMPTS = [[5, 17, 300, 42], [101], list(range(200, 219))]


def _rank_generate(tp: int, vocab: int, max_new: int, modes: tuple[str, ...]):
    import torch

    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.requests import Request

    mapping = init_from_mpi(tp_size=tp)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    device = torch.device("cuda", mapping.local_rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    cfg = load_config(**{**SMALL, "model.target.vocab_size": vocab, "tensor_parallel_size": tp})
    eng = Engine(cfg, mapping, device=device)
    reqs = [Request(list(p), max_new_tokens=max_new, sampling=SamplingParams(temperature=0.9 if i == 1 else 0.0, seed=7 + i))
            for i, p in enumerate(PROMPTS)]
    out = {}
    for mode in modes:
        results, stats = eng.generate(reqs, mode)
        out[mode] = [r.output_ids for r in results]
        out[mode + "_acc"] = stats.mean_acceptance_length
    out["selection"] = eng.worker().selection.describe()
    out["target_vp"] = eng.worker().selection.target_enabled
    out["draft_vp"] = eng.worker().selection.draft_enabled
    return out


def _check(results, tp):
    first = results[0]
    for r in results[1:]:
        assert r == first, "ranks disagree"
    assert first["speculative"] == first["reference"], first
    for mode in ("gathered", "stock"):
        if mode in first:
            assert first[mode] == first["reference"], mode
    assert all(len(o) > 0 for o in first["speculative"])
    return first


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_lossless_tp2_vocab_parallel(mpi_pool_executor):
    res = _check(run_on_ranks(mpi_pool_executor, _rank_generate, 2, 516, 10,
                              ("speculative", "reference", "gathered", "stock")), 2)
    assert res["target_vp"] and res["draft_vp"], res["selection"]
    assert res["speculative_acc"] > 1.0


@pytest.mark.parametrize("mpi_pool_executor", [4], indirect=True)
def test_lossless_tp4_vocab_parallel(mpi_pool_executor):
    res = _check(run_on_ranks(mpi_pool_executor, _rank_generate, 4, 516, 6, ("speculative", "reference")), 4)
    assert res["target_vp"] and res["draft_vp"], res["selection"]


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_lossless_tp2_vocab_parallel_block_aligned_head(mpi_pool_executor):
    """V = 1030: the head's shards are whole 1024-id blocks (the last rank 6 real ids and 1018 zero rows, logit 0):
    vocab-parallel selection and the Markov chain on them stay lossless."""
    res = _check(run_on_ranks(mpi_pool_executor, _rank_generate, 2, 1030, 6, ("speculative", "reference")), 2)
    assert res["target_vp"] and res["draft_vp"], res["selection"]
    assert all(t < 1030 for o in res["speculative"] for t in o)


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_lossless_tp2_uneven_vocab_falls_back_to_gathered(mpi_pool_executor):
    res = _check(run_on_ranks(mpi_pool_executor, _rank_generate, 2, 517, 6, ("speculative", "reference")), 2)
    assert not res["target_vp"] and "unevenly sharded" in res["selection"]


def _rank_generate_reuse(tp: int):
    """Block reuse at TP N: every rank's allocator takes the same cached pages (the plans are the same), and the
    outputs equal an engine without reuse on the same ranks. Two slots: the first two prompts are admitted
    together, so the second waits for the first one's pages (the same decision on every rank)."""
    import torch

    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.runtime.requests import Request

    mapping = init_from_mpi(tp_size=tp)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    device = torch.device("cuda", mapping.local_rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    stem = [9, 250, 3, 97, 14, 400, 8, 61, 2, 330, 45]
    prompts = [stem + [5], stem + [300, 42, 7], stem + [5], stem[:5] + [77]]
    reqs = [Request(list(p), max_new_tokens=5, sampling=SamplingParams(temperature=0.9 if i % 2 else 0.0, seed=3 + i))
            for i, p in enumerate(prompts)]
    base = {**SMALL, "model.target.vocab_size": 516, "tensor_parallel_size": tp, "max_batch_size": 2,
            "kv_cache_config.tokens_per_block": 4}
    out = {}
    for reuse in (False, True):
        eng = Engine(load_config(**{**base, "kv_cache_config.enable_block_reuse": reuse}), mapping, device=device)
        for mode in ("speculative", "target_only"):
            out[(reuse, mode)] = [r.output_ids for r in eng.generate(reqs, mode)[0]]
        out[(reuse, "hits")] = eng.pages.prefix_hits
        out[(reuse, "pages")] = [eng.pages._owned, sorted(eng.pages._key_of), eng.pages.num_free]
    return out


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_block_reuse_tp2_same_pages_and_tokens_on_every_rank(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_generate_reuse, 2)
    assert results[0] == results[1], "ranks disagree"
    res = results[0]
    for mode in ("speculative", "target_only"):
        assert res[(True, mode)] == res[(False, mode)], mode
    assert res[(False, "hits")] == 0 and res[(True, "hits")] >= 2 * 2 * 4  # the repeated prompt, twice per mode
