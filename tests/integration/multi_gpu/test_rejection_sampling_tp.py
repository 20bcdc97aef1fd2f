"""Rejection sampling at TP 2, MPI-launched (gloo on CPU, NCCL on GPUs).

* Vocab-sharded verification == gathered verification bitwise (tokens and acceptance lengths), greedy rows
  == the target-only decode, top-p rows, identical on every rank; the decision is "vocab-sharded".
* Lossless in distribution at TP 2 (a smaller count than at TP 1): chi-square of the first two tokens,
  alpha = 1e-3. For speed the sharded worker runs an op table whose verification, top-p and tail ops are
  the eager twins (same exchanges, same bits as the fused launchers); selection and the Markov chain stay
  the fused kernels, and the model's RMSNorm runs its eager twin.
"""

from __future__ import annotations

import contextlib

import pytest

from tensorrt_llm_ext.testing.mpi import run_on_ranks
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"model.target.vocab_size": 66, "model.target.num_layers": 1, "model.target.capture_layers": [0],
                      "max_seq_len": 32, "speculative_config.use_rejection_sampling": True,
                      "tensor_parallel_size": 2})
PROMPTS = [[5, 17, 30, 42], [51], list(range(20, 31)), [7, 7, 60, 2, 9]]


@contextlib.contextmanager
def _rank_env(tp: int, eager_twins: bool):
    """Join the TP group; on CPU run the model's RMSNorm on its eager twin and (``eager_twins``) give the
    engine an op table with eager-twin verification / top-p / tail ops. The MPI pool's rank processes are
    reused by later tests, so every patch is undone on the way out."""
    import dataclasses

    import torch

    import tensorrt_llm_ext.kernels.rms_norm as rms
    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.speculative import step_ops
    from tensorrt_llm_ext.speculative.verification import rejection_sample_reference, top_p_keep_reference

    mapping = init_from_mpi(tp_size=tp)
    device = None
    saved = (rms.triton_runs_on, step_ops.FUSED_OPS, torch.get_num_threads())
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", mapping.local_rank % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)
            rms.triton_runs_on = lambda t: False
        if eager_twins:
            stock = step_ops.STOCK_OPS
            step_ops.FUSED_OPS = dataclasses.replace(
                step_ops.FUSED_OPS, name="fused-eager-twins", decode_block_table=stock.decode_block_table,
                strict_accept=stock.strict_accept, paged_latent_step=stock.paged_latent_step,
                store_context_latents=stock.store_context_latents, rejection_sample=rejection_sample_reference,
                top_p_keep=top_p_keep_reference)
        yield mapping, device
    finally:
        rms.triton_runs_on, step_ops.FUSED_OPS = saved[0], saved[1]
        torch.set_num_threads(saved[2])


def _rank_sharded_vs_gathered(max_new: int, vocab: int | None = None):
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine

    cfg = SMALL if vocab is None else {**SMALL, "model.target.vocab_size": vocab}
    with _rank_env(2, eager_twins=False) as (mapping, device):
        return _sharded_vs_gathered(Engine(load_config(**cfg), mapping, device=device), max_new)


def _sharded_vs_gathered(eng, max_new: int):
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.requests import Request

    drawn = {1: dict(temperature=1.0), 3: dict(temperature=0.7, top_p=0.8)}
    reqs = [Request(list(p), max_new_tokens=max_new, sampling=SamplingParams(seed=3 + i, **drawn.get(i, {})))
            for i, p in enumerate(PROMPTS)]
    out = {}
    for mode in ("speculative", "gathered", "reference"):
        results, _ = eng.generate(reqs, mode)
        out[mode] = [r.output_ids for r in results]
        out[mode + "_acc"] = [r.accepted_lens for r in results]
    out["decision"] = eng.worker().verifier.decision.describe()
    out["gathered_decision"] = eng.worker("gathered").verifier.decision.describe()
    out["passes"] = eng.worker().verifier.passes
    out["shard_width"] = eng.worker().verifier.width
    return out


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_sharded_verification_equals_gathered(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_sharded_vs_gathered, 5)
    first = results[0]
    assert all(r == first for r in results[1:]), "ranks disagree"
    assert "rejection sampling, vocab-sharded" in first["decision"], first["decision"]
    assert "gathered" in first["gathered_decision"]
    assert first["passes"] == "two"  # V = 66 is less than a block: the head keeps ceil(V / tp) = 33 columns
    assert first["speculative"] == first["gathered"]
    assert first["speculative_acc"] == first["gathered_acc"]
    for i in (0, 2):  # greedy rows
        assert first["speculative"][i] == first["reference"][i]
    assert all(len(o) == 5 for o in first["speculative"])


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_block_aligned_head_verifies_in_one_pass(mpi_pool_executor):
    """V = 1030 at TP 2: the head splits into whole 1024-id blocks (the last rank: 6 real ids, 1018 zero rows;
    ceil(V / tp) would be 515), vocab-parallel selection stays eligible (1030 % 2 == 0), and the sharded verifier
    reads the logits once per call with the gathered path's tokens; greedy rows equal the target-only decode."""
    results = run_on_ranks(mpi_pool_executor, _rank_sharded_vs_gathered, 5, 1030)
    first = results[0]
    assert all(r == first for r in results[1:]), "ranks disagree"
    assert "rejection sampling, vocab-sharded" in first["decision"], first["decision"]
    assert first["shard_width"] == 1024 and first["passes"] == "one", (first["shard_width"], first["passes"])
    assert first["speculative"] == first["gathered"]
    assert first["speculative_acc"] == first["gathered_acc"]
    for i in (0, 2):
        assert first["speculative"][i] == first["reference"][i]
    assert all(len(o) == 5 and all(t < 1030 for t in o) for o in first["speculative"])


def _rank_distribution(n: int, temp: float):
    with _rank_env(2, eager_twins=True) as (mapping, device):
        return _distribution(mapping, device, n, temp)


def _distribution(mapping, device, n: int, temp: float):
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.contract import SamplingParams
    from tensorrt_llm_ext.runtime.requests import Request

    dist = {**SMALL, "model.target.vocab_size": 24, "speculative_config.max_draft_len": 2, "max_batch_size": 64,
            "max_seq_len": 16}
    prompt = [3, 11, 7]
    eng = Engine(load_config(**dist), mapping, device=device)
    rs, _ = eng.generate([Request(list(prompt), max_new_tokens=2, sampling=SamplingParams(temperature=temp, seed=i)) for i in range(n)])
    ref, _ = eng.generate([Request(list(prompt), max_new_tokens=2, sampling=SamplingParams(temperature=temp, seed=n + i)) for i in range(n)],
                          "stock")  # strict acceptance, gathered: bitwise the target's own sampling
    return {"rs": [r.output_ids for r in rs], "ref": [r.output_ids for r in ref],
            "decision": eng.worker().verifier.decision.describe(), "ops": eng.worker().ops.name}


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_lossless_in_distribution(mpi_pool_executor):
    from collections import Counter

    from tensorrt_llm_ext.testing.stats import chi_square_homogeneity

    results = run_on_ranks(mpi_pool_executor, _rank_distribution, 192, 2.0, timeout=600)
    first = results[0]
    assert all(r == first for r in results[1:]), "ranks disagree"
    assert "vocab-sharded" in first["decision"] and first["ops"] == "fused-eager-twins", first
    rs = Counter(tuple(o) for o in first["rs"])
    ref = Counter(tuple(o) for o in first["ref"])
    stat, dof, p = chi_square_homogeneity(rs, ref)
    assert dof >= 3, dof
    assert p > 1e-3, (stat, dof, p)  # alpha = 1e-3
