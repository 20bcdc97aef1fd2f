"""Eager single-latent (MLA-style) block attention over the paged drafter context.

Every position stores ONE latent ``c [d_c]`` per drafter layer in the paged pool (shared by all heads);
keys and values are up-projected per head (``k = W_uk c``, ``v = W_uv c``) and RoPE is applied to q and k
at their absolute positions. A draft block of ``K`` positions attends to

* the request's context latents, positions ``0 .. ctx_len-1``, read through the cache's block table, and
* the block's own latents (stored first at the
  :class:`~tensorrt_llm_ext.contract.DraftBlockPlacement` pages/offsets by
  :func:`write_block_latents`; attention uses the computed values, so a position whose page is
  unallocated still attends correctly),

bidirectionally within the block and without a causal mask over the context. A dummy row
(``seq_lens == 0``) sees nothing and yields zeros (finite).

Fixed shapes only (context gathered up to ``max_pages * page_size``, masked by ``ctx_lens``): no host
sync, no data-dependent branch, so it can be captured in a CUDA graph. It is a reference, not a fast
kernel: it up-projects every gathered context latent each step.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.contract import DraftBlockPlacement, PagedLatentCache


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [...]`` int -> ``(cos, sin)`` fp32 ``[..., rotary_dim // 2]``."""
    if rotary_dim % 2 != 0:
        raise ValueError(f"rope_cos_sin: rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE in fp32. ``x [..., n_heads, D]``, ``cos/sin [..., D/2]`` -> fp32 ``x``."""
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def write_block_latents(pool_layer: torch.Tensor, placement: DraftBlockPlacement, latents: torch.Tensor) -> None:
    """Store the block's own latents at the placement: ``pool_layer[page_ids, page_offsets] = latents``.

    Args:
        pool_layer: ``[num_pages, page_size, d_c]``, one drafter layer of the pool (written in place).
        placement: ``page_ids`` / ``page_offsets`` ``[B, K]`` int32; ``page_ids < 0`` (unallocated page,
            dummy row) means "do not store".
        latents: ``[B, K, d_c]`` (cast to the pool dtype).

    Writes exactly the destinations with ``page_ids >= 0``, nothing else. CUDA-graph safe: no mask
    compaction; skipped entries are redirected to the first stored entry's destination with that
    entry's value (identical bits, so the duplicate index is harmless), or, when nothing is stored,
    to slot ``[0, 0]`` with its own current value.
    """
    num_pages, page_size, d_c = pool_layer.shape
    flat = pool_layer.view(num_pages * page_size, d_c)
    valid = (placement.page_ids >= 0).reshape(-1)
    dest = (placement.page_ids.long().clamp_min(0) * page_size + placement.page_offsets.long()).reshape(-1)
    vals = latents.reshape(-1, d_c).to(pool_layer.dtype)
    # index_select with a [1] index, never tensor[0-dim tensor] (that converts to a Python int: a host
    # sync, which fails under CUDA-graph capture).
    first = torch.argmax(valid.to(torch.int32)).view(1)  # first stored entry (0 if none)
    any_valid = valid.index_select(0, first)  # [1]
    sink_idx = torch.where(any_valid, dest.index_select(0, first), torch.zeros_like(first))  # [1]
    sink_val = torch.where(any_valid.unsqueeze(1), vals.index_select(0, first), flat[:1])  # [1, d_c]
    idx = torch.where(valid, dest, sink_idx)
    flat[idx] = torch.where(valid.unsqueeze(1), vals, sink_val)


def gather_context_latents(
    pool_layer: torch.Tensor, cache: PagedLatentCache, slot_ids: torch.Tensor, ctx_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather every request's context latents through the block table.

    Returns ``latents [B, P, d_c]`` (``P = max_pages * page_size``; position ``p`` of request ``b`` is
    ``pool[block_table[slot, p // page_size], p % page_size]``) and ``valid [B, P]`` (``p < ctx_len``).
    Unallocated (negative) table entries are read as page 0 and masked out.
    """
    page_size = cache.page_size
    table = cache.block_table[slot_ids.long()].long().clamp_min(0)  # [B, max_pages]
    b, max_pages = table.shape
    pos = torch.arange(max_pages * page_size, device=pool_layer.device)
    pages = table[:, pos // page_size]  # [B, P]
    latents = pool_layer[pages, (pos % page_size).expand(b, -1)]  # [B, P, d_c]
    valid = pos.unsqueeze(0) < ctx_lens.long().unsqueeze(1)
    return latents, valid


def masked_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B, K, h, D]``, ``k/v [B, S, h, D]``, ``valid [B, S]`` bool -> ``[B, K, h, D]`` fp32.

    Softmax in fp32 over the valid keys only; a row with no valid key returns zeros (never NaN).
    """
    scores = torch.einsum("bkhd,bshd->bhks", q.float(), k.float()) * scale
    mask = valid[:, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max) * mask
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("bhks,bshd->bkhd", p, v.float())


def single_latent_block_attention(
    q: torch.Tensor,
    block_latents: torch.Tensor,
    ctx_latents: torch.Tensor,
    ctx_valid: torch.Tensor,
    placement: DraftBlockPlacement,
    k_up_weight: torch.Tensor,
    v_up_weight: torch.Tensor,
    rope_theta: float,
    scale: float,
) -> torch.Tensor:
    """Attention of the block's queries over context + block latents.

    Args:
        q: ``[B, K, h, D]`` queries before RoPE (``h`` = this rank's heads).
        block_latents: ``[B, K, d_c]``, the block's latents (as stored at the placement).
        ctx_latents, ctx_valid: from :func:`gather_context_latents`, ``[B, P, d_c]`` / ``[B, P]``.
        placement: RoPE positions of the block (``positions``) and ``seq_lens`` (0 = dummy row).
        k_up_weight, v_up_weight: ``[h * D, d_c]`` per-head up-projections of this rank's heads.

    Returns ``[B, K, h, D]`` in ``q``'s dtype. Context keys take RoPE at their position index.
    """
    b, kk, h, d = q.shape
    p = ctx_latents.shape[1]
    ctx_pos = torch.arange(p, device=q.device).expand(b, p)
    lat = torch.cat((ctx_latents.to(q.dtype), block_latents.to(q.dtype)), dim=1)  # [B, P+K, d_c]
    pos = torch.cat((ctx_pos, placement.positions.long()), dim=1)  # [B, P+K]
    keys = torch.nn.functional.linear(lat, k_up_weight).view(b, p + kk, h, d)
    vals = torch.nn.functional.linear(lat, v_up_weight).view(b, p + kk, h, d)
    cos, sin = rope_cos_sin(pos, d, rope_theta)
    keys = apply_rope(keys, cos, sin)
    qcos, qsin = rope_cos_sin(placement.positions, d, rope_theta)
    qr = apply_rope(q, qcos, qsin)
    live = (placement.seq_lens > 0).unsqueeze(1)  # [B, 1]: a dummy row sees nothing
    valid = torch.cat((ctx_valid & live, live.expand(b, kk)), dim=1)
    return masked_softmax_attention(qr, keys, vals, valid, scale).to(q.dtype)
