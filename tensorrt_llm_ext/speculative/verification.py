"""Vocab-sharded rejection-sampling verification and exact top-p, bitwise the same at every TP size.

Each rank holds its vocabulary shard of the target logits ``[B, K+1, V_local]`` and of the draft logits
``[B, K, V_local]`` (the logits the drafts were sampled from). Nothing proportional to the vocabulary
crosses ranks: per row an int64 max key, a few int64 mass sums, radix histograms ``[R, 256]`` for top-p,
tie counts ``[tp, R, 2]``, per-rank draw totals ``[tp, B, 2]`` and the drawn id ``[B]``.

Semantics (docs/rejection_sampling.md has the full statement):

* ``p`` is the target's temperature softmax in fixed point (integer weights, see
  :mod:`tensorrt_llm_ext.kernels.fixed_point_softmax`) restricted to its exact top-p set (smallest prefix in
  (logit desc, id asc) order whose mass reaches ``p``); ``q`` is the draft's full-vocabulary temperature
  softmax in the same fixed point (the drafter samples with keyed Gumbel-max over the full vocabulary, so
  the draft side applies no top-p). Both use the request's temperature.
* Accept ``d_k`` iff ``u_k * q(d_k) < p(d_k)``; at the first rejection emit a sample of
  ``norm(max(p - q, 0))``, otherwise a sample of ``p_K``. Uniforms are Philox keyed by (seed, absolute
  position, salt) only, so the result does not depend on the TP size, batch composition or tiling.
* ``T <= 0`` rows: strict acceptance against the target argmax (``torch.argmax`` order), bitwise what
  :func:`~tensorrt_llm_ext.kernels.strict_accept.strict_accept` returns on
  :func:`~tensorrt_llm_ext.speculative.vocab_parallel.vocab_parallel_argmax` tokens.

Every mass is an exact int64 and every float step a single IEEE float64 operation, so the fused kernels
equal their eager twins and the sharded call equals the TP-1 call bit for bit.

CUDA graphs: pass a :class:`VerificationWorkspace` (allocated once for the largest batch) and ``out=``;
then no call allocates, syncs the host or branches on data. Input checks that need device values (draft
ids in range, temperatures >= 0, top_p in (0, 1]) run only when the stream is not capturing.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tensorrt_llm_ext.distributed import PairExchange
from tensorrt_llm_ext.kernels import fixed_point_softmax as fps
from tensorrt_llm_ext.kernels import rejection_sample as rs
from tensorrt_llm_ext.kernels import top_p as tpk
from tensorrt_llm_ext.kernels.common import check_int, check_tensor, is_capturing, refuse_allocation_while_capturing
from tensorrt_llm_ext.kernels.ordered_key import MAX_VOCAB

__all__ = ["VerificationWorkspace", "rejection_sample", "rejection_sample_reference", "top_p_keep",
           "top_p_keep_reference"]

_FUSED = SimpleNamespace(
    row_max_keys=fps.row_max_keys, weight_sums=fps.weight_sums, top_p_round=tpk.top_p_round,
    top_p_ties=tpk.top_p_ties, top_p_finalize=tpk.top_p_finalize, top_p_mask=tpk.top_p_mask,
    partials=rs.rejection_partials, pick=rs.rejection_pick, assemble=rs.rejection_assemble)
_EAGER = SimpleNamespace(
    row_max_keys=fps.row_max_keys_reference, weight_sums=fps.weight_sums_reference,
    top_p_round=tpk.top_p_round_reference, top_p_ties=tpk.top_p_ties_reference,
    top_p_finalize=tpk.top_p_finalize_reference, top_p_mask=tpk.top_p_mask_reference,
    partials=rs.rejection_partials_reference, pick=rs.rejection_pick_reference,
    assemble=rs.rejection_assemble_reference)

_H = fps.HIST_BUCKETS
_DEFAULT_BLOCK = 2048


@dataclass(frozen=True)
class _Plan:
    rows_t: int
    rows_q: int
    batch: int
    splits: int
    tp: int
    top_p: bool

    def sizes(self) -> dict[str, int]:
        rt, rq, b, s, tp = self.rows_t, self.rows_q, self.batch, self.splits, self.tp
        hist = _H if self.top_p else 0
        return {
            "keys": (rt + rq) * 2, "sums": rt * (fps.SUMS_COLS + hist) + rq * fps.SUMS_COLS,
            # zeroed once per call, contiguous: state[0], hist rounds 1..3, ties, draw totals, pick
            "zero": rt * 2 + (3 * rt * _H if self.top_p else 0) + rt * 2 + b * 2 + b,
            "state": 4 * rt * 2, "chunk_ties": rt * s, "ties_all": tp * rt * 2, "final": rt * tpk.FINAL_COLS,
            "dec": b * 2, "partial": b * s * 2, "tot_all": tp * b * 2,
        }


class VerificationWorkspace:
    """Preallocated buffers for :func:`rejection_sample` / :func:`top_p_keep` (allocate once, outside capture).

    Sized for up to ``max_rows_t`` target rows, ``max_rows_q`` draft rows and ``max_batch`` requests over
    a shard of ``shard_width`` columns at ``tp`` ranks, with the column plan (``block_size``,
    ``num_splits``) that every call using it must share. For verification of ``B <= max_batch`` requests
    of draft length K use ``VerificationWorkspace.for_verification(max_batch, K, ...)``.
    """

    def __init__(self, max_rows_t: int, max_rows_q: int, max_batch: int, shard_width: int, *, tp: int = 1,
                 device: torch.device | str = "cpu", block_size: int = _DEFAULT_BLOCK, num_splits: int = 1):
        for name, v in (("max_rows_t", max_rows_t), ("max_rows_q", max_rows_q), ("max_batch", max_batch),
                        ("shard_width", shard_width)):
            check_int(name, v, lo=0)
        check_int("tp", tp, lo=1)
        check_int("num_splits", num_splits, lo=1)
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size: expected a power of two >= 16, got {block_size}")
        refuse_allocation_while_capturing("VerificationWorkspace", device)
        self.block_size = block_size
        self.num_splits = num_splits
        self.tp = tp
        self.splits, _ = fps.plan_chunks(shard_width, block_size, num_splits)
        self.capacity = _Plan(max_rows_t, max_rows_q, max_batch, self.splits, tp, True)
        cap = self.capacity.sizes()
        self._bufs = {name: torch.empty(n, dtype=torch.int64, device=device) for name, n in cap.items()}
        self.device = torch.device(device)
        fps.exp2_table(device)  # the weight table, allocated now rather than inside a capture

    @classmethod
    def for_verification(cls, max_batch: int, draft_len: int, shard_width: int, **kw) -> "VerificationWorkspace":
        return cls(max_batch * (draft_len + 1), max_batch * draft_len, max_batch, shard_width, **kw)

    def carve(self, plan: _Plan) -> SimpleNamespace:
        sizes = plan.sizes()
        cap = self.capacity.sizes()
        for name, n in sizes.items():
            if n > cap[name]:
                raise ValueError(f"workspace: {name} needs {n} elements, the workspace holds {cap[name]} "
                                 f"(allocate it for the largest batch)")
        return _views(self._bufs, plan)


def _views(bufs: dict[str, torch.Tensor], plan: _Plan) -> SimpleNamespace:
    rt, rq, b, s, tp = plan.rows_t, plan.rows_q, plan.batch, plan.splits, plan.tp
    hist_w = _H if plan.top_p else 0
    ns = SimpleNamespace()
    keys = bufs["keys"][: (rt + rq) * 2]
    ns.keys = keys
    ns.keys_t, ns.keys_q = keys[: rt * 2].view(rt, 2), keys[rt * 2:].view(rq, 2)
    sums = bufs["sums"][: rt * (fps.SUMS_COLS + hist_w) + rq * fps.SUMS_COLS]
    ns.sums = sums
    ns.sums_t = sums[: rt * (fps.SUMS_COLS + hist_w)].view(rt, fps.SUMS_COLS + hist_w)
    ns.sums_q = sums[rt * (fps.SUMS_COLS + hist_w):].view(rq, fps.SUMS_COLS)
    zero = bufs["zero"][: plan.sizes()["zero"]]
    ns.zero = zero
    o = 0

    def take(n, *shape):
        nonlocal o
        v = zero[o:o + n].view(*shape)
        o += n
        return v

    ns.state0 = take(rt * 2, rt, 2)
    ns.hist = take(3 * rt * _H, 3, rt, _H) if plan.top_p else None
    ns.ties = take(rt * 2, rt, 2)
    ns.tot = take(b * 2, b, 2)
    ns.pick = take(b, b)
    ns.state = bufs["state"][: 4 * rt * 2].view(4, rt, 2)
    ns.chunk_ties = bufs["chunk_ties"][: rt * s].view(rt, s)
    ns.ties_all = bufs["ties_all"][: tp * rt * 2].view(tp, rt, 2)
    ns.final = bufs["final"][: rt * tpk.FINAL_COLS].view(rt, tpk.FINAL_COLS)
    ns.dec = bufs["dec"][: b * 2].view(b, 2)
    ns.partial = bufs["partial"][: b * s * 2].view(b, s, 2)
    ns.tot_all = bufs["tot_all"][: tp * b * 2].view(tp, b, 2)
    return ns


def _call_buffers(workspace, plan, dev, name: str):
    """The call's buffers: carved from ``workspace`` (capturable), else allocated here (never while capturing)."""
    if workspace is None:
        refuse_allocation_while_capturing(f"{name} (no workspace)", dev)
        return _eager_views(plan, dev)
    if workspace.tp != plan.tp:
        raise ValueError(f"workspace: allocated for tp={workspace.tp}, the exchange has tp={plan.tp}")
    return workspace.carve(plan)


