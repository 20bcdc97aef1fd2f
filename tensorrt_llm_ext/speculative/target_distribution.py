"""The target's distribution of a step's rows, composed once: raw logits -> logits processing -> the exact
top-p set -> selection.

Three callers decide tokens from the target's logits -- the worker's selection (prefill and the strict step),
its rejection-sampling verification, and the reference decode it is checked against -- and all three must see
the same distribution for speculation to stay lossless. :class:`TargetDistribution` is that composition, held by
the worker (:attr:`DSparkWorker.distribution`):

1. ``process`` (or None): the rows' logits processing (:mod:`.logits_processing`; the processed step variant);
2. the exact top-p mask (:meth:`TargetDistribution.top_p_masked`; the top-p variant): ``-inf`` outside each
   sampled row's kept set, on the shards jointly when the logits are a shard; rejection verification passes
   ``top_p`` to its own kernel instead (the same kept set, computed inside the accept / resample pass);
3. selection by the op table (argmax, or keyed Gumbel-max at the row's temperature).

Buffers of the top-p path are allocated once per logits width, outside any capture (a capture's warm-up runs
first), so every variant is capturable.
"""

from __future__ import annotations

import torch

from tensorrt_llm_ext.kernels.common import refuse_allocation_while_capturing
from tensorrt_llm_ext.speculative.step_ops import StepOps
from tensorrt_llm_ext.speculative.verification import VerificationWorkspace
from tensorrt_llm_ext.speculative.vocab_parallel import VocabShardedLogits

__all__ = ["TargetDistribution"]

Logits = VocabShardedLogits | torch.Tensor


class TargetDistribution:
    """Processing, the exact top-p mask and selection of a worker's target rows (one instance per worker).

    ``max_rows``: the most rows one call sees (a step's ``R * (K + 1)`` verified positions).
    ``exchange``: the target head's pair exchange when its logits are shards (:meth:`bind`), else None.
    """

    def __init__(self, ops: StepOps, max_batch_size: int, draft_len: int, device: torch.device):
        self.ops = ops
        self.max_batch_size, self.draft_len, self.device = max_batch_size, draft_len, device
        self.exchange = None
        self.selector = None
        # The kept set [R*(K+1), W] bool and its workspace, per logits width W.
        self._top_p_buffers: dict[int, tuple[torch.Tensor, VerificationWorkspace]] = {}

    def bind(self, selector) -> None:
        """After load: the worker's token selector (its target head's exchange, and the selection it runs)."""
        self.selector = selector
        head = selector.target_head
        self.exchange = head.exchange if head is not None else None

    def logits(self, logits: Logits, temps: torch.Tensor | None, *, process=None,
               top_p: torch.Tensor | None = None) -> Logits:
        """``logits`` (a shard or full rows) as the rows' distribution: processed (``process(logits, temps)``,
        or None), then masked to each sampled row's exact top-p set (``top_p [R]``, or None: no top-p row).
        ``temps`` None: a greedy-only worker (no top-p, min_p or top_k)."""
        if process is not None:
            logits = process(logits, temps)
        if temps is not None and top_p is not None:
            logits = self.top_p_masked(logits, temps, top_p)
        return logits

    def select(self, logits: Logits, temps: torch.Tensor | None, seeds: torch.Tensor | None,
               offsets: torch.Tensor | None, salt: int, out: torch.Tensor, *, process=None,
               top_p: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens of ``logits``' rows: :meth:`logits` then the op table's selection into ``out [R]`` int64
        (``temps`` None: greedy)."""
        x = self.logits(logits, temps, process=process, top_p=top_p)
        return self.ops.select(self.selector, x, temps, seeds, offsets, salt, out)

    def top_p_masked(self, logits: Logits, temps: torch.Tensor, top_p: torch.Tensor) -> Logits:
        """``logits`` with ``-inf`` outside the exact top-p set of every sampled row with ``top_p < 1``
        (computed jointly on the shards when ``logits`` is a shard); other rows unchanged."""
        if isinstance(logits, VocabShardedLogits):
            x, start, vocab, exchange = logits.logits, logits.vocab_start, logits.vocab_size, self.exchange
        else:
            x, start, vocab, exchange = logits, 0, logits.shape[-1], None
        out, workspace = self.top_p_buffers(x.shape[-1], exchange.tp_size if exchange is not None else 1)
        keep = self.ops.top_p_keep(x.contiguous(), top_p.contiguous(), temperatures=temps.contiguous(),
                                   vocab_start=start, vocab_size=vocab, exchange=exchange, out=out[:x.shape[0]],
                                   workspace=workspace)
        restrict = ((top_p < 1.0) & (temps > 0))[:, None]
        masked = torch.where(keep | ~restrict, x, torch.full((), float("-inf"), dtype=x.dtype, device=x.device))
        return logits.__class__(masked, start, vocab, logits.padded_vocab_size) \
            if isinstance(logits, VocabShardedLogits) else masked

    def top_p_buffers(self, width: int, tp: int) -> tuple[torch.Tensor, VerificationWorkspace]:
        """The kept-set buffer ``[R*(K+1), width]`` bool and the workspace of :meth:`top_p_masked`, allocated
        once per width, never inside a capture."""
        bufs = self._top_p_buffers.get(width)
        if bufs is None:
            refuse_allocation_while_capturing("TargetDistribution top-p buffers", self.device)
            rows = self.max_batch_size * (self.draft_len + 1)
            # as the rejection verifier: column chunks fill the GPU at small B, one chunk in the interpreter
            splits = 8 if self.device.type == "cuda" else 1
            ws = VerificationWorkspace.for_verification(self.max_batch_size, self.draft_len, width, tp=tp,
                                                        device=self.device, num_splits=splits)
            bufs = self._top_p_buffers[width] = (torch.empty(rows, width, dtype=torch.bool, device=self.device), ws)
        return bufs
