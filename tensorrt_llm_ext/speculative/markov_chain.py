"""DSpark Markov draft chain, owned by the worker: full vocabulary or a vocab shard with the pair exchange.

Semantics (docs/markov_chain.md). Weights ``markov_w1 [V, r]`` (whole on every rank) and ``markov_w2 [V_local, r]``
(this rank's vocabulary rows ``[vocab_start, vocab_start + V_local)``). With ``prev_0`` the anchor (last
accepted token) and base draft logits ``base[b, k, :]``, for ``k = 0 .. K-1``::

    bias_k   = F.linear(w1[prev_k], w2).to(logits dtype)     # [B, V_local]
    biased_k = base[:, k] + bias_k                            # logits dtype, stored and returned
    prev_{k+1} = token[:, k] = select(biased_k)               # over the global vocabulary

``select`` is ``torch.argmax`` order (first NaN, else max, ties to the lowest global id; padded columns
``>= vocab_size`` never win); on a shard each rank packs its best into an int64 selection key
(:mod:`tensorrt_llm_ext.kernels.ordered_key`) and the ``PairExchange`` all-reduces MAX once per step.

Invalid previous tokens (an anchor ``< 0`` or ``>= V``: padding / CUDA-graph dummy rows) gather a ZERO
``w1`` row, so their step's bias is ``F.linear(0, w2)`` (zero) and the row selects from its base logits;
nothing is read out of bounds. Later steps of such a row chain normally from its selected tokens.

Keyed sampling: with ``temperatures``/``seeds``/``offsets`` (``[B]`` each), a row with ``T > 0`` selects
``argmax(biased * div_rn(log2 e, T) + G2)`` with ``G2 = gumbel2_noise(seed, offsets[b] + k, global id,
MARKOV_SALT)`` (keyed Gumbel-max in log2 space, :mod:`tensorrt_llm_ext.kernels.ordered_key`) -- block
position ``k`` uses Philox offset ``offsets[b] + k``, and the salt keeps these draws independent of the
target's and the backbone draft's; ``T <= 0`` rows are greedy. The draw depends only on the
global id, so it is identical at every TP size. The biased logits returned are never temperature-scaled.

Modes (both CUDA-graph safe with a preallocated :class:`MarkovWorkspace` and ``out``):

* ``"exact"``: ``torch.mm(h, w2.t(), out=bias)`` per block position (the same cuBLAS/CPU GEMM ``F.linear``
  runs, hence bitwise the eager bias) around Triton kernels that resolve the previous token from the step
  keys (or the anchors), gather its ``w1`` row into ``h [B, r]``, and add + select + store with one atomic
  MAX per (program, row) into the step key. Bit-identical to :func:`markov_chain_logits_reference`.
  Without an exchange the resolve of step ``k + 1`` is folded into the select launch of step ``k`` (the
  row's last program does it): one resolve launch at the chain start, then GEMM + select per step, and no
  finishing launch. With an exchange the keys are final only after it, so each step is resolve + GEMM +
  select, then the exchange, and the chain ends with one finishing resolve.
* ``"fused"``: one launch per block position (:mod:`tensorrt_llm_ext.kernels.markov_fused_step`), bias computed
  in-kernel in a fixed reduction order: bitwise identical at every TP size and batch size, tokens equal
  to ``exact`` except at near-ties (the bias is rounded once from a different fp32 sum order).

A ``fused`` chain and an exchanged ``exact`` chain end with one finishing launch that writes the last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tensorrt_llm_ext.contract import MarkovHeadWeights
from tensorrt_llm_ext.kernels.common import check_int, check_tensor, refuse_allocation_while_capturing, triton_runs_on
from tensorrt_llm_ext.kernels.markov_exact_step import markov_resolve, markov_select
from tensorrt_llm_ext.kernels.markov_fused_step import ORDERS, FusedConfig, fused_config, markov_fused_step
from tensorrt_llm_ext.kernels.markov_step import W_BF16, W_FP16, W_FP32, markov_step_reference
from tensorrt_llm_ext.kernels.ordered_key import EMPTY_KEY, key_to_id_torch
from tensorrt_llm_ext.logger import info_once
from tensorrt_llm_ext.speculative.step_ops import stock_select

MARKOV_SALT = 0x4D4B5631  # "MKV1": Philox counter word c3 of the Markov chain's Gumbel draws
MODES = ("exact", "fused")
_LOGITS_DTYPES = (torch.bfloat16, torch.float32)
_W_KIND = {torch.float32: W_FP32, torch.bfloat16: W_BF16, torch.float16: W_FP16}


# ----------------------------------------------------------------------------------------------------
# Workspace, validation, stepper
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MarkovWorkspace:
    """Preallocated chain buffers (allocate once, before graph capture; views ``[:B]`` are used per call).

    ``keys`` must hold ``EMPTY_KEY`` in slot 0 and ``counts`` zero between chains: :meth:`allocate` sets
    them, every chain's last launch restores them for the rows it used (the folded exact select's last
    programs zero their counters after every launch), and a chain that does not finish (an exchange or a
    launch raised, Ctrl-C) resets its rows on the way out (:meth:`reset`), so an aborted chain never
    poisons the next one.
    """

    keys: torch.Tensor  # [3, max_B] int64 step selection keys (ring of three slots)
    tokens: torch.Tensor  # [max_B, K] int64
    h: torch.Tensor  # [max_B, r] weights dtype, gathered w1 rows (exact mode; [0, r] for fused)
    bias: torch.Tensor  # [max_B, V_local] weights dtype, the bias GEMV output (exact mode; [0, V_local] for fused)
    counts: torch.Tensor  # [max_B] int32 finished select programs per row (folded exact mode; [0] for fused)

    @classmethod
    def allocate(cls, max_batch_size: int, draft_len: int, markov_w2: torch.Tensor, mode: str) -> MarkovWorkspace:
        dev, dt = markov_w2.device, markov_w2.dtype
        v_local, r = markov_w2.shape
        rows = max_batch_size if mode == "exact" else 0
        return cls(
            keys=torch.full((3, max_batch_size), EMPTY_KEY, dtype=torch.int64, device=dev),
            tokens=torch.zeros((max_batch_size, draft_len), dtype=torch.int64, device=dev),
            h=torch.zeros((rows, r), dtype=dt, device=dev),
            bias=torch.zeros((rows, v_local), dtype=dt, device=dev),
            counts=torch.zeros((rows,), dtype=torch.int32, device=dev),
        )

    def reset(self, rows: int | None = None) -> None:
        """Put the key ring of the first ``rows`` rows (default all) back to ``EMPTY_KEY`` and their
        select counters to zero (two fills)."""
        self.keys[:, :rows].fill_(EMPTY_KEY)
        self.counts[:rows].zero_()


def _check_inputs(base, anchors, w1, w2, vocab_start, vocab_size, temperatures, seeds, offsets, mode, out):
    if mode not in MODES:
        raise ValueError(f"markov_chain_logits mode: expected one of {MODES}, got {mode!r}")
    check_tensor("base_logits", base, shape=(None, None, None), dtype=_LOGITS_DTYPES, unit_last_stride=True)
    B, K, v_local = base.shape
    dev = base.device
    if v_local == 0:
        # Every key would stay EMPTY_KEY and decode to token -1: refuse rather than draft a non-token.
        raise ValueError("base_logits: expected at least one vocabulary column (a shard holds one), got "
                         "no vocabulary columns (V_local = 0)")
    check_tensor("markov_w1", w1, shape=(None, None), dtype=tuple(_W_KIND), device=dev, unit_last_stride=True)
    r = w1.shape[1]
    check_tensor("markov_w2", w2, shape=(v_local, r), dtype=w1.dtype, device=dev, unit_last_stride=True)
    # vocab_size < 2^32 - 1: the int64 selection key holds global ids below that
    check_int("vocab_size", vocab_size, lo=1, hi=min(w1.shape[0], 2**32 - 2) + 1)
    check_int("vocab_start", vocab_start, lo=0)
    # The kernels read row b of every per-row tensor at element b: a strided or broadcast view (e.g.
    # accepted[:, 0]) would be read wrongly without any error, so refuse it.
    check_tensor("anchors", anchors, shape=(B,), dtype=(torch.int32, torch.int64), device=dev, contiguous=True)
    given = [t is not None for t in (temperatures, seeds, offsets)]
    if any(given) and not all(given):
        raise ValueError("temperatures, seeds and offsets: expected all three together or none, got "
                         + ", ".join(n for n, g in zip(("temperatures", "seeds", "offsets"), given) if g))
    if all(given):
        for name, t, dt in (("temperatures", temperatures, torch.float32), ("seeds", seeds, torch.int64),
                            ("offsets", offsets, torch.int64)):
            check_tensor(name, t, shape=(B,), dtype=dt, device=dev, contiguous=True)
    if out is not None:
        check_tensor("out", out, shape=tuple(base.shape), dtype=base.dtype, device=dev, unit_last_stride=True)
    if not triton_runs_on(base):
        raise ValueError(f"base_logits: expected a CUDA tensor or TRITON_INTERPRET=1, got device {dev} without "
                         "the interpreter")


class MarkovChainStepper:
    """One chain invocation, driven step by step: ``keys = step(k)`` for ``k = 0..K-1`` (exchange ``keys``
    in place between steps), then ``finish()``. :func:`markov_chain_logits` drives it with a
    ``PairExchange``; tests drive several shards in lockstep with a host-side MAX instead.

    ``fold_resolve`` (exact mode; set when nothing exchanges the keys between steps) folds each step's
    resolve into the previous step's select launch: the keys a step returns are then already consumed,
    and the last step's are cleared by its own launch, so they must not be exchanged.
    """

    def __init__(self, base_logits, anchors, markov_w1, markov_w2, *, vocab_start=0, vocab_size=None,
                 temperatures=None, seeds=None, offsets=None, mode="exact", out=None,
                 workspace: MarkovWorkspace | None = None, config: FusedConfig | None = None,
                 fold_resolve: bool = False, order: str = "alternate"):
        vocab_size = markov_w1.shape[0] if vocab_size is None else vocab_size
        _check_inputs(base_logits, anchors, markov_w1, markov_w2, vocab_start, vocab_size, temperatures,
                      seeds, offsets, mode, out)
        if order not in ORDERS:
            raise ValueError(f"markov_chain_logits order: expected one of {ORDERS}, got {order!r}")
        B, K, v_local = base_logits.shape
        r = markov_w1.shape[1]
        if out is None or workspace is None:
            refuse_allocation_while_capturing("markov_chain_logits (out=, workspace=)", base_logits.device)
            out = torch.empty_like(base_logits) if out is None else out
            workspace = MarkovWorkspace.allocate(B, K, markov_w2, mode) if workspace is None else workspace
        ws = workspace
        need_rows = B if mode == "exact" else 0
        if (ws.keys.shape[1] < B or ws.tokens.shape[0] < B or ws.tokens.shape[1] != K or ws.h.shape[0] < need_rows
                or ws.bias.shape[0] < need_rows or ws.counts.shape[0] < need_rows
                or (mode == "exact" and (ws.h.shape[1] != r or ws.bias.shape[1] != v_local))):
            raise ValueError(f"workspace: expected room for B={B}, K={K}, r={r}, V_local={v_local} (mode {mode}), got "
                             f"keys {list(ws.keys.shape)}, tokens {list(ws.tokens.shape)}, h {list(ws.h.shape)}, "
                             f"bias {list(ws.bias.shape)}")
        self.base, self.anchors, self.w1, self.w2 = base_logits, anchors, markov_w1, markov_w2
        self.vocab_start, self.vocab_size, self.mode = vocab_start, vocab_size, mode
        self.sample = temperatures is not None
        self.temps, self.seeds, self.offsets = temperatures, seeds, offsets
        self.out, self.ws, self.B, self.K = out, ws, B, K
        self.tokens = ws.tokens[:B]
        self.interpret = not base_logits.is_cuda
        self.config = config or fused_config(r, self.interpret, base_logits.device, B, markov_w2.element_size())
        self.order = order
        self.w_kind = _W_KIND[markov_w1.dtype]
        self.out_bf16 = base_logits.dtype == torch.bfloat16
        self.fold = fold_resolve and mode == "exact"

    def step(self, k: int) -> torch.Tensor:
        """Run block position ``k``; returns this step's ``[B]`` int64 keys view (exchange it in place)."""
        B = self.B
        if B == 0:
            return self.ws.keys[0, :0]
        if self.mode == "fused":
            markov_fused_step(self.base, self.w1, self.w2, self.out, self.anchors, self.ws.keys, self.tokens,
                              self.temps, self.seeds, self.offsets, vocab_start=self.vocab_start,
                              vocab_size=self.vocab_size, k=k, offset_k=k, salt=MARKOV_SALT,
                              w_kind=self.w_kind, out_bf16=self.out_bf16, config=self.config,
                              interpret=self.interpret, order=self.order)
            return self.ws.keys[k % 3, :B]
        h, bias = self.ws.h[:B], self.ws.bias[:B]
        if self.fold:
            # Folded: step k's select launch resolves step k + 1 (its row's last program), so only the
            # chain start resolves on its own -- the anchors, and a clean slot 0 and counters.
            if k == 0:
                markov_resolve(self.anchors, self.ws.keys, self.w1, h, self.tokens, k=0, read_slot=0,
                               reset_slot=0, vocab_size=self.vocab_size, gather=True, counts=self.ws.counts)
            torch.mm(h, self.w2.t(), out=bias)  # the GEMM F.linear(h, w2) runs: bitwise the eager bias
            markov_select(self.base, bias, self.out, self.ws.keys, self.temps, self.seeds, self.offsets,
                          k=k, vocab_start=self.vocab_start, vocab_size=self.vocab_size, salt=MARKOV_SALT,
                          cur_slot=k % 3, fold=(self.ws.counts, self.w1, h, self.tokens),
                          last_step=k == self.K - 1)
            return self.ws.keys[k % 3, :B]
        markov_resolve(self.anchors, self.ws.keys, self.w1, h, self.tokens, k=k, read_slot=0, reset_slot=0,
                       vocab_size=self.vocab_size, gather=True)
        torch.mm(h, self.w2.t(), out=bias)  # the GEMM F.linear(h, w2) runs: bitwise the eager bias
        markov_select(self.base, bias, self.out, self.ws.keys, self.temps, self.seeds, self.offsets, k=k,
                      vocab_start=self.vocab_start, vocab_size=self.vocab_size, salt=MARKOV_SALT, cur_slot=0)
        return self.ws.keys[0, :B]

    def abort(self) -> None:
        """Leave the workspace as a finished chain would (called when the chain stops early)."""
        self.ws.reset(self.B)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the last token (and restore the key ring's slot 0); returns ``(biased_logits, tokens)``.
        Folded exact chains launch nothing here: their last select launch did both."""
        if self.B > 0 and self.K > 0 and not self.fold:  # K = 0: nothing was drafted, the results are final
            K = self.K
            read = (K - 1) % 3 if self.mode == "fused" else 0
            markov_resolve(self.anchors, self.ws.keys, self.w1, self.w1, self.tokens, k=K, read_slot=read,
                           reset_slot=0, vocab_size=self.vocab_size, gather=False)
        return self.out, self.tokens


def markov_chain_logits(
    base_logits: torch.Tensor,
    anchors: torch.Tensor,
    markov_w1: torch.Tensor,
    markov_w2: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    exchange=None,
    temperatures: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
    mode: str = "exact",
    out: torch.Tensor | None = None,
    workspace: MarkovWorkspace | None = None,
    order: str = "alternate",
    config: FusedConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Markov draft chain over K block positions.

    Args:
        base_logits: ``[B, K, V_local]`` bf16/fp32 base draft logits of this rank's vocabulary columns.
        anchors: ``[B]`` int32/int64 contiguous, last accepted tokens (global ids; invalid ids give a zero
            bias).
        markov_w1: ``[V, r]`` (whole); markov_w2: ``[V_local, r]`` this rank's rows; same dtype
            (bf16/fp16/fp32).
        vocab_start, vocab_size: global id of column 0 and the real vocabulary ``V`` (default
            ``markov_w1.shape[0]``); columns with global id ``>= vocab_size`` never win.
        exchange: a ``PairExchange`` (``exchange_(keys)``) for a vocab shard; None on one rank.
        temperatures/seeds/offsets: ``[B]`` fp32/int64/int64, contiguous, for keyed Gumbel-max (see module
            docs).
        mode: ``"exact"`` (bit-identical to :func:`markov_chain_logits_reference`) or ``"fused"``.
        out: optional ``[B, K, V_local]`` output; workspace: optional :class:`MarkovWorkspace`.
            Both are required under CUDA-graph capture (then the call allocates nothing and never syncs).
        order, config: the fused mode's schedule (no effect on any value): ``"alternate"`` (default)
            scans ``markov_w2`` backwards at odd block positions so the tiles the previous step read last
            are read first, from L2; ``"same"`` scans forwards every step. ``config`` overrides the
            per-B :func:`~tensorrt_llm_ext.kernels.markov_fused_step.fused_config` (benchmarks, tests).

    Returns:
        ``(biased_logits [B, K, V_local] in the logits dtype, tokens [B, K] int64)``; ``tokens`` is a
        view of the workspace. ``K = 0`` returns the empty results (nothing is launched).

    Raises ``ValueError`` for a shard without columns (``V_local = 0``). A chain that raises part way
    (e.g. its exchange timed out) leaves ``workspace`` clean for the next chain.
    """
    stepper = MarkovChainStepper(base_logits, anchors, markov_w1, markov_w2, vocab_start=vocab_start,
                                 vocab_size=vocab_size, temperatures=temperatures, seeds=seeds,
                                 offsets=offsets, mode=mode, out=out, workspace=workspace, config=config,
                                 fold_resolve=exchange is None, order=order)
    return _run_chain(stepper, exchange)


def _run_chain(stepper, exchange) -> tuple[torch.Tensor, torch.Tensor]:
    """Drive a stepper through its K block positions, exchanging each step's keys on a vocab shard.

    A chain that does not reach ``finish`` (the exchange timed out, a launch raised, Ctrl-C) resets its
    workspace rows before the exception propagates: the key ring would otherwise hold this chain's keys
    and the next chain on the workspace would resolve its tokens from them, silently.
    """
    try:
        for k in range(stepper.K):
            keys = stepper.step(k)
            if exchange is not None:
                exchange.exchange_(keys)
        return stepper.finish()
    except BaseException:
        stepper.abort()
        raise


# ----------------------------------------------------------------------------------------------------
# Eager reference
# ----------------------------------------------------------------------------------------------------
class MarkovReferenceStepper:
    """Eager twin of :class:`MarkovChainStepper` (same step/exchange/finish protocol)."""

    def __init__(self, base_logits, anchors, markov_w1, markov_w2, *, vocab_start=0, vocab_size=None,
                 temperatures=None, seeds=None, offsets=None):
        self.base, self.w1, self.w2 = base_logits, markov_w1, markov_w2
        self.vocab_start = vocab_start
        self.vocab_size = markov_w1.shape[0] if vocab_size is None else vocab_size
        self.temps, self.seeds, self.offsets = temperatures, seeds, offsets
        B, K, v_local = base_logits.shape
        self.K = K
        self.prev = anchors.to(torch.int64)
        self.outs: list[torch.Tensor] = []
        self.toks: list[torch.Tensor] = []
        self.keys: torch.Tensor | None = None

    def step(self, k: int) -> torch.Tensor:
        if self.keys is not None:
            self.prev = key_to_id_torch(self.keys)
            self.toks.append(self.prev)
        offsets = None if self.offsets is None else self.offsets + k
        biased, self.keys = markov_step_reference(self.base[:, k], self.prev, self.w1, self.w2,
                                                  vocab_start=self.vocab_start, vocab_size=self.vocab_size,
                                                  temperatures=self.temps, seeds=self.seeds, offsets=offsets,
                                                  salt=MARKOV_SALT)
        self.outs.append(biased)
        return self.keys

    def abort(self) -> None:
        """Nothing to clean: the eager chain keeps no state beyond this object."""

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:  # K = 0: an empty chain
            B = self.base.shape[0]
            return self.base.clone(), torch.empty((B, 0), dtype=torch.int64, device=self.base.device)
        self.toks.append(key_to_id_torch(self.keys))
        return torch.stack(self.outs, dim=1), torch.stack(self.toks, dim=1)


def markov_chain_logits_reference(
    base_logits, anchors, markov_w1, markov_w2, *, vocab_start=0, vocab_size=None, exchange=None,
    temperatures=None, seeds=None, offsets=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager chain (the semantics): per step ``F.linear`` bias, add in the logits dtype, torch.argmax-order
    selection via int64 keys (exchanged on a shard). Same arguments and returns as :func:`markov_chain_logits`.
    """
    st = MarkovReferenceStepper(base_logits, anchors, markov_w1, markov_w2, vocab_start=vocab_start,
                                vocab_size=vocab_size, temperatures=temperatures, seeds=seeds, offsets=offsets)
    return _run_chain(st, exchange)


def markov_chain_stock(
    base_logits, anchors, markov_w1, markov_w2, *, vocab_size=None, temperatures=None, seeds=None, offsets=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock chain the upstream worker ran, on the full vocabulary: per block position ``F.linear`` bias,
    add, ``torch.argmax`` (sampled rows: ``argmax(biased / T + G)`` with this chain's keyed noise).

    Same tokens and biased logits as :func:`markov_chain_logits_reference` (and hence the ``exact`` mode);
    only the selection is a plain ``torch.argmax`` instead of int64 keys. Capturable (allocates in the
    graph's pool); no exchange -- the stock worker gathers.
    """
    vocab_size = markov_w1.shape[0] if vocab_size is None else vocab_size
    B, K, _ = base_logits.shape
    prev = anchors.to(torch.int64)
    outs, toks = [], []
    for k in range(K):
        valid = (prev >= 0) & (prev < vocab_size)
        h = markov_w1[torch.where(valid, prev, 0)] * valid[:, None].to(markov_w1.dtype)
        biased = base_logits[:, k] + F.linear(h, markov_w2).to(base_logits.dtype)
        outs.append(biased)
        off = None if offsets is None else offsets + k
        prev = stock_select(biased[:, :vocab_size], temperatures, seeds, off, MARKOV_SALT,
                            torch.empty(B, dtype=torch.int64, device=base_logits.device))
        toks.append(prev)
    return torch.stack(outs, dim=1), torch.stack(toks, dim=1)


# ----------------------------------------------------------------------------------------------------
# Worker-side component
# ----------------------------------------------------------------------------------------------------
# Auto mode: per batch size, the faster of "fused" and "exact": (max batch size, mode) rows in increasing
# order, the last row's max None covering every larger B. Measured on the H200 with `trtllm-ext bench markov`
# (2026-12-01, V = 200064, r = 256, K = 7, bf16): fused is faster at B = 1 / 8 / 32, exact at B = 64 / 128
# (docs/markov_chain.md). One table for every device, since no other GPU has been measured; `auto_table=`
# overrides it.
AutoModeTable = tuple[tuple[int | None, str], ...]
AUTO_MODE_TABLE: AutoModeTable = ((32, "fused"), (None, "exact"))


def auto_mode_for(table: AutoModeTable, batch_size: int) -> str:
    """The mode ``table`` gives ``batch_size`` (the first row whose max covers it)."""
    for max_batch, mode in table:
        if max_batch is None or batch_size <= max_batch:
            return mode
    return table[-1][1]


def _check_auto_table(table: AutoModeTable) -> None:
    bounds = [m for m, _ in table]
    if (not table or bounds[-1] is not None or any(b is None for b in bounds[:-1])
            or bounds[:-1] != sorted(set(bounds[:-1])) or any(mode not in MODES for _, mode in table)):
        raise ValueError(f"auto mode table must be increasing (max batch, mode in {MODES}) rows ending with "
                         f"(None, mode), got {table!r}")


def describe_auto_table(table: AutoModeTable) -> str:
    parts, lo = [], 1
    for max_batch, mode in table:
        parts.append(f"B>={lo} {mode}" if max_batch is None else f"B {lo}..{max_batch} {mode}")
        lo = (max_batch or 0) + 1
    return ", ".join(parts)


class MarkovChain:
    """The worker's Markov chain: reads the drafter's :class:`MarkovHeadWeights`, owns the preallocated
    buffers, runs :func:`markov_chain_logits` (CUDA-graph safe: no allocation, no host sync per call).

    ``mode`` comes from the worker config (read once): ``"exact"`` reproduces the eager chain bit for bit;
    ``"fused"`` is one launch per block position and bitwise identical at every TP size; ``"auto"``
    (default) runs, per batch size, the mode of :data:`AUTO_MODE_TABLE` (measured on the H200; logged
    once), or of ``auto_table`` when given. The choice depends on the batch size only
    (a shape, fixed per captured graph), and both modes share one workspace. ``"stock"`` is the upstream
    eager chain (:func:`markov_chain_stock`), the stock op table's.
    """

    def __init__(self, weights: MarkovHeadWeights, *, max_batch_size: int, draft_len: int,
                 logits_dtype: torch.dtype = torch.bfloat16, exchange=None, mode: str = "auto",
                 auto_table: AutoModeTable | None = None):
        if mode not in MODES + ("auto", "stock"):
            raise ValueError(f"MarkovChain mode must be one of {MODES + ('auto', 'stock')}, got {mode!r}")
        if mode == "stock" and (exchange is not None or weights.vocab_start != 0):
            raise ValueError("MarkovChain mode 'stock' runs on the full vocabulary (the stock worker gathers)")
        self.weights = weights
        self.mode = mode
        self.exchange = exchange
        w2 = weights.markov_w2
        self.auto_table: AutoModeTable | None = None
        if mode == "auto":
            where = "the given table" if auto_table is not None else "the table measured on the H200"
            auto_table = AUTO_MODE_TABLE if auto_table is None else auto_table
            _check_auto_table(auto_table)
            self.auto_table = auto_table
            info_once(f"Markov chain mode 'auto': {where}: {describe_auto_table(auto_table)}",
                      key=f"markov-auto:{where}:{auto_table}")
        # The exact layout holds every buffer either mode needs.
        self.workspace = MarkovWorkspace.allocate(max_batch_size, draft_len, w2,
                                                  "fused" if mode == "fused" else "exact")
        self.out = torch.empty((max_batch_size, draft_len, w2.shape[0]), dtype=logits_dtype, device=w2.device)

    def reset(self) -> None:
        """Clean the workspace's key ring (the engine calls it after an aborted step)."""
        self.workspace.reset()

    def mode_for(self, batch_size: int) -> str:
        if self.auto_table is None:
            return self.mode
        return auto_mode_for(self.auto_table, batch_size)

    def __call__(self, base_logits: torch.Tensor, anchors: torch.Tensor, temperatures=None, seeds=None,
                 offsets=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``base_logits [B, K, V_local]``, ``anchors [B]`` -> views ``(biased [B, K, V_local], tokens [B, K])``."""
        B = base_logits.shape[0]
        w = self.weights
        if self.mode == "stock":
            return markov_chain_stock(base_logits, anchors, w.markov_w1, w.markov_w2, vocab_size=w.vocab_size,
                                      temperatures=temperatures, seeds=seeds, offsets=offsets)
        return markov_chain_logits(base_logits, anchors, w.markov_w1, w.markov_w2, vocab_start=w.vocab_start,
                                   vocab_size=w.vocab_size, exchange=self.exchange, temperatures=temperatures,
                                   seeds=seeds, offsets=offsets, mode=self.mode_for(B), out=self.out[:B],
                                   workspace=self.workspace)