def _eager_views(plan: _Plan, device) -> SimpleNamespace:
    return _views({name: torch.empty(n, dtype=torch.int64, device=device) for name, n in plan.sizes().items()},
                  plan)


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------
def _exchange_facts(exchange: PairExchange | None) -> tuple[PairExchange | None, int, int]:
    if exchange is None:
        return None, 1, 0
    if not isinstance(exchange, PairExchange):
        raise ValueError(f"exchange: expected a PairExchange or None, got {type(exchange).__name__}")
    return exchange, exchange.tp_size, exchange.mapping.tp_rank


def _vocab(vocab_start, vocab_size, width) -> int:
    if vocab_size is None:
        vocab_size = vocab_start + width
    check_int("vocab_size", vocab_size, lo=1, hi=MAX_VOCAB + 1)
    check_int("vocab_start", vocab_start, lo=0, hi=vocab_size)
    return vocab_size


def _host_checks(temperatures, top_p, draft_tokens, vocab_size) -> None:
    """Value checks that read the device (skipped while capturing: the kernels stay in bounds anyway)."""
    if is_capturing(temperatures.device):
        return
    if temperatures.numel() and not bool((temperatures >= 0).all()):
        raise ValueError(f"temperatures: expected values >= 0 (0 = greedy), got {temperatures.tolist()}")
    if top_p is not None and top_p.numel() and not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise ValueError(f"top_p: expected values in (0, 1], got {top_p.tolist()}")
    if draft_tokens is not None and draft_tokens.numel():
        bad = (draft_tokens < 0) | (draft_tokens >= vocab_size)
        if bool(bad.any()):
            raise ValueError(f"draft_tokens: expected global ids in [0, {vocab_size}), got "
                             f"{draft_tokens[bad][:8].tolist()}")


