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


def _rank_setup(tp: int):
    """This rank's mapping (MPI, TP ``tp``) and device; one intra-op thread on a CPU (the ranks share its cores)."""
    from tensorrt_llm_ext.distributed import init_from_mpi

    mapping = init_from_mpi(tp_size=tp)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    return mapping, (torch.device("cuda", mapping.local_rank % torch.cuda.device_count())
                     if torch.cuda.is_available() else None)


def _rank_generate(tp: int, max_new: int, graphs: bool = False):
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.testing.requests import make_request

    mapping, device = _rank_setup(tp)
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


def _rank_gated(tp: int, max_new: int):
    """The speculation gate at TP ``tp``: a 2-token request closes it (window 1, an unreachable threshold) while the
    others run, and they finish in the target-only decode, whose processing at TP > 1 keeps its own full-vocabulary
    state, rebuilt at the hand-over from each request's prompt and tokens so far."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.testing.requests import make_request

    mapping, device = _rank_setup(tp)
    # a random drafter accepts ~nothing: the hand-over comes after ~2 tokens of each row
    gate = {"speculative_config.acceptance_window": 1, "speculative_config.acceptance_length_threshold": 100.0,
            "model.drafter_init": "random"}
    eng = Engine(load_config(**{**SMALL, **gate, "tensor_parallel_size": tp}), mapping, device=device)
    # row 1: a greedy row whose unpenalised decode repeats its first tokens at 7-9, so the penalty acts after the
    # hand-over on counts made before it (in the first batch of slots: the rows past it are admitted target-only)
    reqs = [make_request(max_new_tokens=2, prompt_ids=[11, 12]),
            make_request(max_new_tokens=max_new, prompt_ids=[189, 126, 490], frequency_penalty=1.5)] + [
        make_request(max_new_tokens=max_new, **r) for r in ROWS]
    return _served_and_target(eng, reqs)


def _served_and_target(eng, reqs) -> dict:
    """``reqs`` served speculatively (the engine's switches apply) and decoded target-only: each request's tokens
    (``served`` / ``target``), the decodes the served steps went through in order (``modes``, repeats removed),
    and whether the target decode keeps processing of its own (``separate``: a sharded worker's)."""
    modes = []
    launch = eng.launch_step

    def spy(slots, mode="speculative"):
        modes.append(mode)
        return launch(slots, mode)
    eng.launch_step = spy
    served = [r.output_ids for r in eng.generate(reqs, "speculative")[0]]
    del eng.launch_step
    return {"served": served, "target": [r.output_ids for r in eng.generate(reqs, "target_only")[0]],
            "modes": [m for i, m in enumerate(modes) if i == 0 or modes[i - 1] != m],
            "separate": eng.reference(verify_shaped=False).processors is not eng.worker().processors}


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_gate_hands_running_requests_to_the_target_decode(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_gated, 2, 10)
    first = results[0]
    assert all(r == first for r in results[1:]), "ranks disagree"
    assert first["separate"]  # the hand-over rebuilt the target decode's own processing state
    assert first["modes"] == ["speculative", "target_only"], first["modes"]  # one hand-over, never back
    for row in (1, 2, 5, 6):  # greedy rows (1, 2: penalties): the target's own tokens across the hand-over
        assert first["served"][row] == first["target"][row], row
    assert [len(t) for t in first["served"]] == [2] + [10] * (len(ROWS) + 1)
    assert first["served"][1][7:] != first["served"][1][:3]  # the penalty acted


def _rank_switched(tp: int):
    """Speculation by batch size at TP ``tp`` (max_concurrency 2): the first plans run more requests than that
    (target-only: admitted with a speculative prefill, then handed to the target decode's own full-vocabulary
    processing), the last two resume speculation by a speculative prefill of what they decoded target-only -- the
    shard's processing rebuilt from their prompt and tokens out."""
    from tensorrt_llm_ext.runtime.config import load_config
    from tensorrt_llm_ext.runtime.engine import Engine
    from tensorrt_llm_ext.testing.requests import make_request

    mapping, device = _rank_setup(tp)
    eng = Engine(load_config(**{**SMALL, "speculative_config.max_concurrency": 2, "tensor_parallel_size": tp}),
                 mapping, device=device)
    # rows 0 and 1 outlive the others and resume by their 5th token; row 0's unpenalised decode repeats its first 7
    # tokens from its 8th on: its penalty, after the resume, reads counts made before it (both hand-overs)
    lengths = [16, 14, 2, 3, 3, 4, 4]
    reqs = [make_request(max_new_tokens=lengths[0], prompt_ids=[189, 126, 490], frequency_penalty=1.5,
                         presence_penalty=0.4),
            make_request(max_new_tokens=lengths[1], **ROWS[4])] + [
        make_request(max_new_tokens=n, **r) for n, r in zip(lengths[2:], ROWS)]
    return {**_served_and_target(eng, reqs), "lengths": lengths}


@pytest.mark.parametrize("mpi_pool_executor", [2], indirect=True)
def test_tp2_max_concurrency_switches_decodes_mid_stream(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_switched, 2)
    first = results[0]
    assert all(r == first for r in results[1:]), "ranks disagree"
    assert first["modes"] == ["target_only", "speculative"], first["modes"]
    assert first["separate"]  # the target decode keeps its own full-vocabulary processing; the shards rebuilt theirs
    for row in (0, 1, 2, 5):  # greedy rows (0: penalties): the target's own tokens across both hand-overs
        assert first["served"][row] == first["target"][row], row
    assert [len(t) for t in first["served"]] == first["lengths"]
