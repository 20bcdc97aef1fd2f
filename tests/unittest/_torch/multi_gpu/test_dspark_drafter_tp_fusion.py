"""DSpark drafter TP fusion over MPI (2 and 4 ranks; gloo on CPU, NCCL on GPU).

A TP drafter and a single-rank drafter are built on every rank from the same seeded full weights and
fed the same inputs. Tolerances (TP vs single rank; only rounding differs): fp32 ``atol=rtol=1e-5``;
bf16 projected context ``atol=rtol=4e-2`` and block-decode output ``atol=rtol=6e-2`` (normed values
up to ~4, bf16 ulp 1/64 there; measured on CPU/gloo: <= 2 ulps). Every rank must hold the same
bits, and projections that the plan keeps unsplit must equal the single rank's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.testing.mpi import run_on_ranks

TOL = {
    "float32": dict(ctx=dict(atol=1e-5, rtol=1e-5), out=dict(atol=1e-5, rtol=1e-5)),
    "bfloat16": dict(ctx=dict(atol=4e-2, rtol=4e-2), out=dict(atol=6e-2, rtol=6e-2)),
}


def _block_inputs(cfg, dtype, device, k=4, page_size=4, max_pages=4, seed=1):
    """3 requests (ctx 9, 0, 5) + a dummy row over permuted pages of a random (stale) pool."""
    from tensorrt_llm_ext.contract import DraftBlockPlacement, DrafterBlockInputs, PagedLatentCache

    g = torch.Generator().manual_seed(seed)
    num_slots = 5
    pool = torch.randn(cfg.num_layers, num_slots * max_pages, page_size, cfg.latent_dim, generator=g).to(dtype)
    table = torch.randperm(num_slots * max_pages, generator=g).view(num_slots, max_pages).to(torch.int32)
    table[1, 2:] = -1
    table[0, 2:] = -1  # slot 0 (ctx 5): block position 8 has no page -> not stored
    slot_ids = torch.tensor([3, 1, 0, 4], dtype=torch.int32)
    ctx_lens = torch.tensor([9, 0, 5, 0], dtype=torch.int32)
    seq_lens = torch.tensor([9 + k, k, 5 + k, 0], dtype=torch.int32)
    positions = (ctx_lens.long().unsqueeze(1) + torch.arange(k)).to(torch.int32)
    page_ids = torch.gather(table[slot_ids.long()].long(), 1, positions.long() // page_size).to(torch.int32)
    page_ids[3] = -1  # the dummy row stores nothing
    ids = torch.randint(0, cfg.vocab_size, (4, k), generator=g)
    ids[:, 1:] = cfg.mask_token_id
    placement = DraftBlockPlacement(*(t.to(device) for t in (positions, page_ids, positions % page_size,
                                                              ctx_lens, seq_lens)))
    return DrafterBlockInputs(ids.to(device), slot_ids.to(device), placement,
                              PagedLatentCache(pool.to(device), table.to(device)))


def _fresh_cache(inputs):
    from dataclasses import replace

    return replace(inputs, cache=replace(inputs.cache, pool=inputs.cache.pool.clone()))


def _record_fusions(all_reduce, log):
    """Wrap one AllReduce instance so its calls' fusion ops are recorded (observable fused path)."""
    inner = all_reduce.forward

    def forward(x, all_reduce_params=None):
        log.append(all_reduce_params.fusion_op.name if all_reduce_params is not None else "NONE")
        return inner(x, all_reduce_params=all_reduce_params)

    all_reduce.forward = forward


