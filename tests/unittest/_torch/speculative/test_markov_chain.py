"""DSpark Markov chain: exact mode bit-identical to the eager chain; fused mode bitwise identical across
vocab-shard splits and batch sizes; keyed sampling identical across splits; graph replay (GPU)."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.contract import MarkovHeadWeights
from tensorrt_llm_ext.kernels.markov_fused_step import FusedConfig, fused_grid
from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY
from tensorrt_llm_ext.speculative import markov_chain as mc
from tensorrt_llm_ext.speculative.markov_chain import (
    MarkovChain,
    MarkovChainStepper,
    MarkovReferenceStepper,
    MarkovWorkspace,
    markov_chain_logits,
    markov_chain_logits_reference,
)
from tensorrt_llm_ext.testing.markov import bits_equal, markov_inputs, sampling_inputs
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (compiled kernels, graphs, large sizes)")


def _make(B, K, V, r, wdt, ldt, seed=0, scale=0.3, dev=DEV):
    return markov_inputs(B, K, V, r, wdt, ldt, seed=seed, scale=scale, device=dev)


def _adversarial(base: torch.Tensor) -> torch.Tensor:
    """Ties, NaN, -inf rows and large values across the whole row (shard boundaries included)."""
    base = base.clone()
    B, K, V = base.shape
    if B > 0:
        base[0, 0, :] = 0.0  # all-equal row: bias decides, ties to lowest id
        base[0, -1, V // 3] = float("nan")  # NaN wins wherever it is
        base[0, -1, V - 2] = float("nan")
    if B > 1:
        base[1, 0, :] = float("-inf")  # -inf + finite bias stays -inf: tie across the row -> id 0
        base[1, -1, [5, V // 2, V - 1]] = 1e4  # exact ties far apart: lowest id
    return base


def _sampling(B, seed=7, dev=DEV):
    return sampling_inputs(B, seed=seed, device=dev)


def _run_shards(base, anchors, w1, w2, tp, *, mode, vocab_size=None, sampling=None, reference=False, order="alternate",
                config=None):
    """Emulate a TP-``tp`` vocab shard on one process: each shard's stepper in lockstep, host-side MAX of
    the step keys standing in for the PairExchange. Returns the gathered logits (padding dropped) and
    every shard's tokens."""
    V = base.shape[2] if vocab_size is None else vocab_size
    width = -(-base.shape[2] // tp)
    steppers, spans = [], []
    for rk in range(tp):
        s0, s1 = rk * width, min(base.shape[2], (rk + 1) * width)
        bl = torch.full((base.shape[0], base.shape[1], width), 3e4, dtype=base.dtype, device=base.device)
        bl[:, :, : s1 - s0] = base[:, :, s0:s1]  # padded columns hold huge logits: they must never win
        w2s = torch.zeros(width, w2.shape[1], dtype=w2.dtype, device=w2.device)
        w2s[: s1 - s0] = w2[s0:s1]
        kw = dict(vocab_start=s0, vocab_size=V)
        if sampling is not None:
            kw.update(temperatures=sampling[0], seeds=sampling[1], offsets=sampling[2])
        if reference:
            steppers.append(MarkovReferenceStepper(bl, anchors, w1, w2s, **kw))
        else:
            steppers.append(MarkovChainStepper(bl, anchors, w1, w2s, mode=mode, order=order, config=config, **kw))
        spans.append((s0, s1))
    for k in range(base.shape[1]):
        keys = [st.step(k) for st in steppers]
        best = torch.stack(keys).max(dim=0).values
        for kk in keys:
            kk.copy_(best)
    results = [st.finish() for st in steppers]
    logits = torch.cat([o[:, :, : s1 - s0] for (o, _), (s0, s1) in zip(results, spans)], dim=2)
    return logits, [t.clone() for _, t in results]


# ------------------------------------------------------------------------------------------------------
# exact mode == eager chain
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ldt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [1, 3])
def test_exact_matches_eager(wdt, ldt, B):
    base, anchors, w1, w2 = _make(B, 3, 1531, 40, wdt, ldt, seed=B)
    base = _adversarial(base)
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="exact")
    assert torch.equal(t, rt)
    assert bits_equal(o, ro)


def test_exact_adversarial_tokens():
    """NaN wins, -inf rows tie to id 0, exact ties go to the lowest id (checked against torch.argmax)."""
    B, K, V, r = 2, 2, 1000, 16
    base = torch.zeros(B, K, V)
    w1 = torch.zeros(V, r)
    w2 = torch.zeros(V, r)  # zero bias: tokens are argmax of the base rows
    base[0, 0, 700] = float("nan")
    base[0, 0, 900] = float("nan")
    base[1, 0] = float("-inf")
    base[0, 1, [10, 400, 999]] = 5.0
    base[1, 1, 0] = -1.0
    base[1, 1, [3, 998]] = 2.0
    base, w1, w2 = base.to(DEV), w1.to(DEV), w2.to(DEV)
    anchors = torch.tensor([1, 2], device=DEV)
    for mode in ("exact", "fused"):
        o, t = markov_chain_logits(base, anchors, w1, w2, mode=mode)
        assert t.tolist() == [[700, 10], [0, 3]], mode
        assert torch.equal(t, torch.argmax(o, dim=2)), mode


