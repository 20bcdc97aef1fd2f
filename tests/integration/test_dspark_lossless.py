"""Lossless end to end (docs/end_to_end.md): speculative output == the target's own decode, at TP 1.

Greedy and keyed-Gumbel sampling, vocab-parallel (where bound) and gathered, eager on the CPU (Triton
interpreter); on a GPU also under CUDA graphs, across batch sizes with padding. Multi-rank TP: see
tests/integration/multi_gpu/test_dspark_lossless_tp.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tensorrt_llm_ext.runtime.config import load_config
from tensorrt_llm_ext.runtime.engine import Engine
from tensorrt_llm_ext.contract import SamplingParams
from tensorrt_llm_ext.runtime.requests import Request
from tensorrt_llm_ext.speculative.step_variant import DEFAULT_VARIANT, TOP_P_VARIANT
from tensorrt_llm_ext.testing.tiny_models import tiny_model

# Small enough for the Triton interpreter; an odd vocabulary; prompts longer than a latent page. fp32: eager
# steps run at the live batch size, so the speculative run and the reference see different GEMM shapes; on
# a GPU bf16 rounding of another shape could flip a near-tie (bf16 is tested at one fixed graph shape).
SMALL = tiny_model()
PROMPTS = [[5, 17, 300, 42], [101], list(range(200, 219)), [7, 7, 7, 480, 2, 9, 31, 64, 128, 256, 3]]

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _engine(**overrides) -> Engine:
    return Engine(load_config(**{**SMALL, **overrides}))


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The default engine, shared by the tests that need no other config (generate() leaves no slot held)."""
    return _engine()


_REFERENCES: dict[str, list] = {}


def _reference(reqs) -> list:
    """The target's own decode of ``reqs``, memoized: it depends on the target and the requests only (not
    on the drafter, the Markov mode or the op table), so tests that compare against the same requests share
    one decode."""
    key = repr(reqs)
    if key not in _REFERENCES:
        if "engine" not in _REFERENCES:
            _REFERENCES["engine"] = _engine()
        _REFERENCES[key] = _outputs(_REFERENCES["engine"].generate(reqs, "reference")[0])
    return _REFERENCES[key]


def _requests(max_new=10, temperature=0.0, seed=0, prompts=PROMPTS):
    return [Request(list(p), max_new_tokens=max_new, sampling=SamplingParams(temperature=temperature, seed=seed + i))
            for i, p in enumerate(prompts)]


def _outputs(results):
    return [(r.output_ids, r.finish_reason) for r in results]


def test_greedy_speculative_equals_target_decode(engine):
    # At TP 1 the gathered path is the speculative path (nothing is sharded): the TP 2 tests compare them.
    reqs = _requests(max_new=12)
    spec, stats = engine.generate(reqs, "speculative")
    assert _outputs(spec) == _reference(reqs)
    assert all(len(r.output_ids) == 12 and r.finish_reason == "length" for r in spec)
    # Multi-token acceptance really happened (the tail's n_acc > 1 paths are exercised) and fewer steps ran.
    lens = [n for r in spec for n in r.accepted_lens]
    assert max(lens) >= 3 and stats.mean_acceptance_length > 1.2, lens
    assert stats.num_steps < 11


@pytest.mark.parametrize("markov_mode", ["exact", "fused"])
def test_fused_and_stock_op_tables_give_identical_tokens(markov_mode):
    """One worker, two op tables: the stock (upstream eager) step emits exactly the fused step's tokens,
    greedy and keyed-sampled rows in one batch."""
    eng = _engine(**{"speculative_config.markov_chain_mode": markov_mode})
    reqs = _requests(max_new=10)
    reqs[1].sampling = SamplingParams(0.9, seed=3)
    reqs[3].sampling = SamplingParams(1.2, seed=4)
    fused, fused_stats = eng.generate(reqs, "speculative")
    stock, stock_stats = eng.generate(reqs, "stock")
    assert _outputs(stock) == _outputs(fused)
    assert eng.worker("stock").ops.name == "stock" and eng.worker("speculative").ops.name == "fused"
    assert stock_stats.mean_acceptance_length > 1.0 and fused_stats.mean_acceptance_length > 1.0
    if markov_mode == "exact":  # the exact chain is bitwise the stock chain: same drafts, same acceptance
        assert [r.accepted_lens for r in stock] == [r.accepted_lens for r in fused]


