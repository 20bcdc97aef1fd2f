"""Inputs and comparisons shared by the Markov-chain tests (full vocabulary, shards, folded exact mode)."""

from __future__ import annotations

import torch


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN payloads aside (torch's CPU and CUDA casts canonicalize NaN differently)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    ia = a.masked_fill(na, 0).view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.masked_fill(nb, 0).view(torch.int16 if b.element_size() == 2 else torch.int32)
    return torch.equal(ia, ib)


def markov_inputs(B: int, K: int, V: int, r: int, wdt: torch.dtype, ldt: torch.dtype, *, seed: int = 0,
                  scale: float = 0.3, device="cpu"):
    """``(base [B, K, V] ldt, anchors [B], markov_w1 [V, r] wdt, markov_w2 [V, r] wdt)``, seeded."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, K, V, generator=g).to(ldt)
    w1 = (torch.randn(V, r, generator=g) * scale).to(wdt)
    w2 = (torch.randn(V, r, generator=g) * scale).to(wdt)
    anchors = torch.randint(0, V, (B,), generator=g)
    return base.to(device), anchors.to(device), w1.to(device), w2.to(device)


def sampling_inputs(B: int, *, seed: int = 7, device="cpu"):
    """``(temperatures, seeds, offsets)`` for keyed sampling, every third row greedy (T = 0)."""
    g = torch.Generator().manual_seed(seed)
    temps = torch.rand(B, generator=g) * 1.5 + 0.3
    temps[::3] = 0.0
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    offsets = torch.randint(0, 2**40, (B,), generator=g)
    return temps.to(device), seeds.to(device), offsets.to(device)