@pytest.mark.parametrize("mode", ["exact", "fused"])
def test_invalid_anchors_zero_bias(mode):
    """Anchors < 0 or >= V read nothing out of bounds: their step-0 bias is zero (a zero w1 row)."""
    B, K, V, r = 4, 2, 613, 24
    base, _, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=3)
    # w1 only as big as the real vocab: any out-of-range gather would fault on GPU / raise on CPU.
    anchors = torch.tensor([-1, V, 2**40, 17], device=DEV)
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
    o, t = markov_chain_logits(base, anchors, w1, w2, mode=mode)
    assert torch.equal(o[:3, 0], base[:3, 0])  # zero bias: the row is its base logits
    assert torch.equal(t[:3, 0], torch.argmax(base[:3, 0], dim=1))
    if mode == "exact":
        assert torch.equal(t, rt) and bits_equal(o, ro)
    assert torch.equal(ro[:3, 0], base[:3, 0])


def test_exact_shard_split_matches_eager_shards():
    """Vocab shards (TP 2/3/4 emulated, padded last shard): exact == eager chain run on the same shards."""
    base, anchors, w1, w2 = _make(3, 3, 1237, 32, torch.bfloat16, torch.bfloat16, seed=5)
    base = _adversarial(base)
    for tp in (2, 3, 4):
        lo, lt = _run_shards(base, anchors, w1, w2, tp, mode="exact")
        ro, rt = _run_shards(base, anchors, w1, w2, tp, mode="exact", reference=True)
        assert all(torch.equal(t, rt[0]) for t in lt + rt), tp
        assert bits_equal(lo, ro), tp


# ------------------------------------------------------------------------------------------------------
# fused mode: bitwise across splits and batch sizes; stored row is what was selected from
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_fused_identical_across_tp_splits(wdt):
    base, anchors, w1, w2 = _make(3, 2, 803, 40, wdt, torch.bfloat16, seed=11)
    base = _adversarial(base)
    o1, t1 = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    assert torch.equal(t1, torch.argmax(o1, dim=2))  # the stored biased row is what was selected from
    for tp in (2, 3, 4):
        lo, lt = _run_shards(base, anchors, w1, w2, tp, mode="fused")
        assert all(torch.equal(t, t1) for t in lt), tp
        assert bits_equal(lo, o1), tp


def test_fused_row_independent_of_batch():
    base, anchors, w1, w2 = _make(20, 2, 501, 40, torch.bfloat16, torch.bfloat16, seed=13)
    anchors[4] = -1
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    for rows in ([0], [4, 5], list(range(3, 20))):  # one row tile, a partial tile, spanning tiles
        idx = torch.tensor(rows, device=DEV)
        os_, ts = markov_chain_logits(base[idx].contiguous(), anchors[idx], w1, w2, mode="fused")
        assert torch.equal(ts, t[idx]) and bits_equal(os_, o[idx]), rows


def test_fused_agrees_with_exact():
    """Tokens agree with the exact chain except at near-ties; measured, and the rate printed."""
    base, anchors, w1, w2 = _make(8, 4, 1500, 48, torch.bfloat16, torch.bfloat16, seed=17)
    eo, et = markov_chain_logits(base, anchors, w1, w2, mode="exact")
    fo, ft = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    agree = (et == ft).float().mean().item()
    print(f"fused/exact token agreement: {agree:.4f}")
    assert agree >= 0.9
    # Per-row bias difference is rounding only (one bf16 ulp of the bias at most, before any divergence).
    first = (et[:, 0] == ft[:, 0])
    assert first.float().mean().item() >= 0.9
    diff = (eo[:, 0].float() - fo[:, 0].float()).abs()
    assert diff.max().item() <= 0.07


# Schedules of the fused step that must all give the same bits (interpreter: 3 column programs by default,
# so tiles p, p+3, ... belong to program p; the default table's tile is 16 rows).
_SCHEDULES = [
    FusedConfig(block_n=64, num_warps=4, num_stages=1, programs=3),
    FusedConfig(block_n=32, num_warps=4, num_stages=1, programs=5),
    FusedConfig(block_n=128, num_warps=4, num_stages=1, programs=2, cache_hints=True),
    FusedConfig(block_n=64, num_warps=4, num_stages=1, programs=1),
]
_TILE64 = FusedConfig(block_n=64, num_warps=4, num_stages=1, programs=3, block_b=64)


def test_fused_three_row_tiles_match_rows_alone_and_b16():
    """B = 40 (three 16-row tiles): every row bitwise equals the row run alone and a B = 16 run of the same
    rows straddling two tiles of the B = 40 run."""
    B, K, V, r = 40, 2, 613, 16
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=51)
    base = _adversarial(base)
    anchors[7] = -1
    assert fused_grid(B, V, mc.fused_config(r, True, batch_size=B))[0] == 3  # three row tiles
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    assert torch.equal(t, torch.argmax(o, dim=2))
    idx = torch.arange(24, 40, device=DEV)
    o16, t16 = markov_chain_logits(base[idx].contiguous(), anchors[idx], w1, w2, mode="fused")
    assert torch.equal(t16, t[idx]) and bits_equal(o16, o[idx])
    for b in (0, 7, 16, 39):  # first rows of tiles, the invalid anchor's row, the last row
        o1, t1 = markov_chain_logits(base[b:b + 1].contiguous(), anchors[b:b + 1].contiguous(), w1, w2, mode="fused")
        assert torch.equal(t1, t[b:b + 1]) and bits_equal(o1, o[b:b + 1]), b