def test_greedy_only_worker_refuses_sampled_requests(engine):
    w = engine.worker("speculative", sampling=False)
    assert w is not engine.worker("speculative") and not w.sampling
    with pytest.raises(ValueError, match="greedy-only"):
        w.prefill(0, [1, 2, 3], SamplingParams(0.7))


def test_seeded_sampling_speculative_equals_target_decode(engine):
    reqs = _requests(max_new=10, temperature=0.9, seed=11)
    spec, _ = engine.generate(reqs, "speculative")
    ref = _reference(reqs)
    assert _outputs(spec) == ref
    # The draws are keyed: another seed changes the output; sampling is not the greedy output.
    other = _reference(_requests(max_new=10, temperature=0.9, seed=12))
    greedy = _reference(_requests(max_new=10))
    assert other != ref and greedy != ref


def test_mixed_greedy_and_sampled_batch_and_stop_tokens():
    eng = _engine(**{"speculative_config.markov_chain_mode": "fused"})
    greedy_ref = [out for out, _ in _reference(_requests(max_new=10))]
    stop = greedy_ref[0][4]
    reqs = _requests(max_new=10)
    reqs[1].sampling = SamplingParams(1.3, seed=5)
    reqs[0].stop_token_ids = (stop,)
    spec, _ = eng.generate(reqs, "speculative")
    assert _outputs(spec) == _reference(reqs)
    first = greedy_ref[0].index(stop)
    assert spec[0].finish_reason == "stop" and spec[0].output_ids == greedy_ref[0][:first + 1]
    assert spec[2].output_ids == greedy_ref[2]  # greedy rows unaffected by a sampled neighbour


def test_worker_step_returns_one_model_dict(engine):
    eng = engine
    worker = eng.worker()
    k = eng.draft_len
    for slot, p in enumerate(PROMPTS[:2]):
        eng.pages.allocate(slot, eng.pages.max_pages_per_slot)
        worker.prefill(slot, p)
    worker.set_rows([0, 1], 3)  # one padding row on the dummy slot
    ctx_before = eng.state.ctx_lens[:2].clone()
    out = worker.forward(3)
    assert set(out) == {"logits", "new_tokens", "new_tokens_lens", "next_draft_tokens", "next_new_tokens",
                        "draft_confidences"}
    assert out["new_tokens"].shape == (3, k + 1) and out["next_draft_tokens"].shape == (3, k)
    assert out["draft_confidences"].shape == (3, k) and out["draft_confidences"].dtype == torch.float32
    assert out["next_new_tokens"].shape == (3, k + 1) and out["new_tokens_lens"].dtype == torch.int32
    assert out["logits"].shape == (3 * (k + 1), eng.vocab_size)
    lens = out["new_tokens_lens"]
    assert bool(((lens >= 1) & (lens <= k + 1)).all())
    for b in range(2):  # the bonus token (last accepted) is the next anchor; ctx_len advanced by n_acc
        assert out["next_new_tokens"][b, 0] == out["new_tokens"][b, lens[b] - 1]
        assert eng.state.ctx_lens[b] == ctx_before[b] + lens[b]
    assert eng.state.ctx_lens[eng.state.dummy_slot] == 0  # the dummy slot is emptied, never advanced
    assert torch.equal(eng.state.slot_tokens[:2], out["next_new_tokens"][:2])
    # The decoded block table keeps unallocated pages at -1 (the bookkeeping counts allocated pages).
    allocated = eng.pages.max_pages_per_slot
    assert [int((eng.state.block_table[s] >= 0).sum()) for s in range(4)] == [allocated, allocated, 0, 0]
    assert int((eng.state.block_table[eng.state.dummy_slot] >= 0).sum()) == 0
    for slot in (0, 1):
        eng.pages.free(slot)


