"""Logits processing on vocabulary shards (MPI: gloo on CPU): each rank's ``[R, V_shard]`` with the min_p row-max
all-reduce and the top_k all-gather of ``[R, k]`` gives its columns of the full-vocabulary reference, bitwise,
for even and padded vocabularies, ties across shard boundaries included."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.testing.mpi import run_on_ranks

VOCABS = (60, 61)  # 61 pads the last shard
K = 2


def _case(vocab: int):
    from tensorrt_llm_ext.contract import SamplingParams

    g = torch.Generator().manual_seed(vocab)
    fields = [SamplingParams(top_k=5), SamplingParams(min_p=0.2, logit_bias=((vocab - 1, 9.0),)),
              SamplingParams(top_k=3, min_p=0.05, frequency_penalty=0.7, repetition_penalty=1.4),
              SamplingParams(), SamplingParams(top_k=40, presence_penalty=1.0)]
    temps = [1.0, 0.8, 1.5, 1.0, 0.0]
    prompts = [[1], [2, 3], [4, 4], [5], [vocab - 1]]
    logits = (torch.randn(len(fields) * (K + 1), vocab, generator=g) * 2).round() / 2  # ties across shards
    drafts = torch.randint(0, vocab, (len(fields), K), generator=g)
    history = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in fields]
    return fields, temps, prompts, logits, drafts, history


def _apply(vocab: int, mapping, start: int, width: int, logits: torch.Tensor):
    from tensorrt_llm_ext.speculative.logits_processing import SlotLogitsProcessors

    fields, temps, prompts, _, drafts, history = _case(vocab)
    slots = list(range(len(fields)))
    proc = SlotLogitsProcessors(len(fields), start, width, vocab, "cpu", mapping, sharded=mapping is not None)
    proc.assign(slots, fields, prompts)
    proc.record(slots, torch.tensor(slots), torch.tensor(history), torch.full((len(fields),), 3))
    rows = torch.tensor(slots).repeat_interleave(K + 1)
    return proc.apply(logits, slots, rows, torch.tensor(temps).repeat_interleave(K + 1), drafts)


def _rank():
    from tensorrt_llm_ext.distributed import init_from_mpi

    mapping = init_from_mpi()
    out = {}
    for vocab in VOCABS:
        logits = _case(vocab)[3]
        width = -(-vocab // mapping.tp_size)
        padded = torch.nn.functional.pad(logits, (0, width * mapping.tp_size - vocab), value=float("-inf"))
        start = mapping.tp_rank * width
        shard = _apply(vocab, mapping, start, width, padded[:, start:start + width].contiguous())
        out[vocab] = (start, min(vocab, start + width), shard)
    return out


@pytest.mark.parametrize("mpi_pool_executor", [2, 3], indirect=True)
def test_shard_processing_equals_the_full_reference(mpi_pool_executor):
    from tensorrt_llm_ext.speculative.logits_processing import process_reference

    results = run_on_ranks(mpi_pool_executor, _rank)
    for vocab in VOCABS:
        fields, temps, prompts, logits, drafts, history = _case(vocab)
        rows = [(b, j) for b in range(len(fields)) for j in range(K + 1)]
        want = process_reference(logits, [fields[b] for b, _ in rows], [temps[b] for b, _ in rows],
                                 [history[b] + drafts[b, :j].tolist() for b, j in rows], [prompts[b] for b, _ in rows])
        assert torch.equal(_apply(vocab, None, 0, vocab, logits), want)  # one rank, full rows
        for res in results:
            lo, hi, shard = res[vocab]
            assert torch.equal(shard[:, :hi - lo], want[:, lo:hi]), (vocab, lo)
        # top_k kept at least k tokens over all shards (ties may keep more)
        assert ((want[0] > float("-inf")).sum() >= 5).item()
