"""The teacher pass's outputs kept on the device across steps (``train-drafter --feature-cache-gib``).

Every training step runs the target over its batch (:func:`~tensorrt_llm_ext.training.data.teacher_pass`) for the
captured features ``[S, T, F]`` and the final hidden states ``[S, T, H]`` the drafter and the loss read. A recipe
visits each sequence many times (recipe 5 over the goal's budget: ~24 times), and the pass is a quarter to a third
of a step (docs/real_model.md, "where a training step goes"). This cache keeps each sequence's rows after its first
pass, in two flat device tensors, up to a byte budget fixed at the start: the sequences that fit, in index order
(a step's sequences are drawn uniformly, so any subset serves alike), are planned; a planned sequence is computed
once and read from then on, the others are computed every time as before.

What is read equals what the pass returned for the sequence's own positions ``[0, len)``, bit for bit (one copy in,
one gather out); the rows past a sequence's end (the batch's padding, which the causal target never lets reach a
real position and which no anchor, context or loss term reads) are zeros instead of the pass's values on the pad
tokens. A sequence's rows come from the batch that first computed it: on a GPU a batch of another width may round
the same sequence differently in the last bits, so a run with the cache is not bitwise one without it (neither is
a GPU run bitwise another); the tests hold the exact equality on the CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from tensorrt_llm_ext.logger import logger

GIB = 1 << 30


class FeatureCache:
    """Per-sequence teacher rows on ``device`` for the sequences of lengths ``lens`` (host ``[N]``) that fit
    ``budget_bytes``; the storage is allocated at the first :meth:`lookup` (when the rows' widths and dtype are
    known). A failed allocation (the device's memory) is a log line and the run continues without a cache."""

    def __init__(self, lens: torch.Tensor, budget_bytes: int, device: torch.device):
        if budget_bytes <= 0:
            raise ValueError(f"FeatureCache: the budget must be > 0 bytes, got {budget_bytes}")
        self.lens = [int(n) for n in lens.tolist()]
        self.budget_bytes = int(budget_bytes)
        self.device = torch.device(device)
        self.offsets: list[int] | None = None  # per sequence its first row (row 0 is the zero row), -1: not planned
        self.filled = [False] * len(self.lens)
        self.features: torch.Tensor | None = None  # [1 + planned tokens, F]
        self.final: torch.Tensor | None = None  # [1 + planned tokens, H]
        self.disabled = False
        self.rows_computed = 0  # sequences the pass ran for (a test's and the summary's count)
        self.rows_read = 0  # sequences read from the cache

    def _plan(self, feat_dim: int, hidden_dim: int, dtype: torch.dtype) -> None:
        per_token = (feat_dim + hidden_dim) * torch.empty((), dtype=dtype).element_size()
        cap = self.budget_bytes // per_token - 1
        offsets, used = [], 0
        for n in self.lens:
            if used + n <= cap:
                offsets.append(1 + used)
                used += n
            else:
                offsets.append(-1)
        planned = sum(1 for o in offsets if o >= 0)
        try:
            self.features = torch.zeros(1 + used, feat_dim, dtype=dtype, device=self.device)
            self.final = torch.zeros(1 + used, hidden_dim, dtype=dtype, device=self.device)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            self.features = self.final = None
            self.disabled = True
            logger.warning(f"train-drafter: --feature-cache-gib: {(1 + used) * per_token / GIB:.1f} GiB could not be "
                           f"allocated ({str(e).splitlines()[0][:100]}); every step runs the teacher pass")
            return
        self.offsets = offsets
        logger.info(f"train-drafter: feature cache: {planned} of {len(self.lens)} sequences ({used} tokens, "
                    f"{(1 + used) * per_token / GIB:.1f} GiB on {self.device}) kept after their first teacher pass")

    def lookup(self, idx: torch.Tensor, tokens: torch.Tensor,
               compute: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [S, t, F], final [S, t, H])`` of the sequences ``idx`` (host ``[S]``) whose tokens are
        ``tokens [S, t]`` (on the device, right-padded): read where cached, ``compute`` (the teacher pass) for the
        others, and the planned ones among those stored for the next time. The pass runs over the missing rows
        padded to a power of two (repeats of the first; the whole batch when that is as many): a new shape costs
        the GPU's attention a new plan, so the sizes it meets stay few."""
        ids = [int(i) for i in idx.tolist()]
        s, t = tokens.shape
        missing = [j for j, i in enumerate(ids) if not self.filled[i]]
        computed = None  # row k: the pass's rows of batch row missing[k]
        if missing:
            m = len(missing)
            self.rows_computed += m
            size = 1 << (m - 1).bit_length()
            if size >= s:
                whole = compute(tokens)
                if self.offsets is None and not self.disabled:
                    self._plan(whole[0].shape[-1], whole[1].shape[-1], whole[0].dtype)
                if self.disabled or (m == s and all(self.offsets[ids[j]] < 0 for j in missing)):
                    return whole  # nothing of this batch is (or can be) cached: the pass's own tensors
                rows = torch.tensor(missing, device=tokens.device)
                computed = (whole[0].index_select(0, rows), whole[1].index_select(0, rows))
            else:  # some rows are cached, so the storage is planned and allocated
                rows = torch.tensor(missing + [missing[0]] * (size - m), device=tokens.device)
                f, h = compute(tokens.index_select(0, rows))
                computed = (f[:m], h[:m])
            self._store(ids, missing, computed, t)
        self.rows_read += s - len(missing)
        feats, final = self._gather(ids, t)
        if computed is not None:  # the rows no budget holds: the pass's own values
            loose = [k for k, j in enumerate(missing) if self.offsets[ids[j]] < 0]
            if loose:
                src = torch.tensor(loose, device=tokens.device)
                dst = torch.tensor([missing[k] for k in loose], device=tokens.device)
                feats.index_copy_(0, dst, computed[0].index_select(0, src))
                final.index_copy_(0, dst, computed[1].index_select(0, src))
        return feats, final

    def _store(self, ids: list[int], missing: list[int], computed, t: int) -> None:
        src, dst = [], []
        for k, j in enumerate(missing):
            i = ids[j]
            off = self.offsets[i]
            if off < 0:
                continue
            n = min(self.lens[i], t)
            src.append(torch.arange(k * t, k * t + n))
            dst.append(torch.arange(off, off + n))
            self.filled[i] = True
        if not src:
            return
        src_i = torch.cat(src).to(self.device)
        dst_i = torch.cat(dst).to(self.device)
        f, h = computed
        self.features.index_copy_(0, dst_i, f.reshape(-1, f.shape[-1]).index_select(0, src_i))
        self.final.index_copy_(0, dst_i, h.reshape(-1, h.shape[-1]).index_select(0, src_i))

    def _gather(self, ids: list[int], t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the cached sequences, zero rows past each one's end and for the ones not cached (overwritten by
        the caller)."""
        offs = torch.tensor([self.offsets[i] if self.filled[i] else -1 for i in ids])
        lens = torch.tensor([self.lens[i] for i in ids])
        pos = torch.arange(t)[None, :]
        index = torch.where((offs[:, None] >= 0) & (pos < lens[:, None]), offs[:, None] + pos, 0)
        index = index.to(self.device, non_blocking=True)
        return self.features[index], self.final[index]
