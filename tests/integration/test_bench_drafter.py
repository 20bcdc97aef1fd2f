"""``bench drafter``: the fc bytes per rank, a CPU smoke run of its tables, and the schedule rows it prints
to paste back."""

from __future__ import annotations

import torch

from tensorrt_llm_ext.models import DSparkDrafter, DSparkDrafterNoFusion


def test_bench_fc_bytes_per_rank_and_smoke(capsys):
    from tensorrt_llm_ext.bench.drafter import fc_bytes_per_rank, main

    whole = 7168 * 35840 * 2
    for tp in (1, 2, 4, 8):
        assert fc_bytes_per_rank(DSparkDrafter, tp) * tp == whole
        assert fc_bytes_per_rank(DSparkDrafterNoFusion, tp) == whole
    if not torch.cuda.is_available():  # on GPU the full benchmark is run by hand, not from a test
        main([])
        out = capsys.readouterr().out
        assert "1/8" in out and "ATTENTION_SCHEDULES = (AttentionSchedule(None, block_n=" in out
        main(["--tables", "attention"])  # the sweep alone
        out = capsys.readouterr().out
        assert "Drafter block attention schedules" in out and "fc weight" not in out
        main(["--tables", "serve"])  # the served step, its fused column only in the smoke run
        out = capsys.readouterr().out
        assert "Served drafter step" in out and "fused layers, table: step us" in out


def test_bench_drafter_attention_rows_to_paste():
    """The sweep's ATTENTION_SCHEDULES source, pasted back, gives each measured B its fastest schedule."""
    from tensorrt_llm_ext.bench.drafter import attention_table_source
    from tensorrt_llm_ext.kernels.latent_block_attention import AttentionSchedule, attention_schedule

    a = AttentionSchedule(None, block_n=32, num_warps=4, split_k=8)
    b = AttentionSchedule(None, block_n=64, num_warps=8, split_k=1)
    best = {1: a, 8: a, 32: b}
    src = attention_table_source(best)
    table = eval(src.split(" = ", 1)[1], {"AttentionSchedule": AttentionSchedule})
    assert [s.max_batch for s in table] == [8, None]
    for bsz, sched in {**best, 4: a, 1000: b}.items():
        got = attention_schedule(bsz, table)
        assert (got.block_n, got.num_warps, got.split_k) == (sched.block_n, sched.num_warps, sched.split_k)


def test_bench_drafter_attention_rows_per_latent():
    """Rows swept at two latent widths paste back as one table: each (B, d_c) gets its fastest schedule, a wider
    latent than any swept takes the widest width's rows."""
    from tensorrt_llm_ext.bench.drafter import attention_table_source
    from tensorrt_llm_ext.kernels.latent_block_attention import AttentionSchedule, attention_schedule

    a = AttentionSchedule(None, block_n=16, num_warps=4, split_k=16)
    b = AttentionSchedule(None, block_n=32, num_warps=8, split_k=1)
    c = AttentionSchedule(None, block_n=16, num_warps=8, split_k=8)
    best = {256: {1: a, 8: a, 32: b}, 512: {1: c, 8: b, 32: b}}
    table = eval(attention_table_source(best).split(" = ", 1)[1], {"AttentionSchedule": AttentionSchedule})
    assert [(s.max_batch, s.max_latent) for s in table] == [(8, 256), (None, 256), (1, None), (None, None)]
    for d_c, per_b in {**best, 1024: best[512], 128: best[256]}.items():
        for bsz, sched in per_b.items():
            got = attention_schedule(bsz, table, latent_dim=d_c)
            assert (got.block_n, got.num_warps, got.split_k) == (sched.block_n, sched.num_warps, sched.split_k)
