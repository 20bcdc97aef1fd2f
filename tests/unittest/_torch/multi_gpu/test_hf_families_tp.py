"""Hugging Face families at TP 2 (MPI, gloo on CPU): Llama 3 (`llama3` RoPE), Qwen2 (q/k/v biases), Qwen3 (q/k
norms, explicit head_dim) and Mistral checkpoints, each rank loading its slices from the directory, give
transformers' greedy tokens on every rank -- every family in one MPI launch."""

from __future__ import annotations

import pytest

from tensorrt_llm_ext.testing.mpi import run_on_ranks

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 300, 2, 99, 42, 7, 250, 1, 3]
NEW_TOKENS = 16


def _decode_on_rank(directories: list[str], num_tokens: int) -> list[list[int]]:
    import torch

    from tensorrt_llm_ext.distributed import comm_device, init_from_mpi
    from tensorrt_llm_ext.testing.hf_checkpoints import greedy_decode, load_target

    torch.set_num_threads(1)
    mapping = init_from_mpi()
    return [greedy_decode(load_target(d, mapping, device=comm_device()), PROMPT, num_tokens) for d in directories]


FAMILIES = ("llama3", "qwen2", "qwen3", "mistral")


def test_tp2_families_greedy_equal_transformers(mpi_pool_executor, tmp_path):
    from tensorrt_llm_ext.testing.hf_checkpoints import TINY_FAMILIES, hf_greedy_decode, save_tiny_hf_checkpoint

    assert set(FAMILIES) <= set(TINY_FAMILIES)
    want = []
    for family in FAMILIES:
        hf = save_tiny_hf_checkpoint(tmp_path / family, family, seed=5)
        want.append(hf_greedy_decode(hf, PROMPT, NEW_TOKENS))
    results = run_on_ranks(mpi_pool_executor, _decode_on_rank, [str(tmp_path / f) for f in FAMILIES],
                           NEW_TOKENS, timeout=240)
    assert len(results) == 2
    for rank, got in enumerate(results):
        assert got == want, f"rank {rank}"
