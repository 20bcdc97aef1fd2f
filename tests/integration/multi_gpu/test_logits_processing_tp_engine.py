"""Logits processing under tensor parallelism, MPI-launched (gloo on CPU, NCCL on GPUs): at TP 2 with a
vocab-parallel target, the speculative decode processes this rank's shard (bias and penalties per column,
min_p's row max and top_k's k-th value exchanged) and equals the target's own decode, which processes the
gathered rows over the whole vocabulary -- greedy and keyed-sampled rows, every field, identical on every rank."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.testing.mpi import run_on_ranks
from tensorrt_llm_ext.testing.tiny_models import tiny_model

SMALL = tiny_model(**{"max_seq_len": 40, "model.target.vocab_size": 516})
ROWS = [
    dict(prompt_ids=[5, 5, 17, 300], repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=0.6),
    dict(prompt_ids=[101], temperature=3.0, seed=7, top_k=2),
    dict(prompt_ids=list(range(200, 219)), temperature=2.5, seed=8, min_p=0.3, logit_bias={300: 4.0}),
    dict(prompt_ids=[9, 8, 7], logit_bias={515: 100.0}),  # the last id: the second shard's column
    dict(prompt_ids=[40, 41]),  # unprocessed beside the others
]


def _rank_generate(tp: int, max_new: int, graphs: bool = False):
    import torch

    from tensorrt_llm_ext.distributed import init_from_mpi
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.testing.requests import make_request

    mapping = init_from_mpi(tp_size=tp)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    device = torch.device("cuda", mapping.local_rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    cfg = load_config(**{**SMALL, "tensor_parallel_size": tp})
    eng = Engine(cfg, mapping, device=device, use_cuda_graph=graphs)
    reqs = [make_request(max_new_tokens=max_new, **r) for r in ROWS]
    out = {mode: [r.output_ids for r in eng.generate(reqs, mode)[0]] for mode in ("speculative", "reference")}
    out["target_vp"] = eng.worker().selection.target_enabled
    if graphs:  # the same requests eagerly, and what the graphed runners did
        eager = Engine(cfg, mapping, device=device)
        out["eager"] = {mode: [r.output_ids for r in eager.generate(reqs, mode)[0]]
                        for mode in ("speculative", "reference")}
        out["eager_steps"] = {mode: eng.runner(mode).eager_steps for mode in ("speculative", "reference")}
        out["replayed"] = {mode: sorted(str(v) for (_, v), n in eng.runner(mode).replays.items() if n)
                           for mode in ("speculative", "reference")}
    return out


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_processed_shards_equal_the_gathered_target_decode(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_generate, 2, 6)
    first = results[0]
    assert all(r == first for r in results[1:]), "ranks disagree"
    assert first["target_vp"]
    assert first["speculative"] == first["reference"], first
    assert first["speculative"][3] == [515] * 6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_gpu_processed_steps_replay_the_processed_graph(mpi_pool_executor):
    """At TP 2 under real CUDA graphs: the processed steps (fixed-size row-max all-reduce and top-k all-gather on
    the shards) replay the processed graph -- no step eager -- and emit the eager engine's tokens on every rank."""
    results = run_on_ranks(mpi_pool_executor, _rank_generate, 2, 6, True)
    first = results[0]
    assert all(r == first for r in results[1:]), "ranks disagree"
    assert first["speculative"] == first["eager"]["speculative"] == first["reference"], first
    assert first["reference"] == first["eager"]["reference"]
    assert first["eager_steps"] == {"speculative": 0, "reference": 0}, first["eager_steps"]
    assert all("top-p+processed" in v for v in first["replayed"].values()), first["replayed"]