def test_step_rows_are_validated():
    """Bad rows used to reach the device: a slot out of range (an index fault on a GPU), a slot in two rows
    (advanced twice), or a step larger than set_rows() prepared (stale rows advance absent requests)."""
    eng = Engine(load_config(**{**SMALL, "model.target.num_layers": 1, "model.target.capture_layers": [0]}))
    worker = eng.worker()
    dummy = eng.state.dummy_slot
    for slots, match in (([0, 0], "one row"), ([dummy], "not request slots"), ([-1], "not request slots"),
                         ([dummy + 1], "not request slots")):
        with pytest.raises(ValueError, match=match):
            worker.set_rows(slots, 2)
    worker.set_rows([0], 1)
    ctx = eng.state.ctx_lens.clone()
    with pytest.raises(ValueError, match="set_rows"):
        worker.forward(2)
    with pytest.raises(ValueError, match="set_rows"):
        eng.reference().step(3)
    assert torch.equal(eng.state.ctx_lens, ctx)


def test_target_state_dict_round_trip_and_errors():
    from tensorrt_llm_ext.models.llama_target import LlamaTarget, LlamaTargetConfig, generate_full_state_dict

    cfg = LlamaTargetConfig(vocab_size=101, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                            intermediate_size=32, capture_layers=(1,))
    a, b = LlamaTarget(cfg), LlamaTarget(cfg)
    a.init_weights(3)
    sd = generate_full_state_dict(cfg, 3)
    b.load_full_state_dict(sd)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    bad = dict(sd)
    bad.pop("norm.weight")
    with pytest.raises(ValueError, match="norm.weight"):
        b.load_full_state_dict(bad)
    bad = dict(sd, **{"lm_head.weight": torch.zeros(100, 16)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        b.load_full_state_dict(bad)


def test_target_block_rows_equal_one_token_steps():
    """The verification block's rows equal the target's one-token decode (the lossless premise)."""
    from tensorrt_llm_ext.models.llama_target import LlamaTarget, LlamaTargetConfig

    cfg = LlamaTargetConfig(vocab_size=211, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4,
                            intermediate_size=32, capture_layers=(0, 1))
    m = LlamaTarget(cfg)
    m.init_weights(5)
    seq = torch.tensor([[3, 50, 7, 190, 11, 12, 100, 4]])
    slot = torch.zeros(1, dtype=torch.int32)
    kv = m.make_kv_cache(2, 16)
    block = m.logits(m(seq, torch.arange(8)[None], slot, kv).hidden_states)
    kv1 = m.make_kv_cache(2, 16)
    rows = [m.logits(m(seq[:, i:i + 1], torch.tensor([[i]]), slot, kv1).hidden_states) for i in range(8)]
    torch.testing.assert_close(block, torch.cat(rows), rtol=1e-5, atol=1e-5)
    assert torch.equal(block.argmax(-1), torch.cat(rows).argmax(-1))


# ---------------------------------------------------------------------------------------------------
# GPU: CUDA graphs
# ---------------------------------------------------------------------------------------------------
def _graph_engine(dtype: str, batch_sizes, **overrides) -> Engine:
    cfg = load_config(**{**SMALL, "max_batch_size": 8, "model.dtype": dtype,
                         "cuda_graph_config.batch_sizes": list(batch_sizes),
                         "cuda_graph_config.enable_padding": True, **overrides})
    return Engine(cfg, use_cuda_graph=True)


GPU_PROMPTS = PROMPTS + [[9, 8, 7, 6, 5], [400, 401], list(range(10, 40))]


@cuda_only
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_graph_lossless_fixed_batch_bf16(temperature):
    """bf16, every step replayed at one padded batch size: graph == the target's decode at that shape."""
    eng = _graph_engine("bfloat16", [8])
    reqs = _requests(max_new=16, temperature=temperature, seed=3, prompts=GPU_PROMPTS)
    spec, stats = eng.generate(reqs, "speculative")
    ref, _ = eng.generate(reqs, "reference")
    gathered, _ = eng.generate(reqs, "gathered")
    assert _outputs(spec) == _outputs(ref) == _outputs(gathered)
    assert stats.num_steps > 0


@cuda_only
def test_cuda_graph_lossless_across_batch_sizes_with_padding():
    """fp32, graphs for 1/2/4/8 rows; requests of different lengths make the active count fall through
    every size (padding rows on the dummy slot). Greedy and sampled rows in one batch."""
    eng = _graph_engine("float32", [1, 2, 4, 8])
    reqs = [Request(p, max_new_tokens=4 + 5 * i, sampling=SamplingParams(temperature=0.7 if i % 2 else 0.0, seed=i))
            for i, p in enumerate(GPU_PROMPTS)]
    spec, _ = eng.generate(reqs, "speculative")
    ref, _ = eng.generate(reqs, "reference")
    assert _outputs(spec) == _outputs(ref)
    runner = eng.runner("speculative")
    assert runner.captured(DEFAULT_VARIANT) == runner.captured(TOP_P_VARIANT) == [1, 2, 4, 8]
    assert runner.eager_steps == 0 and sum(runner.replays.values()) > 0
    eager = Engine(eng.config, use_cuda_graph=False)
    eager_out, _ = eager.generate(reqs, "speculative")
    assert _outputs(eager_out) == _outputs(ref)


@cuda_only
def test_cuda_graph_capture_restores_state():
    eng = _graph_engine("bfloat16", [1, 4])
    before = [t.clone() for t in eng.state.mutable_tensors()]
    eng.runner("speculative")  # captures (every variant)
    eng.runner("reference")
    after = eng.state.mutable_tensors()
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@cuda_only
def test_cuda_graph_large_vocab_bf16_lossless():
    """A realistic head width (vocab 128k, split selection kernels) under graphs, bf16."""
    eng = _graph_engine("bfloat16", [4], **{"model.target.vocab_size": 128256, "max_batch_size": 4})
    reqs = _requests(max_new=12, prompts=[[1, 2, 3], [99999, 5], [70000] * 9, [128000]])
    spec, _ = eng.generate(reqs, "speculative")
    ref, _ = eng.generate(reqs, "reference")
    assert _outputs(spec) == _outputs(ref)


def test_graph_batch_size_padding_rule():
    from tensorrt_llm_ext.runtime.cuda_graph import pad_batch_size

    sizes = (1, 2, 4, 8)
    assert [pad_batch_size(n, sizes, True) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [pad_batch_size(n, sizes, False) for n in (3, 4)] == [None, 4]


def test_nvtx_ranges_are_optional(monkeypatch, caplog):
    """Without the nvtx package the stage ranges are no-ops, logged once; with it, each range is annotated."""
    import logging

    import tensorrt_llm_ext.logger as log
    import tensorrt_llm_ext.speculative.worker_base as wb

    monkeypatch.setattr(log, "_seen_once", set())
    monkeypatch.setattr(wb, "_nvtx", None)
    ran = []
    with caplog.at_level(logging.INFO, logger="tensorrt_llm_ext"):
        for _ in range(2):
            with wb.nvtx_range("stage"):
                ran.append(True)
    assert ran == [True, True]
    assert sum("nvtx package not installed" in r.getMessage() for r in caplog.records) == 1

    calls = []

    class FakeNvtx:
        @staticmethod
        def annotate(name, domain):
            calls.append((name, domain))
            return contextlib.nullcontext()

    monkeypatch.setattr(wb, "_nvtx", FakeNvtx)
    with wb.nvtx_range("target_forward"):
        pass
    assert calls == [("target_forward", "tensorrt_llm_ext")]
