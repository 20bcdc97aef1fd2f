"""The COLUMN-parallel LM head's block-aligned vocabulary split (``mapping.vocab_shards``) and what follows it.

At tp > 1 every rank holds ``W = 1024 ceil(ceil(V / tp) / 1024)`` rows when the last rank keeps a real id, else
``ceil(V / tp)``. Here: the rule's numbers and its exact guard; the head's shards (zero rows, log line, the
``shard_rule="ceil"`` knob); selection, verification (the one-pass path, observed) and the drafter's Markov rows on
those shards against TP 1, with adversarial logits: every real logit about -1e4, the padded columns exactly 0.
Ranks are simulated in one process; tests/unittest/_torch/multi_gpu/test_aligned_head_tp.py runs them over MPI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorrt_llm_ext.kernels.ordered_key import key_to_id_torch
from tensorrt_llm_ext.kernels.shard_select import shard_select_keys
from tensorrt_llm_ext.mapping import VOCAB_SHARD_ALIGN, Mapping, vocab_shards
from tensorrt_llm_ext.modules.linear import TensorParallelMode
from tensorrt_llm_ext.modules.lm_head import LMHead
from tensorrt_llm_ext.modules.logits_processor import LogitsProcessor
from tensorrt_llm_ext.speculative import verification as vf
from tensorrt_llm_ext.speculative.selection_decision import local_target_failures
from tensorrt_llm_ext.speculative.verification import rejection_sample
from tensorrt_llm_ext.speculative.vocab_parallel import gumbel_sample, vocab_parallel_argmax
from tensorrt_llm_ext.testing.simulated_tp import shard, simulated_rejection_sample

DEV = "cuda" if torch.cuda.is_available() else "cpu"
G = VOCAB_SHARD_ALIGN
V = 5000  # aligned at TP 2 (3072 > ceil 2500) and TP 3 (2048 > 1667); ceil at TP 4 (3 * 2048 >= 5000)


# ----------------------------------------------------------------------------------------------------
# the rule
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab,widths", [
    (128256, {2: 64512, 3: 43008, 4: 32768, 8: 16384}),  # Llama 3
    (200064, {2: 100352, 3: 67584, 4: 50176, 8: 25600}),
    (151936, {2: 76800, 3: 51200, 4: 38912, 8: 19456}),  # Qwen
    (49152, {2: 24576, 3: 16384, 4: 12288, 8: 6144}),  # SmolLM2: ceil(V / tp) is whole blocks already
])
def test_aligned_widths_of_real_vocabularies(vocab, widths):
    for tp, want in widths.items():
        s = vocab_shards(vocab, tp)
        ceil_w = -(-vocab // tp)
        assert (s.width, s.rule) == (want, "aligned"), tp
        assert s.width % G == 0 and ceil_w <= s.width < ceil_w + G and s.block_aligned
        assert (tp - 1) * s.width < vocab  # the last rank holds a real id; every other rank only real ids
        assert [s.num_valid(r) for r in range(tp - 1)] == [s.width] * (tp - 1)
        assert s.num_valid(tp - 1) == vocab - (tp - 1) * s.width > 0
        assert sum(s.num_valid(r) for r in range(tp)) == vocab and s.padded_vocab_size == tp * s.width
        c = vocab_shards(vocab, tp, "ceil")  # the knob keeps the previous split
        assert (c.width, c.rule) == (ceil_w, "ceil")
        assert c.block_aligned == (ceil_w % G == 0)


@pytest.mark.parametrize("vocab,tp,width,rule", [
    (5000, 2, 3072, "aligned"), (5000, 3, 2048, "aligned"), (5000, 4, 1250, "ceil"), (5000, 8, 625, "ceil"),
    (1031, 2, 1024, "aligned"), (1031, 4, 258, "ceil"), (516, 2, 258, "ceil"), (301, 3, 101, "ceil"),
    # the guard is exact: the last rank of 2049 at TP 3 owns id 2048 alone; at 2048 it would own none
    (2049, 3, 1024, "aligned"), (2048, 3, 683, "ceil"), (2048, 2, 1024, "aligned"), (1025, 2, 1024, "aligned"),
    (1024, 2, 512, "ceil"), (7, 1, 7, "aligned"), (5000, 1, 5000, "aligned"),
])
def test_width_rule_and_its_fallback(vocab, tp, width, rule):
    s = vocab_shards(vocab, tp)
    assert (s.width, s.rule) == (width, rule)
    assert s.num_valid(tp - 1) >= 1 and s.width * tp >= vocab
    assert all(s.num_valid(r) == s.width for r in range(tp - 1))  # padding on the last rank only
    assert s.block_aligned == (tp == 1 or width % G == 0)


def test_width_rule_refuses():
    with pytest.raises(ValueError, match="too small"):
        vocab_shards(5, 4)  # ceil 2: the last rank would start at 6
    with pytest.raises(ValueError, match="rule"):
        vocab_shards(5000, 2, "floor")
    with pytest.raises(ValueError, match="positive"):
        vocab_shards(0, 2)


# ----------------------------------------------------------------------------------------------------
# the head
# ----------------------------------------------------------------------------------------------------
def _adversarial_weight_and_hidden(rows: int, hidden: int = 8, seed: int = 3):
    """A full ``[V, H]`` weight and hidden rows whose every real logit is about -1e4 (fp32 spacing there: 1e-3,
    the spread of the rest: a few units): the padded rows' logit 0 is far above all of them. Row 1 ties the row
    max on the last real id and on the first id of every rank at TP 2 / 3 (0, 2048, 3072, 4096)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, hidden, generator=g)
    w[:, 0] = 1.0
    h = torch.randn(rows, hidden, generator=g)
    h[:, 0] = -1e4
    top = (h[1] @ w.t()).argmax()
    for col in (0, 2048, 3072, 4096, V - 1):
        w[col] = w[top]
    return w, h