def test_fused_64_row_tile_b_and_tp_invariant():
    """The 64-row tile (one tile shape at every B, rows padded at small B): a row alone, the rows in a
    batch of 20 (one padded tile) and on TP 2 / 3 shards (padded last shard) are bitwise equal; under the
    interpreter (fp32 broadcast-sum dot) also equal to the 16-row tile."""
    B, K, V, r = 20, 2, 613, 16
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=73)
    base = _adversarial(base)
    anchors[3] = -1
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused", config=_TILE64)
    o, t = o.clone(), t.clone()
    assert torch.equal(t, torch.argmax(o, dim=2))
    for b in (0, 3, 19):
        o1, t1 = markov_chain_logits(base[b:b + 1].contiguous(), anchors[b:b + 1].contiguous(), w1, w2, mode="fused",
                                     config=_TILE64)
        assert torch.equal(t1, t[b:b + 1]) and bits_equal(o1, o[b:b + 1]), b
    o16, t16 = markov_chain_logits(base, anchors, w1, w2, mode="fused", config=_SCHEDULES[0])
    assert torch.equal(t16, t) and bits_equal(o16, o)
    for tp in (2, 3):
        lo, lt = _run_shards(base, anchors, w1, w2, tp, mode="fused", config=_TILE64)
        assert all(torch.equal(x, t) for x in lt) and bits_equal(lo, o), tp


@pytest.mark.parametrize("sample", [False, True])
def test_fused_schedules_and_orders_identical(sample):
    """No schedule knob changes a value: tile width, program count, cache hints, and the column order
    (alternating vs same) give the same tokens and biased logits, bit for bit; also on TP 2/3 emulated
    shards. B = 20: a full and a partial row tile."""
    B, K, V, r = 20, 2, 613, 16
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=53)
    base = _adversarial(base)
    samp = _sampling(B, seed=5) if sample else (None, None, None)
    kw = dict(temperatures=samp[0], seeds=samp[1], offsets=samp[2])
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused", order="same", **kw)
    o, t = o.clone(), t.clone()
    # Interpreter time is precious: each schedule once, in either order (the reference is 'same').
    runs = [(None, "alternate")] + [(cfg, ("alternate", "same")[i % 2]) for i, cfg in enumerate(_SCHEDULES)]
    for cfg, order in runs if not sample else [(None, "alternate")]:
        oc, tc = markov_chain_logits(base, anchors, w1, w2, mode="fused", order=order, config=cfg, **kw)
        assert torch.equal(tc, t) and bits_equal(oc, o), (cfg, order)
    for tp in (2, 3) if not sample else (2,):
        lo, lt = _run_shards(base, anchors, w1, w2, tp, mode="fused", order="alternate",
                             sampling=samp if sample else None)
        assert all(torch.equal(x, t) for x in lt) and bits_equal(lo, o), tp


def test_fused_order_ties_across_tiles_and_programs():
    """Equal maxima in different column tiles, owned by the same or by different programs, and scanned in
    either direction (odd steps run backwards with order='alternate'): the lowest id wins, as torch.argmax;
    NaN beats everything wherever it sits."""
    B, K, V, r = 4, 3, 700, 16  # 11 tiles of 64 columns; program p owns tiles p, p+3, p+6, ...
    g = torch.Generator().manual_seed(57)
    base = (torch.rand(B, K, V, generator=g) * 0.1).to(torch.bfloat16)
    w1 = (torch.randn(V, r, generator=g) * 0.3).to(torch.bfloat16)
    w2 = (torch.randn(V, r, generator=g) * 0.3).to(torch.bfloat16)
    # step -> tied columns: same program far apart (tiles 1, 10), two programs (tiles 1, 2; step 1 runs
    # backwards with 'alternate'), the first and the last tile.
    ties = {0: (70, 650), 1: (70, 140), 2: (5, 699)}
    for k, cols in ties.items():
        w2[list(cols)] = w2[cols[0]].clone()  # same w2 row: same bias in every row, so the tie survives the bias
        base[:, k, list(cols)] = 50.0
    base[3, 2, [130, 690]] = float("nan")  # two NaNs in different programs: the first wins
    base, w1, w2 = base.to(DEV), w1.to(DEV), w2.to(DEV)
    anchors = torch.randint(0, V, (B,), generator=g).to(DEV)
    for cfg in (None, _SCHEDULES[2]):
        outs = {}
        for order in ("alternate", "same"):
            o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused", order=order, config=cfg)
            assert torch.equal(t, torch.argmax(o, dim=2)), (cfg, order)
            for k, cols in ties.items():
                want = torch.full((B,), min(cols), dtype=torch.int64, device=DEV)
                if k == 2:
                    want[3] = 130
                assert torch.equal(t[:, k], want), (cfg, order, k)
            outs[order] = (o.clone(), t.clone())
        assert torch.equal(outs["alternate"][1], outs["same"][1])
        assert bits_equal(outs["alternate"][0], outs["same"][0])