def _run_pair(cls_name, cfg_kwargs, dtype_name, seed):
    """Per rank: a TP drafter of class ``cls_name`` vs a single-rank DSparkDrafter, same weights."""
    import torch

    from tensorrt_llm_ext.distributed import comm_device, init_from_mpi
    from tensorrt_llm_ext.mapping import Mapping
    from tensorrt_llm_ext import models

    mapping = init_from_mpi()  # TP over the whole MPI world
    dev = comm_device()
    dtype = getattr(torch, dtype_name)
    cfg = models.DSparkDrafterConfig(**cfg_kwargs)
    tp = getattr(models, cls_name)(cfg, mapping, dtype=dtype, device=dev)
    tp.init_weights(seed)
    one = models.DSparkDrafter(cfg, Mapping(), dtype=dtype, device=dev)
    one.init_weights(seed)
    calls: list[str] = []
    for mod in tp.modules():
        if type(mod).__name__ == "AllReduce":
            _record_fusions(mod, calls)
    feats = torch.randn(7, cfg.fc_in_features, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(dev)
    ctx_tp, ctx_one = tp.project_context(feats), one.project_context(feats)
    lat_tp, lat_one = tp.compute_context_latents(feats), one.compute_context_latents(feats)
    ctx_calls = list(calls)
    calls.clear()
    inputs = _block_inputs(cfg, dtype, dev)
    in_tp, in_one = _fresh_cache(inputs), _fresh_cache(inputs)
    out_tp, out_one = tp.forward_block(in_tp), one.forward_block(in_one)
    layer0 = tp.layers[0]
    return dict(
        plan=tp.tp_plan, fc_shape=tuple(tp.fc.weight.shape), q_shape=tuple(layer0.self_attn.q_proj.weight.shape),
        o_reduces=layer0.self_attn.o_proj.reduce_output, down_reduces=layer0.mlp.down_proj.reduce_output,
        ctx_calls=ctx_calls, block_calls=list(calls),
        ctx_tp=ctx_tp.cpu(), ctx_one=ctx_one.cpu(), lat_tp=lat_tp.cpu(), lat_one=lat_one.cpu(),
        out_tp=out_tp.cpu(), out_one=out_one.cpu(), pool_tp=in_tp.cache.pool.cpu(), pool_one=in_one.cache.pool.cpu(),
    )


def _same_on_every_rank(results, keys):
    for key in keys:
        assert all(torch.equal(results[0][key], r[key]) for r in results[1:]), f"{key} differs across ranks"


@pytest.mark.parametrize("mpi_pool_executor", [2, 4], indirect=True)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_tp_drafter_matches_single_rank(mpi_pool_executor, dtype_name):
    from tensorrt_llm_ext.models import DSparkDrafterConfig

    results = run_on_ranks(mpi_pool_executor, _run_pair, "DSparkDrafter", {}, dtype_name, 11)
    tp = len(results)
    cfg = DSparkDrafterConfig()
    n_layers = cfg.num_layers
    tol = TOL[dtype_name]
    for r in results:
        # The fused paths were taken: resolved plan, 1/tp of fc per rank, un-reduced row outputs,
        # and exactly one fused all-reduce per norm (hidden_norm; 2 per layer in the block).
        assert r["plan"].fc_input_split and r["plan"].residual_norm_fusion
        assert r["fc_shape"] == (cfg.hidden_size, cfg.fc_in_features // tp)
        assert r["q_shape"] == (cfg.num_heads * cfg.head_dim // tp, cfg.hidden_size)
        assert not r["o_reduces"] and not r["down_reduces"]
        assert r["ctx_calls"] == ["RMS_NORM", "RMS_NORM"]  # project_context + compute_context_latents
        assert r["block_calls"] == ["RESIDUAL_RMS_NORM"] * (2 * n_layers)
        torch.testing.assert_close(r["ctx_tp"].float(), r["ctx_one"].float(), **tol["ctx"])
        torch.testing.assert_close(r["lat_tp"].float(), r["lat_one"].float(), **tol["ctx"])
        torch.testing.assert_close(r["out_tp"].float(), r["out_one"].float(), **tol["out"])
        torch.testing.assert_close(r["pool_tp"].float(), r["pool_one"].float(), **tol["ctx"])
        assert torch.isfinite(r["out_tp"]).all()
    _same_on_every_rank(results, ("ctx_tp", "lat_tp", "out_tp", "pool_tp"))


@pytest.mark.parametrize("mpi_pool_executor", [2, 4], indirect=True)
def test_unsplittable_fc_loads_unsplit(mpi_pool_executor):
    # F = 3 * 41 = 123 splits over neither 2 nor 4: the declaring drafter keeps the whole fc and the
    # unfused hidden_norm, so it projects exactly as one rank; the residual fusion still applies.
    results = run_on_ranks(mpi_pool_executor, _run_pair, "DSparkDrafter", {"target_hidden_size": 41},
                           "bfloat16", 5)
    for r in results:
        assert not r["plan"].fc_input_split and r["plan"].residual_norm_fusion
        assert "does not split" in r["plan"].reason
        assert r["fc_shape"] == (64, 123)
        assert r["ctx_calls"] == []
        assert torch.equal(r["ctx_tp"], r["ctx_one"]) and torch.equal(r["lat_tp"], r["lat_one"])
        assert r["block_calls"] == ["RESIDUAL_RMS_NORM"] * 4
        torch.testing.assert_close(r["out_tp"].float(), r["out_one"].float(), **TOL["bfloat16"]["out"])
    _same_on_every_rank(results, ("ctx_tp", "out_tp"))


@pytest.mark.parametrize("mpi_pool_executor", [2, 4], indirect=True)
def test_non_declaring_drafter_projects_as_one_rank(mpi_pool_executor):
    results = run_on_ranks(mpi_pool_executor, _run_pair, "DSparkDrafterNoFusion", {}, "bfloat16", 9)
    tp = len(results)
    for r in results:
        assert not r["plan"].fc_input_split and not r["plan"].residual_norm_fusion
        assert "declares no" in r["plan"].reason
        assert r["fc_shape"] == (64, 120)  # whole fc on every rank
        assert r["o_reduces"] and r["down_reduces"]
        assert r["ctx_calls"] == []
        # Unfused block: o_proj/down_proj reduce on their own (plain all-reduce), norms run after.
        assert r["block_calls"] == (["NONE"] * 4 if tp > 1 else [])
        assert torch.equal(r["ctx_tp"], r["ctx_one"]) and torch.equal(r["lat_tp"], r["lat_one"])
        torch.testing.assert_close(r["out_tp"].float(), r["out_one"].float(), **TOL["bfloat16"]["out"])
    _same_on_every_rank(results, ("ctx_tp", "out_tp"))