def _heads(tp: int, w: torch.Tensor, rule: str = "aligned", device=DEV) -> list[LMHead]:
    heads = []
    for rank in range(tp):
        head = LMHead(V, w.shape[1], torch.float32, device, Mapping(world_size=tp, rank=rank, tp_size=tp),
                      TensorParallelMode.COLUMN, gather_output=True, shard_rule=rule)
        head.load_weights(w)
        heads.append(head)
    return heads


def test_head_shards_follow_the_rule_and_log_once(caplog, monkeypatch):
    from tensorrt_llm_ext import logger as logger_module

    monkeypatch.setattr(logger_module, "_seen_once", set())
    w, h = _adversarial_weight_and_hidden(4)
    full = h @ w.t()
    with caplog.at_level("INFO"):
        for tp in (2, 3, 4):
            heads = _heads(tp, w, device="cpu")
            s = vocab_shards(V, tp)
            pieces = []
            for rank, head in enumerate(heads):
                assert (head.shard_width, head.vocab_start, head.num_valid_rows) == (
                    s.width, rank * s.width, s.num_valid(rank))
                assert head.padded_vocab_size == tp * s.width and head.padding_size == tp * s.width - V
                x = head.shard_forward(h)
                assert x.shape == (4, s.width)
                if rank < tp - 1:
                    assert head.num_valid_rows == s.width  # only the last rank holds padding
                else:
                    assert not head.weight[head.num_valid_rows:].any()
                    assert torch.equal(x[:, head.num_valid_rows:], torch.zeros_like(x[:, head.num_valid_rows:]))
                pieces.append(x[:, :head.num_valid_rows])
            torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-2)
            assert bool((full < -9000).all())  # every real logit is far below the padded 0
        _heads(2, w, device="cpu")  # the same layout again: no second line
        ceil_head = _heads(2, w, rule="ceil", device="cpu")[1]
    assert (ceil_head.shard_width, ceil_head.vocab_start, ceil_head.shards.rule) == (2500, 2500, "ceil")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LMHead: V=5000")]
    assert len(lines) == 4, lines
    assert "3072 rows per rank (aligned" in lines[0] and "2048 rows per rank (aligned" in lines[1]
    assert "1250 rows per rank (ceil" in lines[2] and "would leave the last rank no real id" in lines[2]
    assert "2500 rows per rank (ceil" in lines[3]
    with pytest.raises(ValueError, match="too small"):
        LMHead(5, 4, torch.float32, "cpu", Mapping(world_size=4, rank=0, tp_size=4), TensorParallelMode.COLUMN)


