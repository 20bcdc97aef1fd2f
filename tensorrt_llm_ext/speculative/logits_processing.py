"""Per-request logits processing (vLLM's sampling fields): ``logit_bias``, the repetition / frequency /
presence penalties, ``min_p`` and ``top_k``, applied to the target's logits -- full rows, or this rank's
vocabulary shard without gathering it -- before selection and verification.

The processed logits *define* the request's target distribution: the strict step selects from them (argmax,
or keyed Gumbel-max at the row's temperature), rejection sampling verifies the drafts against them, and the
first token of the prefill is chosen from them alike; so speculation stays lossless for the processed
distribution (greedy: the same tokens as a decode without drafts; sampled: the same distribution). A step
none of whose rows has a processed field runs none of this (its output is bit for bit the unprocessed one).

Order (vLLM's): ``logit_bias`` is added, then the repetition penalty (a token seen in the prompt or the
output: a positive logit divided by it, a negative one multiplied), then ``frequency_penalty * count`` and
``presence_penalty * (count > 0)`` are subtracted, counts over the generated tokens. For sampled rows only,
then, on those logits: ``min_p`` drops the tokens with ``p < min_p * p_max`` at the row's temperature
(``logit < max + T * ln(min_p)``), ``top_k`` those below the k-th largest logit (ties at the k-th value are
kept, as vLLM keeps them); top-p then applies to what is left (the worker's exact top-p).

Within a speculative step, row ``j`` of a request's verified block predicts the token after draft ``j - 1``:
its counts are the request's counts plus drafts ``0 .. j-1`` (what the output would be had they been
accepted), so every position sees the history it conditions on.

On shards: bias and penalties are per column (each rank its own ids); ``min_p`` needs the row max (one
all-reduce MAX of ``[R]``), ``top_k`` the k-th largest value (one all-gather of each rank's ``[R, W]`` largest
values, ``W`` = :data:`CAPTURED_TOP_K`).

Capturable: :meth:`SlotLogitsProcessors.apply` runs the same ops for every step, whatever its rows hold --
every field from static per-slot tensors (bias ids / values, ``MAX_LOGIT_BIAS`` per slot; the token-count and
in-prompt tables; the scalars), a row without a field holding its identity value (bias 0, penalties 0 / 1,
``min_p`` 0, ``top_k`` 0), each exactly a no-op in floating point (``y / 1``, ``y * 1``, ``y - 0``, a
``where`` that keeps ``y``), so the result is bit for bit the one computed with the field's work skipped.
The only host fact left is the top-k exchange width: ``W`` unless a row asks for ``top_k > W`` (then the
largest such ``top_k``; :meth:`~SlotLogitsProcessors.wide_top_k` tells the step, which then runs eagerly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tensorrt_llm_ext.contract import MAX_LOGIT_BIAS, SamplingParams
from tensorrt_llm_ext.distributed import allgather, tp_group
from tensorrt_llm_ext.kernels.common import host_to_device, refuse_allocation_while_capturing

# The top-k exchange width of a captured step: rows with top_k up to it replay; a larger top_k (rare: clients
# send 20..100) sizes the exchange by the rows and runs its step eagerly.
CAPTURED_TOP_K = 128


class SlotLogitsProcessors:
    """The processing state of every slot on one rank: its fields (device tensors read per row), the
    generated-token counts and the prompt's tokens of every slot, over this rank's columns
    ``[vocab_start, vocab_start + width)``.

    ``mapping`` (with ``sharded``): the TP group whose ranks hold the other columns (collectives on it).
    ``captured_top_k``: the top-k exchange width of a captured step (:data:`CAPTURED_TOP_K`).
    """

    def __init__(self, num_slots: int, vocab_start: int, width: int, vocab_size: int, device,
                 mapping=None, sharded: bool = False, captured_top_k: int = CAPTURED_TOP_K):
        if captured_top_k < 1:
            raise ValueError(f"SlotLogitsProcessors: captured_top_k must be >= 1, got {captured_top_k}")
        self.num_slots, self.vocab_start, self.width, self.vocab_size = num_slots, vocab_start, width, vocab_size
        self.captured_top_k = captured_top_k
        self.mapping = mapping if sharded else None
        dev = self.device = torch.device(device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=dev)
        # The four float fields in one [S, 4] table, so an admission writes all of its slots' in one launch (one
        # write per field and slot was ~7 launches a request from Python); the named columns are views of it.
        self._floats = torch.zeros(num_slots, 4, dtype=torch.float32, device=dev)
        self._floats[:, 3] = 1.0  # repetition 1: the identity
        self.min_p, self.presence, self.frequency, self.repetition = self._floats.unbind(1)
        self.bias_cols = torch.zeros(num_slots, MAX_LOGIT_BIAS, dtype=torch.int64, device=dev)  # this rank's columns
        self.bias_vals = torch.zeros(num_slots, MAX_LOGIT_BIAS, dtype=torch.float32, device=dev)  # 0: no entry
        # [S, width] int32 / bool, allocated with the first processed request or step (never inside a capture:
        # a capture's warm-up runs first); a slot without penalties ignores its rows (identity penalties).
        self.counts: torch.Tensor | None = None
        self.in_prompt: torch.Tensor | None = None
        # Per slot, from its params at assignment (read for every row of every step: the step variant's host
        # decision must not re-derive them, ~2 us a field from Python, 32 rows twice a step)
        self._acting = [False] * num_slots  # SamplingParams.acts_on_logits(vocab_size)
        self._limit_k = [0] * num_slots  # SamplingParams.limiting_top_k(vocab_size)
        self._counting = [False] * num_slots  # SamplingParams.uses_counts
        # Per slot: its fields hold the identity (top_k 0, min_p 0, no penalties, no logit bias), as the tables
        # start: an admission whose requests and slots are all neutral writes no field (most requests; the writes
        # were 4 launches and 2 copies an admission)
        self._neutral = [True] * num_slots
        self._cols = torch.arange(width, dtype=torch.int64, device=dev)
        self._valid = (self._cols + vocab_start) < vocab_size  # padding columns of the last shard: never kept

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None:
            refuse_allocation_while_capturing("SlotLogitsProcessors token-count tables", self.device)
            self.counts = torch.zeros(self.num_slots, self.width, dtype=torch.int32, device=self.device)
            self.in_prompt = torch.zeros(self.num_slots, self.width, dtype=torch.bool, device=self.device)
        return self.counts, self.in_prompt

    # -- host side (admission; eager) ------------------------------------------------------------------------
    def assign(self, slots: list[int], params: list[SamplingParams], prompts: list[list[int]],
               idx: torch.Tensor | None = None) -> None:
        """Set the processing fields of ``slots`` from their requests' params and reset their counts to the
        prompts'. ``idx``: ``slots`` already on the device as int64 (the caller's copy)."""
        dev = self.device
        neutral = [_neutral_fields(f) for f in params]
        write = not all(neutral) or not all(self._neutral[s] for s in slots)
        for slot, f, n in zip(slots, params, neutral):
            self._acting[slot] = f.acts_on_logits(self.vocab_size)
            self._limit_k[slot] = f.limiting_top_k(self.vocab_size)
            self._counting[slot] = f.uses_counts
            self._neutral[slot] = n
        counting = self.counting(slots)  # the counts are reset to the prompts'
        if idx is None and (write or counting):
            idx = host_to_device(slots, torch.int64, dev)
        if write:  # every slot's fields at once: a launch per field, not per field and slot
            self.top_k[idx] = host_to_device([f.top_k for f in params], torch.int64, dev)
            # float(): a checked field may be a Python int past int64 (a JSON 10**30 repetition penalty is in fp32's
            # range), which torch cannot write into a float tensor as an int
            self._floats[idx] = host_to_device([[float(f.min_p), float(f.presence_penalty),
                                                 float(f.frequency_penalty), float(f.repetition_penalty)]
                                                for f in params], torch.float32, dev)
            self.bias_cols[idx] = 0
            self.bias_vals[idx] = 0.0
        for slot, f in zip(slots, params):
            own = [(t - self.vocab_start, b) for t, b in f.logit_bias if 0 <= t - self.vocab_start < self.width]
            if own:
                self.bias_cols[slot, :len(own)] = host_to_device([c for c, _ in own], torch.int64, dev)
                self.bias_vals[slot, :len(own)] = host_to_device([b for _, b in own], torch.float32, dev)
        if counting:
            counts, in_prompt = self._tables()
            counts[idx] = 0
            in_prompt[idx] = False
            # this shard's columns, chosen on the host (a boolean mask on the device would read its count back)
            rows, cols = [], []
            for slot, prompt in zip(slots, prompts):
                own_cols = [t - self.vocab_start for t in prompt if 0 <= t - self.vocab_start < self.width]
                rows += [slot] * len(own_cols)
                cols += own_cols
            if cols:
                in_prompt[host_to_device(rows, torch.int64, dev), host_to_device(cols, torch.int64, dev)] = True

    def _acts(self, slot: int) -> bool:
        """Whether the slot's processing changes its row (:meth:`SamplingParams.acts_on_logits`)."""
        return self._acting[slot]

    def _limiting_top_k(self, slot: int) -> int:
        """The slot's ``top_k`` where it limits its row (:meth:`SamplingParams.limiting_top_k`), else 0."""
        return self._limit_k[slot]

    def active(self, slots: list[int]) -> bool:
        """Whether any of ``slots`` processes its logits (a host fact: the step variant that runs this)."""
        return any(self._acts(s) for s in slots)

    def wide_top_k(self, slots: list[int]) -> bool:
        """Whether a row of ``slots`` limits to more than :attr:`captured_top_k` tokens (the step's top-k
        exchange is then sized by its rows: not the captured step's)."""
        return any(self._limiting_top_k(s) > self.captured_top_k for s in slots)

    def top_k_width(self, slots: list[int]) -> int:
        """The top-k exchange width of a step over ``slots``: :attr:`captured_top_k`, or the largest limiting
        ``top_k`` of a wide row (:meth:`wide_top_k`). A captured step (no rows) gets the captured width."""
        return max([self.captured_top_k] + [self._limiting_top_k(s) for s in slots])

    # -- device side (the same ops for every step: capturable) ------------------------------------------------
    def apply(self, x: torch.Tensor, slots: list[int], row_slots: torch.Tensor, temps: torch.Tensor | None,
              block_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``x [R, width]`` processed (a new tensor of ``x``'s dtype).

        ``slots``: the host slot ids of the step's rows (a host fact: the top-k width, :meth:`top_k_width`);
        ``row_slots [R]``: each row's slot; ``temps [R]`` (None: greedy-only, min_p / top_k skipped);
        ``block_tokens [B, K]`` (a step): rows are ``B`` blocks of ``K + 1``, row ``j`` of block ``b`` counts
        ``block_tokens[b, :j]`` as generated too. Call on every rank of a sharded head with the same rows.
        No host sync, no branch on the rows' values, fixed-size collectives.
        """
        rows = row_slots.long()
        counts_table, in_prompt = self._tables()
        y = x.float()
        y = y.scatter_add(1, self.bias_cols[rows], self.bias_vals[rows])  # entries without a bias add 0 at col 0
        counts = counts_table[rows]
        if block_tokens is not None:
            counts = counts + _block_counts(block_tokens, self.vocab_start, self.width)
        seen = (counts > 0) | in_prompt[rows]
        rep = self.repetition[rows][:, None]  # 1: y / 1 and y * 1 are y
        y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y - self.frequency[rows][:, None] * counts.float()  # 0 * count = 0: y - 0 is y
        y = y - self.presence[rows][:, None] * (counts > 0).float()
        if temps is not None:
            neg_inf = torch.full((), float("-inf"), dtype=y.dtype, device=y.device)
            sampled = temps > 0
            min_p = self.min_p[rows]
            row_max = torch.where(self._valid, y, neg_inf).amax(-1)
            if self.mapping is not None:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group(self.mapping))
            floor = row_max + temps.float() * torch.log(min_p)  # log(0) = -inf: no floor (masked below anyway)
            y = torch.where((sampled & (min_p > 0))[:, None] & (y < floor[:, None]), neg_inf, y)
            y = self._top_k(y, rows, sampled, self.top_k_width(slots), neg_inf)
        return y.to(x.dtype)

    def _top_k(self, y: torch.Tensor, rows: torch.Tensor, sampled: torch.Tensor, k_max: int,
               neg_inf: torch.Tensor) -> torch.Tensor:
        local = torch.where(self._valid, y, neg_inf)
        width = min(k_max, self.width)
        vals = local.topk(width, dim=-1).values  # [R, width] descending
        if width < k_max:
            vals = torch.cat([vals, neg_inf.expand(vals.shape[0], k_max - width)], dim=-1)
        if self.mapping is not None:
            vals = allgather(vals.contiguous(), self.mapping, dim=-1).sort(dim=-1, descending=True).values
        k = self.top_k[rows]
        limited = sampled & (k > 0) & (k <= k_max) & (k < self.vocab_size)  # k > k_max: never in this step
        kth = vals.gather(1, (k.clamp(1, k_max) - 1)[:, None])  # [R, 1]: the k-th largest over every shard
        return torch.where(limited[:, None] & (y < kth), neg_inf, y)

    def counting(self, slots: list[int]) -> bool:
        """Whether a slot of ``slots`` has a penalty (reads its counts): the eager admission's question. Only such a
        slot's counts and prompt flags are reset at assignment and its first token counted; another slot's rows
        may hold stale counts (a captured processed step counts every row), which its identity penalties never
        read, and which its next assignment with a penalty resets. The tables exist from the processed graph's
        capture on: answering "the tables exist" here cost every admission a reset of its rows and a host walk
        over its prompt (~0.25 ms of host an admission on the GPU machine, 2026-12-07)."""
        return any(self._counting[s] for s in slots)

    def counts_tokens(self, slots: list[int]) -> bool:
        """Whether :meth:`record` counts tokens of ``slots``: the tables exist (a captured processed step counts
        every row), or a slot has a penalty (:meth:`counting`)."""
        return self.counts is not None or self.counting(slots)

    def record(self, slots: list[int], row_slots: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor,
               live: torch.Tensor | None = None) -> None:
        """Count the emitted ``tokens [B, T]`` (the first ``num [B]`` of each row, ``live [B]`` rows only) in
        their slots (every slot once the tables exist: a slot without penalties never reads its counts)."""
        if not self.counts_tokens(slots):
            return  # nothing reads counts yet; the tables start at the next assign or processed step
        counts, _ = self._tables()
        b, t = tokens.shape
        cols = tokens.long() - self.vocab_start
        keep = (torch.arange(t, device=tokens.device)[None, :] < num.long()[:, None]) & (cols >= 0) & (cols < self.width)
        if live is not None:
            keep &= live[:, None]
        flat = row_slots.long()[:, None] * self.width + cols.clamp(0, self.width - 1)
        counts.view(-1).scatter_add_(0, flat.view(-1), keep.view(-1).to(torch.int32))


def record_generated(processors: SlotLogitsProcessors, slots: list[int], row_slots: torch.Tensor,
                     generated: list[list[int]]) -> None:
    """Count each slot's tokens generated so far (host lists; ``row_slots``: ``slots`` on the device) in its
    processing state: what a slot taking over a request mid-stream starts from (a hand-over between the decodes)."""
    width = max(1, max(len(g) for g in generated))
    toks = torch.zeros(len(slots), width, dtype=torch.int64)
    for row, g in enumerate(generated):
        toks[row, :len(g)] = torch.tensor(g, dtype=torch.int64)
    dev = row_slots.device
    processors.record(slots, row_slots, host_to_device(toks, torch.int64, dev),
                      host_to_device([len(g) for g in generated], torch.int32, dev))


def _neutral_fields(f: SamplingParams) -> bool:
    """Whether ``f``'s processing fields are the tables' identity values (what a fresh slot holds)."""
    return f.top_k == 0 and f.min_p == 0 and not f.uses_counts and not f.logit_bias


def _block_counts(block_tokens: torch.Tensor, vocab_start: int, width: int) -> torch.Tensor:
    """``[B*(K+1), width]`` int32: row ``j`` of block ``b`` counts ``block_tokens[b, :j]`` (this rank's columns)."""
    b, k = block_tokens.shape
    dev = block_tokens.device
    out = torch.zeros(b * (k + 1), width, dtype=torch.int32, device=dev)
    cols = block_tokens.long() - vocab_start  # [B, K]
    j = torch.arange(k + 1, device=dev)
    i = torch.arange(k, device=dev)
    before = i[None, :] < j[:, None]  # [K+1, K]: draft i precedes row j
    own = (cols >= 0) & (cols < width)  # [B, K]
    keep = before[None, :, :] & own[:, None, :]  # [B, K+1, K]
    c = cols.clamp(0, width - 1)[:, None, :].expand(b, k + 1, k)
    # integer scatter-add: exact whatever the order (repeated drafts add up), no host sync
    out.scatter_add_(1, c.reshape(b * (k + 1), k), keep.reshape(b * (k + 1), k).to(torch.int32))
    return out


def process_reference(logits: torch.Tensor, fields: list[SamplingParams], temps: list[float],
                      histories: list[list[int]], prompts: list[list[int]]) -> torch.Tensor:
    """The eager full-vocabulary reference: ``logits [R, V]`` processed row by row in plain loops
    (``histories[r]``: the generated tokens before row ``r``'s position). fp32 result."""
    out = logits.float().clone()
    vocab = logits.shape[-1]
    for r, f in enumerate(fields):
        y = out[r]
        for t, b in f.logit_bias:
            y[t] = y[t] + b
        counts = torch.zeros(vocab, dtype=torch.int32)
        for t in histories[r]:
            counts[t] += 1
        if f.uses_counts:
            seen = counts > 0
            for t in prompts[r]:
                seen[t] = True
            rep = torch.tensor(f.repetition_penalty, dtype=torch.float32)
            y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
            y = y - torch.tensor(f.frequency_penalty, dtype=torch.float32) * counts.float()
            y = y - torch.tensor(f.presence_penalty, dtype=torch.float32) * (counts > 0).float()
        if temps[r] > 0:
            if f.min_p > 0:
                floor = y.max() + torch.tensor(temps[r], dtype=torch.float32) * torch.log(torch.tensor(f.min_p))
                y = torch.where(y < floor, torch.tensor(float("-inf")), y)
            if 0 < f.top_k < vocab:
                kth = torch.sort(y, descending=True).values[f.top_k - 1]
                y = torch.where(y < kth, torch.tensor(float("-inf")), y)
        out[r] = y
    return out