# ----------------------------------------------------------------------------------------------------
# top_p_keep
# ----------------------------------------------------------------------------------------------------
def _top_p_pipeline(ops, logits, temps, top_p, vocab_start, vocab_size, exchange, rank, tp, ws, kw, *,
                    tokens=None, row_div=1, keys=None, sums=None):
    """The radix select: rounds 1..3, tie counts, finalize (``ws.final``). ``keys``/``sums`` exchanged."""
    prev = sums[:, fps.SUMS_COLS:]
    states = [ws.state0, ws.state[0], ws.state[1], ws.state[2], ws.state[3]]
    for rnd in (1, 2, 3):
        hist = ws.hist[rnd - 1]
        ops.top_p_round(logits, keys, temps, top_p, sums, prev, states[rnd - 1], states[rnd], hist, vocab_start,
                        vocab_size, rnd, row_div=row_div, **kw)
        if exchange is not None:
            exchange.sum_(hist)
        prev = hist
    ops.top_p_ties(logits, keys, temps, top_p, sums, prev, states[3], states[4], ws.chunk_ties, ws.ties,
                   vocab_start, vocab_size, tokens=tokens, row_div=row_div, **kw)
    if exchange is not None:
        exchange.gather_ranks(ws.ties, out=ws.ties_all)
    else:
        ws.ties_all.copy_(ws.ties.unsqueeze(0))
    ops.top_p_finalize(keys, temps, top_p, sums, states[4], ws.ties_all, ws.final, rank=rank, tp=tp,
                       row_div=row_div)


