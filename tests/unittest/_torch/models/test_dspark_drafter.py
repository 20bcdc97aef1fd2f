"""Single-rank checks of the reference DSpark drafter (its modules: tests/unittest/_torch/modules/).

The paged block decode is compared against an independent dense eager computation written here from
the full state dict (per-request loops, contiguous context), so a wrong page/offset, mask or RoPE
position in the paged path shows. Tolerances: fp32 ``1e-5`` (same math, different op order); bf16
``atol=rtol=3e-2`` (a few bf16 ulps of O(1) normed outputs after two layers).
"""

from __future__ import annotations

import math

import pytest
import torch

from tensorrt_llm_ext._env import ENV
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.models import (DSparkDrafter, DSparkDrafterConfig, DSparkDrafterNoFusion, full_weight_shapes,
                                     generate_full_state_dict, resolve_drafter_tp_plan)
from tensorrt_llm_ext.modules.attention import resolve_block_attention
from tensorrt_llm_ext.contract import DraftBlockPlacement, DrafterBlockInputs, DrafterTPFusions, PagedLatentCache
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

CFG = DSparkDrafterConfig()
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def make_block_inputs(cfg, dtype, k=4, page_size=4, max_pages=4, seed=1):
    """A paged scenario: 3 requests (ctx 9, ctx 0, ctx 5) + 1 dummy row, permuted physical pages,
    unallocated (-1) table tails (one block position without a page), a random (stale) pool so that
    unmasked garbage would show."""
    g = torch.Generator().manual_seed(seed)
    num_slots = 5
    num_pages = num_slots * max_pages
    pool = torch.randn(cfg.num_layers, num_pages, page_size, cfg.latent_dim, generator=g).to(dtype)
    perm = torch.randperm(num_pages, generator=g).view(num_slots, max_pages).to(torch.int32)
    block_table = perm.clone()
    block_table[1, 2:] = -1  # slot 1 (ctx 0) needs one page
    block_table[0, 2:] = -1  # slot 0 (ctx 5): the block's last position (8) has no page -> not stored
    slot_ids = torch.tensor([3, 1, 0, 4], dtype=torch.int32)
    ctx_lens = torch.tensor([9, 0, 5, 0], dtype=torch.int32)
    seq_lens = torch.tensor([9 + k, k, 5 + k, 0], dtype=torch.int32)  # row 3: CUDA-graph dummy
    positions = (ctx_lens.long().unsqueeze(1) + torch.arange(k)).to(torch.int32)
    rows = block_table[slot_ids.long()].long()
    page_ids = torch.gather(rows, 1, positions.long() // page_size).to(torch.int32)
    page_ids[3] = -1  # a dummy row stores nothing (the worker's placement convention)
    page_offsets = (positions % page_size).to(torch.int32)
    ids = torch.randint(0, cfg.vocab_size, (4, k), generator=g)
    ids[:, 1:] = cfg.mask_token_id
    placement = DraftBlockPlacement(positions, page_ids, page_offsets, ctx_lens, seq_lens)
    return DrafterBlockInputs(ids, slot_ids, placement, PagedLatentCache(pool, block_table))


def _norm(x, w, eps):
    x = x.float()
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def dense_reference(sd, cfg, inputs):
    """fp32 dense twin of forward_block: per request, context latents copied out of the pages into a
    contiguous [ctx_len, d_c] tensor, full attention over [context; block]. Returns (hidden, block_latents)."""
    sd = {n: t.float() for n, t in sd.items()}
    pl, cache = inputs.placement, inputs.cache
    ps = cache.page_size
    b, k = inputs.block_input_ids.shape
    nh, d, d_c, eps = cfg.num_heads, cfg.head_dim, cfg.latent_dim, cfg.rms_norm_eps
    h = sd["embed_tokens.weight"][inputs.block_input_ids]
    out = torch.zeros(b, k, cfg.hidden_size)
    blk_lat = torch.zeros(cfg.num_layers, b, k, d_c)
    for r in range(b):
        res = h[r]
        x = _norm(res, sd["layers.0.input_layernorm.weight"], eps)
        n_ctx = int(pl.ctx_lens[r])
        live = int(pl.seq_lens[r]) > 0
        slot = int(inputs.slot_ids[r])
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            w_a = sd["kv_a_proj.weight"][i * d_c:(i + 1) * d_c]
            lat_blk = x @ w_a.T
            blk_lat[i, r] = lat_blk
            ctx = torch.stack([cache.pool[i, int(cache.block_table[slot, t // ps]), t % ps].float()
                               for t in range(n_ctx)]) if n_ctx else torch.zeros(0, d_c)
            lat = torch.cat((ctx, lat_blk))
            pos = torch.cat((torch.arange(n_ctx), pl.positions[r].long()))
            kk = _rope((lat @ sd[p + "self_attn.k_up_proj.weight"].T).view(-1, nh, d), pos, cfg.rope_theta)
            vv = (lat @ sd[p + "self_attn.v_up_proj.weight"].T).view(-1, nh, d)
            q = _rope((x @ sd[p + "self_attn.q_proj.weight"].T).view(k, nh, d), pl.positions[r].long(),
                      cfg.rope_theta)
            if live:
                att = torch.softmax(torch.einsum("khd,shd->hks", q, kk) / math.sqrt(d), -1)
                o = torch.einsum("hks,shd->khd", att, vv).reshape(k, nh * d)
            else:
                o = torch.zeros(k, nh * d)
            res = res + o @ sd[p + "self_attn.o_proj.weight"].T
            x = _norm(res, sd[p + "post_attention_layernorm.weight"], eps)
            m = torch.nn.functional.silu(x @ sd[p + "mlp.gate_proj.weight"].T) * (x @ sd[p + "mlp.up_proj.weight"].T)
            res = res + m @ sd[p + "mlp.down_proj.weight"].T
            nxt = f"layers.{i + 1}.input_layernorm.weight" if i + 1 < cfg.num_layers else "norm.weight"
            x = _norm(res, sd[nxt], eps)
        out[r] = x
    return out, blk_lat


def test_deterministic_init_and_state_dict_round_trip():
    a, b = DSparkDrafter(CFG), DSparkDrafter(CFG)
    a.init_weights(7)
    b.init_weights(7)
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(full_weight_shapes(CFG))
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    c = DSparkDrafter(CFG)
    c.init_weights(8)
    assert not torch.equal(c.state_dict()["fc.weight"], sa["fc.weight"])
    # full state dict -> drafter -> state dict is the identity at tp 1
    full = generate_full_state_dict(CFG, 7)
    d = DSparkDrafter(CFG)
    d.load_full_state_dict({n: t.clone() for n, t in full.items()})
    assert all(torch.equal(d.state_dict()[n], full[n]) for n in full)
    # the same full weights sliced at tp 2: rank slices concatenate back to the full tensors
    r0, r1 = (DSparkDrafter(CFG, Mapping(world_size=2, rank=r, tp_size=2)) for r in (0, 1))
    r0.init_weights(7)
    r1.init_weights(7)
    assert torch.equal(torch.cat((r0.fc.weight, r1.fc.weight), 1), full["fc.weight"])
    q = "layers.1.self_attn.q_proj.weight"
    assert torch.equal(torch.cat((r0.state_dict()[q], r1.state_dict()[q]), 0), full[q])
    dn = "layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat((r0.state_dict()[dn], r1.state_dict()[dn]), 1), full[dn])
    with pytest.raises(ValueError, match="missing"):
        d.load_full_state_dict({n: t for n, t in full.items() if n != "norm.weight"})
    bad = dict(full)
    bad["fc.weight"] = full["fc.weight"][:, :-1]
    with pytest.raises(ValueError, match="fc.weight"):
        d.load_full_state_dict(bad)


def _to_device(inputs, device):
    pl, c = inputs.placement, inputs.cache
    return DrafterBlockInputs(inputs.block_input_ids.to(device), inputs.slot_ids.to(device),
                              DraftBlockPlacement(*(t.to(device) for t in (pl.positions, pl.page_ids, pl.page_offsets,
                                                                            pl.ctx_lens, pl.seq_lens))),
                              PagedLatentCache(c.pool.to(device), c.block_table.to(device)))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("backend", ["fused", "eager"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_block_decode_matches_dense_attention(dtype, device, backend):
    if backend == "fused" and device == "cpu" and torch.cuda.is_available():
        pytest.skip("Triton takes CPU tensors only under the interpreter (CPU machines)")
    drafter = DSparkDrafter(CFG, dtype=dtype, device=device, attention_backend=backend)
    assert drafter.attention_backend == backend
    drafter.init_weights(3)
    dev_inputs = _to_device(make_block_inputs(CFG, dtype), device)
    pool_before = dev_inputs.cache.pool.clone().cpu()
    out = drafter.forward_block(dev_inputs).cpu()
    inputs = _to_device(dev_inputs, "cpu")
    ref, blk_lat = dense_reference(generate_full_state_dict(CFG, 3, dtype), CFG, inputs)
    assert out.shape == (4, 4, CFG.hidden_size) and out.dtype == dtype
    assert torch.isfinite(out).all()
    live = inputs.placement.seq_lens > 0
    torch.testing.assert_close(out[live].float(), ref[live], **TOL[dtype])
    torch.testing.assert_close(out[~live].float(), ref[~live], **TOL[dtype])  # dummy row: no attention
    # The block latents were written at the placement, and nothing else in the pool changed.
    pl, pool = inputs.placement, inputs.cache.pool
    stored = pl.page_ids >= 0
    assert not stored.all() and stored.any()
    written = torch.zeros(pool.shape[:3], dtype=torch.bool)
    written[:, pl.page_ids[stored].long(), pl.page_offsets[stored].long()] = True
    assert torch.equal(pool[~written], pool_before[~written])
    torch.testing.assert_close(pool[:, pl.page_ids[stored].long(), pl.page_offsets[stored].long()].float(),
                               blk_lat[:, stored], **TOL[dtype])


@CUDA
@pytest.mark.parametrize("backend", ["fused", "eager"])
def test_forward_block_cuda_graph_replay(backend):
    """The block decode captures into a CUDA graph (no host sync, no escaping allocation) and the
    replay reproduces the eager output and pool writes (same kernels; bf16 tolerance 1e-2)."""
    drafter = DSparkDrafter(CFG, dtype=torch.bfloat16, device="cuda", attention_backend=backend)
    drafter.init_weights(4)
    inputs = _to_device(make_block_inputs(CFG, torch.bfloat16), "cuda")
    pool0 = inputs.cache.pool.clone()
    eager = drafter.forward_block(inputs).clone()
    eager_pool = inputs.cache.pool.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        drafter.forward_block(inputs)  # warm-up: Triton compile, cuBLAS handles
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        out = drafter.forward_block(inputs)
    inputs.cache.pool.copy_(pool0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(inputs.cache.pool, eager_pool, atol=1e-2, rtol=1e-2)
    assert torch.isfinite(out).all()


def test_context_latents_one_gemm_and_project():
    drafter = DSparkDrafter(CFG, dtype=torch.float32)
    drafter.init_weights(5)
    sd = generate_full_state_dict(CFG, 5, torch.float32)
    feats = torch.randn(7, CFG.fc_in_features, generator=torch.Generator().manual_seed(0))
    ctx = _norm(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"], CFG.rms_norm_eps)
    torch.testing.assert_close(drafter.project_context(feats), ctx, **TOL[torch.float32])
    lat = drafter.compute_context_latents(feats)
    assert lat.shape == (7, CFG.num_layers, CFG.latent_dim)
    for i in range(CFG.num_layers):
        w = sd["kv_a_proj.weight"][i * CFG.latent_dim:(i + 1) * CFG.latent_dim]
        torch.testing.assert_close(lat[:, i], ctx @ w.T, **TOL[torch.float32])
    with pytest.raises(ValueError, match="features"):
        drafter.project_context(feats[:, 1:])


def test_dummy_rows_only_are_finite():
    drafter = DSparkDrafter(CFG)  # auto: the fused kernel on CPU under the interpreter
    drafter.init_weights(0)
    inputs = make_block_inputs(CFG, torch.bfloat16)
    pl = inputs.placement
    zero = torch.zeros_like(pl.seq_lens)
    dummy = DrafterBlockInputs(inputs.block_input_ids, inputs.slot_ids,
                               DraftBlockPlacement(pl.positions, pl.page_ids, pl.page_offsets, zero, zero),
                               inputs.cache)
    assert torch.isfinite(drafter.forward_block(dummy)).all()


def test_tp_plan_resolution():
    plan = DSparkDrafter(CFG).tp_plan
    assert not plan.fc_input_split and not plan.residual_norm_fusion and "tp_size=1" in plan.reason
    declared = DSparkDrafter.tp_fusions
    assert declared == DrafterTPFusions(fc_input_split=True, residual_norm_fusion=True)
    m2 = Mapping(world_size=2, rank=1, tp_size=2)
    p = resolve_drafter_tp_plan(declared, m2, 120)
    assert p.fc_input_split and p.residual_norm_fusion
    p = resolve_drafter_tp_plan(declared, m2, 123)
    assert not p.fc_input_split and p.residual_norm_fusion and "does not split" in p.reason
    p = resolve_drafter_tp_plan(declared, Mapping(world_size=2, rank=0, tp_size=2, enable_attention_dp=True), 120)
    assert not p.fc_input_split and not p.residual_norm_fusion and "attention DP" in p.reason
    p = resolve_drafter_tp_plan(DSparkDrafterNoFusion.tp_fusions, m2, 120)
    assert not p.fc_input_split and not p.residual_norm_fusion and "declares no" in p.reason
    # Built under a TP mapping (no collective needed to build): per-rank fc weight is 1/tp.
    m4 = Mapping(world_size=4, rank=2, tp_size=4)
    d = DSparkDrafter(CFG, m4)
    assert d.tp_plan.fc_input_split and tuple(d.fc.weight.shape) == (CFG.hidden_size, CFG.fc_in_features // 4)
    assert tuple(DSparkDrafterNoFusion(CFG, m4).fc.weight.shape) == (CFG.hidden_size, CFG.fc_in_features)
    odd = DSparkDrafterConfig(target_hidden_size=41)
    assert tuple(DSparkDrafter(odd, m4).fc.weight.shape) == (CFG.hidden_size, 123)


def test_markov_head_weights_sharding():
    full = generate_full_state_dict(CFG, 2)
    whole = DSparkDrafter(CFG)
    whole.load_full_state_dict(full)
    mw = whole.markov_head_weights()
    assert torch.equal(mw.markov_w2, full["markov_w2"]) and mw.vocab_start == 0 and mw.rank == CFG.markov_rank
    v_local = -(-CFG.vocab_size // 4)  # 1031 over tp 4: padded to 1032, 258 rows per rank
    parts = []
    for r in range(4):
        d = DSparkDrafter(CFG, Mapping(world_size=4, rank=r, tp_size=4))
        d.load_full_state_dict(full)
        w = d.markov_head_weights()
        assert w.markov_w2.shape == (v_local, CFG.markov_rank) and w.vocab_start == r * v_local
        assert torch.equal(w.markov_w1, full["markov_w1"]) and w.vocab_size == CFG.vocab_size
        parts.append(w.markov_w2)
        assert torch.equal(d.markov_head_weights(vocab_parallel=False).markov_w2, full["markov_w2"])
    cat = torch.cat(parts)
    assert torch.equal(cat[: CFG.vocab_size], full["markov_w2"]) and not cat[CFG.vocab_size:].any()


def test_lm_head_is_taken_over_not_owned():
    d = DSparkDrafter(CFG)
    with pytest.raises(RuntimeError, match="take_over_lm_head"):
        _ = d.lm_head
    head = torch.nn.Linear(CFG.hidden_size, CFG.vocab_size, bias=False)
    d.take_over_lm_head(head)
    assert d.lm_head is head
    assert not any(n.startswith("_lm_head") for n in d.state_dict())


def test_unsplit_fc_plan_logged_once(caplog):
    # A width no other test uses, so the once-per-process key is fresh.
    cfg = DSparkDrafterConfig(target_hidden_size=43, num_capture_layers=1)
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        for r in range(2):
            DSparkDrafter(cfg, Mapping(world_size=2, rank=r, tp_size=2))
    msgs = [rec.getMessage() for rec in caplog.records if "does not split" in rec.getMessage()]
    assert len(msgs) == 1 and "43" in msgs[0]


def test_block_attention_backend_resolution(caplog):
    # "auto" on CPU: the fused kernel under the interpreter (CPU machines), else the eager twin.
    cpu_auto = "fused" if ENV.triton_interpret else "eager"
    assert resolve_block_attention("auto", "cpu", "t-auto")[0] == cpu_auto
    assert resolve_block_attention("eager", "cpu", "t-eager")[0] == "eager"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_block_attention("flash", "cpu")
    with caplog.at_level("INFO", logger="tensorrt_llm_ext"):
        for _ in range(2):
            resolve_block_attention("auto", "cpu", "t-logged-once")
    msgs = [r.getMessage() for r in caplog.records if "t-logged-once block attention" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].startswith(f"t-logged-once block attention: {cpu_auto} (")
    d = DSparkDrafter(CFG, attention_backend="eager")
    assert d.attention_backend == "eager"
    d.set_attention_backend("auto")
    assert d.attention_backend == cpu_auto


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(
    not ENV.triton_interpret or torch.cuda.is_available(), reason="CPU Triton needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=CUDA)])
def test_fused_layers_match_eager_twin(device):
    """The fused layer path (five small-M launches per layer + the attention; fc then norm + kv_a) against the
    unfused path of the same drafter: the same roundings, another product order -- fp32 within 1e-5, bf16 (CUDA)
    within the bf16 tolerance; the pool writes likewise, nothing else written. On CUDA a graph replay of the fused
    block decode equals its eager run bit for bit. A reload rebuilds the cached concatenated weights."""
    cfg = DSparkDrafterConfig(num_layers=1) if device == "cpu" else CFG  # one layer: cheap under the interpreter
    with pytest.raises(ValueError, match="layer_backend"):
        DSparkDrafter(cfg, layer_backend="cublas")
    with pytest.raises(ValueError, match="one TP rank"):
        DSparkDrafter(cfg, Mapping(world_size=2, rank=0, tp_size=2), layer_backend="fused")
    assert DSparkDrafter(cfg, Mapping(world_size=2, rank=0, tp_size=2), device=device).layer_backend == "eager"
    for dtype in ([torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]):
        fused = DSparkDrafter(cfg, dtype=dtype, device=device, layer_backend="fused")
        eager = DSparkDrafter(cfg, dtype=dtype, device=device, layer_backend="eager")
        fused.init_weights(6)
        eager.init_weights(6)
        a, b = _to_device(make_block_inputs(cfg, dtype), device), _to_device(make_block_inputs(cfg, dtype), device)
        pool0 = a.cache.pool.clone()
        out_f, out_e = fused.forward_block(a), eager.forward_block(b)
        torch.testing.assert_close(out_f.float(), out_e.float(), **TOL[dtype])
        torch.testing.assert_close(a.cache.pool.float(), b.cache.pool.float(), **TOL[dtype])
        changed = (a.cache.pool != pool0).any(-1)
        assert torch.equal(changed, (b.cache.pool != pool0).any(-1)) and changed.any()
        feats = torch.randn(9, cfg.fc_in_features, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
        torch.testing.assert_close(fused.compute_context_latents(feats).float(),
                                   eager.compute_context_latents(feats).float(), **TOL[dtype])
        if device == "cuda":
            a.cache.pool.copy_(pool0)
            fused.forward_block(a)  # warm-up outside capture (compile, concatenated weights)
            ref, ref_pool = fused.forward_block(a).clone(), a.cache.pool.clone()
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph):
                out = fused.forward_block(a)
            a.cache.pool.copy_(pool0)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref) and torch.equal(a.cache.pool, ref_pool)
    w_qc = fused._layer_weights()[0][0]
    before = w_qc.clone()
    fused.init_weights(7)  # a reload: the concatenation is refreshed in place (what a captured graph reads)
    assert fused._layer_weights()[0][0] is w_qc and not torch.equal(w_qc, before)
    assert torch.equal(w_qc[:w_qc.shape[0] - cfg.latent_dim], fused.layers[0].self_attn.q_proj.weight)
    assert torch.equal(w_qc[w_qc.shape[0] - cfg.latent_dim:], fused.kv_a_proj.weight[:cfg.latent_dim])