def test_vocab_parallel_eligibility_reads_the_vocabulary_not_the_padding():
    """1200 over TP 2: aligned shards of 1024 pad the last rank (848 zero rows) and stay eligible (1200 % 2 == 0);
    1201 is refused as before (the runtime config refuses vocab_parallel_selection='on' by V % tp too)."""
    for vocab, eligible in ((1200, True), (1201, False)):
        mapping = Mapping(world_size=2, rank=1, tp_size=2)
        head = LMHead(vocab, 8, torch.float32, "cpu", mapping, TensorParallelMode.COLUMN, gather_output=True)
        assert head.shard_width == 1024 and head.padding_size == 2048 - vocab
        failures = local_target_failures(mapping, head, LogitsProcessor())
        failed = [c.value for c, bad in failures.items() if bad]
        assert (failed == []) == eligible, failed
        if not eligible:
            assert failed == ["the vocabulary is unevenly sharded (vocab % tp != 0)"]


# ----------------------------------------------------------------------------------------------------
# selection and verification on the head's shards == TP 1
# ----------------------------------------------------------------------------------------------------
def _simulated_select(shards, starts, temps=None, seeds=None, offsets=None):
    """Every rank's selection key on its own shard, then the exchange's MAX (what ``PairExchange`` does)."""
    keys = torch.stack([shard_select_keys(x, s, V, temps, seeds, offsets) for x, s in zip(shards, starts)]).amax(0)
    return key_to_id_torch(keys)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_selection_on_head_shards_equals_tp1(tp):
    rows = 6
    w, h = _adversarial_weight_and_hidden(rows)
    w, h = w.to(DEV), h.to(DEV)
    single = LMHead(V, w.shape[1], torch.float32, DEV)
    single.load_weights(w)
    full = single(h)
    heads = _heads(tp, w)
    shards = [head.shard_forward(h) for head in heads]
    starts = [head.vocab_start for head in heads]
    greedy = vocab_parallel_argmax(full, 0, V)
    assert torch.equal(greedy, torch.argmax(full, -1)) and int(greedy[1]) == 0  # the tie: the lowest id
    assert bool((greedy < V).all())
    assert torch.equal(_simulated_select(shards, starts), greedy)
    temps = torch.tensor([1.0, 1.0, 0.0, 2.0, 0.5, 1e3], device=DEV)
    seeds = torch.arange(rows, dtype=torch.int64, device=DEV) * 7919 + 5
    offsets = torch.arange(rows, dtype=torch.int64, device=DEV) + 40
    sampled = gumbel_sample(full, temps, seeds, offsets, 0, V)
    assert torch.equal(_simulated_select(shards, starts, temps, seeds, offsets), sampled)
    assert bool((sampled < V).all())


def _spy_passes(monkeypatch) -> list[str]:
    """Record which first pass each rank's rejection_sample ran: block_stats (one read) or block_keys (two)."""
    seen: list[str] = []

    def spy(name, fn):
        def run(*a, **kw):
            seen.append(name)
            return fn(*a, **kw)
        return run

    for table in ("_FUSED_KERNELS", "_EAGER_KERNELS"):
        ops = getattr(vf, table)
        monkeypatch.setattr(vf, table, dataclasses.replace(ops, stats=spy("one", ops.stats),
                                                           block_keys=spy("two", ops.block_keys)))
    return seen