def test_fused_config_validation():
    with pytest.raises(ValueError, match="block_b"):
        FusedConfig(block_n=64, num_warps=4, num_stages=2, programs=4, block_b=32)
    with pytest.raises(ValueError, match="block_n"):
        FusedConfig(block_n=48, num_warps=4, num_stages=2, programs=4)
    with pytest.raises(ValueError, match="programs"):
        FusedConfig(block_n=64, num_warps=4, num_stages=2, programs=0)
    base, anchors, w1, w2 = _make(2, 2, 300, 8, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="order"):
        markov_chain_logits(base, anchors, w1, w2, mode="fused", order="reverse")


def test_fused_grid_splits_programs_over_row_tiles():
    cfg = FusedConfig(block_n=64, num_warps=4, num_stages=2, programs=528)
    # (row tiles, column programs per row tile, column tiles) at V = 200064
    assert fused_grid(1, 200064, cfg) == (1, 528, 3126)
    assert fused_grid(128, 200064, cfg) == (8, 66, 3126)
    assert fused_grid(129, 200064, cfg) == (9, 59, 3126)
    assert fused_grid(256, 100, cfg) == (16, 2, 2)  # never more programs than column tiles
    tile64 = FusedConfig(block_n=64, num_warps=4, num_stages=2, programs=528, block_b=64)
    assert fused_grid(1, 200064, tile64) == fused_grid(64, 200064, tile64) == (1, 528, 3126)
    assert fused_grid(65, 200064, tile64) == (2, 264, 3126)


# ------------------------------------------------------------------------------------------------------
# auto mode: per-B table measured on the H200
# ------------------------------------------------------------------------------------------------------
def test_bench_markov_sweep_rows_to_paste():
    """`bench markov --tables sweep` prints FUSED_SCHEDULES and AUTO_MODE_TABLE source: pasted back, it
    picks each measured B's winner (consecutive B with one winner share a row, the last row covers the
    rest), and the grid holds both tile shapes with the 64-row tile at 8 warps only."""
    from tensorrt_llm_ext.bench.markov import auto_table_source, schedule_rows, sweep_configs
    from tensorrt_llm_ext.kernels.markov_fused_step import FusedSchedule, fused_schedule

    grid = sweep_configs(132)
    assert {c.block_b for c, _ in grid} == {16, 64}
    assert all(c.num_warps == 8 and c.block_n <= 64 for c, _ in grid if c.block_b == 64)
    assert all(c.programs == p * 132 for c, p in grid)
    a = FusedConfig(64, 8, 2, 264, block_b=64)
    b = FusedConfig(32, 8, 3, 528, block_b=64)
    best = {1: (a, 2), 8: (a, 2), 32: (b, 4), 64: (a, 2), 128: (a, 2)}
    src = schedule_rows(best, 64)
    table = eval(f"({src})", {"FusedSchedule": FusedSchedule})  # the pasted tuple
    assert [s.max_batch for s in table] == [8, 32, None]
    for B, (cfg, progs) in best.items():
        assert fused_schedule(B, table).config(132) == cfg, B
    assert fused_schedule(1000, table).config(132) == a
    assert "block_b" not in schedule_rows({1: (FusedConfig(64, 4, 2, 528), 4)}, 16)
    src = auto_table_source({1: "fused", 8: "fused", 32: "fused", 64: "exact", 128: "exact"})
    assert src.startswith("AUTO_MODE_TABLE = ")
    auto = eval(src.split(" = ", 1)[1])
    assert auto == ((32, "fused"), (None, "exact"))
    assert [mc.auto_mode_for(auto, B) for B in (1, 32, 33, 500)] == ["fused", "fused", "exact", "exact"]
    assert eval(auto_table_source({1: "exact"}).split(" = ", 1)[1]) == ((None, "exact"),)


def test_auto_mode_table_lookup():
    assert mc.AUTO_MODE_TABLE == ((32, "fused"), (None, "exact"))  # the H200 measurement (docs/markov_chain.md)
    assert [mc.auto_mode_for(mc.AUTO_MODE_TABLE, b) for b in (1, 32, 33, 128)] == ["fused", "fused", "exact", "exact"]
    table = ((1, "exact"), (32, "fused"), (None, "exact"))
    assert [mc.auto_mode_for(table, b) for b in (1, 2, 32, 33, 4096)] == ["exact", "fused", "fused", "exact", "exact"]


