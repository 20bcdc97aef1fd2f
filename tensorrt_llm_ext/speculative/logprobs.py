"""Log-probabilities of emitted tokens (the OpenAI ``logprobs`` / ``top_logprobs`` fields), on shards or full rows.

A row with ``T <= 0`` reports the model's own distribution, ``log_softmax(logits)`` (temperature 1, no
top-p): what serving reports for every request (vLLM's default ``logprobs_mode``, ``raw_logprobs``; the engine
passes ``T = 0`` rows). A row with ``T > 0`` reports ``softmax(logits / T)`` restricted to its exact top-p set
(the same :func:`~tensorrt_llm_ext.speculative.verification.top_p_keep` the selection uses) and renormalised
over it: the sampling distribution before any other processing field.

With a vocab-parallel head each rank holds ``[R, V_shard]``: the log-sum-exp is one all-reduce MAX and one
all-reduce SUM of ``[R]`` fp32, the emitted token's value one all-reduce SUM of ``[R]`` (only its owner
adds a non-zero term), and the top ``k`` candidates one all-gather of ``[R, k]`` values and ids -- nothing
proportional to the vocabulary crosses ranks. Torch ops only (eager; called after a step, not captured).

Example::

    lp = token_logprobs(logits, tokens, temperatures, top_p, k=5)   # full rows, one rank
    lp.chosen[i], lp.top_ids[i, :5], lp.top_values[i, :5]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tensorrt_llm_ext.distributed import allgather, tp_group
from tensorrt_llm_ext.speculative.vocab_parallel import VocabParallelHead

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """Per row: the emitted token's log-probability and the ``k`` most likely tokens (value descending,
    ties to the lowest id). ``chosen [R]`` fp32, ``top_values [R, k]`` fp32, ``top_ids [R, k]`` int64."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def row(self, i: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """Host values of row ``i`` with its own ``k`` (<= the computed width)."""
        ids = self.top_ids[i, :k].tolist()
        vals = self.top_values[i, :k].tolist()
        return float(self.chosen[i]), list(zip(ids, vals))


def _all_reduce(x: torch.Tensor, head: VocabParallelHead | None, op) -> torch.Tensor:
    if head is None or head.mapping.tp_size == 1:
        return x
    dist.all_reduce(x, op=op, group=tp_group(head.mapping))
    return x


def _ordered_topk(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``k`` of each row by (value descending, id ascending); deterministic on every rank."""
    by_id = torch.argsort(ids, dim=-1, stable=True)
    values, ids = values.gather(-1, by_id), ids.gather(-1, by_id)
    order = torch.argsort(values, dim=-1, descending=True, stable=True)[:, :k]
    return values.gather(-1, order), ids.gather(-1, order)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor, top_p: torch.Tensor,
                   k: int, *, head: VocabParallelHead | None = None, top_p_keep=None) -> TokenLogprobs:
    """Log-probabilities of ``tokens`` under each row's sampling distribution, and its top ``k``.

    Args:
        logits: ``[R, V]`` full rows, or this rank's ``[R, V_shard]`` of ``head`` (any float dtype).
        tokens: ``[R]`` int64 global ids (the emitted tokens).
        temperatures: ``[R]`` fp32 (``<= 0``: greedy row, reported at temperature 1 without top-p).
        top_p: ``[R]`` fp32 in (0, 1] (sampled rows with ``top_p < 1`` are restricted to the exact kept set).
        k: candidates per row, ``0 <= k <= 20``.
        head: the vocab-parallel head when ``logits`` is a shard (collectives on its TP group: call on
            every rank with the same rows), else None.
        top_p_keep: the exact top-p function (``verification.top_p_keep`` signature); needed only when a
            sampled row has ``top_p < 1``.
    """
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"token_logprobs: k must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    if logits.dim() != 2 or tokens.shape != (logits.shape[0],):
        raise ValueError(f"token_logprobs: expected logits [R, V] and tokens [R], got {tuple(logits.shape)} and "
                         f"{tuple(tokens.shape)}")
    width = logits.shape[1]
    dev = logits.device
    start = head.vocab_start if head is not None else 0
    vocab = head.vocab_size if head is not None else width
    ids = start + torch.arange(width, device=dev)
    sampled = temperatures > 0
    x = logits.float() / torch.where(sampled, temperatures, torch.ones_like(temperatures))[:, None]
    x = x.masked_fill((ids >= vocab)[None, :], float("-inf"))  # padded columns of the last shard
    restrict = sampled & (top_p < 1.0)
    if bool(restrict.any()):
        if top_p_keep is None:
            raise ValueError("token_logprobs: a row has top_p < 1 but no top_p_keep function was given")
        keep = top_p_keep(logits.contiguous(), top_p.float().contiguous(), temperatures=temperatures.float(),
                          vocab_start=start, vocab_size=vocab, exchange=head.exchange if head is not None else None)
        x = torch.where(keep | ~restrict[:, None], x, torch.full((), float("-inf"), device=dev))
    m = _all_reduce(x.amax(dim=-1), head, dist.ReduceOp.MAX)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = _all_reduce(torch.exp(x - m[:, None]).sum(dim=-1), head, dist.ReduceOp.SUM)
    lp = x - (m + torch.log(s))[:, None]
    local = tokens - start
    owned = (local >= 0) & (local < width)
    mine = lp.gather(1, local.clamp(0, width - 1)[:, None])[:, 0]
    chosen = torch.where(owned, mine, torch.zeros_like(mine))
    if head is not None and head.mapping.tp_size > 1:
        # Every non-owner adds an exact 0 (the owner's -inf stays -inf).
        chosen = _all_reduce(chosen.contiguous(), head, dist.ReduceOp.SUM)
    # Local candidates by (value desc, id asc): a stable sort of the id-ordered shard.
    idx = torch.argsort(lp, dim=-1, descending=True, stable=True)[:, :min(k, width)]
    cand_vals, cand_ids = lp.gather(1, idx), ids[idx]
    if head is not None and head.mapping.tp_size > 1:
        cand_vals = allgather(cand_vals.contiguous(), head.mapping, dim=-1)  # [R, tp*k]
        cand_ids = allgather(cand_ids.contiguous(), head.mapping, dim=-1)
    top_vals, top_ids = _ordered_topk(cand_vals, cand_ids, k)
    return TokenLogprobs(chosen, top_vals, top_ids)