def _top_p_keep(ops, logits, top_p, temperatures, vocab_start, vocab_size, exchange, out, workspace):
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
    vocab_size = _vocab(vocab_start, vocab_size, width)
    exchange, tp, rank = _exchange_facts(exchange)
    _host_checks(temperatures, top_p, None, vocab_size)
    if out is None:
        refuse_allocation_while_capturing("top_p_keep", dev)
        out = torch.empty((rows, width), dtype=torch.bool, device=dev)
    check_tensor("out", out, shape=(rows, width), dtype=torch.bool, device=dev, contiguous=True)
    bs, ns = (workspace.block_size, workspace.num_splits) if workspace is not None else (_DEFAULT_BLOCK, 1)
    splits, _ = fps.plan_chunks(max(0, min(width, vocab_size - vocab_start)), bs, ns)
    plan = _Plan(rows, 0, 0, splits, tp, True)
    ws = _call_buffers(workspace, plan, dev, "top_p_keep")
    kw = dict(block_size=bs, num_splits=ns)
    ws.zero.zero_()
    ops.row_max_keys(logits, vocab_start, vocab_size, argmax=False, out=ws.keys_t, **kw)
    if exchange is not None:
        exchange.max_(ws.keys)
    ops.weight_sums(logits, ws.keys_t, temperatures, vocab_start, vocab_size, hist=True, out=ws.sums_t, **kw)
    if exchange is not None:
        exchange.sum_(ws.sums)
    _top_p_pipeline(ops, logits, temperatures, top_p, vocab_start, vocab_size, exchange, rank, tp, ws, kw,
                    keys=ws.keys_t, sums=ws.sums_t)
    return ops.top_p_mask(logits, ws.final, ws.chunk_ties, vocab_start, vocab_size, out=out, **kw)


def top_p_keep(logits: torch.Tensor, top_p: torch.Tensor, *, temperatures: torch.Tensor | None = None,
               vocab_start: int = 0, vocab_size: int | None = None, exchange: PairExchange | None = None,
               out: torch.Tensor | None = None, workspace: VerificationWorkspace | None = None) -> torch.Tensor:
    """The exact top-p kept set of each row of this rank's shard ``logits [R, V_local]``: bool ``[R, V_local]``.

    ``top_p [R]`` fp32 in (0, 1]; ``temperatures [R]`` fp32 (None = 1; ``T = 0`` keeps the first maximum).
    The kept set is the smallest prefix in (logit desc, global id asc) order whose fixed-point mass reaches
    ``ceil(p * Z)``; ``p = 1`` keeps every finite token; padded (id >= vocab_size) and non-finite columns
    are never kept; a row without a finite logit keeps nothing. Decided jointly by all ranks of
    ``exchange`` with six small collectives; bitwise the same at every TP size. CUDA-graph safe with
    ``out=``, ``temperatures`` and ``workspace``.
    """
    return _top_p_keep(_FUSED, logits, top_p, temperatures, vocab_start, vocab_size, exchange, out, workspace)


def top_p_keep_reference(logits: torch.Tensor, top_p: torch.Tensor, *, temperatures: torch.Tensor | None = None,
                         vocab_start: int = 0, vocab_size: int | None = None, exchange: PairExchange | None = None,
                         out: torch.Tensor | None = None,
                         workspace: VerificationWorkspace | None = None) -> torch.Tensor:
    """Eager twin of :func:`top_p_keep` (same exchanges; torch ops instead of kernels)."""
    return _top_p_keep(_EAGER, logits, top_p, temperatures, vocab_start, vocab_size, exchange, out, workspace)