@pytest.mark.parametrize("tp,use_top_p", [(2, False), (3, True), (4, False)])
def test_verification_on_head_shards_one_pass_equals_tp1(tp, use_top_p, monkeypatch):
    """The head's shards at TP 2 / 3 are whole blocks: every rank reads the logits once (observed: block_stats
    ran, block_keys did not) and the tokens are TP 1's; at TP 4 the head falls back to ceil(V / tp) and the two
    passes give the same tokens. The shards are the heads' own logits (padded columns 0, real ones ~ -1e4)."""
    b, k = 2, 2
    w, _ = _adversarial_weight_and_hidden(2)
    w = w.to(DEV)
    g = torch.Generator().manual_seed(tp)
    ht = torch.randn(b, k + 1, w.shape[1], generator=g)
    hd = ht[:, :k] + 0.02 * torch.randn(b, k, w.shape[1], generator=g)  # close to the target: drafts get accepted
    ht[..., 0] = hd[..., 0] = -1e4
    ht, hd = ht.to(DEV), hd.to(DEV)
    single = LMHead(V, w.shape[1], torch.float32, DEV)
    single.load_weights(w)
    target, draft = single(ht).contiguous(), single(hd).contiguous()
    # request 0 drafts its draft rows' argmax; greedy request 1 the target's argmax, then the last real id
    tokens = torch.stack([draft[0].argmax(-1), torch.stack([target[1, 0].argmax(), torch.tensor(V - 1, device=DEV)])])
    kw = dict(temperatures=torch.tensor([1.0, 0.0], device=DEV),
              seeds=torch.tensor([11, 12], dtype=torch.int64, device=DEV),
              offsets=torch.tensor([3, 9], dtype=torch.int64, device=DEV),
              top_p=torch.tensor([0.9, 1.0], device=DEV) if use_top_p else None)
    ref = rejection_sample(target, draft, tokens, **kw)
    assert bool((ref[0] < V).all()) and int(ref[1][1]) >= 2  # the greedy request accepts its first draft
    # the simulation's default shards are exactly each rank's head output (zero padding included)
    heads = _heads(tp, w)
    for rank, head in enumerate(heads):
        want, start = shard(target, tp, rank, V, pad_value=0.0)
        assert start == head.vocab_start
        torch.testing.assert_close(head.shard_forward(ht), want, rtol=0, atol=1e-2)
    seen = _spy_passes(monkeypatch)
    for acc, n in simulated_rejection_sample(target, draft, tokens, tp=tp, vocab=V, block_size=G, num_splits=2,
                                             pad_value=0.0, **kw):
        assert torch.equal(acc, ref[0]) and torch.equal(n, ref[1]), tp
    expect = "one" if vocab_shards(V, tp).rule == "aligned" else "two"
    assert seen == [expect] * tp, seen
    assert expect == ("one" if tp in (2, 3) else "two")


# ----------------------------------------------------------------------------------------------------
# the drafter's Markov rows follow the head it drafts through
# ----------------------------------------------------------------------------------------------------
def test_drafter_markov_rows_follow_the_head():
    from tensorrt_llm_ext.models.dspark_drafter import DSparkDrafter, DSparkDrafterConfig, generate_full_state_dict

    cfg = DSparkDrafterConfig(vocab_size=V)
    full = generate_full_state_dict(cfg, 4)
    for rule in ("aligned", "ceil"):
        parts = []
        for rank in range(2):
            mapping = Mapping(world_size=2, rank=rank, tp_size=2)
            d = DSparkDrafter(cfg, mapping)
            d.load_full_state_dict(full)
            head = LMHead(V, cfg.hidden_size, torch.float32, "cpu", mapping, TensorParallelMode.COLUMN,
                          gather_output=True, shard_rule=rule)
            if rule == "aligned":  # before a head is taken over: the default split
                mw = d.markov_head_weights()
                assert (mw.vocab_start, mw.markov_w2.shape[0]) == (head.vocab_start, head.shard_width)
            d.take_over_lm_head(head)
            mw = d.markov_head_weights()
            assert (mw.vocab_start, mw.markov_w2.shape[0], mw.vocab_size) == (head.vocab_start, head.shard_width, V)
            parts.append(mw.markov_w2)
        cat = torch.cat(parts)
        assert torch.equal(cat[:V], full["markov_w2"].to(cat.dtype)) and not cat[V:].any()
        assert cat.shape[0] == 2 * vocab_shards(V, 2, rule).width
