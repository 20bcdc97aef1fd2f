"""The worker's rejection-sampling verification component: the decision (made once after load) and the
buffers and calls of one step's :func:`~tensorrt_llm_ext.speculative.verification.rejection_sample`.

With ``speculative_config.use_rejection_sampling`` a sampling worker drafts with keyed Gumbel-max at each
request's temperature and verifies with rejection sampling instead of strict acceptance. Where it
verifies is ``speculative_config.vocab_sharded_verification``:

* ``auto``: on this rank's vocabulary columns whenever the target AND the draft side are bound
  vocab-parallel (the Markov chain's biased logits are then this rank's columns), else gathered;
* ``on``: like ``auto``, but a configuration that cannot verify sharded is an error at load;
* ``off``: always on gathered full-vocabulary logits.

The decision is derived only from the selection decision (already agreed across ranks) and the config
(identical on every rank), so it is the same on every rank without a collective of its own; it is logged
once per worker and stored here alone (:attr:`RejectionVerifier.decision`).

Sharded and gathered verification give the same bits (the TP-1 call is the reference of the sharded
one). No request needs the full-vocabulary logits in the step: logprobs are computed on the shards
(:mod:`~tensorrt_llm_ext.speculative.logprobs`), top-p by the exact sharded top-p.

CUDA graphs: the workspaces and the row buffers are allocated here, once, before any capture; the step
allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm_ext.distributed import PairExchange, allgather
from tensorrt_llm_ext.logger import logger
from tensorrt_llm_ext.mapping import Mapping
from tensorrt_llm_ext.speculative.verification import VerificationWorkspace, choose_passes
from tensorrt_llm_ext.speculative.token_selector import VocabParallelSelector

__all__ = ["RejectionVerification", "RejectionVerifier", "VERIFICATION_MODES"]

VERIFICATION_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class RejectionVerification:
    """Whether the worker verifies by rejection sampling, and where (identical on every rank)."""

    enabled: bool  # use_rejection_sampling on a sampling-capable worker
    sharded: bool  # on this rank's vocabulary columns (else on gathered logits)
    reason: str
    tp_size: int = 1

    @classmethod
    def decide(cls, *, use_rejection_sampling: bool, mode: str, sampling: bool,
               selector: VocabParallelSelector, tp_size: int) -> "RejectionVerification":
        """Decide once after the selector is bound (no collective: every input is agreed already)."""
        if mode not in VERIFICATION_MODES:
            raise ValueError(f"vocab_sharded_verification: expected one of {VERIFICATION_MODES}, got {mode!r}")
        if not use_rejection_sampling or not sampling:
            why = "use_rejection_sampling is off" if not use_rejection_sampling else "greedy-only worker"
            if mode == "on":
                raise ValueError(f"vocab_sharded_verification='on' but rejection sampling is not used ({why})")
            return cls(False, False, why, tp_size)
        sel = selector.selection
        if mode == "off":
            reason = "vocab_sharded_verification='off'"
        elif not sel.target_enabled:
            reason = f"the target head is gathered ({sel.target_reason})"
        elif not sel.draft_enabled:
            reason = f"the draft logits are gathered ({sel.draft_reason})"
        else:
            reason = "eligible"
        sharded = reason == "eligible"
        if mode == "on" and not sharded:
            raise ValueError(f"vocab_sharded_verification='on' but not possible: {reason}")
        return cls(True, sharded, reason, tp_size)

    def describe(self) -> str:
        if not self.enabled:
            return f"verification at tp={self.tp_size}: strict acceptance ({self.reason})"
        where = "vocab-sharded" if self.sharded else f"gathered ({self.reason})"
        return f"verification at tp={self.tp_size}: rejection sampling, {where}"


class RejectionVerifier:
    """Owns the decision, the verification workspaces and the step's row buffers.

    Args:
        decision: the :class:`RejectionVerification` (enabled).
        selector: the worker's bound selector (the head facts and the pair exchange come from it).
        mapping: this rank's layout.
        max_batch_size, draft_len: ``R`` and ``K``.
        vocab_size: ``V``.
        logits_dtype: the draft logits' dtype (the Markov chain's output dtype).
        device: where every buffer lives.
    """

    def __init__(self, decision: RejectionVerification, selector: VocabParallelSelector, mapping: Mapping, *,
                 max_batch_size: int, draft_len: int, vocab_size: int, logits_dtype: torch.dtype,
                 device: torch.device):
        if not decision.enabled:
            raise ValueError("RejectionVerifier: the decision says rejection sampling is off")
        self.decision = decision
        self.mapping = mapping
        self.vocab_size = vocab_size
        self.draft_len = draft_len
        r, k = max_batch_size, draft_len
        # Wider column chunks on a GPU keep every SM busy at small B; the interpreter runs programs one
        # after another, so one chunk per row is fastest there. Results do not depend on the plan.
        splits = 32 if torch.device(device).type == "cuda" else 1
        if decision.sharded:
            head = selector.target_head
            self.exchange: PairExchange | None = head.exchange
            self.vocab_start = head.vocab_start
            self.width = head.lm_head.shard_width  # W: the stored draft logits are this rank's columns
            self.sharded_workspace = VerificationWorkspace.for_verification(
                r, k, self.width, tp=mapping.tp_size, device=device, num_splits=splits)
        else:
            self.exchange, self.vocab_start, self.width = None, 0, vocab_size
            self.sharded_workspace = None
        # Full-vocabulary verification (every gathered step, and steps routed to the gathered path).
        self.full_workspace = VerificationWorkspace.for_verification(r, k, vocab_size, tp=1, device=device,
                                                                     num_splits=splits)
        # The path every sharded call takes (shapes only, the same on every rank): one read of the logits on a
        # block-aligned LM head shard, else the two-pass fallback (logged once with the reason, here at bind).
        ws = self.sharded_workspace or self.full_workspace
        self.passes = choose_passes(None, self.width, mapping.tp_size if decision.sharded else 1, self.vocab_start,
                                    ws.block_size)
        self.draft_rows = torch.zeros((r, k, self.width), dtype=logits_dtype, device=device)  # [R, K, W]
        self.draft_tokens = torch.zeros((r, k), dtype=torch.int64, device=device)  # [R, K]
        logger.info(decision.describe())

    # -- draft side ------------------------------------------------------------------------------------
    def store_width(self, biased: torch.Tensor) -> torch.Tensor:
        """The Markov chain's biased logits ``[B, K, V_chain]`` in the stored layout ``[B, K, W]``: as they are
        when the widths agree; all-gathered to ``[B, K, V]`` (contiguous) when verification is gathered but the
        chain ran on a shard (bounded: ``B * K * V_local`` per rank)."""
        if biased.shape[-1] == self.width:
            return biased
        if self.decision.sharded:
            raise ValueError(f"RejectionVerifier: draft logits of width {biased.shape[-1]}, the sharded "
                             f"verification stores {self.width} columns")
        return allgather(biased, self.mapping, dim=-1)[..., :self.vocab_size].contiguous()  # rows stored whole

    # -- verification ------------------------------------------------------------------------------------
    def verify(self, fn, target_logits: torch.Tensor, stored: torch.Tensor, slots: torch.Tensor,
               tokens: torch.Tensor, *, temperatures: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
               top_p: torch.Tensor | None, out: tuple[torch.Tensor, torch.Tensor], load_rows):
        """One step's rejection sampling: ``(accepted [B, K+1] int64, num_accepted [B] int32)`` in ``out``.

        Args:
            fn: the op table's ``rejection_sample`` (fused launcher or its eager twin).
            target_logits: ``[B*(K+1), W]`` this rank's shard (sharded) or ``[B*(K+1), V]``.
            stored: the slot-indexed draft-logits buffer ``[S, K, W]``; slots: ``[B]`` int64 row slots.
            tokens: ``[B, K+1]`` the verified ``[anchor, d_0 .. d_{K-1}]``.
            temperatures / seeds / offsets / top_p: ``[B]`` (``offsets`` = position of ``d_0``).
            load_rows: the op table's ``load_rows`` (``gather_rows`` or its twin) reading ``stored``'s rows.
        """
        b, k = tokens.shape[0], self.draft_len
        drafts = self.draft_tokens[:b]
        drafts.copy_(tokens[:, 1:])
        rows = self.draft_rows[:b]
        load_rows(stored, slots, rows)
        kw = dict(temperatures=temperatures, seeds=seeds, offsets=offsets, top_p=top_p, out=out)
        if not self.decision.sharded:
            tgt = target_logits.reshape(b, k + 1, -1)[..., :self.vocab_size].contiguous()
            return fn(tgt, rows, drafts, vocab_size=self.vocab_size, workspace=self.full_workspace, **kw)
        return fn(target_logits.view(b, k + 1, self.width), rows, drafts, vocab_start=self.vocab_start,
                  vocab_size=self.vocab_size, exchange=self.exchange, workspace=self.sharded_workspace, **kw)