# ----------------------------------------------------------------------------------------------------
# rejection_sample
# ----------------------------------------------------------------------------------------------------
def _rejection_sample(ops, target_logits, draft_logits, draft_tokens, temperatures, seeds, offsets, top_p,
                      vocab_start, vocab_size, exchange, out, workspace):
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
    vocab_size = _vocab(vocab_start, vocab_size, width)
    exchange, tp, rank = _exchange_facts(exchange)
    _host_checks(temperatures, top_p, draft_tokens, vocab_size)
    if out is None:
        refuse_allocation_while_capturing("rejection_sample", dev)
        out = (torch.empty((b, k1), dtype=torch.int64, device=dev), torch.empty((b,), dtype=torch.int32, device=dev))
    accepted, num_accepted = out
    check_tensor("accepted_tokens (out)", accepted, shape=(b, k1), dtype=torch.int64, device=dev, contiguous=True)
    check_tensor("num_accepted (out)", num_accepted, shape=(b,), dtype=torch.int32, device=dev, contiguous=True)
    bs, ns = (workspace.block_size, workspace.num_splits) if workspace is not None else (_DEFAULT_BLOCK, 1)
    n_valid = max(0, min(width, vocab_size - vocab_start))
    splits, _ = fps.plan_chunks(n_valid, bs, ns)
    has_p = top_p is not None
    plan = _Plan(b * k1, b * k, b, splits, tp, has_p)
    ws = _call_buffers(workspace, plan, dev, "rejection_sample")
    kw = dict(block_size=bs, num_splits=ns)
    tgt = target_logits.view(b * k1, width)
    drf = draft_logits.view(b * k, width)
    ws.zero.zero_()
    # 1. row maxima (and the target argmax for greedy rows and rows without a finite logit)
    ops.row_max_keys(tgt, vocab_start, vocab_size, argmax=True, out=ws.keys_t, **kw)
    ops.row_max_keys(drf, vocab_start, vocab_size, argmax=False, out=ws.keys_q, **kw)
    if exchange is not None:
        exchange.max_(ws.keys)
    # 2. masses Z, the drafted tokens' weights, and top-p round 0
    ops.weight_sums(tgt, ws.keys_t, temperatures, vocab_start, vocab_size, tokens=draft_tokens, row_div=k1,
                    hist=has_p, out=ws.sums_t, **kw)
    ops.weight_sums(drf, ws.keys_q, temperatures, vocab_start, vocab_size, tokens=draft_tokens, row_div=k,
                    out=ws.sums_q, **kw)
    if exchange is not None:
        exchange.sum_(ws.sums)
    # 3. exact top-p of the target rows: Z_p and F_p(d_k)
    if has_p:
        _top_p_pipeline(ops, tgt, temperatures, top_p, vocab_start, vocab_size, exchange, rank, tp, ws, kw,
                        tokens=draft_tokens, row_div=k1, keys=ws.keys_t, sums=ws.sums_t)
    else:
        ops.top_p_finalize(ws.keys_t, temperatures, None, ws.sums_t, None, None, ws.final, rank=rank, tp=tp,
                           row_div=k1)
    # 4. decisions and the residual / bonus draw
    args = (tgt, drf, draft_tokens, temperatures, seeds, offsets, ws.keys_t, ws.keys_q, ws.sums_q, ws.final,
            ws.chunk_ties)
    ops.partials(*args, ws.dec, ws.partial, ws.tot, vocab_start, vocab_size, has_top_p=has_p, **kw)
    if exchange is not None:
        exchange.gather_ranks(ws.tot, out=ws.tot_all)
    else:
        ws.tot_all.copy_(ws.tot.unsqueeze(0))
    ops.pick(*args, ws.dec, ws.partial, ws.tot_all, ws.pick, vocab_start, vocab_size, has_top_p=has_p, rank=rank,
             **kw)
    if exchange is not None:
        exchange.sum_(ws.pick)
    ops.assemble(draft_tokens, ws.keys_t, ws.dec, ws.pick, accepted, num_accepted)
    return accepted, num_accepted


def rejection_sample(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor, *,
                     temperatures: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                     top_p: torch.Tensor | None = None, vocab_start: int = 0, vocab_size: int | None = None,
                     exchange: PairExchange | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     workspace: VerificationWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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

    Returns ``(accepted_tokens, num_accepted)``: the first ``num_accepted[b]`` (1..K+1) entries are the
    emitted tokens (accepted drafts, then the residual or bonus sample); the rest are -1 on sampled rows
    and the target argmax on greedy rows (as ``strict_accept``). Identical on every rank and at every TP
    size. CUDA-graph safe with ``out=`` and ``workspace``.
    """
    return _rejection_sample(_FUSED, target_logits, draft_logits, draft_tokens, temperatures, seeds, offsets,
                             top_p, vocab_start, vocab_size, exchange, out, workspace)


def rejection_sample_reference(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_tokens: torch.Tensor,
                               *, temperatures: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor,
                               top_p: torch.Tensor | None = None, vocab_start: int = 0,
                               vocab_size: int | None = None, exchange: PairExchange | None = None,
                               out: tuple[torch.Tensor, torch.Tensor] | None = None,
                               workspace: VerificationWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager twin of :func:`rejection_sample` (same signature, exchanges and results; torch ops)."""
    return _rejection_sample(_EAGER, target_logits, draft_logits, draft_tokens, temperatures, seeds, offsets,
                             top_p, vocab_start, vocab_size, exchange, out, workspace)