def test_auto_mode_component_follows_table(caplog, monkeypatch):
    from tensorrt_llm_ext import logger as ext_logger

    monkeypatch.setattr(ext_logger, "_seen_once", set())  # earlier tests may have logged the line already
    base, anchors, w1, w2 = _make(3, 2, 300, 8, torch.bfloat16, torch.bfloat16, seed=59)
    weights = MarkovHeadWeights(markov_w1=w1, markov_w2=w2, vocab_start=0, vocab_size=300)
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        chain = MarkovChain(weights, max_batch_size=4, draft_len=2, mode="auto")
        MarkovChain(weights, max_batch_size=4, draft_len=2, mode="auto")
    assert chain.auto_table == mc.AUTO_MODE_TABLE
    want = [mc.auto_mode_for(mc.AUTO_MODE_TABLE, b) for b in range(1, 300)]
    assert [chain.mode_for(b) for b in range(1, 300)] == want
    lines = [r.getMessage() for r in caplog.records if "Markov chain mode 'auto'" in r.getMessage()]
    assert lines == ["Markov chain mode 'auto': the table measured on the H200: B 1..32 fused, B>=33 exact"], lines
    given = MarkovChain(weights, max_batch_size=4, draft_len=2, mode="auto", auto_table=((1, "exact"), (None, "fused")))
    assert [given.mode_for(b) for b in (1, 2, 3)] == ["exact", "fused", "fused"]
    assert MarkovChain(weights, max_batch_size=4, draft_len=2, mode="fused").mode_for(300) == "fused"
    for bad in ((), ((8, "fused"),), ((8, "fused"), (4, "exact"), (None, "exact")), ((None, "eager"),)):
        with pytest.raises(ValueError, match="auto mode table"):
            MarkovChain(weights, max_batch_size=4, draft_len=2, mode="auto", auto_table=bad)


# ------------------------------------------------------------------------------------------------------
# keyed sampling
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "fused"])
def test_sampling_identical_across_splits(mode):
    """Keyed Gumbel draws depend on the global id only: the same tokens at every TP split. Integer-valued
    weights make every GEMM exact, so the exact mode's shard bias equals the full one too."""
    B, K, V, r = 5, 2, 601, 16
    g = torch.Generator().manual_seed(23)
    base = torch.randn(B, K, V, generator=g).to(torch.bfloat16).to(DEV)
    w1 = torch.randint(-2, 3, (V, r), generator=g).to(torch.bfloat16).to(DEV)
    w2 = (torch.randint(-2, 3, (V, r), generator=g) * 0.125).to(torch.bfloat16).to(DEV)
    anchors = torch.randint(0, V, (B,), generator=g).to(DEV)
    samp = _sampling(B)
    o1, t1 = markov_chain_logits(base, anchors, w1, w2, mode=mode, temperatures=samp[0], seeds=samp[1],
                                 offsets=samp[2])
    for tp in (2, 3):
        lo, lt = _run_shards(base, anchors, w1, w2, tp, mode=mode, sampling=samp)
        assert all(torch.equal(t, t1) for t in lt), (mode, tp)
        assert bits_equal(lo, o1)
    # Greedy rows select the plain argmax; sampled rows differ from greedy somewhere.
    greedy = samp[0] == 0
    assert torch.equal(t1[greedy], torch.argmax(o1[greedy], dim=2))
    assert not torch.equal(t1[~greedy], torch.argmax(o1[~greedy], dim=2))


def test_exact_sampling_matches_eager():
    """Exact mode with keyed sampling vs the eager chain (torch twin of the Philox/Gumbel draw). The
    uniforms are bit-identical; tl.log may differ from torch.log by an ulp, so a mismatch is allowed only
    where the eager scores of both candidates are within float rounding."""
    B, K, V, r = 6, 3, 1201, 24
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=29)
    samp = _sampling(B, seed=31)
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2, temperatures=samp[0], seeds=samp[1],
                                           offsets=samp[2])
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="exact", temperatures=samp[0], seeds=samp[1],
                               offsets=samp[2])
    assert torch.equal(t, rt)
    assert bits_equal(o, ro)


def test_sampling_distribution():
    """Sampled first tokens follow softmax(biased / T) (chi-square over many seeds)."""
    n, V, r = 800, 5, 4
    base = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).repeat(n, 1)[:, None, :].to(DEV)
    w1 = torch.zeros(V, r, device=DEV)
    w2 = torch.zeros(V, r, device=DEV)
    anchors = torch.zeros(n, dtype=torch.int64, device=DEV)
    temps = torch.full((n,), 0.8, device=DEV)
    seeds = torch.arange(n, dtype=torch.int64, device=DEV) * 7919 + 3
    offsets = torch.zeros(n, dtype=torch.int64, device=DEV)
    _, t = markov_chain_logits(base, anchors, w1, w2, mode="fused", temperatures=temps, seeds=seeds,
                               offsets=offsets)
    counts = torch.bincount(t[:, 0].cpu(), minlength=V).double()
    p = torch.softmax(base[0, 0].cpu().double() / 0.8, dim=0)
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum().item()
    assert chi2 < 18.5  # 4 dof, p ~ 0.001


# ------------------------------------------------------------------------------------------------------
# component, validation
# ------------------------------------------------------------------------------------------------------
def test_markov_chain_component_reuses_buffers():
    base, anchors, w1, w2 = _make(3, 2, 700, 16, torch.bfloat16, torch.bfloat16, seed=37)
    weights = MarkovHeadWeights(markov_w1=w1, markov_w2=w2, vocab_start=0, vocab_size=700)
    for mode in ("exact", "fused", "auto"):
        chain = MarkovChain(weights, max_batch_size=4, draft_len=2, logits_dtype=torch.bfloat16, mode=mode,
                            auto_table=((2, "fused"), (None, "exact")) if mode == "auto" else None)
        ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
        for B in (3, 1, 3, 2):  # different batch sizes reuse the same buffers (auto: exact, fused, ...)
            o, t = chain(base[:B], anchors[:B])
            assert o.data_ptr() == chain.out.data_ptr() and t.data_ptr() == chain.workspace.tokens.data_ptr()
            if chain.mode_for(B) == "exact":
                assert torch.equal(t, rt[:B]) and bits_equal(o, ro[:B])
            else:
                assert torch.equal(t, torch.argmax(o, dim=2))
        assert (chain.workspace.keys[0] == EMPTY_KEY).all()  # ring slot 0 restored for the next chain


