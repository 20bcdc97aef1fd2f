"""Vocab-sharded rejection-sampling verification and exact top-p, bitwise the same at every TP size.

Each rank holds its vocabulary shard of the target logits ``[B, K+1, V_local]`` and of the draft logits
``[B, K, V_local]`` (the logits the drafts were sampled from). Nothing proportional to the vocabulary
crosses ranks: per (row, column chunk) two int64 keys and three int64 masses, the top-p window and radix
histograms ``[R, S, 256]`` for top-p, tie counts ``[tp, R, S * sub, 2]``, and the draw's race ``[tp, B, S * sub, 2]``.

Semantics (docs/rejection_sampling.md has the full statement):

* ``p`` is the target's temperature softmax in fixed point (integer weights, see
  :mod:`tensorrt_llm_ext.kernels.fixed_point_softmax`) restricted to its exact top-p set (smallest prefix in
  (logit desc, id asc) order whose mass reaches ``p``); ``q`` is the draft's full-vocabulary temperature
  softmax in the same fixed point (the drafter samples with keyed Gumbel-max over the full vocabulary, so
  the draft side applies no top-p). Both use the request's temperature.
* Accept ``d_k`` iff ``u_k * q(d_k) < p(d_k)``; at the first rejection emit a sample of
  ``norm(max(p - q, 0))``, otherwise a sample of ``p_K`` (an exponential race keyed by global id, see
  :mod:`~tensorrt_llm_ext.kernels.rejection_sample`). Uniforms are Philox keyed by (seed, absolute
  position, global id where needed, salt) only, so the result does not depend on the TP size, batch
  composition or tiling.
* ``T <= 0`` rows: strict acceptance against the target argmax (``torch.argmax`` order), bitwise what
  :func:`~tensorrt_llm_ext.kernels.strict_accept.strict_accept` returns on
  :func:`~tensorrt_llm_ext.speculative.vocab_parallel.vocab_parallel_argmax` tokens.

Every mass is an exact int64 sum (block weights: exact int64 bins by grid distance) of per-token integer weights
that are one fixed instruction sequence of the token's logit, the row (or block) max and T, so a kernel gives the
same bits at every TP size and tiling (the sharded
call equals the TP-1 call). The weights use the SFU ``exp2``: the eager twins agree bit for bit under the
interpreter and within the stated tolerance on a GPU (docs/rejection_sampling.md, "What is bitwise where").

Weights (docs/rejection_sampling.md, "Semantics"): a request with top-p in force (``T > 0``, ``p < 1``) weighs
its target and draft rows against the row max (``fixed_point_softmax``) as before; every other request uses block
weights (:mod:`~tensorrt_llm_ext.kernels.block_stats`: each 1024-id block against its own max, combined exactly),
which one read of the logits can compute on a block-aligned shard (it reads a top-p request's rows for their keys
alone: their weights are ``verify_sums``').

Per call (:func:`call_shape`): without top-p 4 launches and 3 exchanges (MAX, SUM, all-gather): on a block-aligned
shard ``block_stats`` (one read), ``block_combine``, ``rejection_draw``, ``rejection_assemble``; on any other shard
(:func:`choose_passes`: logged once per reason) ``block_keys`` and ``block_bins`` (two reads) instead of the first
two. With top-p ``verify_sums`` over the top-p requests' rows, the radix rounds (0..n, skipped by the rows that its
window resolves) and the tie count come in between: bf16 logits 8 launches and 6 exchanges, fp16 9 / 7, fp32
10 / 8; ``top_p_keep`` bf16 6 / 5, fp32 8 / 7. Each launcher is one kernel launch and writes every slot of its
output, so no call issues a memset or a copy.

CUDA graphs: pass a :class:`VerificationWorkspace` (allocated once for the largest batch) and ``out=``;
then no call allocates, syncs the host or branches on data. Input checks that need device values (draft
ids in range, temperatures >= 0, top_p in (0, 1]) run only when the stream is not capturing.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from tensorrt_llm_ext.distributed import PairExchange
from tensorrt_llm_ext.kernels import block_stats as bsk
from tensorrt_llm_ext.kernels import fixed_point_softmax as fps
from tensorrt_llm_ext.kernels import rejection_sample as rs
from tensorrt_llm_ext.kernels import top_p as tpk
from tensorrt_llm_ext.kernels.common import check_int, check_tensor, refuse_allocation_while_capturing
from tensorrt_llm_ext.kernels.ordered_key import MAX_VOCAB
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.speculative.value_checks import check_row_values

__all__ = ["DEFAULT_PASSES", "VerificationPlan", "VerificationWorkspace", "call_shape", "choose_passes", "column_plan",
           "draw_plan", "rejection_sample", "rejection_sample_reference", "top_p_keep", "top_p_keep_reference"]


@dataclass(frozen=True)
class _VerificationKernels:
    """The kernels one verification call runs with: the fused launchers or their eager twins.

    Not an op table of its own: the worker picks ``rejection_sample`` or ``rejection_sample_reference``
    (and ``top_p_keep`` / ``top_p_keep_reference``) through its one op table, ``StepOps``; this pairing is
    how each of those two entry points runs the same pipeline (exchanges, buffers, order) -- the eager
    twin of a call is the same call with :data:`_EAGER_KERNELS`. Every entry has the launcher's signature.
    """

    name: str
    keys: Callable  # fixed_point_softmax.verify_keys
    sums: Callable  # fixed_point_softmax.verify_sums
    top_p_window: Callable  # top_p.top_p_window
    top_p_round: Callable  # top_p.top_p_round
    top_p_ties: Callable  # top_p.top_p_ties
    top_p_mask: Callable  # top_p.top_p_mask
    draw: Callable  # rejection_sample.rejection_draw
    assemble: Callable  # rejection_sample.rejection_assemble
    stats: Callable  # block_stats.block_stats (the one pass)
    combine: Callable  # block_stats.block_combine
    block_keys: Callable  # block_stats.block_keys (the two-pass fallback)
    block_bins: Callable  # block_stats.block_bins


_FUSED_KERNELS = _VerificationKernels(
    name="fused", keys=fps.verify_keys, sums=fps.verify_sums, top_p_window=tpk.top_p_window,
    top_p_round=tpk.top_p_round, top_p_ties=tpk.top_p_ties,
    top_p_mask=tpk.top_p_mask, draw=rs.rejection_draw, assemble=rs.rejection_assemble, stats=bsk.block_stats,
    combine=bsk.block_combine, block_keys=bsk.block_keys, block_bins=bsk.block_bins)
_EAGER_KERNELS = _VerificationKernels(
    name="eager", keys=fps.verify_keys_reference, sums=fps.verify_sums_reference,
    top_p_window=tpk.top_p_window_reference, top_p_round=tpk.top_p_round_reference,
    top_p_ties=tpk.top_p_ties_reference,
    top_p_mask=tpk.top_p_mask_reference, draw=rs.rejection_draw_reference, assemble=rs.rejection_assemble_reference,
    stats=bsk.block_stats_reference, combine=bsk.block_combine_reference, block_keys=bsk.block_keys_reference,
    block_bins=bsk.block_bins_reference)


def call_shape(entry: str, top_p: bool, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """``(launches, exchange rounds)`` of one call of ``entry`` (``"rejection_sample"`` / ``"top_p_keep"``).

    The pipeline below, written down once (tests count both on CPU and hold them to it;
    docs/rejection_sampling.md has the before/after table). With top-p the radix rounds after round 0 depend on
    the logits' dtype (:func:`~tensorrt_llm_ext.kernels.top_p.radix_rounds`): bf16 1, fp16 2, fp32 3.
    """
    if entry not in ("rejection_sample", "top_p_keep") or (entry == "top_p_keep" and not top_p):
        raise ValueError(f"call_shape: expected ('rejection_sample', bool) or ('top_p_keep', True), got "
                         f"{(entry, top_p)!r}")
    n = tpk.radix_rounds(dtype) if top_p else 0
    if entry == "top_p_keep":
        return 6 + n, 4 + n  # keys, sums, window, rounds 0..n, ties, mask / MAX, SUM, n + 1 SUMs, gather
    # stats + combine (one pass) or block keys + block bins (two passes), draw, assemble / MAX, SUM, the race's
    # gather; with top-p + the sums of the top-p requests, window, rounds 0..n, ties / + n + 1 SUMs, the ties' gather
    return (8 + n, 5 + n) if top_p else (4, 3)


_H = fps.HIST_BUCKETS
_DEFAULT_BLOCK = 1024
# Column chunks are for occupancy: enough (row, chunk) programs to fill the GPU, no more, since every exchanged slot
# is per (row, chunk) and the volume grows with the chunk count. A program walks its chunk's tiles one after another
# (latency-bound), so 2048: on the H200 (2026-12-05, bench verify --target-programs, V = 200064, K = 7, bf16) it took
# the full vocabulary's call at B = 128 from 1762 to 1264 us (top-p at B = 8: 772 -> 580) against 512, within 5 % of
# it on the TP-4 shard without top-p (docs/rejection_sampling.md).
_TARGET_PROGRAMS = 2048


def column_plan(rows: int, width: int, block_size: int, num_splits: int,
                target_programs: int = _TARGET_PROGRAMS) -> tuple[int, int]:
    """``(splits, chunk)`` of a call over ``rows`` rows (target + draft) of ``width``-column shards: at most
    ``num_splits`` chunks per row and no more than ``ceil(target_programs / rows)``. Depends on shapes only, and
    on the shard's width, not on how many of its columns are real ids: every rank of a TP group must exchange
    buffers of the same shape, and the last rank's shard holds the padding (chunks past the real ids are
    empty: their slots are written as empty)."""
    want = max(1, min(num_splits, -(-target_programs // max(rows, 1))))
    return fps.plan_chunks(width, block_size, want)


def draw_plan(batch: int, splits: int, chunk: int, block_size: int, num_splits: int,
              target_programs: int = _TARGET_PROGRAMS) -> int:
    """Sub-chunks per column chunk of the draw: about ``target_programs`` programs over ``batch`` requests (it reads
    two rows per request, so it needs finer chunks than the passes over every row), at most ``num_splits`` (the
    workspace's cap; 1 without one, so a call without a workspace exchanges a volume independent of the vocabulary)
    and at most one per tile of the chunk. Depends on shapes only."""
    return max(1, min(num_splits, -(-target_programs // max(batch * splits, 1)), chunk // block_size))


@dataclass(frozen=True)
class VerificationPlan:
    """Buffer sizes of one call: ``rows_t`` target rows, ``rows_q`` draft rows, ``batch`` requests, ``splits``
    column chunks per row, ``tp`` ranks, with or without top-p (int64 elements per named buffer)."""

    rows_t: int
    rows_q: int
    batch: int
    splits: int
    tp: int
    top_p: bool
    rounds: int = 3  # radix rounds after round 0 (top_p.radix_rounds of the logits' dtype; round 0 exchanges too)
    sub: int = 1  # sub-chunks per chunk of the draw (draw_plan) and of the tie counts
    passes: str | None = None  # rejection_sample: "one" (block-aligned) or "two" (any shard); None: top_p_keep

    def sizes(self) -> dict[str, int]:
        rt, rq, b, s, tp = self.rows_t, self.rows_q, self.batch, self.splits, self.tp
        p, f = self.top_p, self.sub
        gathered = tp > 1  # at tp 1 the "gathered" buffers are views of the local ones
        ne = tp + 1 if self.passes == "two" else 0  # edge maxima, exchanged with the keys
        # today's sums only for top-p (the requests with top-p in force); block bins per row (one pass) or chunk
        sums = fps.sums_layout(rt, rq, s, p)[1] if p or self.passes is None else 0
        bins = (rt + rq) * (1 if self.passes == "one" else s) * bsk.BINS_COLS if self.passes else 0
        return {
            "keys": (rt + rq) * s * (2 + ne), "sums": sums + bins,
            "stats": (rt + rq) * s * bsk.STATS_COLS if self.passes == "one" else 0,
            "hist": 4 * rt * s * _H if p else 0, "state": 5 * rt * 2 if p else 0,
            "ties": rt * s * f * 2 if p else 0, "ties_all": tp * rt * s * f * 2 if p and gathered else 0,
            "dec": b * 2, "race": b * s * f * rs.RACE_COLS,
            "race_all": tp * b * s * f * rs.RACE_COLS if gathered else 0,
        }

    def exchanges(self) -> list[tuple[str, int]]:
        """The exchange rounds of a ``rejection_sample`` call (``batch > 0``) or a ``top_p_keep`` call
        (``batch == 0``) in order: ``(collective, int64 words this rank sends)``."""
        sz = self.sizes()
        rounds = [("max", sz["keys"]), ("sum", sz["sums"])]
        if self.top_p:
            per_round = self.rows_t * self.splits * _H
            rounds += [("sum", per_round)] * (self.rounds + 1)  # rounds 0..n
            rounds.append(("all_gather", self.rows_t * self.splits * self.sub * 2))
        if self.batch:
            rounds.append(("all_gather", self.batch * self.splits * self.sub * rs.RACE_COLS))
        return rounds


class VerificationWorkspace:
    """Preallocated buffers for :func:`rejection_sample` / :func:`top_p_keep` (allocate once, outside capture).

    Sized for up to ``max_rows_t`` target rows, ``max_rows_q`` draft rows and ``max_batch`` requests over
    a shard of ``shard_width`` columns at ``tp`` ranks, with the column plan (``block_size``,
    ``num_splits``) that every call using it must share. For verification of ``B <= max_batch`` requests
    of draft length K use ``VerificationWorkspace.for_verification(max_batch, K, ...)``.
    """

    def __init__(self, max_rows_t: int, max_rows_q: int, max_batch: int, shard_width: int, *, tp: int = 1,
                 device: torch.device | str = "cpu", block_size: int = _DEFAULT_BLOCK, num_splits: int = 1,
                 target_programs: int = _TARGET_PROGRAMS):
        for name, v in (("max_rows_t", max_rows_t), ("max_rows_q", max_rows_q), ("max_batch", max_batch),
                        ("shard_width", shard_width)):
            check_int(name, v, lo=0)
        check_int("tp", tp, lo=1)
        check_int("num_splits", num_splits, lo=1)
        check_int("target_programs", target_programs, lo=1)
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 16, got {block_size}")
        refuse_allocation_while_capturing("VerificationWorkspace", device)
        self.block_size = block_size
        self.num_splits = num_splits
        self.target_programs = target_programs
        self.tp = tp
        self.splits, _ = fps.plan_chunks(shard_width, block_size, num_splits)
        self._capacity = _capacity(max_rows_t, max_rows_q, max_batch, shard_width, block_size, num_splits, tp,
                                   target_programs)
        self._bufs = {name: torch.empty(n, dtype=torch.int64, device=device) for name, n in self._capacity.items()}
        self.device = torch.device(device)

    @classmethod
    def for_verification(cls, max_batch: int, draft_len: int, shard_width: int, **kw) -> "VerificationWorkspace":
        return cls(max_batch * (draft_len + 1), max_batch * draft_len, max_batch, shard_width, **kw)

    def carve(self, plan: VerificationPlan) -> SimpleNamespace:
        sizes = plan.sizes()
        cap = self._capacity
        for name, n in sizes.items():
            if n > cap[name]:
                raise ValueError(f"workspace: {name} needs {n} elements, the workspace holds {cap[name]} "
                                 f"(allocate it for the largest batch)")
        return _views(self._bufs, plan)


def _capacity(max_rows_t: int, max_rows_q: int, max_batch: int, width: int, block_size: int, num_splits: int,
              tp: int, target_programs: int) -> dict[str, int]:
    """Elements per buffer for every call a workspace serves: the max over its batch sizes (the column plan
    uses fewer chunks at more rows, so the largest batch times the most chunks would overallocate)."""
    cap: dict[str, int] = {}

    def fit(rt: int, rq: int, b: int) -> None:
        s, chunk = column_plan(rt + rq, width, block_size, num_splits, target_programs)
        f = draw_plan(b, s, chunk, block_size, num_splits, target_programs) if b else 1
        for passes in (("one", "two") if b else (None,)):
            for name, n in VerificationPlan(rt, rq, b, s, tp, True, sub=f, passes=passes).sizes().items():
                cap[name] = max(cap.get(name, 0), n)

    k = max_rows_q // max_batch if max_batch else 0
    for bb in range(1, max_batch + 1):  # rejection_sample of bb requests
        fit(min(bb * (k + 1), max_rows_t), min(bb * k, max_rows_q), bb)
    for rt in range(1, max_rows_t + 1):  # top_p_keep of rt rows
        fit(rt, 0, 0)
    fit(0, 0, 0)
    return cap


def _views(bufs: dict[str, torch.Tensor], plan: VerificationPlan) -> SimpleNamespace:
    rt, rq, b, s, tp, f = plan.rows_t, plan.rows_q, plan.batch, plan.splits, plan.tp, plan.sub
    sizes = plan.sizes()
    cols_t, n_sums = fps.sums_layout(rt, rq, s, plan.top_p)
    if plan.passes and not plan.top_p:
        n_sums = 0
    ns = SimpleNamespace()
    n_keys = (rt + rq) * s * 2
    ns.keys_x = bufs["keys"][: sizes["keys"]]  # the MAX exchange: keys (and the edge maxima of the two passes)
    ns.keys = ns.keys_x[:n_keys].view(rt + rq, s, 2)
    ns.edges = ns.keys_x[n_keys:].view(rt + rq, s, plan.tp + 1) if plan.passes == "two" else None
    ns.stats = bufs["stats"][: sizes["stats"]].view(rt + rq, s, bsk.STATS_COLS) if plan.passes == "one" else None
    ns.sums_x = bufs["sums"][: sizes["sums"]]  # the SUM exchange: today's sums (top-p) and the block bins
    ns.sums = ns.sums_x[:n_sums]
    ns.sums_t = ns.sums[: rt * s * cols_t].view(rt, s, cols_t) if n_sums else None
    ns.sums_q = ns.sums[rt * s * cols_t:].view(rq, s, fps.SUMS_COLS) if n_sums else None
    ns.bins = (ns.sums_x[n_sums:].view(rt + rq, 1 if plan.passes == "one" else s, bsk.BINS_COLS) if plan.passes
               else None)
    if plan.top_p:
        ns.hist = bufs["hist"][: sizes["hist"]].view(4, rt, s, _H)
        ns.state = bufs["state"][: sizes["state"]].view(5, rt, 2)  # rounds' (prefix, mass), b* (3), window (4)
        ns.ties = bufs["ties"][: sizes["ties"]].view(rt, s * f, 2)
        ns.ties_all = (bufs["ties_all"][: sizes["ties_all"]].view(tp, rt, s * f, 2) if tp > 1
                       else ns.ties.unsqueeze(0))
    ns.dec = bufs["dec"][: sizes["dec"]].view(b, 2)
    ns.race = bufs["race"][: sizes["race"]].view(b, s * f, rs.RACE_COLS)
    ns.race_all = (bufs["race_all"][: sizes["race_all"]].view(tp, b, s * f, rs.RACE_COLS) if tp > 1
                   else ns.race.unsqueeze(0))
    return ns


def _call_buffers(workspace, plan, dev, name: str):
    """The call's buffers: carved from ``workspace`` (capturable), else allocated here (never while capturing)."""
    if workspace is None:
        refuse_allocation_while_capturing(f"{name} (no workspace)", dev)
        return _views({n: torch.empty(v, dtype=torch.int64, device=dev) for n, v in plan.sizes().items()}, plan)
    if workspace.tp != plan.tp:
        raise ValueError(f"workspace: allocated for tp={workspace.tp}, the exchange has tp={plan.tp}")
    return workspace.carve(plan)


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------
def _plan_knobs(workspace) -> tuple[int, int, int]:
    """``(block_size, num_splits, target_programs)`` of a call's column plan: the workspace's, else the defaults."""
    if workspace is None:
        return _DEFAULT_BLOCK, 1, _TARGET_PROGRAMS
    return workspace.block_size, workspace.num_splits, workspace.target_programs


def _exchange_facts(exchange: PairExchange | None) -> tuple[PairExchange | None, int, int]:
    if exchange is None:
        return None, 1, 0
    if not isinstance(exchange, PairExchange):
        raise ValueError(f"exchange: expected a PairExchange or None, got {type(exchange).__name__}")
    return exchange, exchange.tp_size, exchange.mapping.tp_rank


def _vocab(vocab_start, vocab_size, width, tp) -> int:
    if vocab_size is None:
        vocab_size = vocab_start + width
    check_int("vocab_size", vocab_size, lo=1, hi=MAX_VOCAB + 1)
    check_int("vocab_start", vocab_start, lo=0, hi=vocab_size)
    if tp == 1 and (vocab_start > 0 or vocab_size > width):
        # one rank must own the whole vocabulary: the ids outside [vocab_start, vocab_start + width) would
        # silently count as absent (zero mass, never kept or drawn)
        raise ValueError(f"vocab_start / vocab_size: without an exchange (tp 1) this rank must own every id, "
                         f"expected vocab_start 0 and vocab_size <= {width} (the width), got vocab_start "
                         f"{vocab_start} and vocab_size {vocab_size}; pass the TP group's exchange")
    return vocab_size


# ----------------------------------------------------------------------------------------------------
# The pipeline (one function per entry point; the kernel table picks fused or eager)
# ----------------------------------------------------------------------------------------------------
def _top_p_rounds(ops, logits, temps, top_p, vocab_start, vocab_size, ws, kw, *, tokens=None, row_div=1, n_sub=1):
    """The window's boundary per row (``ws.state[4]``), radix rounds 0..n (n by dtype: bf16 1, fp16 2, fp32 3; every
    program of a row that ``verify_sums``' window resolved skips its pass) and the tie count (``ws.state[3]`` =
    (b*, mass above), ``ws.ties_all``)."""
    n = tpk.radix_rounds(logits.dtype)
    prev, window = None, ws.state[4]
    ops.top_p_window(logits, ws.keys, temps, top_p, ws.sums_t, window, vocab_start, vocab_size, row_div=row_div, **kw)
    for rnd in range(n + 1):
        ops.top_p_round(logits, ws.keys, temps, top_p, ws.sums_t, prev, ws.state[max(rnd - 2, 0)],
                        ws.state[max(rnd - 1, 0)], ws.hist[rnd], vocab_start, vocab_size, rnd, window=window,
                        row_div=row_div, **kw)
        yield "sum", ws.hist[rnd], None
        prev = ws.hist[rnd]
    ops.top_p_ties(logits, ws.keys, temps, top_p, ws.sums_t, prev, ws.state[n - 1], ws.state[3], ws.ties, vocab_start,
                   vocab_size, window=window, tokens=tokens, row_div=row_div, skip_bits=8 * (3 - n), n_sub=n_sub,
                   **kw)
    yield "gather", ws.ties, ws.ties_all


def _drive(steps, exchange: PairExchange | None):
    """Run a pipeline generator, issuing each exchange point it yields on ``exchange`` (none at tp 1)."""
    ex = _exchange_or_none(exchange)
    try:
        step = next(steps)
        while True:
            op, buf, out = step
            if ex is not None:
                if op == "max":
                    ex.max_(buf)
                elif op == "sum":
                    ex.sum_(buf)
                else:
                    ex.gather_ranks(buf, out=out)
            step = next(steps)
    except StopIteration as stop:
        return stop.value


def _exchange_or_none(exchange: PairExchange | None) -> PairExchange | None:
    """The exchange to issue collectives on: None at tp 1 (every round is then a no-op, not a copy)."""
    return None if exchange is None or exchange.tp_size == 1 else exchange


def _top_p_keep_steps(ops, logits, top_p, temperatures, vocab_start, vocab_size, tp, rank, out, workspace):
    """``top_p_keep`` as a generator that yields its exchange points (``(op, buffer, out)``, see :func:`_drive`)."""
    check_tensor("logits", logits, dtype=(torch.float32, torch.float16, torch.bfloat16), unit_last_stride=True)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape [R, V_local], got {list(logits.shape)}")
    rows, width = logits.shape
    dev = logits.device
    check_tensor("top_p", top_p, shape=(rows,), dtype=torch.float32, device=dev, contiguous=True)
    if temperatures is None:
        refuse_allocation_while_capturing("top_p_keep (temperatures=None)", dev)
        temperatures = torch.ones(rows, dtype=torch.float32, device=dev)
    check_tensor("temperatures", temperatures, shape=(rows,), dtype=torch.float32, device=dev, contiguous=True)
    vocab_size = _vocab(vocab_start, vocab_size, width, tp)
    check_row_values(temperatures, top_p)
    if out is None:
        refuse_allocation_while_capturing("top_p_keep", dev)
        out = torch.empty((rows, width), dtype=torch.bool, device=dev)
    check_tensor("out", out, shape=(rows, width), dtype=torch.bool, device=dev, contiguous=True)
    bs, ns, tpg = _plan_knobs(workspace)
    splits, chunk = column_plan(rows, width, bs, ns, tpg)
    plan = VerificationPlan(rows, 0, 0, splits, tp, True)
    ws = _call_buffers(workspace, plan, dev, "top_p_keep")
    if rows == 0:
        return out
    kw = dict(block_size=bs, num_splits=splits)  # the launchers re-derive the same (splits, chunk)
    ops.keys(logits, None, vocab_start, vocab_size, out=ws.keys, **kw)
    yield "max", ws.keys, None
    ops.sums(logits, None, ws.keys, temperatures, vocab_start, vocab_size, hist=True, out=ws.sums, **kw)
    yield "sum", ws.sums, None
    yield from _top_p_rounds(ops, logits, temperatures, top_p, vocab_start, vocab_size, ws, kw)
    return ops.top_p_mask(logits, ws.keys, temperatures, top_p, ws.sums_t, ws.state[3], ws.ties_all, vocab_start,
                          vocab_size, out=out, rank=rank, **kw)


def top_p_keep(logits: torch.Tensor, top_p: torch.Tensor, *, temperatures: torch.Tensor | None = None,
               vocab_start: int = 0, vocab_size: int | None = None, exchange: PairExchange | None = None,
               out: torch.Tensor | None = None, workspace: VerificationWorkspace | None = None) -> torch.Tensor:
    """The exact top-p kept set of each row of this rank's shard ``logits [R, V_local]``: bool ``[R, V_local]``.

    ``top_p [R]`` fp32 in (0, 1]; ``temperatures [R]`` fp32 (None = 1; ``T = 0`` keeps the first maximum).
    The kept set is the smallest prefix in (logit desc, global id asc) order whose fixed-point mass reaches
    ``ceil(p * Z)``; ``p = 1`` keeps every finite token; padded (id >= vocab_size) and non-finite columns
    are never kept; a row without a finite logit keeps nothing. Decided jointly by all ranks of
    ``exchange`` with ``call_shape("top_p_keep", True, logits.dtype)`` small collectives (bf16 4, fp32 6);
    bitwise the same at every TP size. CUDA-graph safe with
    ``out=``, ``temperatures`` and ``workspace``.
    """
    exchange, tp, rank = _exchange_facts(exchange)
    return _drive(_top_p_keep_steps(_FUSED_KERNELS, logits, top_p, temperatures, vocab_start, vocab_size, tp, rank,
                                    out, workspace), exchange)


def top_p_keep_reference(logits: torch.Tensor, top_p: torch.Tensor, *, temperatures: torch.Tensor | None = None,
                         vocab_start: int = 0, vocab_size: int | None = None, exchange: PairExchange | None = None,
                         out: torch.Tensor | None = None,
                         workspace: VerificationWorkspace | None = None) -> torch.Tensor:
    """Eager twin of :func:`top_p_keep` (same exchanges; torch ops instead of kernels)."""
    exchange, tp, rank = _exchange_facts(exchange)
    return _drive(_top_p_keep_steps(_EAGER_KERNELS, logits, top_p, temperatures, vocab_start, vocab_size, tp, rank,
                                    out, workspace), exchange)


# ----------------------------------------------------------------------------------------------------
# rejection_sample
# ----------------------------------------------------------------------------------------------------
DEFAULT_PASSES = "auto"  # rejection_sample's ``passes`` when not given (tests and benchmarks may force "two")
_PASSES = ("auto", "one", "two")


def choose_passes(passes: str | None, width: int, tp: int, vocab_start: int, block_size: int) -> str:
    """``"one"`` (one read of the logits: block statistics, combine, draw) where the shard is block-aligned --
    ``vocab_start`` and, at TP > 1, the width multiples of ``STAT_BLOCK`` and tiles of whole blocks -- else
    ``"two"`` (block keys, then block bins: the same weights on any shard). The same on every rank of a TP group
    (shapes only). ``passes``: ``"auto"`` (None: :data:`DEFAULT_PASSES`), ``"one"`` (a ``ValueError`` where not
    aligned) or ``"two"``."""
    passes = DEFAULT_PASSES if passes is None else passes
    if passes not in _PASSES:
        raise ValueError(f"passes: expected one of {_PASSES}, got {passes!r}")
    g = bsk.STAT_BLOCK
    reasons = [why for bad, why in (
        (block_size % g != 0, f"tiles of {block_size} columns, not whole {g}-id blocks"),
        (vocab_start % g != 0 or (tp > 1 and width % g != 0),
         f"shard width {width} at tp={tp} is not a multiple of {g}"),
    ) if bad]
    if passes == "one" and reasons:
        raise ValueError(f"passes='one': the shard is not block-aligned ({'; '.join(reasons)})")
    if passes == "two" or reasons:
        reason = "; ".join(reasons) or "passes='two'"
        info_once(f"rejection_sample: two passes over the logits ({reason}); logged once per reason",
                  key=f"rejection_sample passes: {reason}")
        return "two"
    return "one"


def _rejection_sample_steps(ops, target_logits, draft_logits, draft_tokens, temperatures, seeds, offsets, top_p,
                            vocab_start, vocab_size, tp, rank, out, workspace, passes=None):
    """``rejection_sample`` as a generator that yields its exchange points (``(op, buffer, out)``, see
    :func:`_drive`)."""
    for name, t in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        check_tensor(name, t, dtype=(torch.float32, torch.float16, torch.bfloat16), contiguous=True)
        if t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor, got shape {list(t.shape)}")
    b, k1, width = target_logits.shape
    k = k1 - 1
    dev = target_logits.device
    if k < 1:
        raise ValueError(f"target_logits: expected [B, K+1, V_local] with K >= 1, got {list(target_logits.shape)}")
    check_tensor("draft_logits", draft_logits, shape=(b, k, width), device=dev)
    check_tensor("draft_tokens", draft_tokens, shape=(b, k), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("temperatures", temperatures, shape=(b,), dtype=torch.float32, device=dev, contiguous=True)
    check_tensor("seeds", seeds, shape=(b,), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("offsets", offsets, shape=(b,), dtype=torch.int64, device=dev, contiguous=True)
    if top_p is not None:
        check_tensor("top_p", top_p, shape=(b,), dtype=torch.float32, device=dev, contiguous=True)
    vocab_size = _vocab(vocab_start, vocab_size, width, tp)
    check_row_values(temperatures, top_p, draft_tokens, vocab_size)
    if out is None:
        refuse_allocation_while_capturing("rejection_sample", dev)
        out = (torch.empty((b, k1), dtype=torch.int64, device=dev), torch.empty((b,), dtype=torch.int32, device=dev))
    accepted, num_accepted = out
    check_tensor("accepted_tokens (out)", accepted, shape=(b, k1), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("num_accepted (out)", num_accepted, shape=(b,), dtype=torch.int32, device=dev, contiguous=True)
    bs, ns, tpg = _plan_knobs(workspace)
    splits, chunk = column_plan(b * (2 * k + 1), width, bs, ns, tpg)
    sub = draw_plan(b, splits, chunk, bs, ns, tpg)
    has_p = top_p is not None
    passes = choose_passes(passes, width, tp, vocab_start, bs)
    plan = VerificationPlan(b * k1, b * k, b, splits, tp, has_p, sub=sub, passes=passes)
    ws = _call_buffers(workspace, plan, dev, "rejection_sample")
    if b == 0:
        return accepted, num_accepted
    kw = dict(block_size=bs, num_splits=splits)  # the launchers re-derive the same (splits, chunk)
    tgt = target_logits.view(b * k1, width)
    drf = draft_logits.view(b * k, width)
    rows = dict(row_div=k1, row_div_q=k)
    if passes == "one":
        # one read of every row: the keys, each block's grid point and mass in bins, the drafted tokens' weights
        # (the keys alone for the requests with top-p in force: their weights are verify_sums')
        ops.stats(tgt, drf, temperatures, vocab_start, vocab_size, tokens=draft_tokens, keys_out=ws.keys,
                  stats_out=ws.stats, top_p=top_p, **rows, **kw)
        yield "max", ws.keys_x, None
        # each chunk's bins shifted to the row's grid point R (known from the exchanged maxima)
        ops.combine(ws.stats, ws.keys, temperatures, rows_t=b * k1, out=ws.bins, **rows)
    else:
        # any shard: the keys and the maxima of the blocks split between ranks, then the block bins against R
        ops.block_keys(tgt, drf, vocab_start, vocab_size, keys_out=ws.keys, edges_out=ws.edges, rank=rank, tp=tp,
                       **kw)
        yield "max", ws.keys_x, None
        ops.block_bins(tgt, drf, ws.keys, ws.edges, temperatures, vocab_start, vocab_size, tokens=draft_tokens,
                       rank=rank, tp=tp, out=ws.bins, **rows, **kw)
    if has_p:
        # the requests with top-p in force keep today's weights: masses, tokens' weights and the top-p window
        ops.sums(tgt, drf, ws.keys, temperatures, vocab_start, vocab_size, tokens=draft_tokens, hist=True,
                 out=ws.sums, top_p_only=top_p, **rows, **kw)
    yield "sum", ws.sums_x, None
    # exact top-p of the target rows: the boundary and its tie counts
    state = ties_all = None
    if has_p:
        yield from _top_p_rounds(ops, tgt, temperatures, top_p, vocab_start, vocab_size, ws, kw, tokens=draft_tokens,
                                 row_div=k1, n_sub=sub)
        state, ties_all = ws.state[3], ws.ties_all
    # decisions and the residual / bonus race over the chunks of row k*, then the winner
    ops.draw(tgt, drf, draft_tokens, temperatures, seeds, offsets, top_p, ws.keys, ws.sums_t, ws.sums_q, state,
             ties_all, ws.bins, ws.edges, ws.dec, ws.race, vocab_start, vocab_size, rank=rank, tp=tp, n_sub=sub, **kw)
    yield "gather", ws.race, ws.race_all
    ops.assemble(draft_tokens, ws.keys, ws.dec, ws.race_all, accepted, num_accepted)
    return accepted, num_accepted


def rejection_sample(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor, *,
                     temperatures: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                     top_p: torch.Tensor | None = None, vocab_start: int = 0, vocab_size: int | None = None,
                     exchange: PairExchange | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     workspace: VerificationWorkspace | None = None,
                     passes: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification of ``B`` requests on this rank's vocabulary shard.

    Args:
        target_logits: ``[B, K+1, V_local]`` fp32/fp16/bf16, contiguous; column ``j`` is global id
            ``vocab_start + j``, ids ``>= vocab_size`` are padding (never kept or drawn).
        draft_logits: ``[B, K, V_local]``, the logits the drafts were sampled from (same shard).
        draft_tokens: ``[B, K]`` int64 global ids.
        temperatures: ``[B]`` fp32; 0 = greedy (strict acceptance against the target argmax).
        seeds, offsets: ``[B]`` int64: the request's seed and the absolute position of its first
            verified token (draft k is verified at ``offset + k``).
        top_p: ``[B]`` fp32 in (0, 1] or None: the target's exact top-p (the draft side has none).
        exchange: the TP group's :class:`PairExchange` (None on one rank).
        out: ``(accepted_tokens [B, K+1] int64, num_accepted [B] int32)`` written in place.
        workspace: a :class:`VerificationWorkspace` for at least this batch (required under capture).
        passes: ``"auto"`` (default): one read of the logits on a block-aligned shard, two otherwise;
            ``"two"`` forces the two-pass path (the same bits); see :func:`choose_passes`.

    Returns ``(accepted_tokens, num_accepted)``: the first ``num_accepted[b]`` (1..K+1) entries are the
    emitted tokens (accepted drafts, then the residual or bonus sample); the rest are -1 on sampled rows
    and the target argmax on greedy rows (as ``strict_accept``). Identical on every rank and at every TP
    size. CUDA-graph safe with ``out=`` and ``workspace``.
    """
    exchange, tp, rank = _exchange_facts(exchange)
    steps = _rejection_sample_steps(_FUSED_KERNELS, target_logits, draft_logits, draft_tokens, temperatures, seeds,
                                    offsets, top_p, vocab_start, vocab_size, tp, rank, out, workspace, passes)
    return _drive(steps, exchange)


def rejection_sample_reference(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor,
                               *, temperatures: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                               top_p: torch.Tensor | None = None, vocab_start: int = 0,
                               vocab_size: int | None = None, exchange: PairExchange | None = None,
                               out: tuple[torch.Tensor, torch.Tensor] | None = None,
                               workspace: VerificationWorkspace | None = None,
                               passes: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`rejection_sample` (same signature, exchanges and results; torch ops)."""
    exchange, tp, rank = _exchange_facts(exchange)
    steps = _rejection_sample_steps(_EAGER_KERNELS, target_logits, draft_logits, draft_tokens, temperatures, seeds,
                                    offsets, top_p, vocab_start, vocab_size, tp, rank, out, workspace, passes)
    return _drive(steps, exchange)
