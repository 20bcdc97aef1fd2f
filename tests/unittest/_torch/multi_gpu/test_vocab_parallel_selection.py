"""Multi-rank vocab-parallel selection (MPI: gloo on CPU, NCCL on GPU): every rank's shard selection
plus the pair exchange equals the gathered path bit for bit, at every TP size, even and uneven
(padded last shard) vocabularies alike."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.mapping import vocab_shards
from tensorrt_llm_ext.testing.mpi import run_on_ranks

WORLDS = [2, 3, 4]
# (vocab, hidden): 1200 splits evenly over 2/3/4; 1201 pads the last shard at every TP size.
VOCABS = (1200, 1201)


def _full_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Identical on every rank: random rows with adversarial ones (ties across shards, NaN, -inf)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 4).round() / 4  # many exact ties
    x[0, vocab - 1] = 99.0
    x[0, 0] = 99.0  # tie between the first and the last shard: id 0
    x[1, vocab - 2] = float("nan")
    x[1, 3] = 1e4  # a larger value before the first NaN loses to it
    x[2] = -float("inf")  # the padded zeros of the last shard must not win
    x[3] = float("nan")
    x[4] = -float("inf")
    x[4, vocab - 1] = -5.0  # the only finite value is the very last real id
    return x


def _my_shard(full: torch.Tensor, mapping, device) -> tuple[torch.Tensor, int]:
    vocab = full.shape[-1]
    width = -(-vocab // mapping.tp_size)
    padded = torch.nn.functional.pad(full, (0, width * mapping.tp_size - vocab))  # zero logits, as the head
    start = mapping.tp_rank * width
    return padded[..., start:start + width].contiguous().to(device), start


def _rank_argmax():
    import torch

    from tensorrt_llm_ext.distributed import PairExchange, comm_device, init_from_mpi
    from tensorrt_llm_ext.speculative.vocab_parallel import gathered_argmax, vocab_parallel_argmax

    mapping = init_from_mpi()
    device = comm_device()
    exchange = PairExchange(mapping)
    results = []
    for vocab in VOCABS:
        full = _full_logits(9, vocab, seed=vocab)
        for dtype in (torch.float32, torch.bfloat16):
            shard, start = _my_shard(full.to(dtype), mapping, device)
            ids = vocab_parallel_argmax(shard, start, vocab, exchange)
            out = torch.empty(9, dtype=torch.int64, device=device)
            vocab_parallel_argmax(shard, start, vocab, exchange, out=out)
            gathered = gathered_argmax(shard, vocab, mapping)
            results.append((ids.cpu(), out.cpu(), gathered.cpu(), torch.argmax(full.to(dtype).float(), -1)))
    return results


def _rank_sample():
    import torch

    from tensorrt_llm_ext.distributed import PairExchange, comm_device, init_from_mpi
    from tensorrt_llm_ext.kernels.shard_select import DRAFT_SALT
    from tensorrt_llm_ext.speculative.vocab_parallel import gathered_gumbel_sample, gumbel_sample

    mapping = init_from_mpi()
    device = comm_device()
    exchange = PairExchange(mapping)
    results = []
    rows = 9
    temps = torch.tensor([0.0, 1.0, 0.5, 0.0, 1.0, 2.0, 0.8, 1.0, 0.0], device=device)
    seeds = (torch.arange(rows, dtype=torch.int64) * 1000003 + 2**35).to(device)
    offsets = torch.arange(rows, dtype=torch.int64, device=device) + 77
    for vocab in VOCABS:
        full = _full_logits(rows, vocab, seed=vocab + 1)
        shard, start = _my_shard(full.to(torch.bfloat16), mapping, device)
        for salt_kw in ({}, {"salt": DRAFT_SALT}):
            ids = gumbel_sample(shard, temps, seeds, offsets, start, vocab, exchange, **salt_kw)
            gathered = gathered_gumbel_sample(shard, temps, seeds, offsets, vocab, mapping, **salt_kw)
            results.append((ids.cpu(), gathered.cpu()))
    return results


def _rank_head_and_selector():
    import torch

    from tensorrt_llm_ext.distributed import comm_device, init_from_mpi
    from tensorrt_llm_ext.mapping import Mapping
    from tensorrt_llm_ext.modules.linear import TensorParallelMode
    from tensorrt_llm_ext.modules.lm_head import LMHead
    from tensorrt_llm_ext.modules.logits_processor import LogitsProcessor
    from tensorrt_llm_ext.speculative.selection_decision import VocabParallelSelection
    from tensorrt_llm_ext.speculative.token_selector import SelectionParams
    from tensorrt_llm_ext.speculative.vocab_parallel import (VocabShardedLogits, gathered_argmax,
                                                             gathered_gumbel_sample)
    from tensorrt_llm_ext.speculative.worker_base import VocabParallelSelectionMixin

    class Custom(LogitsProcessor):
        pass

    class Worker(VocabParallelSelectionMixin):
        def __init__(self, mapping, target, drafter):
            self.mapping, self.target, self.drafter, self.max_exchange_rows = mapping, target, drafter, 0

    class Model:  # the few attributes post_load reads of a target and a drafter
        def __init__(self, head, proc=None):
            self.lm_head, self.logits_processor = head, proc

        def take_over_lm_head(self, head):
            self.lm_head = head

    mapping = init_from_mpi()
    device = comm_device()
    hidden, rows = 24, 6
    g = torch.Generator().manual_seed(5)
    out = {}
    for vocab in VOCABS:
        full_w = torch.randn(vocab, hidden, generator=g)
        h = torch.randn(rows, hidden, generator=g).to(device)
        head = LMHead(vocab, hidden, torch.float32, device, mapping, TensorParallelMode.COLUMN, gather_output=True)
        head.load_weights(full_w)
        single = LMHead(vocab, hidden, torch.float32, device, Mapping(), None)
        single.load_weights(full_w)
        worker = Worker(mapping, Model(head, LogitsProcessor()), Model(None))
        sel = worker.post_load()
        selector = worker.token_selector
        logits = selector.target_logits(h)
        entry = {"decision": (sel.target_enabled, sel.draft_enabled, sel.target_reason, sel.draft_reason),
                 "gathered_head": head(h).cpu(), "single_head": single(h).cpu(), "shard_width": head.shard_width}
        if sel.target_enabled:
            assert isinstance(logits, VocabShardedLogits)
            shard = logits.logits
            # the head's real columns (at TP 2 whole 1024-id blocks: the last rank's 848 padded columns are 0)
            n = head.num_valid_rows
            entry["shard_vs_single"] = (shard[:, :n].cpu(), single(h)[:, head.vocab_start:head.vocab_start + n].cpu())
            entry["padded_columns"] = shard[:, n:].cpu()
            temps = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 1.0], device=device)
            seeds = torch.arange(rows, dtype=torch.int64, device=device)
            offsets = torch.arange(rows, dtype=torch.int64, device=device) * 5
            entry["argmax"] = (selector.select_tokens(logits).cpu(), gathered_argmax(shard, vocab, mapping).cpu())
            entry["sample"] = (selector.select_tokens(logits, SelectionParams(temps, seeds, offsets)).cpu(),
                               gathered_gumbel_sample(shard, temps, seeds, offsets, vocab, mapping).cpu())
            # The draft side goes through the selector too: this rank's shard of the shared head, no gather.
            entry["draft"] = (selector.draft_logits(h).cpu(), shard.cpu())
        out[vocab] = entry
    # A custom logits processor on one rank only: every rank keeps the gathered path, same reason.
    head = LMHead(1200, hidden, torch.float32, device, mapping, TensorParallelMode.COLUMN, gather_output=True)
    proc = Custom() if mapping.tp_rank == mapping.tp_size - 1 else LogitsProcessor()
    sel = VocabParallelSelection.decide(mapping, head, proc, drafter_lm_head=head)
    out["custom_on_last_rank"] = (sel.target_enabled, sel.draft_enabled, sel.target_reason, sel.draft_reason)
    return out


@pytest.mark.parametrize("mpi_pool_executor", WORLDS, indirect=True)
def test_argmax_bit_identical_to_gathered(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_argmax)
    for rank_results in results:
        for ids, out, gathered, expected in rank_results:
            assert torch.equal(ids, gathered) and torch.equal(out, gathered)
            assert torch.equal(ids, expected)
            assert ids[0].item() == 0 and ids[2].item() == 0 and ids[3].item() == 0
    for other in results[1:]:
        assert all(torch.equal(a[0], b[0]) for a, b in zip(results[0], other))


@pytest.mark.parametrize("mpi_pool_executor", WORLDS, indirect=True)
def test_sample_bit_identical_to_gathered(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_sample)
    for rank_results in results:
        for ids, gathered in rank_results:
            assert torch.equal(ids, gathered)
    for other in results[1:]:
        assert all(torch.equal(a[0], b[0]) for a, b in zip(results[0], other))
    # Target and draft salts draw differently on the sampled rows (w.h.p. on at least one).
    assert not torch.equal(results[0][0][0], results[0][1][0])


@pytest.mark.parametrize("mpi_pool_executor", WORLDS, indirect=True)
def test_lm_head_and_selection_decision(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _rank_head_and_selector)
    for res in results:
        even, uneven = res[1200], res[1201]
        assert even["decision"][:2] == (True, True)
        assert uneven["decision"][:2] == (False, False) and "unevenly sharded" in uneven["decision"][2]
        assert even["shard_width"] == vocab_shards(1200, len(results)).width  # 1024 at TP 2: padded, eligible
        for entry in (even, uneven):
            torch.testing.assert_close(entry["gathered_head"], entry["single_head"], rtol=1e-5, atol=1e-5)
        shard, single = even["shard_vs_single"]
        torch.testing.assert_close(shard, single, rtol=1e-5, atol=1e-5)
        assert not even["padded_columns"].any()
        for key in ("argmax", "sample", "draft"):
            assert torch.equal(*even[key]), key
        enabled_t, enabled_d, reason_t, reason_d = res["custom_on_last_rank"]
        assert not enabled_t and "own logits processor" in reason_t
        assert enabled_d and reason_d == "eligible"  # the greedy draft does not go through the processor
    assert all(r["custom_on_last_rank"] == results[0]["custom_on_last_rank"] for r in results)
    assert all(r[1201]["decision"] == results[0][1201]["decision"] for r in results)