def test_validation_errors():
    """Bad inputs raise ValueError naming the argument, what was expected and what arrived."""
    base, anchors, w1, w2 = _make(2, 2, 300, 8, torch.bfloat16, torch.bfloat16)
    cases = [
        (dict(mode="nope"), "mode: expected one of"),
        (dict(markov_w2=w2[:-1]), r"markov_w2: expected shape \[300, 8\], got \[299, 8\]"),
        (dict(markov_w2=w2.float()), "markov_w2: expected dtype bfloat16, got float32"),
        (dict(anchors=anchors[:1]), r"anchors: expected shape \[2\]"),
        (dict(anchors=anchors.float()), "anchors: expected dtype int32 or int64"),
        (dict(temperatures=torch.ones(2, device=DEV)), "expected all three together or none, got temperatures"),
        (dict(base_logits=base.half()), "base_logits: expected dtype bfloat16 or float32, got float16"),
        (dict(vocab_size=301), r"vocab_size: expected an int in \[1, 301\), got 301"),
        (dict(vocab_size=300.0), "vocab_size: expected a Python int"),
        (dict(vocab_start=-1), r"vocab_start: expected an int in \[0, inf\)"),
        (dict(out=torch.empty(2, 2, 299, dtype=base.dtype, device=DEV)), r"out: expected shape \[2, 2, 300\]"),
        (dict(workspace=MarkovWorkspace.allocate(1, 2, w2, "exact")), "workspace: expected room for B=2"),
    ]
    for change, msg in cases:
        kw = dict(base_logits=base, anchors=anchors, markov_w1=w1, markov_w2=w2) | change
        args = [kw.pop(k) for k in ("base_logits", "anchors", "markov_w1", "markov_w2")]
        with pytest.raises(ValueError, match=msg):
            markov_chain_logits(*args, **kw)


def test_strided_per_row_inputs_rejected():
    """The kernels read row b at element b: a strided anchors/sampling view was read wrongly, silently."""
    base, _, w1, w2 = _make(3, 2, 97, 8, torch.float32, torch.float32)
    accepted = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(1)).to(DEV)
    for mode in ("exact", "fused"):
        with pytest.raises(ValueError, match="anchors: expected a contiguous"):
            markov_chain_logits(base, accepted[:, 0], w1, w2, mode=mode)
    anchors = accepted[:, 0].contiguous()
    temps = torch.tensor([0.7], device=DEV).expand(3)  # broadcast view: stride 0
    seeds = torch.arange(6, device=DEV)[::2]
    offsets = torch.zeros(3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="temperatures: expected a contiguous"):
        markov_chain_logits(base, anchors, w1, w2, temperatures=temps, seeds=seeds.contiguous(), offsets=offsets)
    with pytest.raises(ValueError, match="seeds: expected a contiguous"):
        markov_chain_logits(base, anchors, w1, w2, temperatures=temps.contiguous(), seeds=seeds, offsets=offsets)


def test_empty_batch():
    base, anchors, w1, w2 = _make(0, 2, 300, 8, torch.bfloat16, torch.bfloat16)
    for mode in ("exact", "fused"):
        o, t = markov_chain_logits(base, anchors, w1, w2, mode=mode)
        assert o.shape == (0, 2, 300) and t.shape == (0, 2)


# ------------------------------------------------------------------------------------------------------
# GPU only: large sizes, CUDA graph
# ------------------------------------------------------------------------------------------------------
@gpu_only
@pytest.mark.parametrize("B", [1, 8, 64, 128])
def test_gpu_exact_large_matches_eager(B):
    V, r, K = 200064, 256, 7
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=B, scale=0.05)
    base = _adversarial(base)
    anchors[-1] = -1
    ro, rt = markov_chain_logits_reference(base, anchors, w1, w2)
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="exact")
    assert torch.equal(t, rt) and bits_equal(o, ro)
    fo, ft = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    assert torch.equal(ft, torch.argmax(fo, dim=2))
    print(f"B={B}: fused/exact token agreement {(ft == t).float().mean().item():.4f}")


@gpu_only
def test_gpu_fused_large_splits_and_rows():
    V, r, K, B = 200064, 256, 3, 8
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=41, scale=0.05)
    o1, t1 = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    for tp in (2, 3, 4, 8):
        lo, lt = _run_shards(base, anchors, w1, w2, tp, mode="fused")
        assert all(torch.equal(t, t1) for t in lt) and bits_equal(lo, o1), tp
    big = torch.randn(128, K, V, device=DEV).to(torch.bfloat16)
    big_a = torch.randint(0, V, (128,), device=DEV)
    big[77], big_a[77] = base[2], anchors[2]
    bo, bt = markov_chain_logits(big, big_a, w1, w2, mode="fused")
    assert torch.equal(bt[77], t1[2]) and bits_equal(bo[77], o1[2])


