"""The target's fused five-launch layer (``layer_kernels="fused"``) vs its unfused layer, end to end.

Runs the Triton kernels (the interpreter on a CPU): a prefill block, then decode and verify steps over the
cache it wrote, for a plain GQA Llama, a Qwen3-like target (q / k norms, q/k/v biases) and one with o_proj and
MLP biases. fp32 within ``2e-5`` (other summation orders in the products); the K/V pools likewise; the greedy
token of every row equal.
"""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm_ext.models.llama_target import (FUSED_MAX_LAYER_BYTES, FUSED_MAX_ROWS, LlamaTarget,
                                                  LlamaTargetConfig, layer_weight_bytes, picks_fused_layer)
from tensorrt_llm_ext.runtime.cuda_graph import graph_capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)

FAMILIES = {
    "llama": dict(num_heads=6, num_kv_heads=2, head_dim=8),
    "qwen3": dict(num_heads=4, num_kv_heads=4, head_dim=10, qkv_bias=True, qk_norm=True),
    "biases": dict(num_heads=8, num_kv_heads=1, head_dim=8, o_proj_bias=True, mlp_bias=True),
}


def _steps(m: LlamaTarget, kernels: str):
    m.layer_kernels = kernels
    g = torch.Generator().manual_seed(7)
    kv = m.make_kv_cache(3, 32, page_size=4)
    slots = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    outs = []
    prompt = torch.randint(0, m.vocab_size, (2, 9), generator=g).to(DEVICE)
    outs.append(m(prompt, torch.arange(9, device=DEVICE).expand(2, 9).contiguous(), slots, kv))
    for t in (1, 4):  # a decode step, then a verify block
        ids = torch.randint(0, m.vocab_size, (2, t), generator=g).to(DEVICE)
        pos = (9 + torch.arange(t, device=DEVICE)).expand(2, t).contiguous()
        outs.append(m(ids, pos, slots, kv))
    return outs, kv


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_layers_equal_unfused(family):
    cfg = LlamaTargetConfig(vocab_size=97, hidden_size=24, num_layers=2, intermediate_size=40, capture_layers=(0, 1),
                            **FAMILIES[family])
    m = LlamaTarget(cfg, device=DEVICE)
    m.init_weights(3)
    got, kv = _steps(m, "fused")
    want, kv_ref = _steps(m, "unfused")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.hidden_states, b.hidden_states, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(a.captured, b.captured, atol=2e-5, rtol=2e-5)
        assert torch.equal(m.logits(a.hidden_states).argmax(-1), m.logits(b.hidden_states).argmax(-1))
    torch.testing.assert_close(kv.k, kv_ref.k, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kv.v, kv_ref.v, atol=2e-5, rtol=2e-5)


def test_layer_kernel_choice():
    """auto: fused on CUDA at TP 1 up to FUSED_MAX_ROWS rows only; never on a CPU tensor unless forced."""
    m = LlamaTarget(LlamaTargetConfig())
    x = torch.zeros(1)
    assert m.layer_kernels == "auto" and not m._fused_layers(1, x)
    m.layer_kernels = "unfused"
    assert not m._fused_layers(1, x)
    m.layer_kernels = "fast"
    with pytest.raises(ValueError, match="layer_kernels"):
        m._fused_layers(1, x)
    if torch.cuda.is_available():
        m.layer_kernels = "auto"
        xc = x.cuda()
        assert m._fused_layers(FUSED_MAX_ROWS, xc) and not m._fused_layers(FUSED_MAX_ROWS + 1, xc)


def test_fused_layer_only_for_small_layers():
    """The auto rule takes the fused layer only for layers whose weights stream in microseconds: SmolLM2's
    (7 MB a layer) up to FUSED_MAX_ROWS rows at TP 1, never the 8B Llama shape's (436 MB, where cuBLAS measured
    faster at 1, 8 and 32 rows); the bytes are a layer's own parameters on one rank."""
    tiny = LlamaTarget(LlamaTargetConfig(), dtype=torch.bfloat16)
    own = sum(p.numel() * p.element_size() for p in tiny.layers[0].parameters())
    assert layer_weight_bytes(tiny.config, torch.bfloat16) == own
    smollm2 = LlamaTargetConfig(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                head_dim=64, intermediate_size=1536)
    llama8b = LlamaTargetConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                head_dim=128, intermediate_size=14336)
    small, large = layer_weight_bytes(smollm2, torch.bfloat16), layer_weight_bytes(llama8b, torch.bfloat16)
    assert small < FUSED_MAX_LAYER_BYTES < large
    assert layer_weight_bytes(llama8b, torch.bfloat16, tp_size=4) == large // 4
    assert picks_fused_layer(1, small, 1) and picks_fused_layer(FUSED_MAX_ROWS, small, 1)
    assert not picks_fused_layer(FUSED_MAX_ROWS + 1, small, 1) and not picks_fused_layer(1, small, 2)
    assert not any(picks_fused_layer(rows, large, 1) for rows in (1, 8, FUSED_MAX_ROWS))


def test_programmatic_launch_switch_and_bits():
    """Programmatic dependent launch (PDL) is off on a CPU tensor (the interpreter has no griddepcontrol) and
    follows its switch; on a Hopper GPU the fused forward under CUDA-graph replay (replayed three times: a read
    of a value the previous kernel has not written yet would show) gives the same hidden states and K/V with it
    on and off, within a bf16 rounding."""
    from tensorrt_llm_ext.kernels.common import programmatic_launch, set_programmatic_launch

    assert not programmatic_launch(torch.zeros(1))
    prev = set_programmatic_launch(False)
    try:
        assert set_programmatic_launch(True) is False
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
            return
        assert programmatic_launch(torch.zeros(1, device="cuda"))
        cfg = LlamaTargetConfig(vocab_size=97, hidden_size=64, num_layers=3, intermediate_size=96,
                                capture_layers=(0, 2), num_heads=6, num_kv_heads=2, head_dim=16)
        m = LlamaTarget(cfg, device=DEVICE, dtype=torch.bfloat16)
        m.init_weights(5)
        kv = m.make_kv_cache(3, 256, page_size=16)
        slots = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, 97, (2, 150), generator=g).to(DEVICE)
        m(prompt, torch.arange(150, device=DEVICE).expand(2, 150).contiguous(), slots, kv)
        ids = torch.randint(0, 97, (2, 1), generator=g).to(DEVICE)
        pos = torch.full((2, 1), 150, device=DEVICE)
        outs = {}
        for on in (False, True):
            set_programmatic_launch(on)
            m(ids, pos, slots, kv)  # warm-up (compile) outside the capture
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph):
                out = m(ids, pos, slots, kv)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            outs[on] = (out.hidden_states.clone(), kv.k.clone())
        # The same products in the same order either way (the first K block is peeled, not reordered): equal up to
        # at most a bf16 rounding of a value.
        for got, want in zip(outs[True], outs[False]):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    finally:
        set_programmatic_launch(prev)
