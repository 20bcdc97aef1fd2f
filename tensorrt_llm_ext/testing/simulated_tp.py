"""Verification at TP 1..N simulated in one process: every rank's kernels on its own shard, the exchanges done
in place between the ranks' buffers (lockstep), so kernel-vs-kernel TP invariance is testable on one device
and under the interpreter without a process group.

The verification entry points are generators of their exchange points (``(op, buffer, out)`` with op
``max`` / ``sum`` / ``gather``); a real call issues each on its ``PairExchange``, this driver applies it
across the simulated ranks' buffers.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.mapping import vocab_shards
from tensorrt_llm_ext.speculative import verification as vf

__all__ = ["shard", "simulated_rejection_sample", "simulated_top_p_keep"]


def shard(x: torch.Tensor, tp: int, rank: int, vocab: int, pad_value: float = float("nan"),
          width: int | None = None, rule: str = "aligned") -> tuple[torch.Tensor, int]:
    """Rank ``rank``'s shard of ``x [..., V]`` at TP ``tp``: ``width`` columns (default: the LM head's split,
    :func:`~tensorrt_llm_ext.mapping.vocab_shards` under ``rule``: ``"aligned"`` or ``"ceil"``), rank ``r``
    owning ids ``[r width, (r + 1) width)``, padded past ``V`` with ``pad_value`` (never read as a token); returns
    ``(shard, vocab_start)``."""
    width = vocab_shards(vocab, tp, rule).width if width is None else width
    if width * tp < vocab:
        raise ValueError(f"width: expected >= ceil({vocab} / {tp}), got {width}")
    start = rank * width
    out = torch.full((*x.shape[:-1], width), pad_value, dtype=x.dtype, device=x.device)
    n = max(0, min(width, vocab - start))
    out[..., :n] = x[..., start:start + n]
    return out.contiguous(), start


def _lockstep(gens: list) -> list:
    """Run the ranks' pipeline generators together, applying each exchange point across their buffers."""
    results: list = [None] * len(gens)
    steps = []
    for g in gens:
        steps.append(next(g, None))
    while True:
        live = [s is not None for s in steps]
        if not any(live):
            break
        ops = {s[0] for s in steps if s is not None}
        if not all(live) or len(ops) != 1:
            raise RuntimeError(f"simulated ranks out of step: {steps}")
        op = ops.pop()
        bufs = [s[1] for s in steps]
        if op == "max":
            red = torch.stack(bufs).amax(0)
            for b in bufs:
                b.copy_(red)
        elif op == "sum":
            red = torch.stack(bufs).sum(0)
            for b in bufs:
                b.copy_(red)
        else:
            stacked = torch.stack(bufs)
            for s in steps:
                s[2].copy_(stacked)
        for i, g in enumerate(gens):
            try:
                steps[i] = next(g)
            except StopIteration as stop:
                results[i] = stop.value
                steps[i] = None
    return results


def _finish(gens: list) -> list:
    """Drive generators that have no exchange point (tp 1) or the lockstep driver (tp > 1)."""
    out = []
    if len(gens) == 1:
        g = gens[0]
        while True:
            try:
                next(g)
            except StopIteration as stop:
                out.append(stop.value)
                return out
    return _lockstep(gens)


def simulated_rejection_sample(target, draft, tokens, *, tp: int, vocab: int, fused: bool = True,
                               block_size: int = 256, num_splits: int = 2, width: int | None = None,
                               pad_value: float = float("nan"), **kw):
    """``rejection_sample`` of full-vocabulary inputs run as ``tp`` simulated ranks (shards as :func:`shard`);
    returns every rank's ``(accepted, num_accepted)``. ``kw``: temperatures, seeds, offsets, top_p."""
    ops = vf._FUSED_KERNELS if fused else vf._EAGER_KERNELS
    b, k1, _ = target.shape
    gens = []
    for rank in range(tp):
        t, start = shard(target, tp, rank, vocab, pad_value, width)
        d, _ = shard(draft, tp, rank, vocab, pad_value, width)
        ws = vf.VerificationWorkspace.for_verification(b, k1 - 1, t.shape[-1], tp=tp, device=target.device,
                                                       block_size=block_size, num_splits=num_splits)
        gens.append(vf._rejection_sample_steps(ops, t, d, tokens, kw["temperatures"], kw["seeds"], kw["offsets"],
                                               kw.get("top_p"), start, vocab, tp, rank, None, ws))
    return _finish(gens)


def simulated_top_p_keep(logits, top_p, *, temperatures, tp: int, vocab: int, fused: bool = True,
                         block_size: int = 256, num_splits: int = 2, width: int | None = None,
                         pad_value: float = float("nan")) -> torch.Tensor:
    """``top_p_keep`` of full-vocabulary ``logits [R, V]`` run as ``tp`` simulated ranks; returns the kept set
    ``[R, V]`` assembled from the ranks' shards."""
    ops = vf._FUSED_KERNELS if fused else vf._EAGER_KERNELS
    gens = []
    for rank in range(tp):
        x, start = shard(logits, tp, rank, vocab, pad_value, width)
        ws = vf.VerificationWorkspace(x.shape[0], 0, 0, x.shape[1], tp=tp, device=logits.device,
                                      block_size=block_size, num_splits=num_splits)
        gens.append(vf._top_p_keep_steps(ops, x, top_p, temperatures, start, vocab, tp, rank, None, ws))
    masks = _finish(gens)
    return torch.cat(masks, dim=-1)[:, :vocab]