@gpu_only
@pytest.mark.parametrize("mode", ["exact", "fused"])
@pytest.mark.parametrize("sample", [False, True])
def test_gpu_cuda_graph_replay(mode, sample):
    V, r, K, B = 50021, 128, 5, 16
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=43, scale=0.1)
    samp = _sampling(B) if sample else (None, None, None)
    kw = dict(temperatures=samp[0], seeds=samp[1], offsets=samp[2])
    eo, et = markov_chain_logits(base, anchors, w1, w2, mode=mode, **kw)
    eo, et = eo.clone(), et.clone()
    chain = MarkovChain(MarkovHeadWeights(w1, w2, 0, V), max_batch_size=B, draft_len=K, mode=mode)
    assert chain.mode_for(B) == mode
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(base, anchors, *samp)  # warm-up compiles outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        go, gt = chain(base, anchors, *samp)
    go.zero_()
    gt.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gt, et) and bits_equal(go, eo)
    # New inputs copied into the captured tensors take effect on replay.
    base.copy_(torch.randn_like(base.float()).to(base.dtype))
    anchors.copy_(torch.randint(0, V, (B,), device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    ro, rt = markov_chain_logits(base, anchors, w1, w2, mode=mode, **kw)
    assert torch.equal(gt, rt) and bits_equal(go, ro)


def _gpu_schedules():
    """The per-B table's configs and, per table row, the bench's first variant plus the row with cache
    hints flipped, at this GPU's SM count (few: every distinct config costs compiles)."""
    import dataclasses

    from tensorrt_llm_ext.bench.markov import schedule_variants
    from tensorrt_llm_ext.kernels.markov_fused_step import FUSED_SCHEDULES

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    for s in FUSED_SCHEDULES:
        if s.config(sms) not in table:
            table.append(s.config(sms))
    variants = []
    for s in FUSED_SCHEDULES:
        cfg = s.config(sms)
        for c in schedule_variants(s.max_batch or 128, cfg, 1) + [dataclasses.replace(cfg, cache_hints=True)]:
            if c not in table + variants:
                variants.append(c)
    return table, variants[:6]


@gpu_only
def test_gpu_fused_one_pass_rows_orders_schedules():
    """V = 200064, r = 256: rows of B = 128 (8 row tiles), B = 40 and B = 1 are bitwise
    equal; alternating == same order; every schedule of the table and of the bench gives the same bits."""
    V, r, K = 200064, 256, 3
    base, anchors, w1, w2 = _make(128, K, V, r, torch.bfloat16, torch.bfloat16, seed=61, scale=0.05)
    base = _adversarial(base)
    anchors[50] = -1
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    o, t = o.clone(), t.clone()
    assert torch.equal(t, torch.argmax(o, dim=2))
    os_, ts = markov_chain_logits(base, anchors, w1, w2, mode="fused", order="same")
    assert torch.equal(ts, t) and bits_equal(os_, o)
    for lo, n in ((0, 40), (88, 40), (50, 1), (127, 1), (3, 1)):
        idx = torch.arange(lo, lo + n, device=DEV)
        ob, tb = markov_chain_logits(base[idx].contiguous(), anchors[idx].contiguous(), w1, w2, mode="fused")
        assert torch.equal(tb, t[idx]) and bits_equal(ob, o[idx]), (lo, n)
    table, variants = _gpu_schedules()  # compile time: table rows at two sizes, variants at one
    for cfg, B in [(c, b) for c in table for b in (40, 128)] + [(c, 40) for c in variants]:
        oc, tc = markov_chain_logits(base[:B].contiguous(), anchors[:B].contiguous(), w1, w2, mode="fused",
                                     config=cfg)
        assert torch.equal(tc, t[:B]) and bits_equal(oc, o[:B]), (cfg, B)


@gpu_only
@pytest.mark.parametrize("B", [1, 40, 128])
def test_gpu_fused_one_pass_tp_splits(B):
    """Shard widths (TP 2/4/8 and an odd TP 3 with a padded shard) equal the TP-1 chain bit for bit, both
    orders, greedy and keyed sampling."""
    V, r, K = 200064, 256, 3
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=67 + B, scale=0.05)
    base = _adversarial(base)
    for samp in (None, _sampling(B, seed=3)):
        kw = {} if samp is None else {"temperatures": samp[0], "seeds": samp[1], "offsets": samp[2]}
        o1, t1 = markov_chain_logits(base, anchors, w1, w2, mode="fused", **kw)
        o1, t1 = o1.clone(), t1.clone()
        for tp, order in ((2, "same"), (3, "alternate"), (4, "alternate"), (8, "same")):
            lo, lt = _run_shards(base, anchors, w1, w2, tp, mode="fused", sampling=samp, order=order)
            assert all(torch.equal(x, t1) for x in lt) and bits_equal(lo, o1), (tp, order, samp is None)


@gpu_only
@pytest.mark.parametrize("B", [1, 40, 128])
def test_gpu_fused_one_pass_graph_replay(B):
    """CUDA-graph replay of the one-pass fused chain (the worker's component) == eager, then new inputs."""
    V, r, K = 200064, 256, 3
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=71 + B, scale=0.05)
    eo, et = markov_chain_logits(base, anchors, w1, w2, mode="fused")
    eo, et = eo.clone(), et.clone()
    chain = MarkovChain(MarkovHeadWeights(w1, w2, 0, V), max_batch_size=B, draft_len=K, mode="fused")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(base, anchors)  # warm-up compiles outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        go, gt = chain(base, anchors)
    go.zero_()
    gt.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gt, et) and bits_equal(go, eo)
    base.copy_(torch.randn_like(base.float()).to(base.dtype))
    anchors.copy_(torch.randint(0, V, (B,), device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    ro, rt = markov_chain_logits(base, anchors, w1, w2, mode="fused", order="same")
    assert torch.equal(gt, rt) and bits_equal(go, ro)


@gpu_only
@pytest.mark.parametrize("block_b", [16, 64])
@pytest.mark.parametrize("sample", [False, True])
def test_gpu_fused_b_invariance_alone_vs_batch_of_64(block_b, sample):
    """B-invariance on the H200 for each tile shape: a request's fused chain is bitwise the same whether it
    runs alone or as any row of a batch of 64 (for block_b = 64: one full tile vs a tile of 63 padding
    rows), and on TP 2 / 4 shards."""
    V, r, K, B = 200064, 256, 3, 64
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=79 + block_b, scale=0.05)
    base = _adversarial(base)
    samp = _sampling(B, seed=9) if sample else None
    kw = {} if samp is None else {"temperatures": samp[0], "seeds": samp[1], "offsets": samp[2]}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # 8 warps for the 64-row tile: compiled for sm90 at 4 warps it spills (docs/markov_chain.md)
    warps = 4 if block_b == 16 else 8
    cfg = FusedConfig(block_n=64, num_warps=warps, num_stages=2, programs=4 * sms, block_b=block_b)
    o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused", config=cfg, **kw)
    o, t = o.clone(), t.clone()
    for b in (0, 1, 31, 63):
        one = slice(b, b + 1)
        kw1 = {k: v[one].contiguous() for k, v in kw.items()}
        o1, t1 = markov_chain_logits(base[one].contiguous(), anchors[one].contiguous(), w1, w2, mode="fused",
                                     config=cfg, **kw1)
        assert torch.equal(t1, t[one]) and bits_equal(o1, o[one]), b
    for tp in (2, 4):
        lo, lt = _run_shards(base, anchors, w1, w2, tp, mode="fused", sampling=samp, config=cfg)
        assert all(torch.equal(x, t) for x in lt) and bits_equal(lo, o), tp


@gpu_only
@pytest.mark.parametrize("block_b", [16, 64])
def test_gpu_sweep_grid_schedules_bitwise(block_b):
    """Every schedule `bench markov --tables sweep` may paste into FUSED_SCHEDULES gives, within its
    block_b, the same bits as the others (greedy and sampled rows; B = 40 and a request alone), so the
    table can be filled per B from the fastest without changing any output."""
    from tensorrt_llm_ext.bench.markov import sweep_configs

    V, r, K, B = 200064, 256, 3, 40
    base, anchors, w1, w2 = _make(B, K, V, r, torch.bfloat16, torch.bfloat16, seed=83 + block_b, scale=0.05)
    base = _adversarial(base)
    samp = _sampling(B, seed=13)  # every third row greedy
    kw = {"temperatures": samp[0], "seeds": samp[1], "offsets": samp[2]}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ref = None
    for cfg, _ in sweep_configs(sms, block_b):
        o, t = markov_chain_logits(base, anchors, w1, w2, mode="fused", config=cfg, **kw)
        if ref is None:
            ref = (o.clone(), t.clone())
            continue
        assert torch.equal(t, ref[1]) and bits_equal(o, ref[0]), cfg.describe()
        one = slice(7, 8)
        o1, t1 = markov_chain_logits(base[one].contiguous(), anchors[one].contiguous(), w1, w2, mode="fused",
                                     config=cfg, **{k: v[one].contiguous() for k, v in kw.items()})
        assert torch.equal(t1, ref[1][one]) and bits_equal(o1, ref[0][one]), cfg.describe()


@pytest.mark.parametrize("r,elem_bytes", [(256, 2), (256, 4), (576, 2), (576, 4), (1000, 4)])
def test_fused_config_fits_shared_memory(r, elem_bytes):
    """The table's schedule is kept where it fits (r = 256, the rank it was measured at) and otherwise loses
    pipeline stages, then column width, until its pipelined tiles fit: a 576-wide target's fp32 Markov
    weights asked 320 KiB of the H200's 227 KiB per block. The row tile (the bits) never changes."""
    from tensorrt_llm_ext.kernels.markov_fused_step import FUSED_SMEM_BYTES, FUSED_SCHEDULES, fit_shared_memory

    table = FUSED_SCHEDULES[0].config(132)
    cfg = fit_shared_memory(table, r, elem_bytes)
    block_r = max(16, 1 << (r - 1).bit_length())
    assert cfg.num_stages * (cfg.block_n + cfg.block_b) * block_r * elem_bytes <= FUSED_SMEM_BYTES
    assert cfg.block_b == table.block_b and cfg.programs == table.programs and cfg.num_warps == table.num_warps
    need = table.num_stages * (table.block_n + table.block_b) * block_r * elem_bytes
    assert (cfg == table) == (need <= FUSED_SMEM_BYTES)
