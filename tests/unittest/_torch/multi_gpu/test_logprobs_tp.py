"""Log-probabilities on vocabulary shards (MPI: gloo on CPU): each rank's ``[R, V_shard]`` plus the
``[R]`` / ``[R, k]`` exchanges give the single-rank values on the gathered rows, even and padded vocabularies,
with temperature and the exact top-p."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tensorrt_llm_ext.testing.mpi import run_on_ranks

VOCABS = (600, 601)  # 601 pads the last shard
K = 5


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 3).round() / 2  # exact ties across shards
    tokens = torch.randint(0, vocab, (6,), generator=g)
    tokens[0] = vocab - 1  # owned by the last (padded) shard
    temps = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 0.9])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.5, 0.3, 0.95])
    return logits, tokens, temps, top_p


@dataclass(frozen=True)
class _Head:  # what token_logprobs reads of a VocabParallelHead
    vocab_start: int
    vocab_size: int
    mapping: object
    exchange: object


def _rank():
    from tensorrt_llm_ext.distributed import PairExchange, init_from_mpi
    from tensorrt_llm_ext.speculative.logprobs import token_logprobs
    from tensorrt_llm_ext.speculative.verification import top_p_keep_reference

    mapping = init_from_mpi()
    exchange = PairExchange(mapping)
    out = {}
    for vocab in VOCABS:
        logits, tokens, temps, top_p = _inputs(vocab)
        width = -(-vocab // mapping.tp_size)
        padded = torch.nn.functional.pad(logits, (0, width * mapping.tp_size - vocab))
        start = mapping.tp_rank * width
        head = _Head(start, vocab, mapping, exchange)
        shard = token_logprobs(padded[:, start:start + width].contiguous(), tokens, temps, top_p, K, head=head,
                               top_p_keep=top_p_keep_reference)
        single = token_logprobs(logits, tokens, temps, top_p, K, top_p_keep=top_p_keep_reference)
        out[vocab] = (shard, single)
    return out


@pytest.mark.parametrize("mpi_pool_executor", [2, 3], indirect=True)
def test_shard_logprobs_equal_single_rank(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank)
    for res in results:
        for vocab in VOCABS:
            shard, single = res[vocab]
            torch.testing.assert_close(shard.chosen, single.chosen, atol=1e-5, rtol=0)
            torch.testing.assert_close(shard.top_values, single.top_values, atol=1e-5, rtol=0)
            assert torch.equal(shard.top_ids, single.top_ids)  # ties to the lowest id on every rank
            # the single-rank values are torch.log_softmax of the tempered, top-p-restricted rows
            logits, tokens, temps, top_p = _inputs(vocab)
            from tensorrt_llm_ext.speculative.verification import top_p_keep_reference

            x = logits / torch.where(temps > 0, temps, torch.ones_like(temps))[:, None]
            keep = top_p_keep_reference(logits, top_p, temperatures=temps)
            x = torch.where(keep | ~((temps > 0) & (top_p < 1))[:, None], x, torch.tensor(float("-inf")))
            ref = torch.log_softmax(x, -1)
            torch.testing.assert_close(single.chosen, ref.gather(1, tokens[:, None])[:, 0], atol=1e-5, rtol=0)
            assert torch.isfinite(single.top_values[:, 0]).all()
