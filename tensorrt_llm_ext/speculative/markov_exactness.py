"""Load-time exactness guard of the ``exact`` Markov mode on a vocab shard.

On a shard, the exact chain projects ``bias = h @ markov_w2[shard].T`` (``torch.mm``, the GEMM
``F.linear`` runs). It equals the single-rank chain bit for bit only if the GEMM library computes the
sliced product exactly as the corresponding columns of the full ``F.linear(h, markov_w2)`` -- cuBLAS
picks other kernels (another split of the reduction) for some widths and batch sizes, so that is a
property of this GPU, library and shape, not of the code. This guard measures it once after load, on
the real weights, at every batch size up to ``max_batch_size`` at which the chain would run the exact
kernels (mismatches accumulate on the device; one host read at the end), agrees the result across the
TP ranks and, if any rank differs at any size, runs the chain in the ``fused`` mode (TP-invariant by
construction) with one log line on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from tensorrt_llm_ext.distributed.agree import agree_codes
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping

__all__ = ["first_inexact_batch_size", "resolve_markov_mode"]


def _probe_rows(markov_w1: torch.Tensor, n: int) -> torch.Tensor:
    """``[n, r]`` real ``markov_w1`` rows, spread over the vocabulary (deterministic)."""
    v = markov_w1.shape[0]
    ids = (torch.arange(n, device=markov_w1.device, dtype=torch.int64) * 7919 + 13) % v
    return markov_w1.index_select(0, ids)


def first_inexact_batch_size(markov_w1: torch.Tensor, full_w2: torch.Tensor, shard_w2: torch.Tensor,
                             vocab_start: int, vocab_size: int, batch_sizes: Iterable[int]) -> int:
    """The smallest of ``batch_sizes`` at which the shard's projection differs bitwise from the full
    one's columns, or 0 if none does.

    ``full_w2 [V, r]`` is what a single rank projects (the eager chain's ``F.linear``); ``shard_w2
    [V_local, r]`` this rank's rows from global id ``vocab_start`` (padded rows past ``vocab_size`` are
    not compared: they never win). The shard side runs exactly as the exact mode does (``torch.mm``
    into the prefix rows of a ``[max(batch_sizes), V_local]`` workspace). Syncs once, at the end.
    """
    sizes = sorted(set(batch_sizes))
    v_local = shard_w2.shape[0]
    valid = max(0, min(v_local, vocab_size - vocab_start))
    if valid == 0 or not sizes:
        return 0
    top = sizes[-1]
    h_all = _probe_rows(markov_w1, top)
    bias = torch.empty((top, v_local), dtype=shard_w2.dtype, device=shard_w2.device)
    int_view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[shard_w2.element_size()]
    bad = torch.zeros(len(sizes), dtype=torch.bool, device=shard_w2.device)
    for i, b in enumerate(sizes):
        h = h_all[:b]
        torch.mm(h, shard_w2.t(), out=bias[:b])
        ref = F.linear(h, full_w2)[:, vocab_start:vocab_start + valid]
        # Bitwise: NaN payloads and -0.0 count, as they do for the tokens downstream.
        bad[i] = (bias[:b, :valid].view(int_view) != ref.view(int_view)).any()
    hits = bad.nonzero()  # the one host sync
    return sizes[int(hits[0, 0])] if hits.numel() else 0


def resolve_markov_mode(mode: str, mapping: Mapping, markov_w1: torch.Tensor, full_w2: torch.Tensor,
                        shard_w2: torch.Tensor, vocab_start: int, vocab_size: int,
                        exact_batch_sizes: Iterable[int]) -> str:
    """The Markov chain mode to run on a vocab shard: ``mode``, or ``"fused"`` when the exact mode would
    not be bitwise the single-rank chain at one of ``exact_batch_sizes`` on some rank.

    ``exact_batch_sizes``: the batch sizes at which ``mode`` runs the exact kernels (every size for
    ``"exact"``; for ``"auto"`` the sizes its table maps to ``"exact"``); it must be the same on every
    rank. With none (``"fused"``, or ``"auto"`` whose sizes all run fused) nothing is checked and nothing is
    exchanged; otherwise call on every TP rank (one agreement over the CPU group).
    """
    sizes = sorted(set(exact_batch_sizes))
    if mode == "fused" or not sizes:
        return mode
    first_bad = first_inexact_batch_size(markov_w1, full_w2, shard_w2, vocab_start, vocab_size, sizes)
    codes = agree_codes(mapping, first_bad)
    failing = [(rank, b) for rank, b in enumerate(codes) if b]
    if not failing:
        return mode
    rank, b = failing[0]
    logger.warning(f"Markov chain: mode {mode!r} is not bitwise TP-exact here (the sliced markov_w2 projection "
                   f"differs from the full one at batch size {b} on tp rank {rank}; {len(failing)} of "
                   f"{mapping.tp_size} ranks differ); using mode 'fused'")
    return "fused"
